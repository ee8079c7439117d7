"""DeepSpeed's bf16 ZeRO-0 step without its per-parameter host work (the step is host-bound).

On a GPU the trainer's bf16 ZeRO-0 engine wraps FusedAdam in DeepSpeed's ``FP16_Optimizer`` (flat bf16
weights, one flat fp32 master, one FusedAdam launch). Around that one launch, DeepSpeed 0.19.8 does per
parameter, every step (counted on a CPU by benchmarks/step_counts.py; 147 parameters for a 16-layer Llama):

* ``FP16_Optimizer.step``: an overflow check of each gradient (``CheckOverflow.has_overflow_serial``:
  six reductions and a ``bool()`` -- a host read -- per parameter), a ``.to(fp32)`` of each gradient
  before one concatenation, and after the update one copy per parameter from the flat fp32 master back
  into the bf16 weight;
* ``engine.allreduce_gradients`` (in ``engine.backward``), also on one rank: every gradient concatenated,
  scaled by 1 / world size, all-reduced, and copied back one by one;
* the engine's throughput timer: a device synchronize at the start of every forward and at the end of
  every step (``timers.throughput.synchronized``), for a report we never print.

:func:`install` replaces these with the same computation, done once:

* the step (:func:`_lean_fp16_step`) runs ``FP16_Optimizer.step`` as written, minus the per-parameter
  overflow check: a non-finite gradient makes the global norm that the same step computes next
  non-finite, and that check (DeepSpeed's own, ``is_invalid_grad_norm``) skips the step just as the
  overflow check did (``_skip_invalid_grad_norm``). The gradients are concatenated in bf16 and converted
  once (a bf16 -> fp32 conversion is exact, so the flat fp32 gradient is the same); the update is copied
  into the flat bf16 buffer the weights are views of in one copy (the same rounding, element by element;
  a weight that no longer points into the buffer gets its own copy, as before);
* on one rank the engine skips the gradient all-reduce (``enable_backward_allreduce = False``, the flag
  DeepSpeed's own no_sync uses): with one rank, x * (1 / 1) all-reduced over itself is x;
* the throughput timer is off in the DeepSpeed config (``ds_config``): it only measures.

tests/train/test_step_levers.py trains with and without each of these and compares the weights bit for bit
(clipping active, a non-finite gradient skipped, gradient accumulation). ``train.lean_step=false`` keeps
DeepSpeed's own step (and ``train.ds_timers=true`` its timer) to measure the difference
(benchmarks/step.py rows "[before: stock DeepSpeed step]"). Installed only for DeepSpeed 0.19.x's
``FP16_Optimizer`` on bf16 without model parallelism or MoE; anything else keeps DeepSpeed's step.
"""
from __future__ import annotations

import types
from typing import Any, Dict, List

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

LEAN_VERSIONS = ("0.19.",)       # the DeepSpeed releases whose FP16_Optimizer.step this mirrors


def ds_config(t) -> Dict[str, Any]:
    """What the lean step adds to the DeepSpeed config: the throughput timer off unless train.ds_timers."""
    if getattr(t, "ds_timers", False):
        return {}
    return {"timers": {"throughput": {"enabled": False, "synchronized": False}}}


def _why_not(opt) -> str:
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer  # noqa: PLC0415 (optional: deepspeed)
    if not str(deepspeed.__version__).startswith(LEAN_VERSIONS):
        return f"deepspeed {deepspeed.__version__} (the lean step mirrors {LEAN_VERSIONS})"
    if type(opt) is not FP16_Optimizer:
        return f"optimizer wrapper {type(opt).__name__} (the lean step replaces FP16_Optimizer.step only)"
    if opt.low_precision_dtype != torch.bfloat16 or opt.loss_scale_config.use_grad_scaling:
        return "fp16 with loss scaling"
    if opt.mpu is not None or opt.has_moe_layers or opt.fused_adam_legacy:
        return "model parallelism, MoE or the legacy fused step"
    return ""


def install(engine, world: int) -> List[str]:
    """Install the levers on a built engine; returns what was installed (for the run log)."""
    done = []
    opt = getattr(engine, "optimizer", None)
    if opt is not None and not _why_not(opt):
        opt.step = types.MethodType(_lean_fp16_step, opt)
        done.append("lean FP16_Optimizer step")
    if world == 1 and not engine.zero_optimization() and engine.enable_backward_allreduce:
        engine.enable_backward_allreduce = False
        done.append("no gradient all-reduce on one rank")
    return done


def _grads_flat(group, dtype) -> torch.Tensor:
    """The group's gradients, flat, in ``dtype``: one concatenation in the gradients' own dtype and one
    conversion (DeepSpeed: one conversion per gradient, then the concatenation; the same values)."""
    grads = [torch.zeros(p.size(), dtype=p.dtype, device=p.device) if p.grad is None else p.grad for p in group]
    if len({g.dtype for g in grads}) > 1:
        return _flatten_dense_tensors([g.to(dtype) for g in grads])
    flat = _flatten_dense_tensors(grads)
    return flat if flat.dtype == dtype else flat.to(dtype)


def _aliases(flat: torch.Tensor, group) -> bool:
    """Whether every weight of the group is still the contiguous view of ``flat`` that FP16_Optimizer made."""
    base, size, off = flat.data_ptr(), flat.element_size(), 0
    for p in group:
        d = p.data
        if d.dtype != flat.dtype or not d.is_contiguous() or d.data_ptr() != base + off * size:
            return False
        off += d.numel()
    return off == flat.numel()


def _lean_fp16_step(self, closure=None):
    """``FP16_Optimizer.step`` (DeepSpeed 0.19.8, fp16/fused_optimizer.py) for bf16 without MoE or model
    parallelism, without the per-parameter overflow check and per-parameter copies (module docstring)."""
    from deepspeed.runtime.utils import get_flattened_grad_norm, get_global_norm, is_invalid_grad_norm  # noqa: PLC0415 (optional: deepspeed)
    self.overflow = False
    grads_groups_flat, for_norm = [], []
    for i, group in enumerate(self.fp16_groups):
        grads_groups_flat.append(_grads_flat(group, self.fp32_groups_flat[i].dtype))
        self.fp32_groups_flat[i].grad = grads_groups_flat[i]
        if not self.has_executed_step:
            self.flatten_grad_norm_mask_list.append(self._get_norm_mask_idx(group))
        for_norm.append(self.fp32_groups_flat[i])
        for p in group:
            p.grad = None
    all_groups_norm = get_flattened_grad_norm(for_norm, mpu=self.mpu, grad_norm_mask=self.flatten_grad_norm_mask_list)
    scaled_global_grad_norm = get_global_norm(norm_list=[all_groups_norm])
    if is_invalid_grad_norm(scaled_global_grad_norm):
        # a NaN or Inf anywhere in the gradients (what the per-parameter check looked for) lands here
        return self._skip_invalid_grad_norm()
    self._global_grad_norm = scaled_global_grad_norm / self.loss_scale_config.cur_scale
    self.unscale_and_clip_grads(grads_groups_flat, scaled_global_grad_norm)
    self.optimizer.step()
    for group in self.fp32_groups_flat:
        group.grad = None
    for i, group in enumerate(self.fp16_groups):
        if _aliases(self.fp16_groups_flat[i], group):
            self.fp16_groups_flat[i].copy_(self.fp32_groups_flat[i])
        else:
            for p, q in zip(group, _unflatten_dense_tensors(self.fp32_groups_flat[i], group)):
                p.data.copy_(q.data)
    self.has_executed_step = True
    return self.overflow
