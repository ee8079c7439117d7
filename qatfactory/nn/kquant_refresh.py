"""The k-quant scale search refreshed every K optimizer steps (``quant.kquant_refresh_every``).

llama.cpp's Q4_K, Q6_K and (with an importance matrix) Q5_0 quantizers search each sub-block's scale
(and Q4_K's min) before they assign the element codes; on a CPU that search is most of a training
step's fake quant (benchmarks/RESULTS.md). The scales move slowly while the weights train, so with
``K = quant.kquant_refresh_every > 1`` a quantizer of such a type keeps the scales of its last search
and, in the trainer's optimizer steps between searches, only re-assigns the codes of the current
weights under them (the format's own ``quantize(x, **fmt.scale_kwargs(p))``: for Q4_K the last stage
of its quantizer, ``_element_codes``; for Q6_K its step 4; for Q5_0 its reference element rule):

    step s of the run (0-based), block b = s // K:
        the first forward of a step whose kept scales are not from block b runs the full search
        (bit for bit the K = 1 fake quant) and keeps its scales, with s;
        every other forward of block b quantizes the elements under the kept scales.

Outside the trainer's optimizer steps -- every evaluation, calibration, ``convert`` / export, a user's
own forward -- nothing kept is used: the full search of the current weights runs, exactly as with
K = 1. So what is evaluated and exported as the student is always a fresh llama.cpp-exact
quantization of its weights, and the export equals the final student's forward. The gradient is the
format's straight-through rule on the forward that ran (``clipped``: the mask of the scales used).

The kept scales are persistent buffers of the WeightQuantizer, made by ``quantize.prepare``
(nn/kept_scales.py: the state, so a checkpoint holds it and a resume in the middle of a block quantizes
with the very scales the uninterrupted run had). This module is the rule of the trainer's optimizer
steps only: :func:`training_step` installs :func:`forward` as the quantizers' step rule
(``fake_quant.set_step_rule``) for the length of the step and removes it after, so the core quantizer
never imports this module and runs its full search whenever no step is open.

Not covered: calls on part of a tensor (the embedding lookup quantizes only the rows it gathers,
nn/embedding.py: those rows always get the full search; a tied head multiplies by the whole table,
which does keep its scales), formats without a search (q8_0; q5_0 without an imatrix), learnable
or frozen scale strategies. The CUDA kernels take no kept scales: between searches the torch emulator
runs on the GPU (the searches themselves use the kernel).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

from .. import kernels
from . import step_cache
from .fake_quant import set_step_rule
from .kept_scales import attach, attach_all, keep, kept_kwargs, uses_refresh

_STATE: Dict[str, Optional[int]] = {"step": None}
_STATS = {"searches": 0, "kept": 0}


def stats() -> Dict[str, int]:
    """Counters: full searches run inside optimizer steps (``searches``), forwards under kept scales (``kept``)."""
    return dict(_STATS)


def reset_stats() -> None:
    for k in _STATS:
        _STATS[k] = 0


def current_step() -> Optional[int]:
    """The optimizer step the trainer is running (``training_step``), or None outside one."""
    return _STATE["step"]


def forward(q, w3: torch.Tensor, imatrix) -> Optional[torch.Tensor]:
    """The fake quant of ``w3`` under the refresh rule (module docstring), or None where the rule does not
    apply (outside an optimizer step, part of a tensor, a format that does not search here): the caller
    then runs its ordinary full-search path."""
    step = _STATE["step"]
    if step is None or tuple(w3.shape) != q.shape3:
        return None
    fmt = q.fmt
    if not fmt.searches_scales(imatrix is not None):
        return None
    xd = w3.detach()
    made = int(q.kq_step)
    if 0 <= made <= step and made // q.refresh_every == step // q.refresh_every:
        p = fmt.quantize(xd, **kept_kwargs(q))
        _STATS["kept"] += 1
    else:
        p = kernels.quantize(xd, fmt.name, **({} if imatrix is None else {"imatrix": imatrix}))
        keep(q, p, step)
        _STATS["searches"] += 1
    return fmt.fake_quantize_packed(w3, p, q.ste)


@contextlib.contextmanager
def training_step(model, step: int):
    """The trainer's optimizer step ``step`` (the number of steps done before it): inside, quantizers of
    ``model`` that keep scales follow the refresh rule. The fake-quantized weights the step cache holds
    were made outside the step (an evaluation's full search) or inside it (kept scales), so they are
    dropped on the way in and out. A model without kept scales gets a no-op: K = 1 runs as before."""
    if not uses_refresh(model):
        yield
        return
    if _STATE["step"] is not None:
        raise RuntimeError("kquant_refresh.training_step: already inside an optimizer step")
    step_cache.weights_changed()
    _STATE["step"] = int(step)
    prev = set_step_rule(forward)
    try:
        yield
    finally:
        set_step_rule(prev)
        _STATE["step"] = None
        step_cache.weights_changed()


__all__ = ["attach", "attach_all", "forward", "training_step", "uses_refresh", "current_step", "stats",
           "reset_stats"]
