"""GRPO / DAPO with LoRA on a quantized (or bf16) base under DeepSpeed: :func:`run` for method=grpo|dapo.

The loop of the registered methods grpo / dapo (train/methods/grpo.py, ``Method.own_loop``); it
reuses the trainer's distributed init, model building, DeepSpeed config, LR schedule and logger, and
returns its student like every run (``summary["student"]``): the face ships it.

    run_dir/config.yaml, metrics.jsonl, plots/rl.png, summary.json
    run_dir/adapter/           the trained adapter as a PEFT LoRA directory (lora_mode=adapter)
    run_dir/warmup/            method.rl.warmup_steps > 0: the warmed-up model (its base), train/rl_warmup.py
    run_dir/student/           quantize.save_student of the QA-LoRA student (lora_mode=merged)
    run_dir/export-<engine>/   when export.enabled: written and gated by the face (qatfactory.ship)

The student. ``lora_mode=adapter`` (QeRL): quantize.prepare (+ calibrate), every parameter frozen,
a side LoRA on the targets (nn/adapter.py), and the base frozen once at its fake-quantized weights
(``serving_weights``, entered after deepspeed.initialize, held for the whole run): rollouts and
the loss forward both multiply by exactly the tensors the export serves (tested against an
independent decode of convert()'s bytes), plus the adapter. ``lora_mode=merged`` (QA-LoRA,
nn/lora.py): the training forward is ``fake_quant(W + s*B@A)``; rollouts freeze that once per step,
and the export merges through the same quantizer, so it is exactly the sampled policy.
``format=bf16`` gives the BF16-LoRA arm (adapter mode on plain nn.Linear). With
``method.rl.warmup_steps > 0`` the model is first fine-tuned on worked solutions in the rewarded format
(train/rl_warmup.py; task=arith), before it is quantized: the warmed-up model is the base from then on.

One RL step (``train.max_steps`` of them):

1. this rank's ``prompts_per_step / world`` prompts (a seeded order over the task's training
   pool), G completions each (distill/rollout.py), under AQN noise when ``method.rl.aqn.enabled``;
2. rewards (distill/rewards.py), group advantages (a group never spans ranks), dynamic sampling;
3. reference log-probs with the adapters off (beta > 0); old log-probs from a clean forward
   (num_iterations > 1) or the sampler's own (old_logprobs=rollout);
4. num_iterations x minibatches optimizer steps. Each micro-batch returns its loss numerator
   times ``gas * world / D`` with ``D`` the minibatch's global denominator (all-reduced): after
   DeepSpeed divides by gas and averages over ranks the update is that of the whole global batch
   (distill/rl.py). A minibatch whose global denominator is 0 (every group dropped) is skipped on
   every rank.

Evaluation (start, every ``train.eval_every`` steps, end; clean weights, no noise): greedy
completions of the held-out prompts (accuracy, reward, format, entropy along the greedy path), and
one sampled completion each at the rollout temperature from a fixed seed (pass@1, token entropy):
the same prompts and seed for every arm, so step-0 entropies compare across formats.
``entropy`` in the log is the clean policy's mean token entropy over every generated token (first pass),
``rollout_entropy`` the sampler's (noisy under AQN). ZeRO-3 and resume are refused, mid-run checkpoints
are not written (train.save_every is ignored), and train.grad_accum is derived (completions per
minibatch / train.micro_batch).
"""
from __future__ import annotations

import copy
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from .. import quantize as Q
from ..distill import rl as RL
from ..distill.rewards import Task, arith_questions, arith_warmup, make_task
from ..distill.rollout import SamplingConfig, generate
from ..nn import adapter as AD
from ..nn.noise import AQN
from . import rundir
from .config import NO_QUANT, RunConfig, validate
from .data import _encode, load_tokenizer  # noqa: F401  (load_tokenizer re-exported for benchmarks)
from .engine import (
    _barrier,
    _rank_world,
    _resolve_device,
    build_model,
    ds_config,
    init_distributed,
    lr_lambda,
    seed_all,
)
from .methods import Student
from .rl_warmup import prompt_ids as _prompt_ids  # noqa: F401  (re-exported for benchmarks)
from .rl_warmup import save_model_dir, sft_warmup, weights_sha256
from .runlog import RunLogger, memory_gb, read_metrics

RL_METHODS = ("grpo", "dapo")


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
                mode: str = "loss"):
        c = self.rl
        lp, ent = RL.token_logprobs(self.logits(ids, attn, pos, comp.shape[1]), comp, c.temperature,
                                    entropy=mode == "loss")
        if mode == "logp":
            return lp
        old_ = lp.detach() if old is None else old
        loss_t, info = RL.per_token_loss(lp, old_, adv, c.clip_low, c.clip_high, c.beta, ref)
        num = RL.loss_terms(loss_t, mask, c.loss_norm, keep)
        m = mask & keep[:, None] if keep is not None else mask
        st = RL.token_stats(info, m)
        real = attn[:, -comp.shape[1]:].bool()           # every generated token, counted in the loss or not
        st["entropy_sum"] = float((ent * real.float()).sum())
        st["entropy_tokens"] = float(real.sum())
        st["loss_part"] = float(num.detach()) * scale
        return num * scale, st


# ----------------------------------------------------------------------------- batches
def _train_batch(prompts: List[List[int]], comp: torch.Tensor, lengths: torch.Tensor, pad: int, device):
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


def _all_sum(vals: List[float], device) -> List[float]:
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.cpu().tolist()


def _all_max(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


# ----------------------------------------------------------------------------- checks
def check(cfg: RunConfig, world: int) -> None:
    r, t = cfg.method.rl, cfg.train
    r.validate()
    if t.zero_stage == 3:
        raise ValueError("method=grpo|dapo: train.zero_stage=3 is not supported (rollouts read every weight "
                         "on every rank); allowed: 0, 1, 2")
    if cfg.resume:
        raise ValueError("method=grpo|dapo: resume is not implemented for RL runs yet; start a fresh run_dir")
    if r.prompts_per_step % world:
        raise ValueError(f"method.rl.prompts_per_step={r.prompts_per_step} does not split over {world} ranks; "
                         f"allowed: a multiple of the world size")
    per_rank = r.prompts_per_step // world * r.group_size
    if per_rank % r.minibatches or (per_rank // r.minibatches) % t.micro_batch:
        raise ValueError(f"method.rl: {per_rank} completions per rank (prompts_per_step / world * group_size) must "
                         f"split into minibatches={r.minibatches} of whole micro-batches (train.micro_batch="
                         f"{t.micro_batch})")
    quantized = cfg.quant.weight_format not in NO_QUANT
    if r.lora_mode == "merged" and not quantized:
        raise ValueError("method.rl.lora_mode='merged' merges into the quantizer; with format=bf16 use lora_mode=adapter")
    if cfg.quant.lora.rank and r.lora_mode == "adapter":
        raise ValueError("method=grpo|dapo takes its LoRA from method.rl.lora_*; quant.lora.rank must be 0 "
                         "(quant.lora is the merged adapter of method=qad_lora)")


def quantize_base(model, cfg: RunConfig, train_prompts: List[List[int]], dev):
    """The quantized student of ``model`` (PTQ: quantize.prepare, then calibration on the first
    method.calib_samples training prompts when method.calibrate): the base the quantized arms freeze."""
    model = Q.prepare(model, cfg.quant) or model
    if cfg.method.calibrate:
        n = min(cfg.method.calib_samples, len(train_prompts))
        Q.calibrate(model, [{"input_ids": torch.tensor([p], device=dev),
                             "attention_mask": torch.ones(1, len(p), dtype=torch.long, device=dev)}
                            for p in train_prompts[:n]], cfg.quant.calib_method)
    return model


# ----------------------------------------------------------------------------- the warm-up
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
    t = _all_sum(sums, device)
    c = max(t[0], 1.0)
    return {"eval/accuracy": t[1] / c, "eval/reward": t[2] / c, "eval/format": t[3] / c,
            "eval/entropy_greedy": t[4] / max(t[5], 1.0), "eval/pass1_sampled": t[6] / c,
            "eval/entropy": t[7] / max(t[8], 1.0), "eval/format_sampled": t[9] / c, "eval/prompts": t[0]}


# ----------------------------------------------------------------------------- the run
def make_optimizer(params, t):
    """The torch optimizer of the adapters (train.optimizer=adamw_torch); a seam for tests."""
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)


def run(cfg: RunConfig, eval_only: bool = False) -> Dict[str, Any]:
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    if eval_only:
        raise ValueError("method=grpo|dapo: eval-only runs are not implemented; RL runs evaluate at the start and end")
    cfg = validate(cfg)
    r, t = cfg.method.rl, cfg.train
    device = _resolve_device(t.device)
    init_distributed(device)
    rank, world = _rank_world()
    check(cfg, world)
    quantized = cfg.quant.weight_format not in NO_QUANT
    if r.lora_mode == "merged":
        cfg.quant.lora.rank, cfg.quant.lora.alpha = r.lora_rank, r.lora_alpha
        cfg.quant.lora.targets = list(r.lora_targets)
    dev = torch.device(device, int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")
    seed_all(t.seed)
    # the same run-directory rules as every run: never another run's or a user's directory
    run_dir, _, decision = rundir.prepare(cfg, rank, world, False)
    t0 = time.time()

    model, tok, source_dir = build_model(cfg, dev)
    if device == "cuda":
        model.to(dev)
    task = make_task(r.task, r.answer_format, r.task_level, r.n_train, r.n_eval, t.seed, r.format_weight,
                     r.correct_weight)
    eos = int(tok.eos_token_id)
    pad = int(tok.pad_token_id) if getattr(tok, "pad_token_id", None) is not None else eos
    train_prompts = _prompt_ids(tok, task, task.train, r.chat_template)
    eval_prompts = _prompt_ids(tok, task, task.eval, r.chat_template)
    warm = warmup(model, tok, task, r, t.seed, world, t.progress and rank == 0) if r.warmup_steps else None
    if warm is not None:
        # the warmed-up model is the base from here on: the adapter and the export name it, not the source
        wdir = run_dir / "warmup"
        warm["sha256"] = weights_sha256(model)
        if rank == 0:
            save_model_dir(model, tok, source_dir, wdir, warm)
            print(f"[qatfactory] warm-up: {warm['steps']} steps x {warm['batch']} worked solutions, loss "
                  f"{warm['loss_first']:.3f} -> {warm['loss_last']:.3f} in {warm['time_s']:.1f}s; the warmed-up "
                  f"base is {wdir}", flush=True)
        _barrier()
        source_dir = str(wdir)
    if quantized:
        model = quantize_base(model, cfg, train_prompts, dev)
    for p in model.parameters():
        p.requires_grad_(False)
    if t.grad_ckpt:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if r.lora_mode == "adapter":
        AD.attach(model, r.lora_rank, r.lora_alpha, list(r.lora_targets))
    else:
        for m in model.modules():
            if getattr(m, "lora", None) is not None:
                m.lora.lora_A.requires_grad_(True)
                m.lora.lora_B.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("method=grpo|dapo: no trainable adapter parameters (check method.rl.lora_targets)")

    per_rank = r.prompts_per_step // world * r.group_size
    per_mb = per_rank // r.minibatches
    gas = per_mb // t.micro_batch
    tcfg = copy.deepcopy(t)
    tcfg.grad_accum = gas
    tcfg.max_steps = t.max_steps * r.num_iterations * r.minibatches
    run_cfg = copy.copy(cfg)
    run_cfg.train = tcfg
    policy = PolicyLM(model, r)
    dcfg = ds_config(run_cfg, device, True)
    kw: Dict[str, Any] = {"model_parameters": params}
    if "optimizer" not in dcfg:
        kw["optimizer"] = make_optimizer(params, t)
    kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tcfg))
    engine, *_ = deepspeed.initialize(model=policy, config=dcfg, **kw)
    lm = engine.module.lm

    aqn = None
    if r.aqn.enabled:
        a = r.aqn
        aqn = AQN(lm, t.max_steps, a.sigma_start, a.sigma_end, a.stages, a.indexing, a.resample, a.seed,
                  a.include_final_norm)
    log = RunLogger(run_dir, rank == 0, t.tensorboard, t.progress, t.max_steps, 0)
    if rank == 0 and t.save_every:
        print(f"[qatfactory] method={cfg.method.name}: no mid-run checkpoints yet (train.save_every={t.save_every} "
              f"is ignored); the adapter / student is written at the end", flush=True)
    history: List[Dict[str, float]] = []
    frozen = AD.serving_weights(lm) if (quantized and r.lora_mode == "adapter") else None
    if frozen is not None:
        frozen.__enter__()
    tokens_total = 0
    try:
        def do_eval(step):
            ctx = AD.serving_weights(lm) if (quantized and r.lora_mode == "merged") else _Null()
            with ctx:
                e = evaluate(lm, tok, task, eval_prompts, r, rank, world, dev, t.seed + 17, eos, pad)
            e["step"] = step
            history.append(e)
            log.log(e)
            return e

        if r.n_eval:
            do_eval(0)
        order_g = torch.Generator().manual_seed(t.seed + 1)
        perm = torch.randperm(len(train_prompts), generator=order_g).tolist()
        ppr = r.prompts_per_step // world
        for step in range(t.max_steps):
            ts = time.time()
            base = step * r.prompts_per_step + rank * ppr
            pidx = [perm[(base + k) % len(perm)] for k in range(ppr)]
            prompts = [train_prompts[i] for i in pidx]
            items = [task.train[i] for i in pidx]
            gen = torch.Generator(device=dev).manual_seed(t.seed * 1_000_003 + step * 7919 + rank)
            scfg = SamplingConfig(r.max_new_tokens, r.temperature, r.top_p, list(r.stop))
            noise_info: Dict[str, float] = {}
            tr = time.time()
            with (AD.serving_weights(lm) if (quantized and r.lora_mode == "merged") else _Null()):
                with (aqn.rollout(step) if aqn is not None else _NullInfo()) as ninfo:
                    roll = generate(lm, prompts, eos, pad, scfg, gen, repeat=r.group_size, tokenizer=tok)
                    noise_info = dict(ninfo)
            t_roll = time.time() - tr
            scores = [task.score(roll.texts[i], items[i // r.group_size], r.max_new_tokens) for i in range(len(roll.texts))]
            rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
            adv = RL.group_advantages(rewards, r.group_size, r.scale_rewards, r.adv_eps)
            keep = RL.keep_mask(rewards, r.group_size, r.dynamic_sampling)
            T = roll.tokens.shape[1]
            mask = RL.completion_mask(roll.lengths, roll.finished, T, r.mask_truncated)
            ids, attn, pos = _train_batch(roll.prompt_ids, roll.tokens, roll.lengths, pad, dev)
            comp, mask_d, adv_d, keep_d = roll.tokens.to(dev), mask.to(dev), adv.to(dev), keep.to(dev)
            rows_mb = [list(range(i * per_mb, (i + 1) * per_mb)) for i in range(r.minibatches)]
            # the max completion length of Dr.GRPO's denominator is the configured one
            dens = [_all_sum([RL.denominator(mask[rw], r.loss_norm, r.max_new_tokens, keep[rw])], dev)[0]
                    for rw in rows_mb]
            ref = old = None
            micro = [rw[i:i + t.micro_batch] for rw in rows_mb for i in range(0, per_mb, t.micro_batch)]
            with torch.no_grad():
                if r.beta > 0:
                    ref = torch.zeros(comp.shape, dtype=torch.float32, device=dev)
                    with AD.adapters_disabled(lm) if r.lora_mode == "adapter" else _lora_off(lm):
                        for mb in micro:
                            ref[mb] = engine.module(ids[mb], attn[mb], pos[mb], comp[mb], mask_d[mb], mode="logp")
                if r.old_logprobs == "rollout":
                    old = roll.logprobs.to(dev)
                elif r.num_iterations > 1:
                    old = torch.zeros(comp.shape, dtype=torch.float32, device=dev)
                    for mb in micro:
                        old[mb] = engine.module(ids[mb], attn[mb], pos[mb], comp[mb], mask_d[mb], mode="logp")
            agg: Dict[str, float] = {}
            first_ent = [0.0, 0.0]
            updates = 0
            for it in range(r.num_iterations):
                for mi, rw in enumerate(rows_mb):
                    if dens[mi] == 0:
                        continue
                    scale = gas * world / dens[mi]
                    for i in range(0, per_mb, t.micro_batch):
                        mb = rw[i:i + t.micro_batch]
                        loss, st = engine(ids[mb], attn[mb], pos[mb], comp[mb], mask_d[mb], adv_d[mb],
                                          None if old is None else old[mb], None if ref is None else ref[mb],
                                          keep_d[mb], scale)
                        engine.backward(loss)
                        engine.step()
                        st["loss_part"] /= gas * world
                        for k, v in st.items():
                            agg[k] = agg.get(k, 0.0) + v
                        if it == 0:
                            first_ent[0] += st["entropy_sum"]
                            first_ent[1] += st["entropy_tokens"]
                    updates += 1
            # ---- log
            n_tok = roll.n_tokens()
            vals = [float(rewards.sum()), sum(s["correct"] for s in scores), sum(s["format"] for s in scores),
                    float(rewards.numel()), float(RL.zero_std_groups(rewards, r.group_size).sum()),
                    float(rewards.numel() // r.group_size), float(roll.truncated.sum()), float(n_tok),
                    float((roll.entropy * (torch.arange(roll.tokens.shape[1])[None, :] < roll.lengths[:, None])).sum()),
                    agg.get("loss_part", 0.0), agg.get("tokens", 0.0), agg.get("ratio_sum", 0.0),
                    agg.get("clip_low_sum", 0.0), agg.get("clip_high_sum", 0.0), agg.get("kl_sum", 0.0),
                    first_ent[0], first_ent[1]]
            tot = _all_sum(vals, dev)
            t_roll = _all_max(t_roll, dev)
            dt = time.time() - ts
            tokens_total += int(tot[7])
            n = max(tot[3], 1.0)
            rec = {"step": step + 1, "reward": tot[0] / n, "correct": tot[1] / n, "format": tot[2] / n,
                   "frac_zero_std": tot[4] / max(tot[5], 1.0), "truncated": tot[6] / n,
                   "completion_len": tot[7] / n, "rollout_entropy": tot[8] / max(tot[7], 1.0),
                   "loss": tot[9] / max(updates, 1), "entropy": tot[15] / max(tot[16], 1.0),
                   "ratio_mean": tot[11] / max(tot[10], 1.0), "clip_low": tot[12] / max(tot[10], 1.0),
                   "clip_high": tot[13] / max(tot[10], 1.0), "updates": updates,
                   "lr": float(engine.get_lr()[0]), "step_ms": dt * 1000.0, "rollout_ms": t_roll * 1000.0,
                   "rollout_tokens_per_s": tot[7] / max(t_roll, 1e-9), "mem_gb": memory_gb()}
            if r.beta > 0:
                rec["kl"] = tot[14] / max(tot[10], 1.0)
            for k, v in noise_info.items():
                rec[f"aqn/{k}"] = v
            if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
                log.log(rec)
            log.progress(1, reward=rec["reward"], correct=rec["correct"], ent=rec["entropy"],
                         tok_s=int(rec["rollout_tokens_per_s"]))
            if r.n_eval and t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 != t.max_steps:
                do_eval(step + 1)
        if r.n_eval and (not history or history[-1]["step"] != t.max_steps):
            do_eval(t.max_steps)
    finally:
        if frozen is not None:
            frozen.__exit__(None, None, None)
    log.close()
    summary: Dict[str, Any] = {"run_dir": str(run_dir), "method": cfg.method.name,
                               "format": cfg.quant.name or cfg.quant.weight_format, "steps": t.max_steps,
                               "tokens": tokens_total, "time_s": time.time() - t0, "world_size": world,
                               "eval_first": history[0] if history else None,
                               "eval_last": history[-1] if history else None, "eval_history": history}
    if warm is not None:
        summary["warmup"] = warm
    out, student = _finalize(cfg, lm, run_dir, rank, source_dir, eval_prompts, quantized, dev, pad)
    summary.update(out)
    student.request(cfg, run_dir, decision.get("export_dir"))
    _barrier()
    if rank == 0:
        tmp = run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, run_dir / "summary.json")
        if t.plots:
            plot_rl(run_dir)
        print(summary_text(summary), flush=True)
    summary["student"] = student
    summary["engine"] = engine
    return summary


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


class _NullInfo(_Null):
    def __enter__(self):
        return {}


class _lora_off:
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


# ----------------------------------------------------------------------------- the end of a run
@torch.no_grad()
def _policy_logits(lm, prompts, pad, device, quantized):
    """Log-probabilities [N, L, V] of the policy on left-padded prompts, and the real-token mask."""
    ctx = AD.serving_weights(lm) if quantized else _Null()
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


def _finalize(cfg: RunConfig, lm, run_dir: Path, rank: int, source_dir, eval_prompts, quantized, device,
              pad: int):
    """Rank 0 writes the adapter / student and, when the run asks for an export, converts what it
    ships: (summary entries, Student). export_lora=merge first merges the adapter into the quantized
    base and reports how far that moves the trained policy."""
    out: Dict[str, Any] = {}
    r = cfg.method.rl
    student = Student(model=lm)
    if rank != 0:
        return out, student
    if r.lora_mode == "adapter":
        out["adapter_dir"] = AD.save_peft_adapter(lm, str(run_dir / "adapter"), base_model=source_dir)
        # the adapter as trained, held apart from the file: the face's gate compares the folder with it
        student.adapter = {"dir": out["adapter_dir"], "rank": r.lora_rank, "alpha": r.lora_alpha,
                           "modules": {n: (a.lora_A.detach().cpu().clone(), a.lora_B.detach().cpu().clone())
                                       for n, a in AD.adapters(lm).items()},
                           "linears": [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)
                                       or hasattr(m, "in_features") and hasattr(m, "weight")]}
    elif cfg.train.save_student:
        Q.save_student(lm, str(run_dir / "student"), source_dir=source_dir)
        out["student_dir"] = student.student_dir = str(run_dir / "student")
    if not cfg.export.enabled:
        return out, student
    if r.lora_mode == "adapter" and r.export_lora == "merge":
        # the trained policy (frozen base + side adapter) vs what the merged export computes
        probe = eval_prompts[:8] or [[pad]]
        before, am = _policy_logits(lm, probe, pad, device, quantized)
        AD.merge_into_quant(lm)
        after, _ = _policy_logits(lm, probe, pad, device, quantized)
        kl = ((before.exp() * (before - after)).sum(-1) * am).sum() / am.sum()
        top1 = ((before.argmax(-1) == after.argmax(-1)) & am).sum() / am.sum()
        out["merge_kl_to_trained"] = float(kl)
        out["merge_top1_agreement"] = float(top1)
        print(f"[qatfactory] export_lora=merge ships Q(W + s*B@A), not the trained frozen-base + adapter policy: "
              f"KL {float(kl):.3g}, top-1 agreement {float(top1):.3f} on {len(probe)} held-out prompts", flush=True)
    student.converted = Q.convert(lm)
    if source_dir and student.converted.source_dir is None:
        student.converted.source_dir = source_dir
    out["export_lora"] = r.export_lora if r.lora_mode == "adapter" else "merged"
    return out, student


# ----------------------------------------------------------------------------- report
def plot_rl(run_dir) -> Optional[Path]:
    import matplotlib  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    recs = read_metrics(run_dir)
    keys = [k for k in ("reward", "correct", "format", "entropy", "rollout_entropy", "aqn/sigma", "clip_high",
                        "completion_len", "eval/accuracy", "eval/entropy") if any(k in x for x in recs)]
    if not keys:
        return None
    cols = 5
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        pts = [(x["step"], x[k]) for x in recs if k in x and x[k] is not None and math.isfinite(x[k])]
        if pts:
            ax.plot(*zip(*pts), marker="o" if k.startswith("eval/") else None, ms=3)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(run_dir) / "plots"
    out.mkdir(exist_ok=True)
    p = out / "rl.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p


def summary_text(s: Dict[str, Any]) -> str:
    lines = [f"run: {s['run_dir']}",
             f"method={s['method']} format={s['format']} steps={s['steps']} rollout tokens={s['tokens']} "
             f"time={s['time_s']:.1f}s"]
    a, b = s.get("eval_first"), s.get("eval_last")
    if a:
        lines.append(f"{'':20s}{'start':>10s}{'end':>10s}")
        for k in ("accuracy", "reward", "format", "pass1_sampled", "entropy"):
            x, y = a.get(f"eval/{k}"), (b or {}).get(f"eval/{k}")
            lines.append(f"{'eval/' + k:20s}{'-' if x is None else f'{x:.4g}':>10s}{'-' if y is None else f'{y:.4g}':>10s}")
    for k in ("adapter_dir", "student_dir", "merge_kl_to_trained"):
        if k in s:
            lines.append(f"{k}: {s[k]}")
    return "\n".join(lines)
