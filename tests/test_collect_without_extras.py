"""The GPU test entry (`pytest -m cuda tests` in tools/gpu/run.sh) runs on an image without the
CPU-only test dependencies: collecting tests/ there must not stop at an import, and no CUDA test may be
lost because another package is missing. Proven by collecting in a child process in which those packages
cannot be found (a sitecustomize on PYTHONPATH hides them from the path finder, as if never installed)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the GPU image may lack: the CPU-only extras and test dependencies, the parity gate's oracles and
# llama.cpp's runtime (gguf, torch, transformers and DeepSpeed are the package's own dependencies: without
# them nothing of qatfactory imports, so nothing can be tested)
ABSENT = ("lm_eval", "accelerate", "ml_dtypes", "peft", "torchao", "sentencepiece", "diskcache", "libggml",
          "compressed_tensors", "modelopt", "llama_cpp", "trl")

HIDE = '''
import importlib.machinery as _m
import os

_ABSENT = set(os.environ["QF_TEST_ABSENT"].split(","))
_find = _m.PathFinder.find_spec


class _Hidden:
    """PathFinder.find_spec that finds nothing for the absent packages (import fails with
    ModuleNotFoundError, importlib.util.find_spec returns None: what an uninstalled package does)."""

    def __call__(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in _ABSENT:
            return None
        return _find(fullname, path, target)


_m.PathFinder.find_spec = _Hidden()
'''


def _collect(env, *args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *args, "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ids = {ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(("ERROR", "FAILED"))}
    return r, ids


@pytest.mark.slow
def test_tests_collect_without_the_optional_packages_and_keep_every_cuda_test(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    hidden = dict(env, PYTHONPATH=str(tmp_path), QF_TEST_ABSENT=",".join(ABSENT))
    # the hiding works: none of them imports in such a child
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                            f"sys.exit(sum(u.find_spec(n) is not None for n in {ABSENT!r}))"],
                           env=hidden, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr

    r, ids = _collect(hidden)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "error" not in r.stdout.splitlines()[-1], r.stdout[-4000:]
    _, cuda = _collect(env, "-m", "cuda")
    assert cuda, "no CUDA test collected at all"
    assert cuda <= ids, sorted(cuda - ids)[:20]


def test_eval_without_lm_eval_names_the_extra_in_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    hidden = dict(env, PYTHONPATH=str(tmp_path), QF_TEST_ABSENT="lm_eval")
    r = subprocess.run([sys.executable, "-m", "qatfactory.faces.cli", "eval", str(tmp_path), "tasks=qf_arc_easy"],
                       cwd=tmp_path, env=hidden, capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "pip install 'qatfactory[eval]'" in last and "Traceback" not in r.stderr
