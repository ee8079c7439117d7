"""Fake-quantized weights kept for one optimizer step.

Weights change once per optimizer step, yet a QuantLinear fake-quantizes its weight in every forward,
again in the backward where the CUDA path recomputes instead of saving, and once more per micro-batch
of gradient accumulation, per gradient-checkpointing recompute and per evaluation forward. Inside
``step_cache.enabled()`` with weights on (the trainer's default), a module instead keeps
``fq(W)`` (detached, in the weight dtype) in a :class:`Site` and every use reads it:

* the forward multiplies by the kept tensor; its gradient reaches W through the quantizer's own
  straight-through rule (identity: the gradient itself; ``clipped``: recomputed through the
  quantizer in the backward, so the mask is the quantizer's);
* the recompute-in-backward path (``_QuantLinearFn``) takes the kept tensor instead of a second
  launch.

Validity. An entry is used only while both hold:

1. the step epoch is the one it was made in: ``step_cache.weights_changed()`` (the trainer after every
   optimizer step and checkpoint load; every ``torch.optim`` optimizer's step through a global
   post-hook) ends the epoch and frees every entry;
2. every tensor the value depends on -- the weight, the fused group's weights (their shared amax), the
   quantizer's amax / scales / imatrix buffers -- has the storage pointer and version counter it had:
   an in-place write through torch (an optimizer, ``load_state_dict``, an edit under ``no_grad``,
   ``module.to``) is seen even inside an epoch. Writes through ``tensor.data`` have a version counter
   of their own and are NOT seen: call ``step_cache.weights_changed()`` after those.

Not cached (the per-forward path runs): learnable scales (the scale trains through the quantizer),
LoRA (the merged weight), the ParetoQ grids (their learnable path is batched per forward instead,
nn/lowbit_batch.py), ZeRO-3 partitioned weights (a kept copy would undo the
partitioning), modules with quantization off.

Batched fills. The first miss of an epoch fills, in one go, every site that was used in the previous
epoch and quantizes the same way (format, dtype, device, row length K): their weights are concatenated
row-wise in chunks of up to ``CHUNK_ELEMS`` elements and fake-quantized by one launch per chunk, with
NVFP4's per-tensor amax given per row (each row carries its own tensor's -- or fused group's, or
expert's -- amax). Blocks never cross a row and the per-tensor constants depend on the amax alone, so
this gives the same bits as one launch per tensor (tests/nn/test_weight_cache.py on the emulator,
tests/kernels/test_kernels_cuda.py on the kernels). The amax of all fused groups comes from one multi-tensor
reduction. Batching runs where the CUDA kernels do (``auto``; the emulator gains nothing from it), or
always / never (``set_batching``; the trainer sets ``train.weight_cache_batch``).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

from .. import kernels
from ..formats import get_format
from . import step_cache
from .fake_quant import WeightQuantizer, has_global_scale, quant_kwargs

_INF = float("inf")
BATCH_MODES = ("auto", "always", "never")
CHUNK_ELEMS = 1 << 28           # elements per batched launch (512 MiB of bf16 read at once)
_STATS = {"fills": 0, "batched_launches": 0, "batched_sites": 0, "hits": 0}
_LIVE: "weakref.WeakSet" = weakref.WeakSet()      # sites holding an entry
_USED: Dict[int, "weakref.ref"] = {}               # sites used in this epoch
_PREV: Dict[int, "weakref.ref"] = {}               # ... and in the last epoch that used any
_PLANS: Dict[tuple, "_Plan"] = {}
_MODE = {"batch": None}


def set_batching(mode: Optional[str]) -> Optional[str]:
    """``auto`` (default: where the CUDA kernels run), ``always``, ``never``; None: unset (auto). Returns
    the previous setting (the trainer puts it back after its run)."""
    if mode is not None and mode not in BATCH_MODES:
        raise ValueError(f"weight cache batching {mode!r}; allowed: {list(BATCH_MODES)}")
    prev = _MODE["batch"]
    _MODE["batch"] = mode
    return prev


def batching() -> str:
    m = _MODE["batch"]
    return "auto" if m is None else m


def stats() -> Dict[str, int]:
    """Counters since the last reset: fills (entries made), hits, batched_launches, batched_sites."""
    return dict(_STATS)


def reset_stats() -> None:
    for k in _STATS:
        _STATS[k] = 0


def release_all() -> None:
    """Drop every entry (the epoch ended); the sites used in it become the next batch's plan."""
    global _USED, _PREV
    for s in list(_LIVE):
        s.entry = None
    _LIVE.clear()
    if _USED:
        _PREV, _USED = _USED, {}


def forget() -> None:
    """Forget which sites were used (a trainer block starts or ends): no batch of another run's sites."""
    _USED.clear()
    _PREV.clear()
    _PLANS.clear()


step_cache._ON_CHANGE.append(release_all)
step_cache._ON_BLOCK.append(forget)


def version_key(tensors) -> tuple:
    """What a kept value computed from ``tensors`` is valid for: each one's storage and version."""
    return tuple((t.data_ptr(), t._version) for t in tensors)


def group_amax_now(ws: List[torch.Tensor]) -> torch.Tensor:
    """max |W| over detached tensors as float32 [1]: one reduction launch for the whole group."""
    with torch.no_grad():
        if len(ws) == 1:
            a = torch.linalg.vector_norm(ws[0], _INF).float()
        else:
            a = torch.stack(torch._foreach_norm(ws, _INF)).amax().float()
    return a.reshape(1)


def expert_amax_now(w: torch.Tensor) -> torch.Tensor:
    """Per-expert max |W| [E] (float32)."""
    with torch.no_grad():
        return torch.linalg.vector_norm(w.detach(), _INF, dim=(1, 2)).float()


class Entry:
    __slots__ = ("key", "wq", "amax")

    def __init__(self, key, wq, amax):
        self.key, self.wq, self.amax = key, wq, amax


class Site:
    """One kept weight: ``owner._parameters[name]`` ([R, K]; fused experts [E, R, K]) and the
    WeightQuantizer at ``owner.<quant_attr>``. Lives on the owner (``owner._qf_wc``)."""

    __slots__ = ("owner", "name", "quant_attr", "experts", "entry", "_bk", "_deps", "__weakref__")

    def __init__(self, owner, name: str, quant_attr: str, experts: bool):
        self.owner = weakref.ref(owner)
        self.name, self.quant_attr, self.experts = name, quant_attr, experts
        self.entry: Optional[Entry] = None
        self._bk = None
        self._deps = None          # (epoch, weight, quantizer, deps): the list rebuilt once per epoch

    def param(self) -> torch.Tensor:
        return self.owner()._parameters[self.name]

    def quant(self):
        return getattr(self.owner(), self.quant_attr)

    def members(self) -> List[torch.Tensor]:
        """The tensors whose amax this one's depends on (the fused group's weights)."""
        o = self.owner()
        if self.experts or self.quant().strategy != "dynamic":
            return [self.param()]
        return [m._parameters["weight"] for m in o._group]

    def deps(self) -> List[torch.Tensor]:
        q = self.quant()
        out = self.members()
        if out[0] is not self.param():
            out = [self.param()] + out
        for b in ("amax", "scales", "imatrix"):
            t = q._buffers.get(b)
            if t is not None:
                out.append(t)
        return out

    def eligible(self) -> bool:
        o = self.owner()
        q = self.quant()
        if type(q) is not WeightQuantizer or q.strategy not in ("dynamic", "frozen"):
            return False
        if not self.experts and (o.lora is not None or not o.quant_enabled):
            return False
        return not hasattr(self.param(), "ds_id")          # ZeRO-3: partitioned, gathered per use

    def key(self, epoch: int) -> tuple:
        """(epoch, storage and version of every dependency). The dependency list is kept for the epoch
        (rebuilt at once if the weight Parameter or the quantizer object is replaced)."""
        d = self._deps
        o = self.owner()
        w, q = o._parameters[self.name], o._modules[self.quant_attr]
        if d is None or d[0] != epoch or d[1] is not w or d[2] is not q:
            d = self._deps = (epoch, w, q, self.deps())
        k = [epoch]
        for t in d[3]:
            k.append(t.data_ptr())
            k.append(t._version)
        return tuple(k)

    def amax_now(self) -> Optional[torch.Tensor]:
        q = self.quant()
        if q.strategy != "dynamic":
            return None
        if self.experts:
            return expert_amax_now(self.param())
        return group_amax_now([m.detach() for m in self.members()])

    def quantize_now(self, w: torch.Tensor, amax) -> torch.Tensor:
        """fq(w) exactly as the module's per-forward path computes it (w may require grad)."""
        q = self.quant()
        if self.experts:
            return q(w, amax).to(w.dtype)
        return q(w.unsqueeze(0), amax)[0].to(w.dtype)

    def batch_key(self):
        """(format, dtype, device, K) when this site may join a batched fill, else None."""
        p, q = self.param(), self.quant()
        sig = (p.dtype, p.device, tuple(p.shape), id(q), q.strategy,
               None if "imatrix" not in q._buffers else version_key([q.imatrix]))
        if self._bk is not None and self._bk[0] == sig:
            return self._bk[1]
        bk = None
        mode = batching()
        # kept k-quant scales (q.refresh_every > 1) are per quantizer: its own forward, never a batch
        if q.strategy == "dynamic" and mode != "never" and q._imatrix() is None and q.refresh_every == 1:
            fmt = q.fmt
            kw = quant_kwargs(fmt, amax=torch.ones(1) if has_global_scale(fmt) else None)
            if mode == "always" or kernels.why_not(p.detach(), fmt.name, **kw) is None:
                bk = (fmt.name, p.dtype, p.device, int(p.shape[-1]))
        self._bk = (sig, bk)
        return bk


def site(owner, name: str, quant_attr: str, experts: bool = False) -> Site:
    d = owner.__dict__.setdefault("_qf_wc", {})
    s = d.get(name)
    if s is None:
        s = d[name] = Site(owner, name, quant_attr, experts)
    return s


def lookup(s: Site) -> Optional[Entry]:
    """The kept fq(W) of a site for this step (filled on a miss), or None when not cached."""
    if not step_cache.weights_cached() or not s.eligible():
        return None
    epoch = step_cache.current()
    if id(s) not in _USED:
        _USED[id(s)] = weakref.ref(s)
    key = s.key(epoch)
    e = s.entry
    if e is not None and e.key == key:
        _STATS["hits"] += 1
        return e
    _fill(s, epoch, key)
    return s.entry


def _valid(s: Site, epoch: int) -> bool:
    return s.entry is not None and s.entry.key == s.key(epoch)


def _fill(s: Site, epoch: int, key: tuple) -> None:
    bk = s.batch_key()
    if bk is not None:
        others = []
        for r in _PREV.values():
            t = r()
            if t is None or t is s or t.owner() is None or not t.eligible() or t.batch_key() != bk:
                continue
            if not _valid(t, epoch):
                others.append(t)
        if others:
            _fill_batched([s] + others, bk, epoch)
            return
    s.entry = None
    with torch.no_grad():
        amax = s.amax_now()
        wq = s.quantize_now(s.param().detach(), amax)
    s.entry = Entry(key, wq, amax)
    _LIVE.add(s)
    _STATS["fills"] += 1


class _Plan:
    """The fixed part of a batched fill: site order, rows, the group-amax gather index, chunks."""

    def __init__(self, sites: List[Site], K: int, device, needs_amax: bool):
        self.refs = [weakref.ref(s) for s in sites]
        self.rows = [s.param().numel() // K for s in sites]
        lin = [s for s in sites if not s.experts]
        self.n_lin = len(lin)
        self.midx = None
        if needs_amax and lin:
            # one row per linear site: the positions of its group's members in the member list,
            # padded with its own (a max is unchanged by repeats)
            order: Dict[int, int] = {}
            rows = []
            for t in lin:
                ids = [order.setdefault(id(m), len(order)) for m in t.members()]
                rows.append(ids)
            width = max(len(r) for r in rows)
            self.midx = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
        # units: one per linear site, one per expert; chunks split at site boundaries
        self.units = [1 if not s.experts else int(s.param().shape[0]) for s in sites]
        self.chunks = []
        lo, acc = 0, 0
        for i, s in enumerate(sites):
            n = s.param().numel()
            if acc and acc + n > CHUNK_ELEMS:
                self.chunks.append(self._chunk(sites, lo, i, K, device))
                lo, acc = i, 0
            acc += n
        self.chunks.append(self._chunk(sites, lo, len(sites), K, device))

    def _chunk(self, sites, lo, hi, K, device):
        u0 = sum(self.units[:lo])
        u1 = u0 + sum(self.units[lo:hi])
        counts = []
        for s, nrow, nu in zip(sites[lo:hi], self.rows[lo:hi], self.units[lo:hi]):
            counts += [nrow // nu] * nu
        rows = sum(self.rows[lo:hi])
        return lo, hi, u0, u1, rows, torch.tensor(counts, dtype=torch.long, device=device)

    def matches(self, sites) -> bool:
        return len(sites) == len(self.refs) and all(r() is s for r, s in zip(self.refs, sites))


def _fill_batched(sites: List[Site], bk, epoch: int) -> None:
    fmt_name, dtype, device, K = bk
    fmt = get_format(fmt_name)
    needs_amax = has_global_scale(fmt)
    sites = [s for s in sites if not s.experts] + [s for s in sites if s.experts]
    sig = tuple((id(s), tuple(id(m) for m in s.members())) for s in sites)
    plan = _PLANS.get(sig)
    if plan is None or not plan.matches(sites):
        if len(_PLANS) > 16:
            _PLANS.clear()
        plan = _PLANS[sig] = _Plan(sites, K, device, needs_amax)
    keys = [s.key(epoch) for s in sites]
    for s in sites:
        s.entry = None
    with torch.no_grad():
        units = None
        if needs_amax:
            parts = []
            if plan.n_lin:
                mem: Dict[int, torch.Tensor] = {}
                for t in sites[:plan.n_lin]:
                    for m in t.members():
                        mem.setdefault(id(m), m.detach())
                norms = torch.stack(torch._foreach_norm(list(mem.values()), _INF))
                parts.append(norms[plan.midx].amax(1).float())
            parts += [expert_amax_now(s.param()) for s in sites[plan.n_lin:]]
            units = torch.cat(parts) if len(parts) > 1 else parts[0]
        for lo, hi, u0, u1, rows, counts in plan.chunks:
            ws = [s.param().detach().reshape(-1, K) for s in sites[lo:hi]]
            x = torch.cat(ws) if len(ws) > 1 else ws[0]
            amax = None
            if needs_amax:
                amax = torch.repeat_interleave(units[u0:u1], counts, output_size=rows)
            y = kernels.fake_quantize(x, fmt_name, **quant_kwargs(fmt, amax=amax))
            _STATS["batched_launches"] += 1
            r, u = 0, u0
            for i in range(lo, hi):
                s = sites[i]
                p = s.param()
                n = plan.rows[i]
                a = None if units is None else units[u:u + plan.units[i]]
                s.entry = Entry(keys[i], y[r:r + n].view(p.shape), a)
                _LIVE.add(s)
                r += n
                u += plan.units[i]
    _STATS["batched_sites"] += len(sites)
    _STATS["fills"] += len(sites)


class CachedWeight(torch.autograd.Function):
    """Returns the kept ``wq`` with W's gradient by the quantizer's straight-through rule: identity
    passes the gradient through; ``clipped`` recomputes fq(W) in the backward and takes the
    quantizer's own gradient (its saturation mask)."""

    @staticmethod
    def forward(ctx, w, wq, s, amax):
        ctx.site, ctx.amax = s, amax
        ctx.clipped = s.quant().ste == "clipped"
        if ctx.clipped:
            ctx.save_for_backward(w)
        return wq

    @staticmethod
    def backward(ctx, g):
        if not ctx.clipped:
            return g, None, None, None
        (w,) = ctx.saved_tensors
        with torch.enable_grad():
            wd = w.detach().requires_grad_()
            (gw,) = torch.autograd.grad(ctx.site.quantize_now(wd, ctx.amax), wd, g)
        return gw, None, None, None


def training_weight(s: Site, e: Entry) -> torch.Tensor:
    """The kept fq(W) as the forward uses it: with W's straight-through gradient when W trains."""
    w = s.param()
    if torch.is_grad_enabled() and w.requires_grad:
        return CachedWeight.apply(w, e.wq, s, e.amax)
    return e.wq


__all__ = ["Site", "Entry", "site", "lookup", "training_weight", "release_all", "stats", "reset_stats",
           "set_batching", "batching", "version_key", "group_amax_now", "expert_amax_now", "CHUNK_ELEMS"]
