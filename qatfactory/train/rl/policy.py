"""The pieces of a GRPO / DAPO step that are not the loop's: the module DeepSpeed wraps
(:class:`PolicyLM`: the policy loss of a micro-batch, or its log-probs), the loss batch of a rollout,
the quantized base, the supervised warm-up before RL, and the held-out evaluation (greedy and sampled
completions of the task's prompts). The method itself is train/methods/grpo.py."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn as nn

from ... import quantize as Q
from ...nn import adapter as AD
from . import losses as RL
from .rewards import Task, arith_questions, arith_warmup
from .rollout import SamplingConfig, generate
from .warmup import sft_warmup


# ----------------------------------------------------------------------------- the module DeepSpeed wraps
class PolicyLM(nn.Module):
    """forward(batch, mode): "loss" -> (scaled loss numerator, stats); "logp" -> log-probs [N, T]."""

    def __init__(self, lm: nn.Module, rl_cfg: RL.RLConfig):
        super().__init__()
        self.lm = lm
        self.rl = rl_cfg

    def logits(self, ids, attn, pos, width: int):
        out = self.lm(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=width + 1)
        return out.logits[:, :width]

    def forward(self, ids, attn, pos, comp, mask, adv=None, old=None, ref=None, keep=None, scale: float = 1.0,
                mode: str = "loss", isw=None):
        c = self.rl
        lp, ent = RL.token_logprobs(self.logits(ids, attn, pos, comp.shape[1]), comp, c.temperature,
                                    entropy=mode == "loss")
        if mode == "logp":
            return lp
        old_ = lp.detach() if old is None else old
        loss_t, info = RL.per_token_loss(lp, old_, adv, c.clip_low, c.clip_high, c.beta, ref, isw)
        num = RL.loss_terms(loss_t, mask, c.loss_norm, keep)
        m = mask & keep[:, None] if keep is not None else mask
        st = RL.token_stats(info, m)
        real = attn[:, -comp.shape[1]:].bool()           # every generated token, counted in the loss or not
        st["entropy_sum"] = float((ent * real.float()).sum())
        st["entropy_tokens"] = float(real.sum())
        st["loss_part"] = float(num.detach()) * scale
        return num * scale, st


# ----------------------------------------------------------------------------- batches
def train_batch(prompts: List[List[int]], comp: torch.Tensor, lengths: torch.Tensor, pad: int, device):
    """[left-padded prompt | completion] ids, attention mask and position ids for the loss forward."""
    N, T = comp.shape
    P = max(len(p) for p in prompts)
    ids = torch.full((N, P + T), pad, dtype=torch.long)
    attn = torch.zeros((N, P + T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):P] = 1
    ids[:, P:] = comp
    attn[:, P:] = (torch.arange(T)[None, :] < lengths[:, None]).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), attn.to(device), pos.to(device)


def all_sum(vals: List[float], device) -> List[float]:
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.cpu().tolist()


def all_max(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


# ----------------------------------------------------------------------------- the base
def quantize_base(model, qcfg, mcfg, train_prompts: List[List[int]], dev, calibrate: bool):
    """The quantized student of ``model`` (PTQ: quantize.prepare with ``qcfg``, then calibration on the first
    method.calib_samples training prompts when method.calibrate and ``calibrate``; a resumed run reads the
    calibrated scales from its checkpoint): the base the quantized arms freeze."""
    model = Q.prepare(model, qcfg) or model
    if mcfg.calibrate and calibrate:
        n = min(mcfg.calib_samples, len(train_prompts))
        Q.calibrate(model, [{"input_ids": torch.tensor([p], device=dev),
                             "attention_mask": torch.ones(1, len(p), dtype=torch.long, device=dev)}
                            for p in train_prompts[:n]], qcfg.calib_method)
    return model


def warmup(model, tok, task: Task, r: RL.RLConfig, seed: int, world: int, progress: bool) -> Dict[str, Any]:
    """method.rl.warmup_steps > 0: supervised warm-up of the (not yet quantized) model on worked arith
    solutions that share no question with this run's training pool or held-out set at any level;
    with several ranks, rank 0's weights are then broadcast so every rank quantizes the same model."""
    n = int(r.warmup_steps) * int(r.warmup_batch)
    items = arith_warmup(n, list(r.warmup_levels) or None, seed, arith_questions([seed], r.n_train, r.n_eval))
    info = sft_warmup(model, tok, task, items, int(r.warmup_steps), float(r.warmup_lr), int(r.warmup_batch),
                      r.chat_template, seed, progress=progress)
    if world > 1:
        with torch.no_grad():
            for ten in list(model.parameters()) + list(model.buffers()):
                buf = ten.data.float()
                torch.distributed.broadcast(buf, 0)
                ten.data.copy_(buf)
    info.pop("losses")
    return info


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(lm, tok, task: Task, prompts, rl_cfg: RL.RLConfig, rank: int, world: int, device, seed: int,
             eos: int, pad: int) -> Dict[str, float]:
    n = len(prompts)
    idx = list(range(rank, n, world))
    sums = [0.0] * 10     # count, correct, reward, format, ent_sum, ent_tok, s_correct, s_ent_sum, s_tok, s_format
    if idx:
        ps = [prompts[i] for i in idx]
        items = [task.eval[i] for i in idx]
        g = generate(lm, ps, eos, pad, SamplingConfig(rl_cfg.max_new_tokens, 0.0, 1.0, list(rl_cfg.stop)),
                     tokenizer=tok)
        gen = torch.Generator(device=device).manual_seed(seed + 7919 * rank)
        s = generate(lm, ps, eos, pad, SamplingConfig(rl_cfg.max_new_tokens, rl_cfg.temperature, rl_cfg.top_p,
                                                     list(rl_cfg.stop)), gen, tokenizer=tok)
        for i, it in enumerate(items):
            sc = task.score(g.texts[i], it, rl_cfg.max_new_tokens)
            sums[0] += 1
            sums[1] += sc["correct"]
            sums[2] += sc["reward"]
            sums[3] += sc["format"]
            ss = task.score(s.texts[i], it, rl_cfg.max_new_tokens)
            sums[6] += ss["correct"]
            sums[9] += ss["format"]
        gm = torch.arange(g.tokens.shape[1])[None, :] < g.lengths[:, None]
        sm = torch.arange(s.tokens.shape[1])[None, :] < s.lengths[:, None]
        sums[4] += float((g.entropy * gm).sum())
        sums[5] += float(gm.sum())
        sums[7] += float((s.entropy * sm).sum())
        sums[8] += float(sm.sum())
    t = all_sum(sums, device)
    c = max(t[0], 1.0)
    return {"eval/accuracy": t[1] / c, "eval/reward": t[2] / c, "eval/format": t[3] / c,
            "eval/entropy_greedy": t[4] / max(t[5], 1.0), "eval/pass1_sampled": t[6] / c,
            "eval/entropy": t[7] / max(t[8], 1.0), "eval/format_sampled": t[9] / c, "eval/prompts": t[0]}


# ----------------------------------------------------------------------------- switches
class Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


class NullInfo(Null):
    def __enter__(self):
        return {}


class lora_off:
    """The merged-mode reference: every QuantLinear without its LoRA (fake_quant(W))."""

    def __init__(self, lm):
        self.mods = [m for m in lm.modules() if getattr(m, "lora", None) is not None]

    def __enter__(self):
        self.saved = [m.lora for m in self.mods]
        for m in self.mods:
            m.lora = None

    def __exit__(self, *a):
        for m, l in zip(self.mods, self.saved):
            m.lora = l
        return False


@torch.no_grad()
def policy_logits(lm, prompts, pad, device, quantized):
    """Log-probabilities [N, L, V] of the policy on left-padded prompts, and the real-token mask."""
    ctx = AD.serving_weights(lm) if quantized else Null()
    with ctx:
        p = [list(x) for x in prompts]
        L = max(len(x) for x in p)
        ids = torch.full((len(p), L), pad, dtype=torch.long)
        attn = torch.zeros((len(p), L), dtype=torch.long)
        for i, x in enumerate(p):
            ids[i, L - len(x):] = torch.tensor(x)
            attn[i, L - len(x):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = lm(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device), use_cache=False)
        return out.logits.float().log_softmax(-1), attn.bool().to(device)
