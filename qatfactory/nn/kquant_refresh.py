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

The kept scales are persistent buffers of the WeightQuantizer (``kq_step`` and ``kq_<field>``, fp16
fields stored as int16 bits, so no dtype cast of the module touches them): DeepSpeed checkpoints hold
them, so a resume in the middle of a block quantizes with the very scales the uninterrupted run had.
They exist only when K > 1 (K = 1 state dicts are unchanged).

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


def _probe_fields(fmt, G: int, R: int, K: int):
    """(field name, dtype, shape) of the kept scales of a [G, R, K] weight: from one row's PackedTensor."""
    probe = fmt.quantize(torch.zeros(1, 1, K))
    out = []
    for name, t in fmt.scale_kwargs(probe).items():
        out.append((name, t.dtype, (G, R) + tuple(t.shape[2:])))
    return out


def attach(q, every: int, device=None) -> bool:
    """Give WeightQuantizer ``q`` the kept-scale state for refreshing every ``every`` steps (buffers on
    ``device``). Returns whether it applies (a dynamic quantizer of a format with a scale search);
    every == 1 does nothing."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"kquant_refresh_every={every!r}; allowed: an int >= 1 (1 = a full search every forward)")
    fmt = q.fmt
    if every == 1 or q.strategy != "dynamic" or not (fmt.searches_scales(True) or fmt.searches_scales(False)):
        return False
    if "kq_step" in q._buffers:
        raise ValueError(f"{q!r}: kept scales are attached already")
    G, R, K = q.shape3
    dev = q.imatrix.device if q.uses_imatrix else device
    fields = []
    for name, dtype, shape in _probe_fields(fmt, G, R, K):
        store = torch.int16 if dtype == torch.float16 else dtype
        if store.is_floating_point:
            raise TypeError(f"{fmt.name}: kept scale field {name!r} is {dtype}; only fp16 and integer fields are kept")
        q.register_buffer(f"kq_{name}", torch.zeros(shape, dtype=store, device=dev))
        fields.append((name, dtype))
    q.register_buffer("kq_step", torch.full((), -1, dtype=torch.int64, device=dev))
    q.refresh_every = every
    q._kq_fields = tuple(fields)
    return True


def attach_all(model, every: int) -> int:
    """attach() every WeightQuantizer of a prepared model; returns how many keep scales."""
    from .fake_quant import WeightQuantizer  # noqa: PLC0415 (cycle: fake_quant calls forward below)
    p = next(iter(model.parameters()), None)
    dev = None if p is None else p.device
    seen, n = set(), 0
    for m in model.modules():
        if type(m) is WeightQuantizer and id(m) not in seen:
            seen.add(id(m))
            n += attach(m, every, dev)
    model.__dict__.pop("_qf_kq_any", None)
    return n


def _kept_kwargs(q) -> Dict[str, torch.Tensor]:
    out = {}
    for name, dtype in q._kq_fields:
        t = q._buffers[f"kq_{name}"]
        out[name] = t.view(torch.float16) if dtype == torch.float16 else t
    return out


@torch.no_grad()
def _keep(q, p, step: int) -> None:
    for name, t in q.fmt.scale_kwargs(p).items():
        b = q._buffers[f"kq_{name}"]
        src = t.detach().reshape(b.shape)
        b.copy_(src.view(torch.int16) if src.dtype == torch.float16 else src)
    q.kq_step.fill_(step)


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
        p = fmt.quantize(xd, **_kept_kwargs(q))
        _STATS["kept"] += 1
    else:
        p = kernels.quantize(xd, fmt.name, **({} if imatrix is None else {"imatrix": imatrix}))
        _keep(q, p, step)
        _STATS["searches"] += 1
    return fmt.fake_quantize_packed(w3, p, q.ste)


def uses_refresh(model) -> bool:
    """Whether any quantizer of ``model`` keeps scales between searches (checked once per model)."""
    hit = model.__dict__.get("_qf_kq_any")
    if hit is None:
        hit = any(getattr(m, "refresh_every", 1) > 1 for m in model.modules())
        model.__dict__["_qf_kq_any"] = hit
    return hit


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
    try:
        yield
    finally:
        _STATE["step"] = None
        step_cache.weights_changed()


__all__ = ["attach", "attach_all", "forward", "training_step", "uses_refresh", "current_step", "stats",
           "reset_stats"]
