"""Batched sampling with a KV cache: the rollouts of GRPO/DAPO.

:func:`generate` runs a Hugging Face causal LM as it is (for RL: inside
``nn.adapter.serving_weights``, so the base multiplies by the exact weights the export serves, plus
the current adapters). Prompts are left-padded into one batch and each repeated ``repeat`` times
(group-major: prompt i's copies are rows i*G .. i*G+G-1). One prefill, then one token per forward
through the model's own cache (``past_key_values``); position ids are counted over real tokens, so
padding never shifts a position.

Sampling: logits / temperature, then top-p (the smallest set of most likely tokens whose
probability reaches p; ties at the boundary kept in sorted order), then a draw from a seeded
``torch.Generator``. ``temperature == 0`` is greedy. A completion ends at EOS or when its decoded
text contains a stop string; the ending token is part of the completion (it is the action that
ended it). A completion that reaches ``max_new_tokens`` without ending is ``truncated``.

The log-probabilities and entropies returned are those of the distribution sampled from before
top-p (logits / temperature), as TRL's GRPO uses for its policy: ``old_logprobs="rollout"`` takes them.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0      # 0: greedy
    top_p: float = 1.0
    stop: List[str] = field(default_factory=list)


@dataclass
class Rollouts:
    prompt_ids: List[List[int]]    # per row (repeated), unpadded
    tokens: torch.Tensor           # [N, T] completion ids, pad after the end
    lengths: torch.Tensor          # [N] tokens in each completion (the ending token included)
    finished: torch.Tensor         # [N] bool: ended by EOS or a stop string
    logprobs: torch.Tensor         # [N, T] float32, log pi(token) at the sampling temperature
    entropy: torch.Tensor          # [N, T] float32, entropy of that distribution
    texts: List[str]               # decoded completions (up to the end)

    @property
    def truncated(self) -> torch.Tensor:
        return ~self.finished

    def n_tokens(self) -> int:
        return int(self.lengths.sum())


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits with every token outside the nucleus set to -inf (top_p = 1 keeps everything)."""
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    sp, idx = probs.sort(dim=-1, descending=True)
    before = sp.cumsum(-1) - sp            # mass of the strictly more likely tokens
    drop_sorted = before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _left_pad(seqs: Sequence[Sequence[int]], pad: int, device):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long, device=device)
    attn = torch.zeros((len(seqs), L), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        if len(s) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        ids[i, L - len(s):] = torch.tensor(list(s), dtype=torch.long, device=device)
        attn[i, L - len(s):] = 1
    return ids, attn


def _decode(tok, ids) -> str:
    if tok is None:
        return ""
    try:
        return tok.decode(list(ids), skip_special_tokens=True)
    except TypeError:           # the byte tokenizer of the tiny test models drops specials itself
        return tok.decode(list(ids))


def _cache_kwarg(model) -> str:
    """transformers 5.x names the KV cache ``cache`` (``past_key_values`` before, still accepted)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], eos_id: int, pad_id: int, cfg: SamplingConfig,
             generator: Optional[torch.Generator] = None, repeat: int = 1, tokenizer=None) -> Rollouts:
    """Sample completions for ``prompts`` (token id lists), each ``repeat`` times."""
    if cfg.stop and tokenizer is None:
        raise ValueError("generate: stop strings need the tokenizer (to decode the completions)")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={cfg.max_new_tokens!r}; allowed: an int >= 1")
    rows = [list(p) for p in prompts for _ in range(repeat)]
    dev = next(model.parameters()).device
    ids, attn = _left_pad(rows, pad_id, dev)
    N, T = len(rows), int(cfg.max_new_tokens)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    ckw = _cache_kwarg(model)
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache = _cache_of(out)
        logits = out.logits[:, -1]
        next_pos = pos[:, -1:] + 1
        toks = torch.full((N, T), pad_id, dtype=torch.long, device=dev)
        lps = torch.zeros((N, T), dtype=torch.float32, device=dev)
        ents = torch.zeros((N, T), dtype=torch.float32, device=dev)
        lengths = torch.zeros(N, dtype=torch.long, device=dev)
        done = torch.zeros(N, dtype=torch.bool, device=dev)
        finished = torch.zeros(N, dtype=torch.bool, device=dev)
        keep_chars = max((len(s) for s in cfg.stop), default=0) + 8
        for t in range(T):
            z = logits.float()
            if cfg.temperature > 0:
                z = z / cfg.temperature
            lsm = torch.log_softmax(z, dim=-1)
            if cfg.temperature == 0:
                nxt = z.argmax(-1)
            else:
                zf = top_p_filter(z, cfg.top_p)
                nxt = torch.multinomial(torch.softmax(zf, dim=-1), 1, generator=generator).squeeze(-1)
            live = ~done
            nxt = torch.where(live, nxt, torch.full_like(nxt, pad_id))
            toks[:, t] = nxt
            lps[:, t] = torch.where(live, lsm.gather(-1, nxt.clamp(max=lsm.shape[-1] - 1)[:, None]).squeeze(-1), 0.0)
            ents[:, t] = torch.where(live, -(lsm.exp() * lsm).sum(-1), 0.0)
            lengths += live.long()
            ended = live & (nxt == eos_id)
            if cfg.stop:
                for i in torch.nonzero(live & ~ended).flatten().tolist():
                    lo = max(0, int(lengths[i]) - keep_chars)
                    tail = _decode(tokenizer, toks[i, lo:int(lengths[i])].tolist())
                    if any(s in tail for s in cfg.stop):
                        ended[i] = True
            finished |= ended
            done |= ended
            if bool(done.all()) or t == T - 1:
                break
            attn = torch.cat([attn, live.long()[:, None]], dim=1)
            out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos,
                        use_cache=True, **{ckw: cache})
            cache = _cache_of(out)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
    finally:
        if was_training:
            model.train()
    width = int(lengths.max()) if N else 0
    toks, lps, ents = toks[:, :width], lps[:, :width], ents[:, :width]
    texts = [_decode(tokenizer, toks[i, :int(lengths[i])].tolist()) for i in range(N)] if tokenizer is not None \
        else [""] * N
    return Rollouts(rows, toks.cpu(), lengths.cpu(), finished.cpu(), lps.cpu(), ents.cpu(), texts)
