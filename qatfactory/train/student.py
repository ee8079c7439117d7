"""The student as DeepSpeed wraps it, its teacher, and the held-out evaluation every distillation
method shares: :class:`StudentLM` (forward = the method's loss, or the evaluation sums),
:class:`Teacher` (live, or a top-k cache written once) and :func:`evaluate` (KL to the teacher, CE,
perplexity, top-1 agreement)."""
from __future__ import annotations

import contextlib
import hashlib
import math
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn as nn

from .. import _fsutil
from ..distill.losses import LiveTeacherOut, TopKTeacherOut, lm_loss, lm_metrics
from ..distill.teachers import (
    CachedTeacher,
    LiveTeacher,
    head_weight,
    precompute_topk,
    split_causal_lm,
    weights_sha256,
)
from .head_chunks import head_chunks_loss, head_chunks_metrics
from .runtime import barrier, ds_config, load_teacher_model


def backbone_kwargs(attn, position_ids) -> Dict[str, Optional[torch.Tensor]]:
    """The attention arguments of a decoder forward: the 2-D mask, or for packed documents (data.doc_mask) their
    position ids and no mask: transformers then builds a block-diagonal causal mask from the restarts (it reads
    position ids for packing only when the 2-D mask is None), so no token attends across a document boundary.
    Packed samples have no padding, so the mask dropped is all ones."""
    if position_ids is None:
        return {"attention_mask": attn}
    return {"attention_mask": None, "position_ids": position_ids}


class StudentLM(nn.Module):
    """The module DeepSpeed wraps: forward runs the method's loss (Method.loss), or the loop's
    evaluation sums (``metrics=True``). Without a method the loss is the chunked ``loss_cfg`` one."""

    def __init__(self, lm: nn.Module, loss_cfg, method=None):
        super().__init__()
        self.lm = lm
        self.loss_cfg = loss_cfg
        backbone, head = split_causal_lm(lm)
        # kept outside the module tree: they are already registered under self.lm
        object.__setattr__(self, "_backbone", backbone)
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "_method", method)
        object.__setattr__(self, "_pos", None)      # the position ids of the forward in progress (packed documents)
        # (process group, size) of Ulysses sequence parallelism (train/seqpar.py), set by the trainer
        object.__setattr__(self, "seq_parallel", None)

    def head_param(self):
        return head_weight(self._head)

    def shifted(self, input_ids, attn, mask, teacher=None, apply_head: bool = True, position_ids=None):
        """(hidden [B, T-1, H] or logits when the head is not a plain linear, head weight or None,
        next-token labels, the mask of counted targets, the teacher's outputs at the same positions).
        ``apply_head=False``: hidden states whatever the head (the caller runs a non-plain head itself).
        ``position_ids`` (default: the ones given to forward): packed documents, see :func:`backbone_kwargs`."""
        pos = self._pos if position_ids is None else position_ids
        out = self._backbone(input_ids=input_ids, use_cache=False, **backbone_kwargs(attn, pos))
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        w = head_weight(self._head)
        if w is None and apply_head:        # a quantized / biased head: its own forward, then the loss on logits
            h = self._head(h)
        h = h[:, :-1]
        labels = input_ids[:, 1:]
        m = mask[:, 1:] & attn[:, 1:].bool()
        if isinstance(teacher, TopKTeacherOut):
            teacher = TopKTeacherOut(teacher.logprobs[:, :-1], teacher.indices[:, :-1])
        elif teacher is not None:
            teacher = LiveTeacherOut(teacher.hidden[:, :-1], teacher.weight)
        return h, w, labels, m, teacher

    def forward(self, input_ids, attn, mask, teacher=None, metrics: bool = False, position_ids=None,
                targets=None, target_mask=None):
        if targets is not None:
            # a sequence-parallel shard (train/seqpar.py): targets were taken before the sequence was cut
            from . import seqpar  # noqa: PLC0415 (deepspeed's sequence parallelism, only when asked)
            part = {"input_ids": input_ids, "position_ids": position_ids, "targets": targets,
                    "target_mask": target_mask}
            if metrics:
                s = seqpar.sp_metrics(self._backbone, self._head, part, teacher, self.loss_cfg.chunk_tokens,
                                      self.loss_cfg.vocab_chunk)
                return torch.tensor([s["tokens"], s["kl_sum"], s["ce_sum"], s["agree_sum"]], dtype=torch.float64,
                                    device=input_ids.device)
            group, sp = self.seq_parallel
            return seqpar.sp_loss(self._backbone, self._head, part, teacher, self.loss_cfg, group, sp)
        object.__setattr__(self, "_pos", position_ids)
        try:
            return self._forward(input_ids, attn, mask, teacher, metrics)
        finally:
            object.__setattr__(self, "_pos", None)

    def _forward(self, input_ids, attn, mask, teacher, metrics: bool):
        if metrics:
            h, w, labels, m, t = self.shifted(input_ids, attn, mask, teacher, apply_head=False)
            if w is None:
                s = head_chunks_metrics(self._head, h, labels, m, t, self.loss_cfg.chunk_tokens)
            else:
                s = lm_metrics(h, w, labels, m, t, self.loss_cfg.chunk_tokens, vocab_chunk=self.loss_cfg.vocab_chunk)
            return torch.tensor([s["tokens"], s["kl_sum"], s["ce_sum"], s["agree_sum"]], dtype=torch.float64,
                                device=input_ids.device)
        if self._method is None:
            return self.default_loss(input_ids, attn, mask, teacher)
        return self._method.loss(self, input_ids, attn, mask, teacher)

    def default_loss(self, input_ids, attn, mask, teacher):
        """The chunked loss of ``loss_cfg`` over the next-token targets (the teacher only when the
        loss reads one): what a method's loss is unless it says otherwise."""
        h, w, labels, m, t = self.shifted(input_ids, attn, mask, teacher, apply_head=False)
        t = t if self.loss_cfg.needs_teacher else None
        if w is None:
            return head_chunks_loss(self._head, h, labels, m, t, self.loss_cfg)
        return lm_loss(h, w, labels, m, t, self.loss_cfg)


class Teacher:
    """Uniform access to a live or cached teacher for train and eval samples."""

    def __init__(self, live: Optional[LiveTeacher] = None, train_cache=None, eval_cache=None):
        self.live, self.caches = live, {"train": train_cache, "eval": eval_cache}

    @property
    def has_eval(self) -> bool:
        """Whether evaluations see the teacher (KL, top-1 agreement)."""
        return self.live is not None or self.caches["eval"] is not None

    def batch(self, split: str, batch: Dict[str, torch.Tensor], device):
        if self.live is not None:
            pos = batch.get("position_ids")
            return self.live.outputs(batch["input_ids"].to(device), batch["attn"].to(device),
                                     None if pos is None else pos.to(device))
        t = self.caches[split].get(batch["sample_ids"])
        lp, ix = t.logprobs, t.indices
        if "shard" in batch:                 # a sequence-parallel shard: the cache holds whole sequences
            a, e = batch["shard"].tolist()
            lp, ix = lp[:, a:e], ix[:, a:e]
        return contextlib.nullcontext(TopKTeacherOut(lp.to(device), ix.to(device)))


def evaluate(model, samples, teacher, n: int, micro_batch: int, rank: int, world: int, device,
             sp=(0, 1)) -> Dict[str, float]:
    """KL to the teacher, CE, perplexity and top-1 agreement over the first ``n`` held-out samples
    (all ranks). ``model``: a StudentLM, or the DeepSpeed engine wrapping one; ``teacher``: an
    object with ``batch(split, batch, device)`` (a context manager of the teacher's outputs) and
    ``has_eval``, or None. ``sp``: (this rank's index in its sequence-parallel group, the group's size): the
    group's ranks read the same samples, each its shard (train/seqpar.py)."""
    mb = micro_batch
    sp_rank, sp_size = sp
    all_ranks = world
    rank, world = rank // sp_size, world // sp_size          # the data-parallel split of the samples
    sums = torch.zeros(4, dtype=torch.float64)
    mod = getattr(model, "module", model)
    was_training = mod.training
    model.eval()
    with torch.no_grad():
        # every rank runs the same number of forwards (ZeRO-3 gathers are collective)
        per_rank = math.ceil(math.ceil(n / world) / mb)
        for i in range(per_rank):
            lo = (i * world + rank) * mb
            idx = list(range(lo, min(lo + mb, n)))
            real = bool(idx)
            if not real:
                idx = [0]
            pad = mb - len(idx) if sp_size > 1 else 0
            b = samples.select(idx + idx[:1] * pad)
            if sp_size > 1:
                # Ulysses attention is built for micro_batch rows: a short last batch is padded with rows that
                # count no token
                b["mask"][len(idx):] = False
                from .seqpar import shard_batch  # noqa: PLC0415 (only under sequence parallelism)
                b = shard_batch(b, sp_rank, sp_size)
            with teacher.batch("eval", b, device) if teacher is not None else contextlib.nullcontext() as t:
                kw = {k: b[k].to(device) for k in ("position_ids", "targets", "target_mask") if k in b}
                s = model(b["input_ids"].to(device), b["attn"].to(device), b["mask"].to(device), t, metrics=True, **kw)
            if real:
                sums += s.cpu()
    if was_training:
        model.train()
    if all_ranks > 1:
        st = sums.to(device)
        torch.distributed.all_reduce(st)
        sums = st.cpu()
    tok = max(float(sums[0]), 1.0)
    out = {"eval/tokens": float(sums[0]), "eval/ce": float(sums[2]) / tok}
    out["eval/ppl"] = math.exp(min(out["eval/ce"], 50.0))
    if teacher is not None and teacher.has_eval:
        out["eval/kl"] = float(sums[1]) / tok
        out["eval/top1"] = float(sums[3]) / tok
    return out


def eval_count(cfg, samples) -> int:
    """How many held-out samples an evaluation reads (train.eval_samples; 0: all)."""
    return len(samples) if not cfg.train.eval_samples else min(len(samples), cfg.train.eval_samples)


def load_teacher(cfg, kind: Optional[str], teacher_init, train_s, eval_s, run_dir: Path, rank: int,
                  device: str, dev, vocab: int, eval_only: bool) -> Optional[Teacher]:
    """The teacher the method asked for: live (a frozen copy, ZeRO-3-partitioned like the student),
    or a top-k cache (rank 0 writes it once when missing; the teacher is then dropped)."""
    if kind is None:
        return None
    t, m = cfg.train, cfg.method
    tdtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    tmodel = load_teacher_model(cfg, teacher_init)
    zero3 = ds_config(cfg, device, False) if t.zero_stage == 3 else None
    if kind == "live":
        return Teacher(LiveTeacher(tmodel, tdtype, dev, zero3_config=zero3))
    cache_root = Path(m.teacher_cache or (run_dir / "teacher_cache"))
    if not m.teacher_cache:
        # the run's own cache folder: never a link to a cache somewhere else (a named one is the user's choice)
        for folder, name in ((run_dir, "teacher_cache"), (cache_root, "train"), (cache_root, "eval")):
            if (Path(folder) / name).exists() or (Path(folder) / name).is_symlink():
                _fsutil.own_file(folder, name, "the run's teacher cache folder")
    # the teacher's identity (its weights, and the dtype it runs in) goes into the cache and is checked on
    # every reuse with the data's fingerprint, top-k, seq_len and the stored dtype (distill/teachers.py)
    tsha = hashlib.sha256(f"{weights_sha256(tmodel)}:{tdtype}".encode()).hexdigest()
    for split, s in (("train", train_s), ("eval", eval_s)):
        if eval_only and not (cache_root / split / "meta.json").exists():
            # an evaluation writes nothing but its own result file
            raise FileNotFoundError(f"method.teacher=cached: {cache_root / split / 'meta.json'} not found; "
                                    f"evaluate with the run's teacher cache, or method.teacher=live")
        if not (cache_root / split / "meta.json").exists():
            # every rank refuses a folder that is not a cache (the user's own, say) before rank 0 would write
            # there, so no rank waits at the barrier for a write that was refused
            _fsutil.check_replaceable(cache_root / split, ("teacher_cache",), "method.teacher_cache")
        # rank 0 alone decides and writes; every rank passes the barrier either way
        if rank == 0 and not (cache_root / split / "meta.json").exists():
            lt = LiveTeacher(tmodel, tdtype, dev)
            precompute_topk(lt, s, str(cache_root / split), m.topk, batch_size=t.micro_batch,
                            chunk_tokens=m.loss.chunk_tokens, logprob_dtype=m.cache_dtype,
                            teacher_name=m.teacher_path or cfg.model.name, vocab=vocab, teacher_sha256=tsha)
        barrier()
    del tmodel

    def expect(s):
        return {"teacher_sha256": tsha, "fingerprint": s.fingerprint(), "k": m.topk, "seq_len": cfg.data.seq_len,
                "logprob_dtype": m.cache_dtype, "temperature": 1.0}
    return Teacher(None, CachedTeacher(str(cache_root / "train"), expect=expect(train_s)),
                    CachedTeacher(str(cache_root / "eval"), expect=expect(eval_s)))
