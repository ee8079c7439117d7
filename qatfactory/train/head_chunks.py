"""The loss and the evaluation sums for an lm_head that is not a plain linear (a quantized or a biased head,
which runs its own forward): the head runs on ``chunk_tokens`` rows of hidden states at a time, so no
[tokens, vocabulary] logits exist beyond one chunk (the loss of a plain head is chunked inside
distill.losses)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..distill.losses import LiveTeacherOut, TopKTeacherOut, counted, lm_loss, lm_metrics


def _flat_teacher(t):
    if t is None:
        return None
    if isinstance(t, TopKTeacherOut):
        k = t.indices.shape[-1]
        return TopKTeacherOut(t.logprobs.reshape(-1, k), t.indices.reshape(-1, k))
    return LiveTeacherOut(t.hidden.reshape(-1, t.hidden.shape[-1]), t.weight)


def _teacher_rows(t, sl: slice):
    if t is None:
        return None
    if isinstance(t, TopKTeacherOut):
        return TopKTeacherOut(t.logprobs[sl], t.indices[sl])
    return LiveTeacherOut(t.hidden[sl], t.weight)


def head_chunks_metrics(head: nn.Module, h, labels, mask, teacher, chunk_tokens: int) -> Dict[str, float]:
    """lm_metrics for a head that is not a plain linear (a quantized or biased lm_head): the head runs on
    ``chunk_tokens`` rows at a time, so no [tokens, vocabulary] logits exist beyond one chunk. Exact: the
    head maps each row on its own (an input quantizer reads its calibrated static amax)."""
    hf = h.reshape(-1, h.shape[-1])
    lab = labels.reshape(-1)
    mk = mask.reshape(-1)
    tf = _flat_teacher(teacher)
    out = {"tokens": 0.0, "kl_sum": 0.0, "ce_sum": 0.0, "agree_sum": 0.0}
    step = int(chunk_tokens)
    for s in range(0, hf.shape[0], step):
        sl = slice(s, min(s + step, hf.shape[0]))
        if not bool(mk[sl].any()):
            continue
        part = lm_metrics(head(hf[sl]), None, lab[sl], mk[sl], _teacher_rows(tf, sl), step)
        for key in out:
            out[key] += part[key]
    return out


def head_chunks_loss(head: nn.Module, h, labels, mask, teacher, cfg) -> torch.Tensor:
    """lm_loss for a head that is not a plain linear, ``cfg.chunk_tokens`` rows at a time: each chunk's head
    forward and loss run under activation checkpointing, so the backward keeps the chunk's hidden states and
    recomputes its logits (instead of every chunk's [rows, vocabulary] logits gradient living until the
    backward). The chunk losses are weighted by their share of the counted tokens: the same mean as one call."""
    hf = h.reshape(-1, h.shape[-1])
    lab = labels.reshape(-1)
    mk = mask.reshape(-1)
    tf = _flat_teacher(teacher)
    cnt = counted(hf.shape[0], lab, mk, hf.device, cfg, torch.float64 if hf.dtype == torch.float64 else torch.float32)
    total_cnt = cnt.sum().clamp_min(1.0)
    step = int(cfg.chunk_tokens)
    total = None
    for s in range(0, hf.shape[0], step):
        sl = slice(s, min(s + step, hf.shape[0]))

        def piece(rows, sl=sl):
            return lm_loss(head(rows), None, lab[sl], mk[sl], _teacher_rows(tf, sl), cfg)

        part = checkpoint(piece, hf[sl], use_reentrant=False) if torch.is_grad_enabled() else piece(hf[sl])
        part = part * (cnt[sl].sum() / total_cnt)
        total = part if total is None else total + part
    return hf.sum() * 0 if total is None else total
