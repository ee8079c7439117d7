"""A CPU stand-in for DeepSpeed's FusedAdam, so that a CPU run takes the optimizer path a GPU run takes.

On a GPU the trainer (``train.optimizer=adamw_fused``) hands DeepSpeed a FusedAdam, and DeepSpeed picks
its bf16 wrapper by the optimizer's type: ZeRO-0 bf16 with a FusedAdam is ``FP16_Optimizer`` (flat
fp32 masters), with torch's AdamW ``FP16_UnfusedOptimizer`` (one fp32 master per parameter). FusedAdam
cannot be built without CUDA, so a CPU count of a GPU step would otherwise measure the other wrapper.

:class:`FusedAdamCPU` is a FusedAdam whose multi-tensor kernel is replaced by ``torch._foreach_*`` ops
(written here from the update rule DeepSpeed documents for ``adam_w_mode``: decoupled weight decay,
bias correction); DeepSpeed's own ``FusedAdam.step`` (the grouping, the step counter) runs unchanged.
It is not bit-equal to the CUDA kernel and is not meant to be: it is used to count the host work
around the optimizer (benchmarks/step_counts.py) and to compare two DeepSpeed paths with the same
optimizer (tests/train/test_step_levers.py). On CUDA the kernel is one launch per 320 chunks of 65,536
elements (``multi_tensor_apply``); :func:`cuda_launches` gives that count for a list of sizes.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

CHUNK = 2048 * 32          # deepspeed.ops.adam.fused_adam: MultiTensorApply(2048 * 32)
MAX_BLOCKS = 320           # csrc/includes/multi_tensor_apply.cuh: depth_to_max_blocks for 4 lists
MAX_TENSORS = 36           # ... depth_to_max_tensors for 4 lists


def cuda_launches(numels: Iterable[int]) -> int:
    """Kernel launches of one multi_tensor_apply over tensors of these sizes (the CUDA FusedAdam): a
    launch when the tensor table or the block table is full, or at the last chunk."""
    numels = [int(n) for n in numels]
    launches, blocks, tensors = 0, 0, 0
    for t, n in enumerate(numels):
        tensors += 1
        chunks = max(1, math.ceil(n / CHUNK))
        for c in range(chunks):
            blocks += 1
            last_of_tensor = c == chunks - 1
            if (tensors == MAX_TENSORS and last_of_tensor) or blocks == MAX_BLOCKS or \
                    (t == len(numels) - 1 and last_of_tensor):
                launches += 1
                blocks = 0
                tensors = 0 if last_of_tensor else 1
    return launches


def _adam_foreach(chunk_size, noop, lists, lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, decay):
    """What multi_tensor_adam computes, as foreach ops over whole tensors."""
    g, p, m, v = lists
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    g32 = [x.float() for x in g] if g[0].dtype != torch.float32 else list(g)
    if not adam_w_mode and decay:
        g32 = torch._foreach_add(g32, [x.float() for x in p], alpha=decay)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g32, alpha=1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g32, g32, value=1.0 - beta2)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    upd = torch._foreach_div(m, bc1)
    torch._foreach_div_(upd, denom)
    if adam_w_mode and decay:
        torch._foreach_add_(upd, p, alpha=decay)
    torch._foreach_add_(p, upd, alpha=-lr)


class _Holder:
    multi_tensor_adam = staticmethod(_adam_foreach)


def fused_adam_cpu_class():
    """The class, built on first use (deepspeed is imported only then)."""
    from deepspeed.ops.adam import FusedAdam

    class FusedAdamCPU(FusedAdam):
        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                     weight_decay=0.0, amsgrad=False, set_grad_none=True):
            if amsgrad:
                raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
            defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
            torch.optim.Optimizer.__init__(self, params, defaults)
            self.adam_w_mode = 1 if adam_w_mode else 0
            self.set_grad_none = set_grad_none
            self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32)
            self.multi_tensor_adam = _Holder.multi_tensor_adam

    return FusedAdamCPU


def swap_in(optimizer: torch.optim.Optimizer):
    """A FusedAdamCPU over ``optimizer``'s parameters and hyperparameters (a torch AdamW's)."""
    groups = optimizer.param_groups
    g0 = groups[0]
    cls = fused_adam_cpu_class()
    return cls([{"params": list(g["params"]), **{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}}
                for g in groups], lr=g0["lr"], betas=tuple(g0["betas"]), eps=g0["eps"],
               weight_decay=g0["weight_decay"], adam_w_mode=True)
