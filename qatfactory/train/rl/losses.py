"""GRPO and DAPO: group-relative advantages and the clipped token-level policy loss.

A rollout batch is group-major: prompt ``i``'s ``G`` completions are rows ``i*G .. i*G+G-1``.
Per completion ``j`` of a group with rewards ``r``:

    A_j = (r_j - mean(r)) / (std(r) + eps)     std unbiased (n - 1), as TRL's GRPOTrainer
    A_j =  r_j - mean(r)                       scale_rewards=False (Dr.GRPO)

one scalar per completion, broadcast to its tokens. Per completion token ``t``:

    rho_t  = exp(logp_t - old_t)
    loss_t = -min(rho_t * A, clip(rho_t, 1 - clip_low, 1 + clip_high) * A)
           + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)        k3 estimator of KL(pi || ref)

GRPO clips symmetrically (0.2 / 0.2); DAPO raises the upper bound ("clip-higher", 0.2 / 0.28).
``old_t`` is the policy that produced the rollout; with one update per rollout it is the current
policy detached, so ``rho == 1`` and the update is ``-A * grad logp``. The reference for the KL is
the model with the adapters disabled (the frozen base).

Normalizations (``loss_norm``), over the completion tokens that count (``mask``):

* ``bnpo`` (DAPO's token-level loss): ``sum_t loss_t / sum_t mask``;
* ``sequence`` (GRPO as published): mean over tokens within each completion, then mean over completions;
* ``dr_grpo``: ``sum_t loss_t / (n_completions * max_completion_length)``.

A completion cut at max_new_tokens ("truncated": no EOS, no stop string) gets an all-zero mask when
``mask_truncated`` (DAPO's overlong filtering); it still counts as a completion in the ``sequence`` and
``dr_grpo`` denominators, as in TRL. Dynamic sampling (DAPO) removes groups whose rewards all agree
(their advantage is 0 everywhere): they count nowhere, denominators included.

Micro-batching: :func:`loss_terms` returns the numerator and the denominator separately, so a
trainer can sum numerators over micro-batches (and ranks) and divide once by the global
denominator: the result equals the loss of the whole batch (tested).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .rewards import ANSWER_FORMATS, ARITH_LEVELS, TASKS

LOSS_NORMS = ("bnpo", "sequence", "dr_grpo")
OLD_LOGPROBS = ("recompute", "rollout")
LORA_MODES = ("adapter", "merged")
EXPORT_LORA = ("adapter", "merge")
BASES = ("dequantized", "packed")
IS_CORRECTIONS = ("none", "token_truncated")


@dataclass
class AQNConfig:
    """Adaptive quantization noise (see qatfactory/nn/noise.py): Gaussian noise on the norm gains
    that feed q/k/v and gate/up, for rollouts only."""

    enabled: bool = False
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10
    indexing: str = "code"         # code (NVlabs/QeRL: the last stage reaches sigma_end) | paper (Eq. 8)
    resample: str = "step"         # step (once per RL step, as the code) | forward (every forward pass)
    include_final_norm: bool = False
    seed: int = 0


@dataclass
class RLConfig:
    """The Hydra schema ``method.rl`` for method=grpo|dapo."""

    # task and reward (train/rl/rewards.py)
    task: str = "arith"              # say7 | arith | gsm8k
    task_level: int = 1              # arith: difficulty (rewards.ARITH_LEVELS)
    answer_format: str = "tag"       # tag (<think>..</think><answer>N</answer>) | hash ("#### N")
    format_weight: float = 0.2
    correct_weight: float = 2.0
    n_train: int = 1000              # prompts in the training pool (arith: generated; gsm8k: <= 1000)
    n_eval: int = 64                 # held-out prompts evaluated greedily at the start and the end
    chat_template: bool = True       # render prompts with the tokenizer's chat template
    # supervised warm-up before RL (train/rl/warmup.py; task=arith only): full fine-tuning of the
    # model before it is quantized, on worked solutions no RL prompt or held-out item shares
    warmup_steps: int = 0            # 0: none
    warmup_batch: int = 8
    warmup_lr: float = 1e-4
    warmup_levels: List[int] = field(default_factory=list)   # arith levels taken in turn; [] = all
    # rollouts (train/rl/rollout.py)
    prompts_per_step: int = 4        # global prompts per RL step (split over ranks)
    group_size: int = 8              # G completions per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: List[str] = field(default_factory=list)
    # the loss
    clip_low: float = 0.2
    clip_high: float = 0.2           # dapo: 0.28 (clip-higher)
    beta: float = 0.0                # k3 KL to the adapter-disabled reference
    loss_norm: str = "bnpo"          # bnpo | sequence | dr_grpo
    scale_rewards: bool = True       # divide by the group's std (False: Dr.GRPO)
    adv_eps: float = 1e-4
    mask_truncated: bool = True
    dynamic_sampling: bool = False   # drop groups whose rewards are all equal
    num_iterations: int = 1          # policy updates per rollout batch (mu)
    minibatches: int = 1             # optimizer steps per pass over the rollout batch
    old_logprobs: str = "recompute"  # recompute (clean training forward, QeRL) | rollout (the sampler's)
    # the adapter: a LoRA beside the frozen base (adapter) or merged before quantization (merged)
    lora_mode: str = "adapter"
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_targets: List[str] = field(default_factory=lambda: ["*q_proj", "*k_proj", "*v_proj", "*o_proj",
                                                            "*gate_proj", "*up_proj", "*down_proj"])
    export_lora: str = "adapter"     # adapter (base through the gate + a PEFT adapter) | merge (Q(W + s*B@A))
    # how the frozen base is held in adapter mode: its dequantized weights (fast, a second copy of the
    # model) or its packed codes + scales, decoded per layer at each use (nn/packed_base.py; the same bits)
    base: str = "dequantized"
    # what is sampled is what is trained: the sampler's log-probs against the trainer's recomputed ones on
    # the same tokens, every step (sampler_kl); a run stops when that KL passes sampler_kl_max (0: no bound);
    # token_truncated weighs each token's loss by min(pi_trainer / pi_sampler, is_cap), as TRL does for
    # vLLM rollouts
    sampler_check: bool = False
    sampler_kl_max: float = 0.0
    is_correction: str = "none"
    is_cap: float = 2.0
    aqn: AQNConfig = field(default_factory=AQNConfig)

    def validate(self) -> "RLConfig":
        for fld, v, allowed in (("task", self.task, TASKS), ("answer_format", self.answer_format, ANSWER_FORMATS),
                                ("loss_norm", self.loss_norm, LOSS_NORMS),
                                ("old_logprobs", self.old_logprobs, OLD_LOGPROBS),
                                ("lora_mode", self.lora_mode, LORA_MODES), ("export_lora", self.export_lora, EXPORT_LORA),
                                ("base", self.base, BASES), ("is_correction", self.is_correction, IS_CORRECTIONS),
                                ("aqn.indexing", self.aqn.indexing, ("code", "paper")),
                                ("aqn.resample", self.aqn.resample, ("step", "forward"))):
            if v not in allowed:
                raise ValueError(f"method.rl.{fld}={v!r}; allowed: {list(allowed)}")
        for fld in ("prompts_per_step", "max_new_tokens", "num_iterations", "minibatches", "lora_rank", "n_train"):
            if int(getattr(self, fld)) < 1:
                raise ValueError(f"method.rl.{fld}={getattr(self, fld)!r}; allowed: an int >= 1")
        if int(self.group_size) < 2:
            raise ValueError(f"method.rl.group_size={self.group_size!r}; allowed: an int >= 2 "
                             f"(a group of one has no relative advantage)")
        if int(self.n_eval) < 0:
            raise ValueError(f"method.rl.n_eval={self.n_eval!r}; allowed: an int >= 0")
        if int(self.warmup_steps) < 0 or int(self.warmup_batch) < 1 or not self.warmup_lr > 0:
            raise ValueError(f"method.rl.warmup_steps={self.warmup_steps!r}, warmup_batch={self.warmup_batch!r}, "
                             f"warmup_lr={self.warmup_lr!r}; allowed: steps >= 0, batch >= 1, lr > 0")
        if self.warmup_steps and self.task != "arith":
            raise ValueError(f"method.rl.warmup_steps={self.warmup_steps} needs method.rl.task=arith (the warm-up's "
                             f"worked solutions come from the arithmetic generator); task={self.task!r}")
        bad = [lv for lv in self.warmup_levels if not 0 <= int(lv) < len(ARITH_LEVELS)]
        if bad:
            raise ValueError(f"method.rl.warmup_levels={list(self.warmup_levels)!r}; allowed: levels "
                             f"0..{len(ARITH_LEVELS) - 1} (rewards.ARITH_LEVELS), [] for all")
        if not 0 <= self.clip_low < 1 or not self.clip_high >= 0:
            raise ValueError(f"method.rl.clip_low={self.clip_low!r}, clip_high={self.clip_high!r}; "
                             f"allowed: 0 <= clip_low < 1, clip_high >= 0")
        if self.beta < 0 or self.adv_eps < 0:
            raise ValueError(f"method.rl.beta={self.beta!r}, adv_eps={self.adv_eps!r}; allowed: numbers >= 0")
        if not self.temperature > 0:
            raise ValueError(f"method.rl.temperature={self.temperature!r}; allowed: a number > 0 "
                             f"(the policy's log-probabilities are taken at this temperature)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"method.rl.top_p={self.top_p!r}; allowed: 0 < top_p <= 1")
        if not self.sampler_kl_max >= 0 or not self.is_cap >= 1:
            raise ValueError(f"method.rl.sampler_kl_max={self.sampler_kl_max!r}, is_cap={self.is_cap!r}; allowed: "
                             f"sampler_kl_max >= 0 (0: no bound), is_cap >= 1")
        if self.is_correction != "none" and self.old_logprobs != "recompute":
            raise ValueError(f"method.rl.is_correction={self.is_correction!r} weighs the trainer's recomputed "
                             f"old policy against the sampler's; with old_logprobs={self.old_logprobs!r} the "
                             f"ratio already starts from the sampler: allowed is_correction='none' there")
        a = self.aqn
        if a.enabled and not (a.sigma_start > 0 and a.sigma_end > 0 and int(a.stages) >= 3):
            raise ValueError(f"method.rl.aqn: sigma_start={a.sigma_start!r}, sigma_end={a.sigma_end!r}, "
                             f"stages={a.stages!r}; allowed: sigmas > 0 and stages >= 3")
        return self


# ----------------------------------------------------------------------------- advantages
def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if x.ndim != 1 or x.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(x.shape)} do not split into groups of {group_size} "
                         f"(expected a 1-D tensor, group-major)")
    return x.reshape(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """A per completion [N] from rewards [N] (group-major), float32 (float64 stays float64)."""
    r = _groups(rewards.double() if rewards.dtype == torch.float64 else rewards.float(), group_size)
    a = r - r.mean(dim=1, keepdim=True)
    if scale:
        a = a / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    return a.reshape(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N / G] bool: groups whose rewards are all equal (no learning signal)."""
    r = _groups(rewards, group_size)
    return (r == r[:, :1]).all(dim=1)


def keep_mask(rewards: torch.Tensor, group_size: int, dynamic_sampling: bool) -> torch.Tensor:
    """[N] bool: completions that stay in the batch (all, or those of groups with reward variance)."""
    if not dynamic_sampling:
        return torch.ones(rewards.numel(), dtype=torch.bool, device=rewards.device)
    return (~zero_std_groups(rewards, group_size)).repeat_interleave(group_size)


def completion_mask(lengths: torch.Tensor, finished: torch.Tensor, width: int, mask_truncated: bool) -> torch.Tensor:
    """[N, width] bool: token t of completion i counts when t < lengths[i] (the EOS or stop token
    included), and, with ``mask_truncated``, only for completions that finished."""
    t = torch.arange(width, device=lengths.device)
    m = t[None, :] < lengths[:, None]
    if mask_truncated:
        m = m & finished[:, None].bool()
    return m


# ----------------------------------------------------------------------------- per-token terms
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(token) [N, T] from logits [N, T, V] at ``temperature`` (float32 math), and the entropy
    [N, T] of the same distribution when asked."""
    z = logits.float() if logits.dtype != torch.float64 else logits
    if temperature != 1.0:
        z = z / temperature
    lsm = torch.log_softmax(z, dim=-1)
    lp = lsm.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1 per token (>= 0; an unbiased estimator of KL(pi || ref))."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def sampler_gap(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """How far the policy that sampled the tokens is from the one the trainer scores, on those tokens: sums
    over counted tokens of k3 (an unbiased, non-negative estimator of KL(sampler || trainer) from tokens
    the sampler drew) and of |log-prob difference|, the token count, and the largest difference."""
    d = trainer_logp.float() - sampler_logp.float()
    m = mask.bool()
    k3 = torch.exp(d) - d - 1.0
    mf = m.float()
    return {"k3_sum": float((k3 * mf).sum()), "absdiff_sum": float((d.abs() * mf).sum()),
            "tokens": float(mf.sum()), "absdiff_max": float(d.abs()[m].max()) if bool(m.any()) else 0.0}


def is_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights [N, T]: min(pi_trainer(token) / pi_sampler(token), cap), no gradient."""
    return torch.exp(trainer_logp.float() - sampler_logp.float()).clamp(max=cap).detach()


def per_token_loss(logp, old_logp, adv, clip_low: float, clip_high: float, beta: float = 0.0,
                   ref_logp=None, is_weight=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """loss_t [N, T] and the per-token indicators the trainer logs (ratio, clipped low/high, kl).
    ``is_weight`` [N, T] multiplies the clipped policy term (the sampler correction), not the KL term."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None].to(logp.dtype)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * a
    loss = -torch.min(unclipped, clipped)
    if is_weight is not None:
        loss = loss * is_weight.to(loss.dtype)
    info = {"ratio": ratio.detach(),
            "clip_low": ((ratio < 1.0 - clip_low) & (a < 0)).detach(),
            "clip_high": ((ratio > 1.0 + clip_high) & (a > 0)).detach()}
    if beta:
        if ref_logp is None:
            raise ValueError("per_token_loss: beta > 0 needs ref_logp (the adapter-disabled reference)")
        kl = k3_kl(logp, ref_logp)
        loss = loss + beta * kl
        info["kl"] = kl.detach()
    return loss, info


def denominator(mask: torch.Tensor, norm: str, max_len: Optional[int] = None,
                keep: Optional[torch.Tensor] = None) -> float:
    """The normalizer of ``norm`` for a batch: tokens that count (bnpo), completions (sequence),
    or completions x max_completion_length (dr_grpo). ``keep`` [N] drops completions entirely."""
    if norm not in LOSS_NORMS:
        raise ValueError(f"loss_norm={norm!r}; allowed: {list(LOSS_NORMS)}")
    n = int(mask.shape[0]) if keep is None else int(keep.sum())
    m = mask if keep is None else mask & keep[:, None]
    if norm == "bnpo":
        return float(m.sum())
    if norm == "sequence":
        return float(n)
    if max_len is None:
        raise ValueError("loss_norm='dr_grpo' needs max_len (the max completion length)")
    return float(n * int(max_len))


def loss_terms(loss_t: torch.Tensor, mask: torch.Tensor, norm: str,
               keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The numerator of ``norm`` (a 0-d tensor with grad): sum of counted token losses (bnpo,
    dr_grpo) or the sum over completions of their per-token mean (sequence)."""
    m = mask if keep is None else mask & keep[:, None]
    mf = m.to(loss_t.dtype)
    if norm == "sequence":
        per_seq = (loss_t * mf).sum(-1) / mf.sum(-1).clamp(min=1.0)
        return per_seq.sum()
    if norm not in LOSS_NORMS:
        raise ValueError(f"loss_norm={norm!r}; allowed: {list(LOSS_NORMS)}")
    return (loss_t * mf).sum()


def policy_loss(logp, old_logp, adv, mask, *, clip_low: float = 0.2, clip_high: float = 0.2, beta: float = 0.0,
                ref_logp=None, norm: str = "bnpo", max_len: Optional[int] = None,
                keep: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The GRPO/DAPO loss of one whole batch: numerator / denominator (0 when nothing counts)."""
    loss_t, info = per_token_loss(logp, old_logp, adv, clip_low, clip_high, beta, ref_logp)
    num = loss_terms(loss_t, mask, norm, keep)
    den = denominator(mask, norm, max_len if max_len is not None else mask.shape[1], keep)
    loss = num / den if den > 0 else num * 0.0
    return loss, token_stats(info, mask if keep is None else mask & keep[:, None])


def token_stats(info: Dict[str, torch.Tensor], mask: torch.Tensor) -> Dict[str, float]:
    """Sums over counted tokens (the trainer adds them over micro-batches and ranks)."""
    mf = mask.float()
    out = {"tokens": float(mf.sum()), "ratio_sum": float((info["ratio"].float() * mf).sum()),
           "clip_low_sum": float((info["clip_low"].float() * mf).sum()),
           "clip_high_sum": float((info["clip_high"].float() * mf).sum())}
    if "kl" in info:
        out["kl_sum"] = float((info["kl"].float() * mf).sum())
    return out
