"""ParetoQ's full-precision-then-QAT schedule (``train.quant_start``), as method hooks.

The first ``round(quant_start * max_steps)`` optimizer steps train with the quantizers off; then the
scales are calibrated from the weights trained so far, quantization switches on, the optimizer's
fp32 masters are re-read and its state cleared (a fresh AdamW, as ParetoQ's QAT starts from a
full-precision checkpoint), and the LR schedule restarts over the remaining steps with peak
``quant_lr`` (None: lr). A checkpoint records which side of the switch it is on (``quant_on``).
Methods that train a quantized student from its own weights (qat, qad) inherit :class:`QuantStart`.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ... import quantize as Q
from .base import Context, Method, quantized


def switch_step(tcfg) -> int:
    """Optimizer steps trained with quantization off (round(quant_start * max_steps))."""
    return int(round(float(getattr(tcfg, "quant_start", 0.0) or 0.0) * int(tcfg.max_steps)))


def check(cfg, method: Method) -> None:
    """Refuse train.quant_start > 0 where the schedule cannot run, saying why."""
    t = cfg.train
    if not t.quant_start > 0:
        return
    why: Optional[str] = None
    if not quantized(cfg):
        why = "format=bf16 quantizes nothing"
    elif method.quant_start_refusal is not None:
        why = method.quant_start_refusal.format(name=cfg.method.name)
    elif t.zero_stage == 3:
        why = "ZeRO-3 partitions the weights the switch calibrates from (use zero_stage 0-2)"
    if why:
        raise ValueError(f"train.quant_start={t.quant_start!r}: {why}; allowed with method qat / qad on a "
                         f"quantized format")


class QuantStart(Method):
    """The hooks of the schedule; a no-op when train.quant_start is 0."""

    quant_start_refusal = None
    _s0, _on = 0, True

    def lr_restart(self, cfg) -> Tuple[int, float]:
        t = cfg.train
        s0 = switch_step(t) if quantized(cfg) else 0
        return s0, float(t.quant_lr or t.lr) / float(t.lr)

    def begin(self, ctx: Context, state: Dict[str, Any]) -> None:
        self._s0 = switch_step(ctx.cfg.train) if quantized(ctx.cfg) else 0
        self._on = True
        if self._s0 > 0:
            self._on = bool(state.get("quant_on", ctx.step > self._s0))
            Q.set_quantization(ctx.model, self._on)

    def before_step(self, ctx: Context) -> None:
        if not self._on and ctx.step >= self._s0:
            self._switch(ctx)

    def end(self, ctx: Context) -> bool:
        if not self._on:            # quant_start = 1: full precision all along, then PTQ of the result
            self._switch(ctx)
        return bool(ctx.history) and ctx.history[-1].get("quant_on") is False

    def state(self) -> Dict[str, Any]:
        return {"quant_on": self._on} if self._s0 > 0 else {}

    def eval_tags(self) -> Dict[str, Any]:
        return {"quant_on": self._on} if self._s0 > 0 else {}

    def _switch(self, ctx: Context) -> None:
        """The full-precision model's eval, then quantizers on, scales calibrated from the weights
        trained so far, the optimizer restarted."""
        cfg = ctx.cfg
        if not ctx.history or ctx.history[-1]["step"] != ctx.step:
            ctx.evaluate()
        Q.set_quantization(ctx.model, True)
        Q.calibrate(ctx.model, ctx.calib, cfg.quant.calib_method if cfg.method.calibrate else "max")
        ctx.reset_optimizer()
        self._on = True
        ctx.say(f"step {ctx.step}: quantization on ({cfg.quant.weight_format}), scales calibrated, "
                f"LR schedule restarted")
