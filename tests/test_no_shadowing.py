"""No helper module of ours may take the name of a real package.

Tests and scripts put tests/ and its subfolders (pytest imports a test file from its own folder), scripts/, the
benchmark folders and tools/gpu first on sys.path (a script's own folder is always first). A file there named
like an installed distribution's module, or like a package that transformers probes for, is imported in its place: transformers 5.25 found `kernels` installed, imported
`benchmarks/kernels.py` instead, and 432 tests failed in CI. This test fails on the next such name.
"""
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_FOLDERS = sorted(str(d.relative_to(REPO)) for d in (REPO / "tests").rglob("*")
                      if d.is_dir() and any(d.glob("*.py")))
ON_PATH = ["tests", *TEST_FOLDERS, "scripts", "benchmarks", "benchmarks/gpu", "benchmarks/papers", "tools/gpu"]


def _our_modules():
    for folder in ON_PATH:
        d = REPO / folder
        for p in sorted(d.iterdir()):
            if p.suffix == ".py" and p.stem != "__init__":
                yield folder, p.stem
            elif p.is_dir() and (p / "__init__.py").exists():
                yield folder, p.name


@functools.lru_cache(maxsize=1)
def _taken():
    return set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names) | _probed_by_transformers()


def _probed_by_transformers():
    """The optional packages transformers looks for by name (its own source says which)."""
    import transformers.utils.import_utils as iu
    text = Path(iu.__file__).read_text()
    return set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_]+)"', text))


def test_the_probe_list_is_read():
    # the regex finds the probes (a transformers rewrite that hides them would make the next test vacuous)
    names = _probed_by_transformers()
    assert {"torch", "accelerate"} <= names and len(names) > 20
    assert "kernels" in _taken()        # the name that broke CI is caught whether or not `kernels` is installed


@pytest.mark.parametrize("folder,name", list(_our_modules()), ids=lambda v: str(v))
def test_no_helper_module_shadows_a_package(folder, name):
    if folder == "tests" and name == "conftest":
        return
    assert name not in _taken(), (f"{folder}/{name}.py has the name of a real package or module; anything importing "
                               f"`{name}` while {folder}/ is on sys.path gets ours instead: rename it")
