"""The frozen teacher and the trainer's chunked loss, for a training loop that is not ours.

    d = Distiller(teacher_model)                 # frozen copy of the unquantized model (or a folder, or a cache)
    loss = d.loss(student, input_ids, attention_mask, labels)   # forward KL, chunked: no [B, T, V] logits
    loss.backward()

The loss is the one ``qatfactory train`` computes (train/student.py's StudentLM.shifted, then
distill.losses.lm_loss on the next-token targets), so a step in someone else's loop computes the same bits
as a step of ours on the same batch. ``labels`` follow Hugging Face's convention: ``-100`` marks a token
that does not count (padding, a prompt); the CE term (``ce_weight`` or ``kind="ce"``) takes its targets from
them. Without labels every attended token counts.

A model wrapped by DDP, DeepSpeed or FSDP must run its forward through the wrapper (that is where the
wrapper gathers or synchronises). :meth:`Distiller.install` makes the model's own forward compute this
loss when it is called with ``qatfactory_teacher=...``; :meth:`Distiller.loss` then calls the wrapper.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn
import yaml

from .._recipes import recipes_dir
from ..distill.losses import IGNORE_INDEX, LossConfig, lm_loss
from ..distill.teachers import CachedTeacher, LiveTeacher
from ..exitcodes import UsageError
from ..train.student import StudentLM

KEY = "qatfactory_teacher"      # the forward keyword that selects the loss (see install)
_NONE = object()


def loss_config(loss: Union[None, str, LossConfig, dict], **fields) -> LossConfig:
    """A LossConfig from a kind name (``forward_kl``, ``reverse_kl``, ``jsd``, ``ce``), a dict of its
    fields or a LossConfig; ``fields`` override. Errors name the field as ``method.loss.<field>``."""
    if isinstance(loss, LossConfig):
        d = {f: getattr(loss, f) for f in loss.__dataclass_fields__}
    elif isinstance(loss, dict):
        d = dict(loss)
    elif isinstance(loss, str) or loss is None:
        d = {"kind": loss or "forward_kl"}
    else:
        raise UsageError(f"loss={loss!r}: allowed: a kind name, a dict of method.loss fields or a LossConfig")
    d.update(fields)
    known = set(LossConfig.__dataclass_fields__)
    bad = sorted(set(d) - known)
    if bad:
        raise UsageError(f"method.loss: unknown field(s) {bad}; allowed: {sorted(known)}")
    try:
        return LossConfig(**d)
    except ValueError as e:
        raise UsageError(str(e).replace("LossConfig.", "method.loss.")) from None


def method_loss(method: str, loss: Union[None, str, LossConfig, dict] = None) -> LossConfig:
    """The LossConfig of ``qatfactory train method=<method>`` (recipes/method/<method>.yaml's method.loss), with
    ``loss`` over it: a kind name, a dict of fields, or a LossConfig taken as it is."""
    if isinstance(loss, LossConfig):
        return loss
    p = recipes_dir() / "method" / f"{method}.yaml"
    d = ((yaml.safe_load(p.read_text(encoding="utf-8")) or {}).get("method") or {}).get("loss") or {}
    over = {"kind": loss} if isinstance(loss, str) else dict(loss or {})
    return loss_config(dict(d), **over)


def student_loss(lm: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 labels: Optional[torch.Tensor], teacher_out, cfg: LossConfig) -> torch.Tensor:
    """The chunked loss of ``cfg`` for a Hugging Face causal LM on one batch: the decoder's final hidden
    states times the head, in token (and vocabulary) chunks, against ``teacher_out`` (a LiveTeacherOut
    or TopKTeacherOut for the same tokens, or None for CE)."""
    attn = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    mask = attn.bool() if labels is None else labels != IGNORE_INDEX
    h, w, targets, m, t = StudentLM(lm, cfg).shifted(input_ids, attn, mask, teacher_out)
    if labels is not None:
        # the CE targets are the labels' own; where a label does not count the input token stands in
        # (its weight is 0), so with labels == input_ids this is the trainer's loss exactly
        nxt = labels[:, 1:]
        targets = torch.where(nxt == IGNORE_INDEX, targets, nxt)
    return lm_loss(h, w, targets, m, t if cfg.needs_teacher else None, cfg)


def _is_cache(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(path), "meta.json"))


class Distiller:
    """A frozen teacher and the loss of ``qatfactory train``'s method.loss, for any training loop.

    ``teacher``: a Hugging Face causal LM (frozen here: no gradients, eval mode), a local model folder
    (loaded without remote code), a top-k cache folder (``meta.json`` inside, written by
    ``method=qad_cached`` or ``distill.precompute_topk``: then each batch gives ``sample_ids``), or None
    for ``loss="ce"`` (QAT). ``loss``: a kind (default ``forward_kl``, the CLI's method=qad), a dict of
    method.loss fields or a LossConfig; ``loss_fields`` override single fields (``temperature=2.0``).
    ``dtype``: the live teacher's (default: its own); ``device``: where it runs (default: its own).
    ``zero3_config``: a DeepSpeed config to partition a live teacher like a ZeRO-3 student."""

    def __init__(self, teacher: Any = None, loss: Union[None, str, LossConfig, dict] = None, *,
                 dtype: Optional[torch.dtype] = None, device=None, zero3_config: Optional[dict] = None,
                 **loss_fields):
        self.cfg = loss_config(loss, **loss_fields)
        self.live: Optional[LiveTeacher] = None
        self.cache: Optional[CachedTeacher] = None
        if teacher is None:
            if self.cfg.needs_teacher:
                raise UsageError(f"method.loss.kind={self.cfg.kind!r} distills from a teacher: give teacher= (a model, "
                                 f"a model folder or a top-k cache folder), or loss='ce' for QAT")
            return
        if _is_cache(teacher):
            self.cache = CachedTeacher(os.fspath(teacher))
            return
        if isinstance(teacher, (str, os.PathLike)):
            if not os.path.isdir(os.fspath(teacher)):
                raise FileNotFoundError(f"teacher={os.fspath(teacher)!r} is not a directory (a local Hugging Face "
                                        f"model folder, or a top-k cache folder with meta.json)")
            from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
            teacher = AutoModelForCausalLM.from_pretrained(os.fspath(teacher), dtype=dtype or "auto")
        if not isinstance(teacher, nn.Module):
            raise UsageError(f"teacher={type(teacher).__name__}: allowed: a causal LM module, a model folder or a "
                             f"top-k cache folder")
        p = next(teacher.parameters())
        self.live = LiveTeacher(teacher, dtype or p.dtype, device if device is not None else p.device,
                                zero3_config=zero3_config)

    @property
    def teacher_module(self) -> Optional[nn.Module]:
        """The live teacher's module (HiddenStates around the model), or None."""
        return None if self.live is None else self.live.module

    def teacher_outputs(self, input_ids, attention_mask=None, sample_ids=None):
        """A context manager of the teacher's outputs for the batch (None without a teacher or for CE)."""
        if not self.cfg.needs_teacher:
            return contextlib.nullcontext(None)
        if self.live is not None:
            return self.live.outputs(input_ids, attention_mask)
        if sample_ids is None:
            raise UsageError(f"teacher={self.cache.path}: a top-k cache is read by sample id; give each batch "
                             f"sample_ids (the row numbers of the samples the cache was written for)")
        t = self.cache.get(sample_ids)
        return contextlib.nullcontext(type(t)(t.logprobs.to(input_ids.device), t.indices.to(input_ids.device)))

    def install(self, model: nn.Module) -> nn.Module:
        """Make ``model``'s forward compute a Distiller's loss when called with ``qatfactory_teacher=
        (teacher outputs, LossConfig)`` (any other call runs the model's own forward): a DDP / DeepSpeed /
        FSDP wrapper then runs the loss through its own forward. Returns the model."""
        if getattr(model, "_qatfactory_distill", False):
            return model
        own = model.forward

        @functools.wraps(own)     # its signature: Trainer reads the columns a batch keeps from it
        def forward(*args, **kw):
            t = kw.pop(KEY, _NONE)
            if t is _NONE:
                return own(*args, **kw)
            ids = kw.pop("input_ids", args[0] if args else None)
            return student_loss(model, ids, kw.get("attention_mask"), kw.get("labels"), t[0], t[1])

        model.forward = forward
        object.__setattr__(model, "_qatfactory_distill", True)
        return model

    def loss(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
             labels: Optional[torch.Tensor] = None, sample_ids=None) -> torch.Tensor:
        """The loss of one batch. ``model``: the student, or the wrapper (DDP, DeepSpeed engine) around a
        student this Distiller was installed on."""
        inner = model
        while not getattr(inner, "_qatfactory_distill", False) and hasattr(inner, "module"):
            inner = inner.module
        with self.teacher_outputs(input_ids, attention_mask, sample_ids) as t:
            if getattr(inner, "_qatfactory_distill", False):
                return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **{KEY: (t, self.cfg)})
            return student_loss(model, input_ids, attention_mask, labels, t, self.cfg)

    __call__ = loss
