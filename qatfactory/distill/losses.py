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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional

import torch

LOSS_KINDS = ("forward_kl", "reverse_kl", "jsd", "ce")
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
def _logits(h: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    # the matmul runs in the model dtype (what model.lm_head(h) would do), then float32
    return (h if w is None else h @ w.t()).float()


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


def _teacher_chunk(teacher, sl: slice):
    if teacher is None:
        return None
    if isinstance(teacher, TopKTeacherOut):
        return TopKTeacherOut(teacher.logprobs[sl].float(), teacher.indices[sl].long())
    return _logits(teacher.hidden[sl], teacher.weight)


def _token_losses(zs: torch.Tensor, tchunk, labels: Optional[torch.Tensor], cfg: LossConfig) -> torch.Tensor:
    """Per-token loss [n] for student logits zs [n, V] (float32)."""
    tau = float(cfg.temperature)
    out = torch.zeros(zs.shape[0], dtype=torch.float32, device=zs.device)
    if cfg.kind != "ce" and cfg.kd_weight != 0:
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


def _weights(n: int, labels, mask, device, cfg: LossConfig) -> torch.Tensor:
    """Per-token weight: 1/count for counted tokens, 0 elsewhere."""
    w = torch.ones(n, dtype=torch.float32, device=device)
    if mask is not None:
        w = w * mask.reshape(-1).to(device=device, dtype=torch.float32)
    if labels is not None and cfg.ce_coef != 0 and not cfg.needs_teacher:
        w = w * (labels.reshape(-1) != IGNORE_INDEX).to(device=device, dtype=torch.float32)
    return w / w.sum().clamp_min(1.0)


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
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        step = int(cfg.chunk_tokens)
        for s in range(0, h.shape[0], step):
            sl = slice(s, min(s + step, h.shape[0]))
            wt = tok_w[sl]
            if not bool((wt != 0).any()):
                continue
            with torch.enable_grad():
                zs = _logits(h[sl], w).detach().requires_grad_(need_h or need_w)
                tch = _teacher_chunk(teacher, sl)
                lab = None if labels is None else labels[sl]
                part = (_token_losses(zs, tch, lab, cfg) * wt).sum()
            total += part.detach()
            if need_h or need_w:
                (gz,) = torch.autograd.grad(part, zs)
                gz = gz.to(h.dtype) if w is not None else gz
                if need_h:
                    grad_h[sl] = (gz @ w).to(h.dtype) if w is not None else gz.to(h.dtype)
                if need_w:
                    if h.dtype in (torch.bfloat16, torch.float16):
                        # a bf16 GEMM (fp32 accumulate inside) per chunk, rounded once per chunk and
                        # summed in fp32; an fp32 addmm here costs several times the whole loss on GPUs
                        grad_w += gz.to(h.dtype).t() @ h[sl]
                    else:
                        grad_w.addmm_(gz.float().t(), h[sl].float())
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = None if w is None else w.dtype
        return total

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * g.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * g).to(ctx.w_dtype)
        return gh, gw, None, None, None, None, None


def lm_loss(hidden: torch.Tensor, weight: Optional[torch.Tensor], labels: Optional[torch.Tensor] = None,
            mask: Optional[torch.Tensor] = None, teacher=None, cfg: Optional[LossConfig] = None) -> torch.Tensor:
    """The run's loss without materialising full logits.

    ``hidden``: student final hidden states ``[..., H]`` (``weight [V, H]`` the lm_head weight), or the
    student's logits ``[..., V]`` with ``weight=None``. ``labels``: next-token ids ``[...]`` aligned
    with ``hidden`` (``-100`` = ignore). ``mask``: 1 where the token counts (prompt and padding 0).
    ``teacher``: :class:`LiveTeacherOut` or :class:`TopKTeacherOut` aligned with ``hidden``.
    Returns a 0-d float32 tensor, differentiable in ``hidden`` and ``weight``.
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
    tok_w = _weights(n, lab, mask, h.device, cfg)
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
            tch = TopKTeacherOut(teacher.logprobs.reshape(-1, k).float(), teacher.indices.reshape(-1, k).long())
        else:
            tch = _logits(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), teacher.weight)
    w = _weights(h.shape[0], lab, mask, h.device, cfg)
    return (_token_losses(zs, tch, lab, cfg) * w).sum()


@torch.no_grad()
def lm_metrics(hidden, weight, labels=None, mask=None, teacher=None, chunk_tokens: int = 1024) -> Dict[str, float]:
    """Sums for evaluation over counted tokens, chunked like the loss: forward KL to the teacher
    (temperature 1; renormalised over the top-k set for cached teachers), CE, top-1 agreement.
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
    for s in range(0, h.shape[0], int(chunk_tokens)):
        sl = slice(s, min(s + int(chunk_tokens), h.shape[0]))
        mk = m[sl]
        if not bool(mk.any()):
            continue
        zs = _logits(h[sl], weight)[mk]
        out["tokens"] += float(mk.sum())
        if lab is not None:
            out["ce_sum"] += float(-torch.log_softmax(zs, -1).gather(-1, lab[sl][mk].unsqueeze(-1)).sum())
        if teacher is not None:
            tch = _teacher_chunk(teacher, sl)
            if isinstance(tch, TopKTeacherOut):
                tch = TopKTeacherOut(tch.logprobs[mk], tch.indices[mk])
                top = tch.indices.gather(-1, tch.logprobs.argmax(-1, keepdim=True)).squeeze(-1)
            else:
                tch = tch[mk]
                top = tch.argmax(-1)
            out["kl_sum"] += float(_token_losses(zs, tch, None, kl_cfg).sum())
            out["agree_sum"] += float((zs.argmax(-1) == top).sum())
    return out
