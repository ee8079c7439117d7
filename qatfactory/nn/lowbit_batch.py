"""The ParetoQ grids' learnable fake quant of a whole model in a few calls per forward.

A learnable low-bit scale trains through the quantizer, so fq(W) cannot be kept for the step the way
nn/weight_cache.py keeps the other formats': every forward pass builds it with its graph. Built per linear
(nn/lowbit.py ``_ParetoQ``) that costs ~60 op launches per linear and step (benchmarks/lowbit_step.py:
SmolLM2-135M's 210 linears, ~13,000 of a step's launches), and a small model's GPU step is bound by the
host issuing them (the H200 trained 4-bit LSQ SmolLM2 at ~0.72 s per step, ~11,000 tokens/s).

Inside the trainer (``step_cache.enabled()``, :func:`register` called on the student by train/levers.py
when ``train.lowbit_batch`` is on, the default) the linears of one
format, row length K, weight dtype, device and gradient rule form a group. The first linear of a group
that a forward pass reaches computes fq(W) of every member in one custom autograd call per chunk of up to
``CHUNK_ELEMS`` weights (rows concatenated; each row has its own alpha, each member its own gradient
scale g = 1/sqrt(N Qp), given per row), and the others take their rows. The values are the per-linear
call's: the same float32 operations on each element, row sums over the same K elements
(tests/nn/test_lowbit_batch.py: forward and gradients bit for bit against the per-linear path and ParetoQ's
released quantizer on a CPU; tests/nn/test_lowbit_batch_cuda.py asks the same of CUDA, whose row-sum launch
configuration depends on the number of rows). A member whose rows get no gradient in the backward (not
used by that pass) gets None, as it would unbatched. Host syncs: one finite check per call.

Validity. A training entry (grad mode on) serves one forward pass (``new_pass()``: the trainer calls it
before each micro-batch's forward) and is dropped once its backward ran; an evaluation entry (grad mode
off) serves the step epoch. Every lookup also checks the member's weight and alpha storage and version (an
in-place write since the entry was made recomputes it) and that the member still qualifies (learnable
LowBitQuantizer, quantization on, no LoRA, not ZeRO-3-partitioned, the group's dtype and device). Not used
with gradient checkpointing (the trainer does not register then: a recompute would have to rebuild the
same saved tensors) nor outside the trainer (``train.lowbit_batch=false`` turns it off there too). A
registered linear finds its group through its ``linear.WEIGHT_HOOK`` attribute (the group's ``lookup``):
nn/linear.py does not import this module.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

from ..formats import get_format
from . import step_cache
from .linear import WEIGHT_HOOK, QuantLinear
from .lowbit import LowBitQuantizer, grad_scale, paretoq_grads, scales_of

# weights per batched call: on a GPU 2^26 (256 MiB per float32 temporary, held by torch's caching
# allocator); on a CPU 2^22 (16 MiB: glibc serves blocks under its 32 MiB mmap threshold from the heap,
# where larger ones are mapped and unmapped on each use, a page fault per 4 KiB touched)
CHUNK_ELEMS = {"cuda": 1 << 26, "cpu": 1 << 22}
_STATE = {"pass": 0}
_GROUPS: Dict[tuple, "_Group"] = {}
_ATTR = WEIGHT_HOOK
_STATS = {"calls": 0, "hits": 0}


def _key(m, now: bool = True) -> Optional[tuple]:
    """The group of a QuantLinear, or None when it does not qualify (``now``: with its quantization on;
    registration ignores that switch, which quant_start flips during the run)."""
    wq = m._modules.get("weight_quant")
    if type(wq) is not LowBitQuantizer or wq.strategy != "learnable" or m.lora is not None:
        return None
    if now and not m.quant_enabled:
        return None
    w = m._parameters["weight"]
    if hasattr(w, "ds_id") or w.dim() != 2:
        return None
    a = wq._parameters["alpha"]
    return (wq.fmt_name, int(w.shape[-1]), w.dtype, a.dtype, w.device, wq.grad_rule)


def register(model) -> int:
    """Batch the learnable low-bit linears of ``model`` while the current step_cache block lasts;
    returns how many joined a group."""
    n = 0
    for m in model.modules():
        if not isinstance(m, QuantLinear):
            continue
        k = _key(m, now=False)
        if k is None:
            continue
        g = _GROUPS.get(k)
        if g is None:
            g = _GROUPS[k] = _Group(k)
        g.members.append(weakref.ref(m))
        m.__dict__[_ATTR] = g
        n += 1
    return n


def forget() -> None:
    """Unregister everything (the trainer's step_cache block starts or ends)."""
    for g in _GROUPS.values():
        for r in g.members:
            m = r()
            if m is not None:
                m.__dict__.pop(_ATTR, None)
        g.entries.clear()
    _GROUPS.clear()


def release() -> None:
    """Drop every entry (the weights changed: an optimizer step)."""
    for g in _GROUPS.values():
        g.entries.clear()


def new_pass() -> None:
    """A training forward pass begins: its linears get entries of their own."""
    _STATE["pass"] += 1


def stats() -> Dict[str, int]:
    return dict(_STATS)


step_cache._ON_CHANGE.append(release)
step_cache._ON_BLOCK.append(forget)


def _version(m) -> tuple:
    w, a = m._parameters["weight"], m._modules["weight_quant"]._parameters["alpha"]
    return (w.data_ptr(), w._version, a.data_ptr(), a._version)


class _Entry:
    __slots__ = ("epoch", "pass_id", "index", "outs", "versions", "consumed", "__weakref__")

    def __init__(self, epoch, pass_id):
        self.epoch, self.pass_id = epoch, pass_id
        self.index: Dict[int, int] = {}
        self.outs: List[torch.Tensor] = []
        self.versions: List[tuple] = []
        self.consumed = False


class _Chunk:
    """The fixed part of one batched call: members' rows and shapes, the per-row gradient scale."""

    def __init__(self, fmt, K: int, mods, device, clean: bool):
        self.fmt, self.K, self.clean = fmt, K, clean
        self.ng = fmt.n_groups(K)
        ws = [m._parameters["weight"] for m in mods]
        self.rows = [int(w.shape[0]) for w in ws]
        self.w_shapes = [tuple(w.shape) for w in ws]
        self.a_shapes = [tuple(m._modules["weight_quant"]._parameters["alpha"].shape) for m in mods]
        # ParetoQ's g = 1/sqrt(N Qp) of each member, N its element count, as float32 per row
        self.g = torch.cat([torch.full((r, 1, 1), grad_scale(fmt, r * K), dtype=torch.float32, device=device)
                            for r in self.rows]) if len(mods) > 1 else grad_scale(fmt, self.rows[0] * K)

    def fits(self, mods) -> bool:
        return self.w_shapes == [tuple(m._parameters["weight"].shape) for m in mods] and \
            self.a_shapes == [tuple(m._modules["weight_quant"]._parameters["alpha"].shape) for m in mods]


class _Group:
    def __init__(self, key: tuple):
        self.key = key
        self.fmt = get_format(key[0])
        self.members: List[weakref.ref] = []
        self.entries: Dict[bool, _Entry] = {}
        self._plan = None          # (member ids, [(chunk members, _Chunk)]) while the members are the same

    def _valid(self, e: Optional[_Entry], grad: bool, epoch: int) -> bool:
        return (e is not None and e.epoch == epoch and not e.consumed
                and (not grad or e.pass_id == _STATE["pass"]))

    def lookup(self, m) -> Optional[torch.Tensor]:
        epoch = step_cache.current()
        if epoch is None:
            return None
        grad = torch.is_grad_enabled()
        e = self.entries.get(grad)
        if self._valid(e, grad, epoch):
            i = e.index.get(id(m))
            if i is not None and e.versions[i] == _version(m):
                _STATS["hits"] += 1
                return e.outs[i]
        e = self._compute(grad, epoch)
        i = e.index.get(id(m))
        return None if i is None else e.outs[i]

    def _chunks(self, mods):
        ids = tuple(id(m) for m in mods)
        if self._plan is not None and self._plan[0] == ids and all(c.fits(ms) for ms, c in self._plan[1]):
            return self._plan[1]
        fmt, K, dev, clean = self.fmt, self.key[1], self.key[4], self.key[5] == "clean"
        limit = CHUNK_ELEMS.get(torch.device(dev).type, CHUNK_ELEMS["cuda"])
        parts, cur, acc = [], [], 0
        for m in mods:
            n = m._parameters["weight"].numel()
            if cur and acc + n > limit:
                parts.append(cur)
                cur, acc = [], 0
            cur.append(m)
            acc += n
        if cur:
            parts.append(cur)
        self._plan = (ids, [(ms, _Chunk(fmt, K, ms, dev, clean)) for ms in parts])
        return self._plan[1]

    def _compute(self, grad: bool, epoch: int) -> _Entry:
        mods = [m for m in (r() for r in self.members) if m is not None and _key(m) == self.key]
        e = _Entry(epoch, _STATE["pass"] if grad else None)
        self.entries[grad] = e
        ref = weakref.ref(e)
        for chunk, meta in (self._chunks(mods) if mods else ()):
            ws = [m._parameters["weight"] for m in chunk]
            al = [m._modules["weight_quant"]._parameters["alpha"] for m in chunk]
            outs = _ParetoQGroup.apply(meta, ref, len(chunk), *ws, *al)
            _STATS["calls"] += 1
            for m, y in zip(chunk, outs):
                e.index[id(m)] = len(e.outs)
                e.outs.append(y)
                e.versions.append(_version(m))
        return e


def weight(m) -> Optional[torch.Tensor]:
    """fq(W) [R, K] of a registered QuantLinear for this pass (in the weight dtype, with ParetoQ's
    gradients to W and alpha), or None: the caller runs the per-linear path."""
    g = m.__dict__.get(_ATTR)
    return None if g is None else g.lookup(m)


class _ParetoQGroup(torch.autograd.Function):
    """fq(W_i) of n members in one call: inputs (meta, entry ref, n, W_1..W_n, alpha_1..alpha_n), outputs
    the n fake-quantized weights in their weight dtype."""

    @staticmethod
    def forward(ctx, meta: _Chunk, entry, n: int, *tensors):
        ws, al = tensors[:n], tensors[n:]
        fmt, K, ng = meta.fmt, meta.K, meta.ng
        wf = _cat([w.detach() for w in ws], K).float()
        fmt.check_finite(fmt.name, wf)
        d, a = scales_of(fmt, _cat([x.detach() for x in al], ng))
        y = fmt.fake_values(wf.reshape(-1, ng, K // ng), a, d).reshape(-1, K).to(ws[0].dtype)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a, *ws)      # the weights themselves: the backward concatenates again
        ctx.meta, ctx.entry, ctx.n = meta, entry, n
        return tuple(y.split(meta.rows)) if n > 1 else (y,)

    @staticmethod
    def backward(ctx, *gys):
        meta, n = ctx.meta, ctx.n
        e = ctx.entry()
        if e is not None:            # its pass is over: the next forward builds a fresh entry
            e.consumed = True
            e.outs.clear()
        a, *ws = ctx.saved_tensors
        need_w, need_a = ctx.needs_input_grad[3:3 + n], ctx.needs_input_grad[3 + n:]
        used = [g is not None for g in gys]
        if not any(used) or not (any(need_w) or any(need_a)):
            return (None, None, None) + (None,) * (2 * n)
        K, ng = meta.K, meta.ng
        ref = next(g for g in gys if g is not None)
        go = _cat([g if g is not None else ref.new_zeros(r, K) for g, r in zip(gys, meta.rows)], K)
        wf = _cat([w.detach() for w in ws], K).float()
        shp = (wf.shape[0], ng, K // ng)
        gw, ga = paretoq_grads(meta.fmt, wf.reshape(shp), a, go.float().reshape(shp), meta.g, meta.clean)
        gw = gw.reshape(-1, K).to(ref.dtype)
        gws = gw.split(meta.rows) if n > 1 else (gw,)
        gas = ga.split(meta.rows) if n > 1 else (ga,)
        out_w = [gws[i].view(meta.w_shapes[i]) if need_w[i] and used[i] else None for i in range(n)]
        out_a = [gas[i].view(meta.a_shapes[i]) if need_a[i] and used[i] else None for i in range(n)]
        return (None, None, None, *out_w, *out_a)


def _cat(ts, k: int) -> torch.Tensor:
    """Row-wise concatenation of tensors viewed as [-1, k] (no copy for one)."""
    return torch.cat([t.reshape(-1, k) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1, k)


__all__ = ["register", "forget", "release", "new_pass", "weight", "stats", "CHUNK_ELEMS"]
