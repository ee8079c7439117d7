"""The training performance levers behind one door: what a run switches on, from its config alone.

Each lever computes the same bits as the plain path and only changes what a step costs; each is a
module of its own that reaches into the core modules through a hook the core offers (the core never
imports a lever):

    lever                        config (train.*)              where
    fq(W) kept for the step      weight_cache (true)           nn/step_cache.py, nn/weight_cache.py
    ... filled in batched calls  weight_cache_batch (auto)     nn/weight_cache.py (set_batching)
    ParetoQ grids batched        lowbit_batch (true)           nn/lowbit_batch.py (linear.WEIGHT_HOOK)
    k-quant scales kept K steps  quant.kquant_refresh_every    nn/kquant_refresh.py (fake_quant.set_step_rule)
    less activation memory       lean_act (false)              nn/lean_act.py (per-instance forward)
    DeepSpeed step, no host work lean_step (true), ds_timers   train/ds_step.py
    which NVFP4 CUDA kernel      nvfp4_kernel (auto)           kernels (set_nvfp4_kernel)

The loop's whole interface, one :class:`Levers` per run::

    lv = Levers(cfg, training)          # reads cfg fields only; a bad value -> UsageError naming the field
    with lv:                            # the run's scope: step cache, batching mode, NVFP4 kernel; on exit
                                        # all undone (lean_act patches, low-bit groups, the callers' settings)
        lv.install(model)               # the prepared student, before DeepSpeed wraps it (lean_act)
        engine = deepspeed.initialize(...)
        lv.attach(engine, world)        # after it: the lean step (training and lean_step), low-bit batching
        ...
        with lv.step(step):             # one optimizer step (k-quant scales kept between searches)
            lv.forward()                # before each micro-batch's forward
            ...
            lv.weights_changed()        # after the accumulation boundary, a checkpoint load, an optimizer reset

``ds_config(train_cfg)`` is what the lean step adds to the DeepSpeed config. The environment plays no part
in a run: the trainer sets every switch from its config (``QF_NVFP4_KERNEL`` remains only for code run
outside the trainer, kernels/__init__.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, List, Optional

from .. import kernels
from ..exitcodes import UsageError
from ..nn import kquant_refresh, lean_act, lowbit_batch, step_cache, weight_cache
from . import ds_step

_BOOLS = ("weight_cache", "lowbit_batch", "lean_act", "lean_step")
_CHOICES = {"weight_cache_batch": weight_cache.BATCH_MODES, "nvfp4_kernel": kernels.NVFP4_KERNELS}


def ds_config(t) -> Dict[str, Any]:
    """What the levers add to the DeepSpeed config of train config ``t`` (train/ds_step.py)."""
    return ds_step.ds_config(t)


class Levers:
    """The levers of one run (module docstring). Not reentrant: one scope per object."""

    def __init__(self, cfg, training: bool):
        t = cfg.train
        for f in _BOOLS:
            if not isinstance(getattr(t, f), bool):
                raise UsageError(f"train.{f}={getattr(t, f)!r}; allowed: true or false")
        for f, allowed in _CHOICES.items():
            if getattr(t, f) not in allowed:
                raise UsageError(f"train.{f}={getattr(t, f)!r}; allowed: {list(allowed)}")
        self.training = bool(training)
        self.weight_cache, self.weight_cache_batch = t.weight_cache, t.weight_cache_batch
        self.lowbit_batch = t.lowbit_batch and not t.grad_ckpt   # a recompute would rebuild saved tensors
        self.nvfp4_kernel, self.lean_act, self.lean_step = t.nvfp4_kernel, t.lean_act, t.lean_step
        self.model = None
        self._scope: Optional[contextlib.ExitStack] = None

    # -- the run's scope --------------------------------------------------------------------
    def __enter__(self) -> "Levers":
        if self._scope is not None:
            raise RuntimeError("Levers: this run's scope is open already")
        st = contextlib.ExitStack()
        try:
            st.callback(weight_cache.set_batching, weight_cache.set_batching(self.weight_cache_batch))
            st.callback(kernels.set_nvfp4_kernel, kernels.set_nvfp4_kernel(self.nvfp4_kernel))
            st.enter_context(step_cache.enabled(weights=self.weight_cache))
            st.callback(self._uninstall)
        except BaseException:
            st.close()
            raise
        self._scope = st
        return self

    def __exit__(self, *exc) -> None:
        st, self._scope = self._scope, None
        if st is not None:
            st.close()

    def _uninstall(self) -> None:
        if self.model is not None and self.lean_act:
            lean_act.unregister(self.model)
        self.model = None

    # -- installing ---------------------------------------------------------------------------
    def install(self, model) -> Dict[str, int]:
        """The levers on the prepared student itself (before DeepSpeed wraps it): ``train.lean_act``.
        Returns what was patched (norms, mlps)."""
        self.model = model
        return lean_act.register(model) if self.lean_act else {"norms": 0, "mlps": 0}

    def attach(self, engine, world: int) -> List[str]:
        """After ``deepspeed.initialize``: DeepSpeed may have cast, moved or partitioned the weights (the
        step's kept values start afresh); the lean step when training with ``train.lean_step``; the
        batched ParetoQ fake quant (``train.lowbit_batch``; grouped by the weights' final dtype and
        device, so only now). Returns what was installed, for the run log."""
        step_cache.weights_changed()
        done = ds_step.install(engine, world) if self.training and self.lean_step else []
        if self.lowbit_batch and self.model is not None:     # a plain model has no low-bit linear to batch
            n = lowbit_batch.register(self.model)
            if n:
                done.append(f"batched low-bit fake quant ({n} linears)")
        return done

    # -- per step -----------------------------------------------------------------------------
    def forward(self) -> None:
        """A micro-batch's training forward begins (its batched low-bit weights are its own)."""
        lowbit_batch.new_pass()

    def step(self, step: int) -> ContextManager:
        """Around optimizer step ``step`` (the number done before it): k-quant scales kept between
        searches (quant.kquant_refresh_every; a no-op for every other model)."""
        if self.model is None:      # nothing installed: no quantizer of this run keeps scales
            return contextlib.nullcontext()
        return kquant_refresh.training_step(self.model, step)

    def weights_changed(self) -> None:
        """The weights changed outside an optimizer's own step signal: the accumulation boundary, a
        checkpoint load, an optimizer reset. Every kept value is dropped."""
        step_cache.weights_changed()


__all__ = ["Levers", "ds_config"]
