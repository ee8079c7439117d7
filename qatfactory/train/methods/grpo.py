"""method=grpo: GRPO with LoRA on the frozen quantized base (QeRL), as hooks of the one loop.

    run_dir/adapter/           the trained adapter as a PEFT LoRA directory (lora_mode=adapter)
    run_dir/warmup/            method.rl.warmup_steps > 0: the warmed-up model (its base), train/rl/warmup.py
    run_dir/student/           quantize.save_student of the QA-LoRA student (lora_mode=merged)

The student. ``lora_mode=adapter`` (QeRL): quantize.prepare (+ calibrate), every parameter frozen,
a side LoRA on the targets (nn/adapter.py), and the base frozen once at its fake-quantized weights
(``serving_weights``, entered in :meth:`GRPO.begin`, held for the whole run): rollouts and the loss
forward both multiply by exactly the tensors the export serves, plus the adapter. ``lora_mode=merged``
(QA-LoRA, nn/lora.py): the training forward is ``fake_quant(W + s*B@A)``; rollouts freeze that once per
step, and the export merges through the same quantizer, so it is exactly the sampled policy.
``format=bf16`` gives the BF16-LoRA arm. With ``method.rl.warmup_steps > 0`` the model is first
fine-tuned on worked solutions (task=arith) before it is quantized; the warmed-up model is the base.

One loop step (``train.max_steps`` of them), in the hooks:

1. ``before_step``: this rank's ``prompts_per_step / world`` prompts (a seeded order over the task's
   pool), G completions each (rl/rollout.py, under AQN noise when enabled); rewards, group advantages
   (a group never spans ranks), dynamic sampling; reference log-probs with the adapters off (beta > 0)
   and old log-probs from a clean forward (num_iterations > 1) or the sampler's own;
2. ``micro_batches`` / ``train_step``: num_iterations x minibatches optimizer steps over the buffered
   completions. Each micro-batch returns its loss numerator times ``gas * world / D`` with ``D`` the
   minibatch's global denominator (all-reduced): after DeepSpeed divides by gas and averages over
   ranks, the update is that of the whole global batch (rl/losses.py). A minibatch whose global
   denominator is 0 (every group dropped) is skipped on every rank;
3. ``record``: rewards, clip fractions, entropies, KL, AQN, all summed over ranks.

Evaluation (start, every ``train.eval_every`` steps, end; clean weights): greedy completions of the
held-out prompts (accuracy, reward, format, entropy along the greedy path), and one sampled completion
each from a fixed seed (pass@1, token entropy). Every rollout draws from generators seeded by the step,
so a resumed run samples what the uninterrupted one would have. ZeRO-3 is refused: rollouts read
every weight on every rank. train.grad_accum is derived (completions per minibatch / train.micro_batch).
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from ... import quantize as Q
from ...exitcodes import BadInputError
from ...nn import adapter as AD
from ...nn import packed_base as PB
from ...nn.noise import AQN
from .. import runtime as R
from ..rl import losses as RL
from ..rl import policy as P
from ..rl.rewards import make_task
from ..rl.rollout import SamplingConfig, generate
from ..rl.warmup import prompt_ids, read_record, save_model_dir, weights_sha256
from .base import Context, Method, Needs, Student, quantized


class GRPO(Method):
    name = "grpo"
    summary = "GRPO on a task's rewards, LoRA on the quantized base, rollouts from the serving weights"
    needs = Needs(rollouts=True)
    options, options_key = RL.RLConfig, "rl"
    quant_start_refusal = "method={name} trains adapters on a frozen base"
    zero3_refusal = "rollouts read every weight on every rank"
    always_exports = True
    summary_keys = ("accuracy", "reward", "format", "pass1_sampled", "entropy")
    plots = {"rl": ("reward", "correct", "format", "entropy", "rollout_entropy", "aqn/sigma", "clip_high",
                    "completion_len", "eval/accuracy", "eval/entropy")}

    # ------------------------------------------------------------------ config
    def validate(self, cfg) -> None:
        super().validate(cfg)
        r = cfg.method.rl
        r.validate()
        if cfg.export.enabled and cfg.export.engine == "llama_cpp" and r.lora_mode == "adapter" \
                and r.export_lora == "adapter":
            # the trained policy is the base plus a PEFT adapter (vllm serve --lora-modules); a GGUF export would
            # ship the base alone, and llama.cpp LoRA adapters are not written
            raise ValueError(f"method={cfg.method.name} with export=llama_cpp and method.rl.export_lora=adapter: the "
                             f"trained policy ships as a LoRA adapter beside the base, and GGUF LoRA adapters are not "
                             f"supported; allowed: export=vllm or export=sglang (base + PEFT adapter), or "
                             f"method.rl.export_lora=merge (one GGUF of the merged policy)")
        if r.base == "packed" and (r.lora_mode != "adapter" or not quantized(cfg)):
            raise ValueError(f"method.rl.base=packed holds a quantized frozen base as its packed bytes; it needs "
                             f"method.rl.lora_mode=adapter and a quantized format (got lora_mode={r.lora_mode!r}, "
                             f"format={cfg.quant.weight_format!r})")
        if r.lora_mode == "merged" and not quantized(cfg):
            raise ValueError("method.rl.lora_mode='merged' merges into the quantizer; with format=bf16 use "
                             "lora_mode=adapter")
        if cfg.quant.lora.rank and r.lora_mode == "adapter":
            raise ValueError("method=grpo|dapo takes its LoRA from method.rl.lora_*; quant.lora.rank must be 0 "
                             "(quant.lora is the merged adapter of method=qad_lora)")

    def preflight(self, cfg, world: int) -> None:
        r, t = cfg.method.rl, cfg.train
        if r.prompts_per_step % world:
            raise ValueError(f"method.rl.prompts_per_step={r.prompts_per_step} does not split over {world} ranks; "
                             f"allowed: a multiple of the world size")
        per_rank = r.prompts_per_step // world * r.group_size
        if per_rank % r.minibatches or (per_rank // r.minibatches) % t.micro_batch:
            raise ValueError(f"method.rl: {per_rank} completions per rank (prompts_per_step / world * group_size) "
                             f"must split into minibatches={r.minibatches} of whole micro-batches (train.micro_batch="
                             f"{t.micro_batch})")

    def teacher(self, cfg) -> Optional[str]:
        return None        # the reward is the signal; the reference policy is the adapter-free base

    # ------------------------------------------------------------------ the student
    def data(self, ctx: Context) -> None:
        """The task's prompts (training pool and held-out), tokenized once; no text samples."""
        r, t = ctx.cfg.method.rl, ctx.cfg.train
        tok = ctx.tokenizer
        self.task = make_task(r.task, r.answer_format, r.task_level, r.n_train, r.n_eval, t.seed, r.format_weight,
                              r.correct_weight)
        self.eos = int(tok.eos_token_id)
        self.pad = int(tok.pad_token_id) if getattr(tok, "pad_token_id", None) is not None else self.eos
        self.train_prompts = prompt_ids(tok, self.task, self.task.train, r.chat_template)
        self.eval_prompts = prompt_ids(tok, self.task, self.task.eval, r.chat_template)
        order_g = torch.Generator().manual_seed(t.seed + 1)
        self.perm = torch.randperm(len(self.train_prompts), generator=order_g).tolist()

    def prepare(self, ctx: Context) -> None:
        """Warm-up (first run only), the quantized base, frozen, and the trainable LoRA."""
        cfg, r, t = ctx.cfg, ctx.cfg.method.rl, ctx.cfg.train
        model = ctx.model
        self.warm: Optional[Dict[str, Any]] = None
        if r.warmup_steps:
            wdir = Path(ctx.run_dir) / "warmup"
            if ctx.resumed:
                # the checkpoint holds the warmed-up weights; the base the adapter names is the run's own folder
                self.warm = read_record(wdir)
                if self.warm is None:
                    raise BadInputError(f"{wdir}: no warm-up record; a resumed run with method.rl.warmup_steps > 0 "
                                        f"reads its warmed-up base from the run's own warmup folder")
            else:
                self.warm = P.warmup(model, ctx.tokenizer, self.task, r, t.seed, ctx.world,
                                     t.progress and ctx.rank == 0)
                self.warm["sha256"] = weights_sha256(model)
                if ctx.rank == 0:
                    save_model_dir(model, ctx.tokenizer, ctx.source_dir, wdir, self.warm)
                    ctx.say(f"warm-up: {self.warm['steps']} steps x {self.warm['batch']} worked solutions, loss "
                            f"{self.warm['loss_first']:.3f} -> {self.warm['loss_last']:.3f} in "
                            f"{self.warm['time_s']:.1f}s; the warmed-up base is {wdir}")
                R.barrier()
            ctx.source_dir = str(wdir)
        if quantized(cfg):
            qcfg = cfg.quant
            if r.lora_mode == "merged":      # the QA-LoRA adapter lives in the quantizer (nn/lora.py)
                qcfg = copy.deepcopy(cfg.quant)
                qcfg.lora.rank, qcfg.lora.alpha, qcfg.lora.targets = r.lora_rank, r.lora_alpha, list(r.lora_targets)
            model = P.quantize_base(model, qcfg, cfg.method, self.train_prompts, ctx.device, not ctx.resumed)
        for p in model.parameters():
            p.requires_grad_(False)
        if r.lora_mode == "adapter":
            AD.attach(model, r.lora_rank, r.lora_alpha, list(r.lora_targets))
        else:
            for m in model.modules():
                if getattr(m, "lora", None) is not None:
                    m.lora.lora_A.requires_grad_(True)
                    m.lora.lora_B.requires_grad_(True)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("method=grpo|dapo: no trainable adapter parameters (check method.rl.lora_targets)")
        ctx.model = model

    def module(self, ctx: Context):
        return P.PolicyLM(ctx.model, ctx.cfg.method.rl)

    def accumulation(self, ctx: Context) -> Tuple[int, int]:
        r, t = ctx.cfg.method.rl, ctx.cfg.train
        per_mb = r.prompts_per_step // ctx.world * r.group_size // r.minibatches
        return per_mb // t.micro_batch, r.num_iterations * r.minibatches

    # ------------------------------------------------------------------ around the steps
    def begin(self, ctx: Context, state: Dict[str, Any]) -> None:
        cfg, r, t = ctx.cfg, ctx.cfg.method.rl, ctx.cfg.train
        self.lm = ctx.engine.module.lm
        self.quantized, self.merged = quantized(cfg), r.lora_mode == "merged"
        self.gas = self.accumulation(ctx)[0]
        self.tokens_total = int(state.get("rl_tokens", 0))
        self.last_tokens = 0
        self.aqn = None
        if r.aqn.enabled:
            a = r.aqn
            self.aqn = AQN(self.lm, t.max_steps, a.sigma_start, a.sigma_end, a.stages, a.indexing, a.resample, a.seed,
                           a.include_final_norm)
        # adapter mode: the base frozen once at the weights the export serves, for the whole run
        frozen = PB.packed_base if r.base == "packed" else AD.serving_weights
        self.frozen = frozen(self.lm) if (self.quantized and r.lora_mode == "adapter") else None
        if self.frozen is not None:
            self.frozen.__enter__()

    def close(self, ctx: Context) -> None:
        if getattr(self, "frozen", None) is not None:
            self.frozen.__exit__(None, None, None)
            self.frozen = None

    def _step_weights(self):
        """Merged mode: fake_quant(W + s*B@A) frozen for the rollout or evaluation (once, not per token)."""
        return AD.serving_weights(self.lm) if (self.quantized and self.merged) else P.Null()

    def before_step(self, ctx: Context) -> None:
        """The rollout of this step and everything its updates read."""
        r, t = ctx.cfg.method.rl, ctx.cfg.train
        rank, world, dev, step, lm = ctx.rank, ctx.world, ctx.device, ctx.step, self.lm
        self.t0 = time.time()
        ppr = r.prompts_per_step // world
        base = step * r.prompts_per_step + rank * ppr
        pidx = [self.perm[(base + k) % len(self.perm)] for k in range(ppr)]
        prompts = [self.train_prompts[i] for i in pidx]
        items = [self.task.train[i] for i in pidx]
        gen = torch.Generator(device=dev).manual_seed(t.seed * 1_000_003 + step * 7919 + rank)
        scfg = SamplingConfig(r.max_new_tokens, r.temperature, r.top_p, list(r.stop))
        self.noise_info: Dict[str, float] = {}
        tr = time.time()
        with self._step_weights():
            with (self.aqn.rollout(step) if self.aqn is not None else P.NullInfo()) as ninfo:
                roll = generate(lm, prompts, self.eos, self.pad, scfg, gen, repeat=r.group_size,
                                tokenizer=ctx.tokenizer)
                self.noise_info = dict(ninfo)
        self.t_roll = time.time() - tr
        scores = [self.task.score(roll.texts[i], items[i // r.group_size], r.max_new_tokens)
                  for i in range(len(roll.texts))]
        rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
        adv = RL.group_advantages(rewards, r.group_size, r.scale_rewards, r.adv_eps)
        keep = RL.keep_mask(rewards, r.group_size, r.dynamic_sampling)
        T = roll.tokens.shape[1]
        mask = RL.completion_mask(roll.lengths, roll.finished, T, r.mask_truncated)
        ids, attn, pos = P.train_batch(roll.prompt_ids, roll.tokens, roll.lengths, self.pad, dev)
        comp, mask_d, adv_d, keep_d = roll.tokens.to(dev), mask.to(dev), adv.to(dev), keep.to(dev)
        per_mb = r.prompts_per_step // world * r.group_size // r.minibatches
        rows_mb = [list(range(i * per_mb, (i + 1) * per_mb)) for i in range(r.minibatches)]
        # the max completion length of Dr.GRPO's denominator is the configured one
        dens = [P.all_sum([RL.denominator(mask[rw], r.loss_norm, r.max_new_tokens, keep[rw])], dev)[0]
                for rw in rows_mb]
        ref = old = None
        micro = [rw[i:i + t.micro_batch] for rw in rows_mb for i in range(0, per_mb, t.micro_batch)]
        module = ctx.engine.module
        with torch.no_grad():
            if r.beta > 0:
                ref = torch.zeros(comp.shape, dtype=torch.float32, device=dev)
                with AD.adapters_disabled(lm) if r.lora_mode == "adapter" else P.lora_off(lm):
                    for mb in micro:
                        ref[mb] = module(ids[mb], attn[mb], pos[mb], comp[mb], mask_d[mb], mode="logp")
            check = r.sampler_check or r.sampler_kl_max > 0 or r.is_correction != "none"
            trainer_old = None
            if r.num_iterations > 1 or check:
                trainer_old = torch.zeros(comp.shape, dtype=torch.float32, device=dev)
                for mb in micro:
                    trainer_old[mb] = module(ids[mb], attn[mb], pos[mb], comp[mb], mask_d[mb], mode="logp")
            # one policy update per rollout: the old policy is the current one, detached in the loss forward
            old = roll.logprobs.to(dev) if r.old_logprobs == "rollout" else \
                (trainer_old if r.num_iterations > 1 else None)
        self.gap, isw = None, None
        if check:
            self.gap = RL.sampler_gap(trainer_old, roll.logprobs.to(dev), mask_d)
            if r.is_correction == "token_truncated":
                isw = RL.is_weights(trainer_old, roll.logprobs.to(dev), r.is_cap)
                self.gap["isw_sum"] = float((isw * mask_d.float()).sum())
            self.check_gap(ctx)
        self.roll, self.scores, self.rewards = roll, scores, rewards
        self.batch = (ids, attn, pos, comp, mask_d, adv_d, keep_d, old, ref, isw)
        self.rows_mb, self.dens, self.per_mb = rows_mb, dens, per_mb
        self.agg: Dict[str, float] = {}
        self.first_ent = [0.0, 0.0]
        self.updates = 0

    def check_gap(self, ctx: Context) -> None:
        """The step's sampler-vs-trainer numbers over every rank, and the bound that stops a run."""
        r, g = ctx.cfg.method.rl, self.gap
        tot = P.all_sum([g["k3_sum"], g["absdiff_sum"], g["tokens"], g.get("isw_sum", 0.0)], ctx.device)
        n = max(tot[2], 1.0)
        rec = {"sampler_kl": tot[0] / n, "sampler_logp_absdiff": tot[1] / n,
               "sampler_logp_absdiff_max": P.all_max(g["absdiff_max"], ctx.device)}
        if r.is_correction != "none":
            rec["is_weight_mean"] = tot[3] / n
        self.gap_record = rec
        if r.sampler_kl_max > 0 and rec["sampler_kl"] > r.sampler_kl_max:
            raise RuntimeError(f"step {ctx.step}: the sampler's policy is {rec['sampler_kl']:.3g} nats/token (k3 KL "
                               f"over {int(tot[2])} tokens) from the policy the trainer scores, above "
                               f"method.rl.sampler_kl_max={r.sampler_kl_max:g}: what is sampled is not what is "
                               f"trained (largest log-prob difference {rec['sampler_logp_absdiff_max']:.3g})")

    def micro_batches(self, ctx: Context) -> Iterator[Dict[str, Any]]:
        r, t = ctx.cfg.method.rl, ctx.cfg.train
        for it in range(r.num_iterations):
            for mi, rw in enumerate(self.rows_mb):
                if self.dens[mi] == 0:
                    continue
                scale = self.gas * ctx.world / self.dens[mi]
                for i in range(0, self.per_mb, t.micro_batch):
                    yield {"rows": rw[i:i + t.micro_batch], "scale": scale, "iteration": it}
                self.updates += 1

    def train_step(self, ctx: Context, b: Dict[str, Any]) -> torch.Tensor:
        ids, attn, pos, comp, mask_d, adv_d, keep_d, old, ref, isw = self.batch
        mb = b["rows"]
        loss, st = ctx.call(ids[mb], attn[mb], pos[mb], comp[mb], mask_d[mb], adv_d[mb],
                            None if old is None else old[mb], None if ref is None else ref[mb], keep_d[mb], b["scale"],
                            isw=None if isw is None else isw[mb])
        st["loss_part"] /= self.gas * ctx.world
        for k, v in st.items():
            self.agg[k] = self.agg.get(k, 0.0) + v
        if b["iteration"] == 0:
            self.first_ent[0] += st["entropy_sum"]
            self.first_ent[1] += st["entropy_tokens"]
        return loss

    def record(self, ctx: Context, loss_sum: torch.Tensor, micro: int) -> Dict[str, Any]:
        r, dev, roll, rewards, agg = ctx.cfg.method.rl, ctx.device, self.roll, self.rewards, self.agg
        scores = self.scores
        n_tok = roll.n_tokens()
        vals = [float(rewards.sum()), sum(s["correct"] for s in scores), sum(s["format"] for s in scores),
                float(rewards.numel()), float(RL.zero_std_groups(rewards, r.group_size).sum()),
                float(rewards.numel() // r.group_size), float(roll.truncated.sum()), float(n_tok),
                float((roll.entropy * (torch.arange(roll.tokens.shape[1])[None, :] < roll.lengths[:, None])).sum()),
                agg.get("loss_part", 0.0), agg.get("tokens", 0.0), agg.get("ratio_sum", 0.0),
                agg.get("clip_low_sum", 0.0), agg.get("clip_high_sum", 0.0), agg.get("kl_sum", 0.0),
                self.first_ent[0], self.first_ent[1]]
        tot = P.all_sum(vals, dev)
        t_roll = P.all_max(self.t_roll, dev)
        self.last_tokens = int(tot[7])
        self.tokens_total += self.last_tokens
        n = max(tot[3], 1.0)
        rec = {"reward": tot[0] / n, "correct": tot[1] / n, "format": tot[2] / n,
               "frac_zero_std": tot[4] / max(tot[5], 1.0), "truncated": tot[6] / n,
               "completion_len": tot[7] / n, "rollout_entropy": tot[8] / max(tot[7], 1.0),
               "loss": tot[9] / max(self.updates, 1), "entropy": tot[15] / max(tot[16], 1.0),
               "ratio_mean": tot[11] / max(tot[10], 1.0), "clip_low": tot[12] / max(tot[10], 1.0),
               "clip_high": tot[13] / max(tot[10], 1.0), "updates": self.updates,
               "lr": float(ctx.engine.get_lr()[0]), "rollout_ms": t_roll * 1000.0,
               "rollout_tokens_per_s": tot[7] / max(t_roll, 1e-9)}
        if r.beta > 0:
            rec["kl"] = tot[14] / max(tot[10], 1.0)
        for k, v in self.noise_info.items():
            rec[f"aqn/{k}"] = v
        if self.gap is not None:
            rec.update(self.gap_record)
        self.roll = self.batch = None       # the step's buffers go before the next rollout
        return rec

    def tokens_per_step(self, ctx: Context) -> int:
        return self.last_tokens

    def tokens(self, ctx: Context) -> int:
        return self.tokens_total

    def progress(self, ctx: Context, rec: Dict[str, Any]) -> Dict[str, Any]:
        return {"reward": rec["reward"], "correct": rec["correct"], "ent": rec["entropy"],
                "tok_s": int(rec["rollout_tokens_per_s"])}

    def evaluate(self, ctx: Context) -> Optional[Dict[str, Any]]:
        r, t = ctx.cfg.method.rl, ctx.cfg.train
        if not r.n_eval:
            return None
        with self._step_weights():
            return P.evaluate(self.lm, ctx.tokenizer, self.task, self.eval_prompts, r, ctx.rank, ctx.world,
                              ctx.device, t.seed + 17, self.eos, self.pad)

    def state(self) -> Dict[str, Any]:
        return {"rl_tokens": self.tokens_total}

    # ------------------------------------------------------------------ the end
    def export(self, ctx: Context) -> Student:
        """Rank 0: the adapter (PEFT folder) or the QA-LoRA student, and, when the run exports, what it
        ships. export_lora=merge first merges the adapter into the quantized base and reports how far
        that moves the trained policy."""
        cfg, r, lm = ctx.cfg, ctx.cfg.method.rl, self.lm
        self.out: Dict[str, Any] = {}
        out = self.out
        student = Student(model=lm)
        if r.lora_mode == "adapter":
            out["adapter_dir"] = AD.save_peft_adapter(lm, str(Path(ctx.run_dir) / "adapter"),
                                                      base_model=ctx.source_dir)
            # the adapter as trained, held apart from the file: the face's gate compares the folder with it
            student.adapter = {"dir": out["adapter_dir"], "rank": r.lora_rank, "alpha": r.lora_alpha,
                               "modules": {n: (a.lora_A.detach().cpu().clone(), a.lora_B.detach().cpu().clone())
                                           for n, a in AD.adapters(lm).items()},
                               "linears": [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)
                                           or hasattr(m, "in_features") and hasattr(m, "weight")]}
        elif cfg.train.save_student:
            Q.save_student(lm, str(Path(ctx.run_dir) / "student"), source_dir=ctx.source_dir)
            student.student_dir = str(Path(ctx.run_dir) / "student")
        if not cfg.export.enabled:
            return student
        if r.lora_mode == "adapter" and r.export_lora == "merge":
            # the trained policy (frozen base + side adapter) vs what the merged export computes
            probe = self.eval_prompts[:8] or [[self.pad]]
            before, am = P.policy_logits(lm, probe, self.pad, ctx.device, self.quantized)
            AD.merge_into_quant(lm)
            after, _ = P.policy_logits(lm, probe, self.pad, ctx.device, self.quantized)
            kl = ((before.exp() * (before - after)).sum(-1) * am).sum() / am.sum()
            top1 = ((before.argmax(-1) == after.argmax(-1)) & am).sum() / am.sum()
            out["merge_kl_to_trained"] = float(kl)
            out["merge_top1_agreement"] = float(top1)
            ctx.say(f"export_lora=merge ships Q(W + s*B@A), not the trained frozen-base + adapter policy: "
                    f"KL {float(kl):.3g}, top-1 agreement {float(top1):.3f} on {len(probe)} held-out prompts")
        student.converted = Q.convert(lm)
        if ctx.source_dir and student.converted.source_dir is None:
            student.converted.source_dir = ctx.source_dir
        out["export_lora"] = r.export_lora if r.lora_mode == "adapter" else "merged"
        return student

    def summary_entries(self, ctx: Context) -> Dict[str, Any]:
        out = dict(getattr(self, "out", {}) or {})
        if self.warm is not None:
            out["warmup"] = self.warm
        return out
