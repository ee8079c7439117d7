"""Live top-k KL: the teacher's ``k`` most likely tokens per position, taken in the same step from the
live teacher, plus one bucket for the rest of the vocabulary.

A dense float32 logits tensor at 32K tokens and a 248K vocabulary is 30 GiB; distilling on the teacher's
top-k keeps long-context QAD on one GPU (Model Optimizer's Megatron-Bridge QAD runs ``--logit_kl_top_k
4096`` for this reason). Per position, with ``S`` the teacher's top-k token ids (at temperature ``tau``,
the same set at every temperature), ``p`` the teacher's and ``q`` the student's full-vocabulary softmax
at ``tau``, the loss is the forward KL over ``k + 1`` bins, the ``k`` tokens and "everything else"::

    L = sum_{i in S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail),
    p_tail = 1 - sum_{i in S} p_i,   q_tail = 1 - sum_{i in S} q_i

scaled by ``tau**2`` like the other divergences (losses.py). Unlike the cached top-k teacher (which
renormalises the teacher over ``S`` and drops the tail), the teacher's probabilities here are its own,
normalised over the whole vocabulary, and the student's mass outside ``S`` is matched to the teacher's
tail mass as one number. When ``k`` is the vocabulary size the tail is empty and ``L`` is the full forward
KL exactly.

The tails are computed as log-sum-exps over the complement of ``S`` (the top-k logits set to -inf), not
as ``1 - sum``: at k = 4096 the teacher's tail is often below 1e-3, where ``1 - sum`` in float32 loses
most of its digits.

Gradient (``a = z / tau`` the student's scaled logits)::

    dL/da_j = q_j - p_j                    for j in S
    dL/da_j = q_j (1 - p_tail / q_tail)    otherwise

i.e. ``q`` minus a target that is the teacher on ``S`` and the teacher's tail spread over the other tokens
in the student's own proportions. The chunk computes it in closed form, ``q_j p_tail / q_tail`` as
``exp(log q_j + log p_tail - log q_tail)`` (the ratio alone overflows when the student's tail is tiny).

Memory per token chunk of ``n`` rows: the teacher's ``[n, V]`` logits and one masked copy while its top-k
and tail are taken, then the student's log-softmax and one more ``[n, V]`` buffer for the gradient; with
``method.loss.vocab_chunk`` (:func:`topk_sliced`) the same in slices of the vocabulary.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch


def teacher_topk(zt: torch.Tensor, k: int, tau: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p on the top-k [n, k], their ids [n, k], log p_tail [n]) of teacher logits ``zt`` [n, V]
    at temperature ``tau``. ``zt`` is only read."""
    a = zt if tau == 1.0 else zt / tau
    lse = torch.logsumexp(a, -1)
    val, idx = a.topk(k, dim=-1)
    rest = a.scatter(-1, idx, -math.inf)
    a = None
    tail = torch.logsumexp(rest, -1) - lse        # -inf when k covers the vocabulary
    return val - lse.unsqueeze(-1), idx, tail


def topk_chunk(student: Callable[[], torch.Tensor], teacher: Callable[[], torch.Tensor], k: int,
               labels: Optional[torch.Tensor], wt: torch.Tensor, cfg, grads: bool):
    """(weighted loss sum, dL/dz [n, V] or None) of one token chunk of ``method.loss.kind=topk_kl``.

    ``student()`` / ``teacher()`` make the chunk's float logits [n, V] (they may be views of the caller's
    tensors: only read). ``cfg``: the LossConfig (temperature, kd_weight, ce_weight); a CE term on the
    labels at temperature 1 is added as in the other losses."""
    tau = float(cfg.temperature)
    logp_k, idx, logp_t = teacher_topk(teacher(), k, tau)
    zs = student()
    logq = torch.log_softmax(zs if tau == 1.0 else zs / tau, dim=-1)
    logq_k = logq.gather(-1, idx)
    logq_t = torch.logsumexp(logq.scatter(-1, idx, -math.inf), -1)
    p_k, p_t = logp_k.exp(), logp_t.exp()
    has_tail = p_t > 0
    div = (p_k * (logp_k - logq_k)).sum(-1)
    div = div + torch.where(has_tail, p_t * (logp_t - logq_t), torch.zeros_like(p_t))
    out = (cfg.kd_weight * tau * tau) * div
    cc = None
    ce_logq = None
    if cfg.ce_weight != 0:
        if labels is None:
            raise ValueError("lm_loss: a CE term (ce_weight > 0) needs labels")
        ce_logq = logq if tau == 1.0 else torch.log_softmax(zs, dim=-1)
        safe = labels.clamp_min(0).unsqueeze(-1)
        nll = -ce_logq.gather(-1, safe).squeeze(-1)
        ignore = labels == -100
        out = out + cfg.ce_weight * torch.where(ignore, torch.zeros_like(nll), nll)
        cc = torch.where(ignore, torch.zeros_like(wt), wt * cfg.ce_weight)
    zs = None
    part = (out * wt).sum()
    if not grads:
        return part, None
    gc = None
    if cc is not None:
        # softmax(z) - onehot at temperature 1, before logq's buffer is reused below
        gc = ce_logq.exp()
        gc.scatter_add_(-1, safe, -torch.ones_like(safe, dtype=gc.dtype))
        gc.mul_(cc.unsqueeze(-1))
    ce_logq = None
    # log(p_tail / q_tail), -inf where the teacher has no tail (then nothing is spread outside S)
    shift = torch.where(has_tail, logp_t - logq_t, torch.full_like(p_t, -math.inf)).unsqueeze(-1)
    spread = (logq + shift).exp_()                 # q_j p_tail / q_tail on every column
    spread_k = spread.gather(-1, idx)
    g = logq.exp_().sub_(spread)                   # q_j (1 - p_tail / q_tail): the columns outside S
    spread = None
    # on S: q_j - p_j, i.e. add back the spread put there and take the teacher's probability off
    g.scatter_add_(-1, idx, spread_k - p_k)
    g.mul_((wt * (cfg.kd_weight * tau)).unsqueeze(-1))      # tau^2 scale times the 1/tau of d/dz
    if gc is not None:
        g.add_(gc)
    return part, g


def _members(idx: torch.Tensor, s: int, e: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(which top-k ids fall in columns [s, e) [n, k], their local column (clamped, safe to gather/scatter),
    a [n, e - s] bool of the columns that are top-k members)."""
    inside = (idx >= s) & (idx < e)
    loc = (idx - s).clamp(0, e - s - 1)
    # counted, not scattered as bools: ids outside the slice clamp onto a column a member may hold too
    hit = torch.zeros(idx.shape[0], e - s, dtype=torch.int32, device=idx.device)
    hit.scatter_add_(-1, loc, inside.to(torch.int32))
    return inside, loc, hit > 0


def topk_sliced(student: Callable[[int, int], torch.Tensor], teacher: Callable[[int, int], torch.Tensor],
                fold: Optional[Callable[[int, int, torch.Tensor], None]], n: int, vocab: int, vc: int, k: int,
                labels: Optional[torch.Tensor], wt: torch.Tensor, cfg) -> torch.Tensor:
    """:func:`topk_chunk` for one token chunk of ``n`` rows without any tensor wider than ``vc`` vocabulary
    columns (method.loss.vocab_chunk), or ``2 k`` where the running top-k merges with a slice's. ``student(s, e)`` / ``teacher(s, e)`` give the float logits of columns
    [s, e); ``fold(s, e, dL/dz)`` takes each slice's gradient (None: no gradient). Three passes over the
    vocabulary: (1) running log-sum-exps of both sides and the teacher's running top-k (a slice's own top-k
    merged with the best so far); (2) with the top-k set known, the log-sum-exps of both sides outside it and
    the student's logits on it; (3) each slice's gradient, in the closed form of the module docstring. The
    student's head runs three times, the teacher's twice. Returns the chunk's weighted loss sum."""
    tau = float(cfg.temperature)
    dt = wt.dtype
    ninf = torch.full((n,), -math.inf, dtype=dt, device=wt.device)
    ce = cfg.ce_weight != 0
    if ce and labels is None:
        raise ValueError("lm_loss: a CE term (ce_weight > 0) needs labels")
    lse_s, lse_t, lse1 = ninf, ninf, ninf
    z_lab = torch.zeros(n, dtype=dt, device=wt.device)
    lab = None if labels is None else labels.clamp_min(0)
    top_v = top_i = None
    for s in range(0, vocab, vc):
        e = min(s + vc, vocab)
        zs, zt = student(s, e), teacher(s, e)
        a, b = (zs, zt) if tau == 1.0 else (zs / tau, zt / tau)
        lse_s = torch.logaddexp(lse_s, torch.logsumexp(a, -1))
        lse_t = torch.logaddexp(lse_t, torch.logsumexp(b, -1))
        if ce:
            lse1 = torch.logaddexp(lse1, torch.logsumexp(zs, -1))
            inside = (lab >= s) & (lab < e)
            z_lab = torch.where(inside, zs.gather(-1, (lab - s).clamp(0, e - s - 1).unsqueeze(-1)).squeeze(-1), z_lab)
        v, i = b.topk(min(k, e - s), dim=-1)
        if top_v is not None:
            v, j = torch.cat([top_v, v], -1), torch.cat([top_i, i + s], -1)
            v, pick = v.topk(min(k, v.shape[-1]), dim=-1)
            top_v, top_i = v, j.gather(-1, pick)
        else:
            top_v, top_i = v, i + s
    # pass 2: outside the top-k set, both sides; the student's logits on it
    tail_s, tail_t = ninf, ninf
    z_top = torch.zeros(top_i.shape, dtype=dt, device=wt.device)
    for s in range(0, vocab, vc):
        e = min(s + vc, vocab)
        zs, zt = student(s, e), teacher(s, e)
        a, b = (zs, zt) if tau == 1.0 else (zs / tau, zt / tau)
        inside, loc, member = _members(top_i, s, e)
        tail_s = torch.logaddexp(tail_s, torch.logsumexp(a.masked_fill(member, -math.inf), -1))
        tail_t = torch.logaddexp(tail_t, torch.logsumexp(b.masked_fill(member, -math.inf), -1))
        z_top = torch.where(inside, a.gather(-1, loc), z_top)
    logp_k, logp_t = top_v - lse_t.unsqueeze(-1), tail_t - lse_t
    logq_k, logq_t = z_top - lse_s.unsqueeze(-1), tail_s - lse_s
    p_k, p_t = logp_k.exp(), logp_t.exp()
    has_tail = p_t > 0
    div = (p_k * (logp_k - logq_k)).sum(-1) + torch.where(has_tail, p_t * (logp_t - logq_t), torch.zeros_like(p_t))
    out = (cfg.kd_weight * tau * tau) * div
    cc = None
    if ce:
        ignore = labels == -100
        out = out + cfg.ce_weight * torch.where(ignore, torch.zeros_like(lse1), lse1 - z_lab)
        cc = torch.where(ignore, torch.zeros_like(wt), wt * cfg.ce_weight)
    total = (out * wt).sum()
    if fold is None:
        return total
    # pass 3: dL/dz slice by slice: a (q - p on S, q (1 - p_tail / q_tail) elsewhere) + cc (softmax - onehot)
    coef = (wt * (cfg.kd_weight * tau)).unsqueeze(-1)
    shift = torch.where(has_tail, logp_t - logq_t, torch.full_like(p_t, -math.inf)).unsqueeze(-1)
    for s in range(0, vocab, vc):
        e = min(s + vc, vocab)
        zs = student(s, e)
        logq = (zs if tau == 1.0 else zs / tau) - lse_s.unsqueeze(-1)
        spread = (logq + shift).exp()
        g = logq.exp() - spread
        inside, loc, _ = _members(top_i, s, e)
        fix = torch.where(inside, spread.gather(-1, loc) - p_k, torch.zeros_like(p_k))
        g = g.scatter_add(-1, loc, fix).mul_(coef)
        if ce:
            gc = (zs - lse1.unsqueeze(-1)).exp()
            lin = (lab >= s) & (lab < e)
            gc = gc.scatter_add(-1, (lab - s).clamp(0, e - s - 1).unsqueeze(-1), -lin.to(dt).unsqueeze(-1))
            g = g + cc.unsqueeze(-1) * gc
        fold(s, e, g)
    return total
