"""Per-step reuse of what only changes when the optimizer steps: group amax and fake-quantized weights.

The fused groups of a QuantLinear (q/k/v, gate/up) share one per-tensor amax computed from all
members' weights, and every quantized weight is fake-quantized from the current weights. Without a
cache each member recomputes both every forward (and again in the backward recompute, gradient
checkpointing and every micro-batch of gradient accumulation). The trainer knows when weights
change, so it turns the cache on for a run and calls ``weights_changed()`` after every optimizer
step (and after loading a checkpoint); a cached value is used only within one such epoch, and only
while the tensors it was computed from are unchanged (nn/weight_cache.py: storage and version
counter, so any in-place write through torch -- an optimizer, ``load_state_dict``, an edit under
``no_grad`` -- is seen even within an epoch). Every ``torch.optim.Optimizer.step`` ends an epoch
too (a global post-hook, registered on the first ``enabled()``).

Outside ``enabled()`` (a user's own loop, tests, calibration), nothing is cached: every forward
computes from the current weights, so no caller can see a stale value by accident.

``enabled(weights=...)`` also decides whether fake-quantized weights are kept (default on; the trainer
passes ``train.weight_cache``); the group amax is kept either way.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

from torch.optim.optimizer import register_optimizer_step_post_hook

_STATE = {"enabled": 0, "epoch": 0, "hooked": False}
_WEIGHTS: List[bool] = []                 # one entry per open enabled() block
_ON_CHANGE: List[Callable[[], None]] = []  # weight_cache.release_all
_ON_BLOCK: List[Callable[[], None]] = []   # weight_cache.forget: a block starts or ends afresh


def weights_changed() -> None:
    """Invalidate every cached statistic and weight (call after each optimizer step / checkpoint load)."""
    _STATE["epoch"] += 1
    for f in _ON_CHANGE:
        f()


def current() -> Optional[int]:
    """The epoch a cached value may be keyed on, or None when caching is off."""
    return _STATE["epoch"] if _STATE["enabled"] > 0 else None


def weights_cached() -> bool:
    """Whether fake-quantized weights are kept for the step (inside enabled(weights=True))."""
    return _STATE["enabled"] > 0 and _WEIGHTS[-1]


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    weights_changed()


def _hook_optimizers() -> None:
    if _STATE["hooked"]:
        return
    register_optimizer_step_post_hook(_optimizer_stepped)
    _STATE["hooked"] = True


@contextlib.contextmanager
def enabled(weights: bool = True):
    """Cache group statistics (and, with ``weights``, fake-quantized weights) inside this block;
    weights_changed() marks each optimizer step."""
    _hook_optimizers()
    _WEIGHTS.append(bool(weights))
    _STATE["enabled"] += 1
    weights_changed()
    for f in _ON_BLOCK:
        f()
    try:
        yield
    finally:
        _STATE["enabled"] -= 1
        _WEIGHTS.pop()
        weights_changed()
        for f in _ON_BLOCK:
            f()
