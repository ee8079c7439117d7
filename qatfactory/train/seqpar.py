"""Ulysses sequence parallelism (``train.sequence_parallel=N``): one sequence spread over N ranks.

DeepSpeed's :class:`UlyssesSPAttentionHF` (deepspeed.runtime.sequence_parallel.ulysses_sp) takes the place of the
model's attention implementation in transformers' attention table (process-wide, so a live teacher with the same
implementation runs through it too). Every layer but attention sees only this rank's ``T / N`` tokens; attention
exchanges them by an all-to-all so that each rank holds the whole sequence for ``heads / N`` heads, runs the
ordinary attention kernel causally over it, and exchanges back. Ranks ``[g N, (g + 1) N)`` form one
sequence-parallel group (DeepSpeed's grouping), fed the same micro-batch; the data-parallel degree is
``world / N``.

What this module adds around it:

* :func:`shard`: the next-token targets are taken on the whole sequence *before* it is cut (the last token of
  one shard predicts the first of the next), then ids, position ids (global positions: rotary embeddings and
  the causal order after the exchange depend on them), targets and their mask are cut into ``N`` contiguous
  shards.
* :func:`sp_loss`: a shard's loss is its sum over its counted tokens divided by the group's count and
  multiplied by ``N``. The trainer's data-parallel step averages gradients over all ``world`` ranks (DeepSpeed
  is not told of the groups), and the attention all-to-all's backward routes each token's gradient to the rank
  that holds it, so the average of the ranks' gradients is the gradient of the group's mean loss: the same
  loss and gradients as one rank running the whole sequence, up to float summation order (tested on two gloo
  ranks, tests/train/test_seqpar.py).

Packed documents (``data.doc_mask``) are refused with it: the wrapper drops the attention mask, and with
sdpa transformers then attends causally across the whole sequence.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..distill.losses import counted, lm_loss, lm_metrics
from ..distill.teachers import head_weight
from .head_chunks import head_chunks_loss, head_chunks_metrics

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")

_STATE: Dict[str, object] = {}


def enable(model, sp: int, micro_batch: int):
    """Install Ulysses attention for ``model``'s attention implementation (once per process) and return
    (the sequence-parallel process group, this rank's index in it)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"train.sequence_parallel={sp} with attention implementation {impl!r}; allowed: "
                         f"{list(ATTN_IMPLEMENTATIONS)} (Ulysses drops the attention mask; eager needs it)")
    import deepspeed.comm as dist  # noqa: PLC0415 (optional: deepspeed)
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu  # noqa: PLC0415
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: PLC0415
    if not dist.is_initialized():
        import deepspeed  # noqa: PLC0415
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    key = (impl, sp, micro_batch)
    if _STATE.get("key") != key:
        if _STATE:
            raise RuntimeError(f"sequence parallelism is already installed as {_STATE['key']}; one per process")
        UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation=impl,
                                                       sequence_parallel_size=sp, micro_batch_size=micro_batch,
                                                       seq_length_is_variable=True)
        _STATE["key"] = key
    return mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()


def shard(input_ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor, sp_rank: int, sp: int,
          position_ids: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """This rank's shard of a [B, T] micro-batch: ``input_ids``, ``position_ids`` (global), ``targets`` (the next
    token, -100 after the last) and ``target_mask`` (the next token counts and is attended), each [B, T / sp]."""
    b, t = input_ids.shape
    if t % sp:
        raise ValueError(f"train.sequence_parallel={sp}: a sample of {t} tokens does not split into {sp} equal "
                         f"shards; allowed: data.seq_len a multiple of {sp}")
    if position_ids is None:
        position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
    targets = torch.cat([input_ids[:, 1:], input_ids.new_full((b, 1), -100)], 1)
    tmask = torch.cat([mask[:, 1:] & attn[:, 1:].bool(), mask.new_zeros((b, 1), dtype=torch.bool)], 1)
    n = t // sp
    sl = slice(sp_rank * n, (sp_rank + 1) * n)
    return {"input_ids": input_ids[:, sl], "position_ids": position_ids[:, sl], "targets": targets[:, sl],
            "target_mask": tmask[:, sl]}


def shard_batch(b: Dict[str, torch.Tensor], sp_rank: int, sp: int) -> Dict[str, torch.Tensor]:
    """A micro-batch of ``Samples.select`` cut for this rank: :func:`shard`'s tensors plus ``attn`` (this shard's),
    ``sample_ids``, and ``shard`` = (first, end) position, which a cached teacher's outputs are sliced by."""
    part = shard(b["input_ids"], b["mask"], b["attn"], sp_rank, sp, b.get("position_ids"))
    n = part["input_ids"].shape[1]
    a = sp_rank * n
    part.update(attn=b["attn"][:, a:a + n], mask=b["mask"][:, a:a + n], sample_ids=b["sample_ids"],
                shard=torch.tensor([a, a + n]))
    return part


def _hidden(backbone, head, part):
    """(the shard's final hidden states, the head weight or None for a head that runs its own forward)."""
    out = backbone(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h, head_weight(head)


def sp_metrics(backbone, head, part: Dict[str, torch.Tensor], teacher, chunk_tokens: int,
               vocab_chunk=None) -> Dict[str, float]:
    """lm_metrics' sums of this rank's shard (the evaluation adds every rank's)."""
    h, w = _hidden(backbone, head, part)
    if w is None:
        return head_chunks_metrics(head, h, part["targets"], part["target_mask"], teacher, chunk_tokens)
    return lm_metrics(h, w, part["targets"], part["target_mask"], teacher, chunk_tokens, vocab_chunk=vocab_chunk)


def sp_loss(backbone, head, part: Dict[str, torch.Tensor], teacher, cfg, group, sp: int) -> torch.Tensor:
    """This rank's share of the group's mean loss (module docstring): the shard's loss sum / the group's count x sp.
    ``teacher``: the teacher's outputs on the same shard (a LiveTeacherOut or TopKTeacherOut), or None."""
    import deepspeed.comm as dist  # noqa: PLC0415 (optional: deepspeed)
    h, w = _hidden(backbone, head, part)
    lab, m = part["targets"], part["target_mask"]
    local = counted(lab.numel(), lab, m, h.device, cfg, torch.float64 if h.dtype == torch.float64 else torch.float32)
    mine = local.sum()
    total = mine.detach().clone()
    dist.all_reduce(total, group=group)
    t = teacher if cfg.needs_teacher else None
    loss = head_chunks_loss(head, h, lab, m, t, cfg) if w is None else lm_loss(h, w, lab, m, t, cfg)
    return loss * (mine / total.clamp_min(1.0) * sp)
