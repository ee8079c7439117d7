"""Distillation and language-model losses, computed in token chunks.

The student's logits for a batch of B x T tokens over a vocabulary V are B*T*V floats; in float32
that is 4 GiB for 4 x 2048 tokens and V = 128K, plus the same again for softmax and gradient.
:func:`lm_loss` never builds them: it takes the final hidden states ``h [N, H]`` and the lm_head
weight ``W [V, H]`` and walks the tokens in chunks of ``chunk_tokens``. For each chunk it forms the
float32 logits, the loss and the gradient with respect to those logits, folds that gradient into
``dL/dh`` (chunk rows) and ``dL/dW`` (accumulated), and drops the chunk. Backward only scales the
stored gradients by the incoming one, so peak memory is one chunk of logits plus ``dL/dW``.
(This is "gradient in the forward pass": valid because the loss is a scalar that is used once,
which is how the trainer uses it; calling ``backward`` twice on one result raises like any graph.)

Per-token losses (``p`` teacher, ``q`` student, both at temperature ``tau``; sums over the support):

* ``forward_kl`` (default): ``KL(p || q) = sum p (log p - log q)``, scaled by ``tau**2`` so the
  gradient magnitude does not shrink with the temperature (Hinton et al. 2015).
* ``reverse_kl``: ``KL(q || p)``, same scaling.
* ``jsd``: generalised Jensen-Shannon with ``m = beta p + (1 - beta) q``:
  ``beta KL(p || m) + (1 - beta) KL(q || m)`` (GKD, Agarwal et al. 2024), same scaling.
* ``ce``: next-token cross-entropy on the labels at temperature 1 (no teacher).
* mixes: ``kd_weight * divergence + ce_weight * CE`` for the divergences above.

A token counts when its mask is true and (for CE) its label is not ``ignore_index``; the loss is the
sum over counted tokens divided by their number (0 when none count, never NaN).

Cached (top-k) teachers. A cache holds, per token, the teacher's ``k`` largest log-probabilities
``l_i`` (at temperature 1, over the full vocabulary) and their indices ``S``. The loss renormalises
the teacher over ``S``: ``p_i = exp(l_i / tau) / sum_{j in S} exp(l_j / tau)`` for ``i in S``, 0
elsewhere (``l_i / tau`` differs from ``z_i / tau`` by a constant, so this equals the teacher's
temperature softmax conditioned on ``S``). The student side:

* ``forward_kl``: ``sum_{i in S} p_i (log p_i - log q_i)`` with ``q`` the student's full-vocabulary
  softmax, so mass the student puts outside ``S`` is still penalised;
* ``reverse_kl`` and ``jsd``: the student renormalised over ``S`` as well (``q_i = softmax over S of
  z_i / tau``), since outside ``S`` the teacher has no value and ``KL(q || p)`` would be infinite.

When ``S`` is the whole vocabulary all three equal the live-teacher losses exactly (tested).

Vocabulary chunking (``vocab_chunk``). A token chunk still holds ``[chunk_tokens, V]`` float32
logits for the student and the teacher (about 2.5 GB at 1024 tokens and V = 152K, counting the
softmaxes and the gradient). With ``vocab_chunk = c < V`` no tensor wider than ``c`` columns exists:

1. a first pass over the vocabulary slices ``W[s:s+c]`` keeps running log-sum-exps (student at
   temperature 1 for CE and at ``tau``, teacher at ``tau``; ``logaddexp`` of the slice values, the
   streaming form of one log-softmax) and picks up the label logit and the top-k logits;
2. the divergences whose gradient needs a per-token sum of the whole vocabulary (reverse KL, JSD:
   ``dL/da_i = q_i (g_i - sum_j q_j g_j)``) get one more pass for that sum and the loss value;
3. a last pass recomputes each slice's logits, forms ``dL/dz`` for the slice in closed form
   (forward KL ``(q - p) / tau``; reverse KL ``g = log q - log p``; JSD ``g = (1 - beta) log(q/m)``;
   CE ``softmax - onehot``), and folds it into ``dL/dh`` and ``dL/dW[s:s+c]``.

The price is recomputing the head matmuls: 2 (forward KL, CE, cached teachers) or 3 (live reverse KL,
JSD) forward passes over ``W`` instead of 1, for a peak of ``chunk_tokens * c`` floats per tensor.
``vocab_chunk >= V`` takes the unsliced path, so a default larger than a small vocabulary is free.

Fused chunks (``fused``, the default; forward KL, with or without CE at temperature 1, and CE alone,
live or top-k teacher, unsliced vocabulary). Instead of running autograd through the chunk's losses
(which holds the student's and the teacher's logits, both log-softmaxes, the teacher's probabilities,
their product and the backward's buffers at once), a chunk computes the loss with the same operations
(so the value is bit for bit the autograd path's) and its logits gradient in closed form, in place
over the log-softmax buffers: ``dL/dz = w kd tau (q - p) + w ce (softmax(z) - onehot)``. The teacher's
logits are freed once their log-softmax exists, so at most three ``[chunk, V]`` float buffers live at a
time (autograd's path holds about twice that).
The gradient differs from autograd's in rounding only: ``q`` and ``p`` are each divided by their own
computed row sum (a rounded log-sum-exp is one factor on a whole row), which the tests measure to be
closer to float64 than autograd's ``q * sum(p) - p`` (tests/distill/test_distill_fused.py).

Arithmetic is float32, or float64 when the student's hidden states are float64 (the tests compare
the sliced path with :func:`naive_lm_loss` there to 1e-10).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import torch

from .topk_kl import teacher_topk, topk_chunk, topk_sliced

LOSS_KINDS = ("forward_kl", "reverse_kl", "jsd", "ce", "topk_kl")
IGNORE_INDEX = -100


@dataclass
class LossConfig:
    """The loss of one run (also the Hydra schema ``method.loss``)."""

    kind: str = "forward_kl"
    temperature: float = 1.0
    beta: float = 0.5            # jsd only
    kd_weight: float = 1.0       # weight of the divergence (ignored when kind == "ce")
    ce_weight: float = 0.0       # weight of the CE term added to a divergence
    chunk_tokens: int = 1024     # tokens per chunk; memory ~ chunk_tokens * V * 4 bytes * 3
    vocab_chunk: Optional[int] = None   # vocabulary columns per slice (None: the whole vocabulary);
                                        # memory ~ chunk_tokens * vocab_chunk * 4 * 3, more head matmuls
    fused: bool = True           # forward KL / CE: closed-form logits gradient per chunk (_fused_chunk)
    top_k: Optional[int] = None  # topk_kl only: the live teacher's tokens per position (distill/topk_kl.py)

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"LossConfig.kind={self.kind!r}; allowed: {list(LOSS_KINDS)}")
        if not self.temperature > 0:
            raise ValueError(f"LossConfig.temperature={self.temperature!r}; allowed: a number > 0")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"LossConfig.beta={self.beta!r}; allowed: 0 < beta < 1 "
                             f"(beta 0 or 1 makes the JSD identically zero)")
        if self.kd_weight < 0 or self.ce_weight < 0:
            raise ValueError(f"LossConfig kd_weight={self.kd_weight!r}, ce_weight={self.ce_weight!r}; "
                             f"allowed: numbers >= 0")
        if int(self.chunk_tokens) < 1:
            raise ValueError(f"LossConfig.chunk_tokens={self.chunk_tokens!r}; allowed: an int >= 1")
        if self.vocab_chunk is not None and (isinstance(self.vocab_chunk, bool) or int(self.vocab_chunk) < 1):
            raise ValueError(f"LossConfig.vocab_chunk={self.vocab_chunk!r}; allowed: null (whole vocabulary) "
                             f"or an int >= 1")
        if self.kind == "topk_kl":
            if self.top_k is None or isinstance(self.top_k, bool) or int(self.top_k) < 1:
                raise ValueError(f"LossConfig.top_k={self.top_k!r} with kind='topk_kl'; allowed: an int from 1 to "
                                 f"the vocabulary size (the teacher's tokens per position, e.g. 4096)")
        elif self.top_k is not None:
            raise ValueError(f"LossConfig.top_k={self.top_k!r} with kind={self.kind!r}; allowed: null (top_k is "
                             f"read by kind='topk_kl' only)")

    @property
    def needs_teacher(self) -> bool:
        return self.kind != "ce"

    @property
    def ce_coef(self) -> float:
        return 1.0 if self.kind == "ce" else float(self.ce_weight)


class LiveTeacherOut(NamedTuple):
    """A live teacher's final hidden states ``[N, H]`` and lm_head weight ``[V, H]``;
    ``weight=None`` means ``hidden`` already holds the logits ``[N, V]``."""

    hidden: torch.Tensor
    weight: Optional[torch.Tensor] = None


class TopKTeacherOut(NamedTuple):
    """A cached teacher: top-k log-probabilities ``[N, k]`` (temperature 1, full-vocab normalised)
    and their vocabulary indices ``[N, k]`` (int64 or int32)."""

    logprobs: torch.Tensor
    indices: torch.Tensor


# ------------------------------------------------------------------------- per-chunk math
def _acc(x: torch.Tensor) -> torch.dtype:
    # float32 for model dtypes; float64 stays float64 so tests can compare paths far below fp32 rounding
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _logits(h: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    # the matmul runs in the model dtype (what model.lm_head(h) would do), then float32
    return (h if w is None else h @ w.t()).to(_acc(h))


def _slice_logits(h: torch.Tensor, w: Optional[torch.Tensor], s: int, e: int, dtype) -> torch.Tensor:
    """Logits of vocabulary columns [s, e): rows s:e of the head, or columns of given logits."""
    return (h[:, s:e] if w is None else h @ w[s:e].t()).to(dtype)


def _xlogy_diff(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum over the last axis of p (log p - log q), with 0 where p == 0."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def _divergence(kind: str, beta: float, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    if kind == "forward_kl":
        return _xlogy_diff(logp, logq)
    if kind == "reverse_kl":
        return _xlogy_diff(logq, logp)
    # jsd: log m = logsumexp(log beta + log p, log(1 - beta) + log q)
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * _xlogy_diff(logp, logm) + (1.0 - beta) * _xlogy_diff(logq, logm)


def _teacher_chunk(teacher, sl: slice, dtype=torch.float32):
    if teacher is None:
        return None
    if isinstance(teacher, TopKTeacherOut):
        return TopKTeacherOut(teacher.logprobs[sl].to(dtype), teacher.indices[sl].long())
    return _logits(teacher.hidden[sl], teacher.weight)


def _rows(teacher, sl: slice, dtype):
    """A token chunk of the teacher, logits not yet formed (the vocabulary passes slice them)."""
    if isinstance(teacher, TopKTeacherOut):
        return TopKTeacherOut(teacher.logprobs[sl].to(dtype), teacher.indices[sl].long())
    return LiveTeacherOut(teacher.hidden[sl], teacher.weight)


def _token_losses(zs: torch.Tensor, tchunk, labels: Optional[torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    """Per-token loss [n] for student logits zs [n, V] (float32)."""
    tau = float(cfg.temperature)
    out = torch.zeros(zs.shape[0], dtype=zs.dtype, device=zs.device)
    if cfg.kind == "topk_kl" and cfg.kd_weight != 0:
        # the k + 1 bins of distill/topk_kl.py through autograd (fused=False, naive_lm_loss)
        logp_k, idx, logp_t = teacher_topk(tchunk, int(cfg.top_k), tau)
        logq = torch.log_softmax(zs / tau, dim=-1)
        logq_t = torch.logsumexp(logq.scatter(-1, idx, -math.inf), -1)
        tail = torch.where(logp_t > -math.inf, logp_t.exp() * (logp_t - logq_t), torch.zeros_like(logp_t))
        div = (logp_k.exp() * (logp_k - logq.gather(-1, idx))).sum(-1) + tail
        out = out + (cfg.kd_weight * tau * tau) * div
    elif cfg.kind != "ce" and cfg.kd_weight != 0:
        if isinstance(tchunk, TopKTeacherOut):
            logp = torch.log_softmax(tchunk.logprobs / tau, dim=-1)
            idx = tchunk.indices
            if cfg.kind == "forward_kl":
                logq = torch.log_softmax(zs / tau, dim=-1).gather(-1, idx)
            else:
                logq = torch.log_softmax(zs.gather(-1, idx) / tau, dim=-1)
        else:
            logp = torch.log_softmax(tchunk / tau, dim=-1)
            logq = torch.log_softmax(zs / tau, dim=-1)
        out = out + (cfg.kd_weight * tau * tau) * _divergence(cfg.kind, cfg.beta, logp, logq)
    if cfg.ce_coef != 0:
        if labels is None:
            raise ValueError("lm_loss: a CE term (kind='ce' or ce_weight > 0) needs labels")
        safe = labels.clamp_min(0).unsqueeze(-1)
        nll = -torch.log_softmax(zs, dim=-1).gather(-1, safe).squeeze(-1)
        out = out + cfg.ce_coef * torch.where(labels == IGNORE_INDEX, torch.zeros_like(nll), nll)
    return out


def counted(n: int, labels, mask, device, cfg: LossConfig, dtype=torch.float32) -> torch.Tensor:
    """Per-token 1 where the token counts in the loss (its mask, and for CE alone a label), else 0."""
    w = torch.ones(n, dtype=dtype, device=device)
    if mask is not None:
        w = w * mask.reshape(-1).to(device=device, dtype=dtype)
    if labels is not None and cfg.ce_coef != 0 and not cfg.needs_teacher:
        w = w * (labels.reshape(-1) != IGNORE_INDEX).to(device=device, dtype=dtype)
    return w


def _weights(n: int, labels, mask, device, cfg: LossConfig, dtype=torch.float32) -> torch.Tensor:
    """Per-token weight: 1/count for counted tokens, 0 elsewhere."""
    w = counted(n, labels, mask, device, cfg, dtype)
    return w / w.sum().clamp_min(1.0)


def _in_slice(idx: torch.Tensor, s: int, e: int):
    """Where ids fall in columns [s, e), and the ids made local and safe to gather with."""
    return (idx >= s) & (idx < e), (idx - s).clamp(0, e - s - 1)


def _fold(h, w, s: int, e: int, gz: torch.Tensor, grad_h, grad_w) -> None:
    """Add one vocabulary slice's dL/dz [n, e - s] into dL/dh (float accumulator) and dL/dW[s:e]."""
    if w is None:                        # h held the logits: their gradient is gz itself
        if grad_h is not None:
            grad_h[:, s:e] += gz
        return
    low = h.dtype in (torch.bfloat16, torch.float16)
    g = gz.to(h.dtype) if low else gz.to(grad_h.dtype if grad_h is not None else grad_w.dtype)
    if grad_h is not None:
        # a model-dtype GEMM per slice (as the unsliced path does per chunk), summed in the accumulator
        grad_h += (g @ w[s:e]).to(grad_h.dtype)
    if grad_w is not None:
        if low:
            grad_w[s:e] += g.t() @ h
        else:
            grad_w[s:e].addmm_(g.t().to(grad_w.dtype), h.to(grad_w.dtype))


def _vocab_sliced(h, w, teacher, labels, wt, cfg: LossConfig, vc: int, grad_h, grad_w):
    """Loss of one token chunk walking the vocabulary in slices of ``vc`` columns (module docstring).

    ``teacher`` is the chunk's :class:`LiveTeacherOut` rows or :class:`TopKTeacherOut` or None.
    Adds ``dL/dh`` into ``grad_h`` (chunk rows, or None) and ``dL/dW`` into ``grad_w`` (or None);
    returns the chunk's weighted loss sum."""
    dt = _acc(h)
    n = h.shape[0]
    vocab = h.shape[1] if w is None else w.shape[0]
    tau, beta, kind = float(cfg.temperature), float(cfg.beta), cfg.kind
    kd = kind != "ce" and cfg.kd_weight != 0
    topk = kd and isinstance(teacher, TopKTeacherOut)
    live = kd and not topk
    ce = cfg.ce_coef != 0
    grads = grad_h is not None or grad_w is not None
    wt = wt.to(dt)
    ck = wt * (cfg.kd_weight * tau * tau)          # per-token weight of the divergence
    zeros = torch.zeros(n, dtype=dt, device=h.device)
    ninf = torch.full((n,), -math.inf, dtype=dt, device=h.device)

    def slices():
        for s in range(0, vocab, vc):
            e = min(s + vc, vocab)
            zs = _slice_logits(h, w, s, e, dt)
            zt = _slice_logits(teacher.hidden, teacher.weight, s, e, dt) if live else None
            yield s, e, zs, zt

    # pass 1: running log-sum-exps, the label logits, the student's logits on the top-k set
    lse1, lse_s, lse_t, z_lab = ninf, ninf, ninf, zeros
    if ce:
        if labels is None:
            raise ValueError("lm_loss: a CE term (kind='ce' or ce_weight > 0) needs labels")
        ignore = labels == IGNORE_INDEX
        cc = torch.where(ignore, zeros, wt * cfg.ce_coef)
        lab = labels.clamp_min(0)
    if topk:
        idx = teacher.indices
        z_top = torch.zeros(idx.shape, dtype=dt, device=h.device)
    for s, e, zs, zt in slices():
        if ce:
            lse1 = torch.logaddexp(lse1, torch.logsumexp(zs, -1))
            inside, loc = _in_slice(lab, s, e)
            z_lab = torch.where(inside, zs.gather(-1, loc.unsqueeze(-1)).squeeze(-1), z_lab)
        if (live or (topk and kind == "forward_kl")) and not (ce and tau == 1.0):
            lse_s = torch.logaddexp(lse_s, torch.logsumexp(zs / tau, -1))
        if live:
            lse_t = torch.logaddexp(lse_t, torch.logsumexp(zt / tau, -1))
        if topk:
            inside, loc = _in_slice(idx, s, e)
            z_top = torch.where(inside, zs.gather(-1, loc), z_top)

    if ce and tau == 1.0:
        lse_s = lse1                 # the same sum: zs / 1.0 is zs exactly
    total = zeros.new_zeros(())
    if ce:
        total = total + (cc * (lse1 - z_lab)).sum()
    g_top = p_top = None
    if topk:
        logp = torch.log_softmax(teacher.logprobs / tau, dim=-1)
        if kind == "forward_kl":
            # full-vocabulary student: dL/da = q - p (p scattered onto S), formed slice by slice below
            div = _xlogy_diff(logp, z_top / tau - lse_s.unsqueeze(-1))
            p_top = logp.exp()
        else:
            # the student renormalised over S: everything lives on the k logits, autograd there is cheap
            with torch.enable_grad():
                zk = z_top.detach().requires_grad_(grads)
                div = _divergence(kind, beta, logp, torch.log_softmax(zk / tau, dim=-1))
                if grads:
                    (g_top,) = torch.autograd.grad(div.sum(), zk)
            div = div.detach()
        total = total + (ck * div).sum()

    def live_terms(zs, zt):
        logq = zs / tau - lse_s.unsqueeze(-1)
        logp = zt / tau - lse_t.unsqueeze(-1)
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta)) if kind == "jsd" else None
        return logq, logp, logm

    def slice_grad(s, e, zs, zt, terms=None):
        """dL/dz on columns [s, e) (weights included), in the accumulation dtype."""
        gz = torch.zeros_like(zs)
        if live:
            logq, logp, logm = terms if terms is not None else live_terms(zs, zt)
            q = logq.exp()
            if kind == "forward_kl":
                ga = q - logp.exp()
            elif kind == "reverse_kl":
                ga = q * (logq - logp - big_g.unsqueeze(-1))
            else:
                ga = q * ((1.0 - beta) * (logq - logm) - big_g.unsqueeze(-1))
            gz = gz + (ck / tau).unsqueeze(-1) * ga
        elif topk:
            inside, loc = _in_slice(idx, s, e)
            if p_top is not None:
                ga = (zs / tau - lse_s.unsqueeze(-1)).exp()
                ga = ga.scatter_add(-1, loc, torch.where(inside, -p_top, torch.zeros_like(p_top)))
                gz = gz + (ck / tau).unsqueeze(-1) * ga
            else:
                gz = gz.scatter_add(-1, loc, torch.where(inside, g_top, torch.zeros_like(g_top)) * ck.unsqueeze(-1))
        if ce:
            inside, loc = _in_slice(lab, s, e)
            gc = (zs - lse1.unsqueeze(-1)).exp()
            gc = gc.scatter_add(-1, loc.unsqueeze(-1), -inside.to(dt).unsqueeze(-1))
            gz = gz + cc.unsqueeze(-1) * gc
        return gz

    # pass 2 (live teacher): the divergence, and G = sum_j q_j g_j for reverse KL / JSD gradients
    big_g = None
    if live:
        div, big_g = zeros, zeros
        merged = kind == "forward_kl"      # its gradient is local: fold pass 3 into this one
        for s, e, zs, zt in slices():
            terms = logq, logp, logm = live_terms(zs, zt)
            if kind == "jsd":
                kl_qm = _xlogy_diff(logq, logm)
                div = div + beta * _xlogy_diff(logp, logm) + (1.0 - beta) * kl_qm
                big_g = big_g + (1.0 - beta) * kl_qm
            else:
                div = div + _divergence(kind, beta, logp, logq)
            if merged and grads:
                _fold(h, w, s, e, slice_grad(s, e, zs, zt, terms), grad_h, grad_w)
        if kind == "reverse_kl":
            big_g = div
        total = total + (ck * div).sum()

    if not grads or (live and kind == "forward_kl"):
        return total
    for s, e, zs, zt in slices():
        _fold(h, w, s, e, slice_grad(s, e, zs, zt), grad_h, grad_w)
    return total


def _fusable(cfg: LossConfig, teacher) -> bool:
    """The chunks _fused_chunk computes: forward KL (CE added only at temperature 1) or CE alone."""
    if not cfg.fused:
        return False
    if cfg.kind == "ce":
        return True
    return cfg.kind == "forward_kl" and teacher is not None and (cfg.ce_coef == 0 or float(cfg.temperature) == 1.0)


def _fused_chunk(student, teacher, labels: Optional[torch.Tensor], wt: torch.Tensor, cfg: LossConfig,
                 grads: bool):
    """(weighted loss sum, dL/dzs or None) of one token chunk (module docstring, fused chunks).

    ``student()`` / ``teacher()`` make the chunk's logits (teacher: logits or a TopKTeacherOut) here, so
    that no caller frame keeps them alive once used. They may be views of the caller's tensors (logits
    given directly): they are only read; every buffer written in place is made here. The loss uses the
    operations of _token_losses in the same order, so it is the same float."""
    tau = float(cfg.temperature)
    tch = teacher() if teacher is not None else None
    zs = student()
    n = zs.shape[0]
    kd = cfg.kind != "ce" and cfg.kd_weight != 0
    topk = isinstance(tch, TopKTeacherOut)
    out = torch.zeros(n, dtype=zs.dtype, device=zs.device)
    logp = None
    if kd:
        if topk:
            logp = torch.log_softmax(tch.logprobs / tau, dim=-1)
        else:
            # x / 1.0 is x: the division is skipped, not the value changed
            logp = torch.log_softmax(tch if tau == 1.0 else tch / tau, dim=-1)
            tch = None                                           # the teacher's logits are done
    # student: log softmax(zs / tau); CE needs it at temperature 1, which is then the same tensor
    logq = torch.log_softmax(zs if tau == 1.0 or not kd else zs / tau, dim=-1)
    zs = None
    p = None
    if kd:
        # _xlogy_diff(logp, lq) with logp's buffer reused for the products: the same values
        p = logp.exp()
        d = logp.sub_(logq.gather(-1, tch.indices) if topk else logq).mul_(p)
        logp = None
        div = d.masked_fill_(~(p > 0), 0.0).sum(-1)
        d = None
        out = out + (cfg.kd_weight * tau * tau) * div
    cc = None
    if cfg.ce_coef != 0:
        if labels is None:
            raise ValueError("lm_loss: a CE term (kind='ce' or ce_weight > 0) needs labels")
        safe = labels.clamp_min(0).unsqueeze(-1)
        nll = -logq.gather(-1, safe).squeeze(-1)
        ignore = labels == IGNORE_INDEX
        out = out + cfg.ce_coef * torch.where(ignore, torch.zeros_like(nll), nll)
        cc = torch.where(ignore, torch.zeros_like(wt), wt * cfg.ce_coef)
    part = (out * wt).sum()
    if not grads:
        return part, None
    # dL/dz = a (q - p) + cc (q - onehot), a = w kd tau (the tau^2 scale over the 1/tau of d/dz)
    a = wt * (cfg.kd_weight * tau) if kd else None
    if a is None and cc is None:                       # kd_weight = ce_weight = 0: a zero loss
        return part, torch.zeros_like(logq)
    # each distribution divided by its own computed sum: the rounding of a row's log-sum-exp is one
    # factor on that row of exp(log softmax), which this removes (autograd's q * sum(p) - p removes
    # the teacher's alone); measured closer to float64 than autograd (tests/distill/test_distill_fused.py)
    q = logq.exp_()
    qs = q.sum(-1)
    a_q = None if a is None else a / qs
    c_q = None if cc is None else cc / qs
    a_p = a / p.sum(-1) if kd else None
    coef = a_q if c_q is None else (c_q if a_q is None else a_q + c_q)
    g = q.mul_(coef.unsqueeze(-1))
    if kd:
        if topk:
            g.scatter_add_(-1, tch.indices, -(p * a_p.unsqueeze(-1)))
        else:
            g.sub_(p.mul_(a_p.unsqueeze(-1)))
    if cc is not None:
        g.scatter_add_(-1, safe, -cc.unsqueeze(-1))
    return part, g


def _chunks_counted(tok_w: torch.Tensor, step: int) -> List[bool]:
    """Per chunk of ``step`` tokens, whether any of its tokens counts (a chunk with none is skipped): all
    chunks in one host read (a GPU run waits for its queue once per loss, not once per chunk)."""
    n = tok_w.shape[0]
    if n == 0:
        return []
    ends = torch.arange(step, n + step, step, device=tok_w.device).clamp_(max=n) - 1
    seen = (tok_w != 0).cumsum(0)[ends]
    return (torch.diff(seen, prepend=seen.new_zeros(1)) > 0).tolist()


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, tok_w, t_a, t_b, cfg):
        teacher = None
        if t_a is not None:
            teacher = TopKTeacherOut(t_a, t_b) if t_b is not None and t_b.dtype in (torch.int32, torch.int64) \
                else LiveTeacherOut(t_a, t_b)
        need_h = ctx.needs_input_grad[0]
        need_w = w is not None and ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=_acc(w), device=w.device) if need_w else None
        total = torch.zeros((), dtype=_acc(h), device=h.device)
        step = int(cfg.chunk_tokens)
        vocab = h.shape[1] if w is None else w.shape[0]
        vc = None if cfg.vocab_chunk is None or int(cfg.vocab_chunk) >= vocab else int(cfg.vocab_chunk)
        for s, counted in zip(range(0, h.shape[0], step), _chunks_counted(tok_w, step)):
            sl = slice(s, min(s + step, h.shape[0]))
            wt = tok_w[sl]
            if not counted:
                continue
            if vc is not None:
                acc_h = torch.zeros(h[sl].shape, dtype=_acc(h), device=h.device) if need_h else None
                lab = None if labels is None else labels[sl]
                if cfg.kind == "topk_kl":
                    hs, tr, dt = h[sl], _rows(teacher, sl, _acc(h)), _acc(h)
                    total += topk_sliced(
                        lambda a, e: _slice_logits(hs, w, a, e, dt),
                        lambda a, e: _slice_logits(tr.hidden, tr.weight, a, e, dt),
                        (lambda a, e, gz: _fold(hs, w, a, e, gz, acc_h, grad_w)) if need_h or need_w else None,
                        hs.shape[0], vocab, vc, int(cfg.top_k), lab, wt.to(dt), cfg)
                else:
                    total += _vocab_sliced(h[sl], w, _rows(teacher, sl, _acc(h)) if teacher is not None else None,
                                           lab, wt, cfg, vc, acc_h, grad_w)
                if need_h:
                    grad_h[sl] = acc_h.to(h.dtype)
                continue
            lab = None if labels is None else labels[sl]
            if cfg.kind == "topk_kl" and cfg.fused:
                part, gz = topk_chunk(lambda: _logits(h[sl], w), lambda: _teacher_chunk(teacher, sl, _acc(h)),
                                      int(cfg.top_k), lab, wt, cfg, need_h or need_w)
                total += part
            elif _fusable(cfg, teacher):
                part, gz = _fused_chunk(lambda: _logits(h[sl], w),
                                        None if teacher is None else lambda: _teacher_chunk(teacher, sl, _acc(h)),
                                        lab, wt, cfg, need_h or need_w)
                total += part
            else:
                with torch.enable_grad():
                    zs = _logits(h[sl], w).detach().requires_grad_(need_h or need_w)
                    tch = _teacher_chunk(teacher, sl, _acc(h))
                    part = (_token_losses(zs, tch, lab, cfg) * wt).sum()
                total += part.detach()
                gz = torch.autograd.grad(part, zs)[0] if need_h or need_w else None
                zs = tch = part = None
            if gz is not None:
                gz = gz.to(h.dtype) if w is not None else gz
                if need_h:
                    grad_h[sl] = (gz @ w).to(h.dtype) if w is not None else gz.to(h.dtype)
                if need_w:
                    if h.dtype in (torch.bfloat16, torch.float16):
                        # a bf16 GEMM (fp32 accumulate inside) per chunk, rounded once per chunk and
                        # summed in fp32; an fp32 addmm here costs several times the whole loss on GPUs
                        grad_w += gz.to(h.dtype).t() @ h[sl]
                    else:
                        grad_w.addmm_(gz.to(grad_w.dtype).t(), h[sl].to(grad_w.dtype))
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = None if w is None else w.dtype
        return total

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * g.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * g).to(ctx.w_dtype)
        return gh, gw, None, None, None, None, None


def check_topk(cfg: LossConfig, vocab: int, cached: bool = False) -> None:
    """kind='topk_kl' against the vocabulary and the teacher: one line naming the field (ValueError)."""
    if cached:
        raise ValueError("method.loss.kind='topk_kl' with a cached teacher; allowed: method.teacher=live (the top-k "
                         "and the tail mass are taken from the live teacher's full-vocabulary logits each step)")
    if int(cfg.top_k) > vocab:
        raise ValueError(f"method.loss.top_k={cfg.top_k} with a vocabulary of {vocab} tokens; allowed: 1..{vocab}")


def lm_loss(hidden: torch.Tensor, weight: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
            mask: Optional[torch.Tensor] = None, teacher=None, cfg: Optional[LossConfig] = None) -> torch.Tensor:
    """The run's loss without materialising full logits.

    ``hidden``: student final hidden states ``[..., H]`` (``weight [V, H]`` the lm_head weight), or the
    student's logits ``[..., V]`` with ``weight=None``. ``labels``: next-token ids ``[...]`` aligned
    with ``hidden`` (``-100`` = ignore). ``mask``: 1 where the token counts (prompt and padding 0).
    ``teacher``: :class:`LiveTeacherOut` or :class:`TopKTeacherOut` aligned with ``hidden``.
    Returns a 0-d float32 tensor (float64 for float64 ``hidden``), differentiable in ``hidden`` and
    ``weight``. ``cfg.vocab_chunk`` bounds the logits held at once to ``chunk_tokens x vocab_chunk``.
    """
    cfg = cfg or LossConfig()
    feat = hidden.shape[-1]
    h = hidden.reshape(-1, feat)
    n = h.shape[0]
    if weight is not None and weight.shape[-1] != feat:
        raise ValueError(f"lm_loss: hidden size {feat} does not match lm_head weight {tuple(weight.shape)}")
    if cfg.needs_teacher and teacher is None:
        raise ValueError(f"lm_loss: kind={cfg.kind!r} needs a teacher (LiveTeacherOut or TopKTeacherOut)")
    lab = None if labels is None else labels.reshape(-1).long()
    if lab is not None and lab.shape[0] != n:
        raise ValueError(f"lm_loss: labels hold {lab.shape[0]} tokens, hidden holds {n}")
    if mask is not None and mask.numel() != n:
        raise ValueError(f"lm_loss: mask holds {mask.numel()} tokens, hidden holds {n}")
    t_a = t_b = None
    if teacher is not None and cfg.needs_teacher:
        if isinstance(teacher, TopKTeacherOut):
            k = teacher.indices.shape[-1]
            t_a, t_b = teacher.logprobs.reshape(-1, k), teacher.indices.reshape(-1, k).long()
        else:
            t_a = teacher.hidden.reshape(-1, teacher.hidden.shape[-1])
            t_b = teacher.weight
        if t_a.shape[0] != n:
            raise ValueError(f"lm_loss: teacher holds {t_a.shape[0]} tokens, student {n}")
        vocab = feat if weight is None else weight.shape[0]
        if cfg.kind == "topk_kl":
            check_topk(cfg, vocab, isinstance(teacher, TopKTeacherOut))
        if isinstance(teacher, TopKTeacherOut):
            # the vocabulary slices would silently drop an out-of-range index instead of failing
            lo, hi = torch.stack(torch.aminmax(t_b)).tolist() if t_b.numel() else (0, 0)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"lm_loss: top-k teacher indices span [{lo}, {hi}]; "
                                 f"allowed: 0..{vocab - 1} (the student's vocabulary)")
        else:
            t_vocab = t_a.shape[-1] if t_b is None else t_b.shape[0]
            if t_vocab != vocab:
                raise ValueError(f"lm_loss: teacher vocabulary {t_vocab} != student vocabulary {vocab}")
    tok_w = _weights(n, lab, mask, h.device, cfg, _acc(h))
    return _ChunkedLMLoss.apply(h, weight, lab, tok_w, t_a, t_b, cfg)


def naive_lm_loss(hidden, weight, labels=None, mask=None, teacher=None, cfg: Optional[LossConfig] = None):
    """The same loss with full logits and plain autograd: the reference the tests compare against."""
    cfg = cfg or LossConfig()
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = None if labels is None else labels.reshape(-1).long()
    zs = _logits(h, weight)
    tch = None
    if teacher is not None and cfg.needs_teacher:
        if isinstance(teacher, TopKTeacherOut):
            k = teacher.indices.shape[-1]
            tch = TopKTeacherOut(teacher.logprobs.reshape(-1, k).to(zs.dtype),
                                 teacher.indices.reshape(-1, k).long())
        else:
            tch = _logits(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), teacher.weight)
    w = _weights(h.shape[0], lab, mask, h.device, cfg, zs.dtype)
    return (_token_losses(zs, tch, lab, cfg) * w).sum()


@torch.no_grad()
def _metrics_sliced(h, w, teacher, lab, vc: int) -> Dict[str, float]:
    """lm_metrics' sums for counted rows only, walking the vocabulary in slices of ``vc`` columns."""
    dt = _acc(h)
    n = h.shape[0]
    vocab = h.shape[1] if w is None else w.shape[0]
    live = teacher is not None and not isinstance(teacher, TopKTeacherOut)
    ninf = torch.full((n,), -math.inf, dtype=dt, device=h.device)
    first = torch.zeros(n, dtype=torch.long, device=h.device)
    lse, lse_t, z_lab, best, arg, t_best, t_arg = ninf, ninf, ninf.new_zeros(n), ninf, first, ninf, first
    z_top = None
    if isinstance(teacher, TopKTeacherOut):
        z_top = torch.zeros(teacher.indices.shape, dtype=dt, device=h.device)

    def slices():
        for s in range(0, vocab, vc):
            e = min(s + vc, vocab)
            yield s, e, _slice_logits(h, w, s, e, dt), \
                (_slice_logits(teacher.hidden, teacher.weight, s, e, dt) if live else None)

    for s, e, zs, zt in slices():
        lse = torch.logaddexp(lse, torch.logsumexp(zs, -1))
        v, a = zs.max(-1)
        # strictly greater: the first maximum wins across slices, as argmax over the whole row does
        best, arg = torch.where(v > best, v, best), torch.where(v > best, a + s, arg)
        if lab is not None:
            inside, loc = _in_slice(lab, s, e)
            z_lab = torch.where(inside, zs.gather(-1, loc.unsqueeze(-1)).squeeze(-1), z_lab)
        if live:
            lse_t = torch.logaddexp(lse_t, torch.logsumexp(zt, -1))
            v, a = zt.max(-1)
            t_best, t_arg = torch.where(v > t_best, v, t_best), torch.where(v > t_best, a + s, t_arg)
        if z_top is not None:
            inside, loc = _in_slice(teacher.indices, s, e)
            z_top = torch.where(inside, zs.gather(-1, loc), z_top)
    out = {"tokens": float(n), "kl_sum": 0.0, "ce_sum": 0.0, "agree_sum": 0.0}
    if lab is not None:
        out["ce_sum"] = float((lse - z_lab).sum())
    if live:
        kl = ninf.new_zeros(n)
        for s, e, zs, zt in slices():
            kl = kl + _xlogy_diff(zt - lse_t.unsqueeze(-1), zs - lse.unsqueeze(-1))
        out["kl_sum"] = float(kl.sum())
        out["agree_sum"] = float((arg == t_arg).sum())
    elif z_top is not None:
        logp = torch.log_softmax(teacher.logprobs, -1)
        out["kl_sum"] = float(_xlogy_diff(logp, z_top - lse.unsqueeze(-1)).sum())
        top = teacher.indices.gather(-1, teacher.logprobs.argmax(-1, keepdim=True)).squeeze(-1)
        out["agree_sum"] = float((arg == top).sum())
    return out


def lm_metrics(hidden, weight, labels=None, mask=None, teacher=None, chunk_tokens: int = 1024,
               vocab_chunk: Optional[int] = None) -> Dict[str, float]:
    """Sums for evaluation over counted tokens, chunked like the loss: forward KL to the teacher
    (temperature 1; renormalised over the top-k set for cached teachers), CE, top-1 agreement.
    ``vocab_chunk`` slices the vocabulary as in :func:`lm_loss`.
    Returns ``{"tokens", "kl_sum", "ce_sum", "agree_sum"}`` (divide by tokens to average)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = None if labels is None else labels.reshape(-1).long()
    m = torch.ones(h.shape[0], dtype=torch.bool, device=h.device) if mask is None \
        else mask.reshape(-1).to(h.device).bool()
    if lab is not None:
        m = m & (lab != IGNORE_INDEX)
    if isinstance(teacher, TopKTeacherOut):
        k = teacher.indices.shape[-1]
        teacher = TopKTeacherOut(teacher.logprobs.reshape(-1, k), teacher.indices.reshape(-1, k))
    elif teacher is not None:
        teacher = LiveTeacherOut(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), teacher.weight)
    out = {"tokens": 0.0, "kl_sum": 0.0, "ce_sum": 0.0, "agree_sum": 0.0}
    kl_cfg = LossConfig(kind="forward_kl")
    vocab = h.shape[1] if weight is None else weight.shape[0]
    vc = None if vocab_chunk is None or int(vocab_chunk) >= vocab else int(vocab_chunk)
    for s in range(0, h.shape[0], int(chunk_tokens)):
        sl = slice(s, min(s + int(chunk_tokens), h.shape[0]))
        mk = m[sl]
        if not bool(mk.any()):
            continue
        if vc is not None:
            tch = _rows(teacher, sl, _acc(h)) if teacher is not None else None
            if isinstance(tch, TopKTeacherOut):
                tch = TopKTeacherOut(tch.logprobs[mk], tch.indices[mk])
            elif tch is not None:
                tch = LiveTeacherOut(tch.hidden[mk], tch.weight)
            part = _metrics_sliced(h[sl][mk], weight, tch, None if lab is None else lab[sl][mk], vc)
            for key in out:
                out[key] += part[key]
            continue
        zs = _logits(h[sl], weight)[mk]
        out["tokens"] += float(mk.sum())
        if lab is not None:
            out["ce_sum"] += float(-torch.log_softmax(zs, -1).gather(-1, lab[sl][mk].unsqueeze(-1)).sum())
        if teacher is not None:
            tch = _teacher_chunk(teacher, sl, zs.dtype)
            if isinstance(tch, TopKTeacherOut):
                tch = TopKTeacherOut(tch.logprobs[mk], tch.indices[mk])
                top = tch.indices.gather(-1, tch.logprobs.argmax(-1, keepdim=True)).squeeze(-1)
            else:
                tch = tch[mk]
                top = tch.argmax(-1)
            out["kl_sum"] += float(_token_losses(zs, tch, None, kl_cfg).sum())
            out["agree_sum"] += float((zs.argmax(-1) == top).sum())
    return out
