"""Test dependencies that a machine may lack (the GPU image has no CPU-only extras such as lm-eval or
ml_dtypes): a test that needs one skips with the reason instead of stopping the whole collection.

A module whose tests all need the package takes it at the top with ``needed(name)`` (the module skips);
a module that also holds CUDA tests takes it with ``lazy(name)``, so only the tests that use it skip
and the CUDA tests still run where it is missing."""
import importlib

import pytest

# where each comes from, for the skip reason
WHERE = {
    "ml_dtypes": "the test extra: pip install -e '.[test]'",
    "lm_eval": "the eval extra: pip install qatfactory[eval]",
    "auto_round": "the test or bench extra: pip install -e '.[bench]'",
    "trl": "the test extra: pip install -e '.[test]'",
}


def _reason(name: str) -> str:
    return f"{name} is not installed ({WHERE.get(name, 'an optional test dependency')})"


def needed(name: str):
    """The module, or the calling test module is skipped with the reason."""
    return pytest.importorskip(name, reason=_reason(name))


class lazy:
    """The module, imported at its first attribute use: inside a test, a missing package skips that
    test only; where it is present nothing changes."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("_"):
            # pytest probes every module-level object for its own markers while collecting: those
            # lookups must not import (or skip the module)
            raise AttributeError(attr)
        try:
            mod = importlib.import_module(self._name)
        except ImportError:
            pytest.skip(_reason(self._name))
        return getattr(mod, attr)
