"""Per-step reuse of weight statistics that only change when the optimizer steps.

The fused groups of a QuantLinear (q/k/v, gate/up) share one per-tensor amax computed from all
members' weights. Without a cache each member recomputes it every forward (three times per q/k/v
group), and again in the gradient-checkpointing recomputation. The trainer knows when weights
change, so it turns the cache on for a run and calls ``weights_changed()`` after every optimizer
step (and after loading a checkpoint); a cached value is used only within one such epoch.

Outside ``enabled()`` (a user's own loop, tests, calibration), nothing is cached: every forward
computes from the current weights, so no caller can see a stale value by accident.
"""
from __future__ import annotations

import contextlib
from typing import Optional

_STATE = {"enabled": 0, "epoch": 0}


def weights_changed() -> None:
    """Invalidate every cached statistic (call after each optimizer step / checkpoint load)."""
    _STATE["epoch"] += 1


def current() -> Optional[int]:
    """The epoch a cached value may be keyed on, or None when caching is off."""
    return _STATE["epoch"] if _STATE["enabled"] > 0 else None


@contextlib.contextmanager
def enabled():
    """Cache group statistics inside this block; weights_changed() marks each optimizer step."""
    _STATE["enabled"] += 1
    weights_changed()
    try:
        yield
    finally:
        _STATE["enabled"] -= 1
        weights_changed()
