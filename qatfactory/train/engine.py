"""The QAT / QAD trainer under DeepSpeed: one function, :func:`run`, from a RunConfig to a run dir.

    run_dir/config.yaml        the resolved config
    run_dir/metrics.jsonl      one line per logged step and per evaluation (tb/ too when installed)
    run_dir/checkpoints/       step-N directories (see checkpoint.py), last keep_last kept
    run_dir/teacher_cache/     cached-teacher runs: top-k log-probabilities (train/ and eval/)
    run_dir/plots/*.png        curves; run_dir/summary.json + printed summary at the end
    run_dir/student/           quantize.save_student (train.save_student), input of `qatfactory export`
    run_dir/export-<engine>/   when export.enabled (then verified with the exporter's own check)

Launch: ``qatfactory train k=v ...`` / ``python -m qatfactory.train k=v ...`` (one process; the env
vars DeepSpeed expects are set here) or ``deepspeed --num_gpus N -m qatfactory.train k=v ...``.
Every rank reads the same data and takes its slice of each global micro-batch (data.py).

Order of work: distributed init -> tokenizer, data -> student (and teacher copy) -> quantize.prepare
-> calibrate -> deepspeed.initialize -> [resume] -> eval at start -> train/eval/save -> final eval,
checkpoint, summary, plots, export. ``ptq`` stops after the first evaluation.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.nn as nn

from ..distill.losses import LiveTeacherOut, TopKTeacherOut, lm_loss, lm_metrics
from ..nn import step_cache
from ..distill.teachers import (CachedTeacher, LiveTeacher, head_weight, precompute_topk, split_causal_lm)
from . import checkpoint as ckpt
from . import rundir
from .config import NO_QUANT, RunConfig, to_dict, validate
from .data import Order, load_data, load_tokenizer, rank_batch
from .runlog import RunLogger, memory_gb, plot_curves, summary_text

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# ----------------------------------------------------------------------------- distributed
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str) -> None:
    """Join the launcher's process group, or make a one-process group when run without one.

    Without RANK/WORLD_SIZE DeepSpeed falls back to MPI discovery (and dies without mpi4py), so
    a plain ``python -m qatfactory.train`` sets them itself. The shm comm op is switched off first:
    on CPU it would otherwise be JIT-compiled (minutes) before the first collective."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import deepspeed
    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", auto_mpi_discovery=False)


def _rank_world():
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _resolve_device(d: str) -> str:
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA device is visible; use train.device=cpu")
    return d


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- model
def build_model(cfg: RunConfig, device: Optional[torch.device] = None):
    """(model, tokenizer, source_dir) of cfg.model, in model.dtype. A random-init model is built
    directly on ``device`` when that is a GPU (seconds instead of a minute of CPU init for 1B)."""
    m = cfg.model
    dtype = _DTYPES[m.dtype]
    path = m.path
    if path is None and m.asset:
        from .. import assets
        path = str(assets.prepare_model_dir(m.asset))
    if path is None:
        from transformers import LlamaConfig, LlamaForCausalLM
        t = m.tiny
        hf = LlamaConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                         num_key_value_heads=t.num_key_value_heads, tie_word_embeddings=t.tie_word_embeddings,
                         max_position_embeddings=t.max_position_embeddings, bos_token_id=256,
                         initializer_range=t.initializer_range, eos_token_id=257,
                         pad_token_id=258)
        on_gpu = device is not None and device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if on_gpu else []):
            torch.manual_seed(m.init_seed)
            with torch.device(device if on_gpu else "cpu"):
                model = LlamaForCausalLM(hf)
        return model.to(dtype), load_tokenizer(m.tokenizer), None
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.path={path!r} is not a directory (a local Hugging Face model dir)")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)   # never trust_remote_code
    return model, load_tokenizer(m.tokenizer or path), str(path)


def load_teacher_model(cfg: RunConfig, student_init: nn.Module) -> nn.Module:
    if cfg.method.teacher_path:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(cfg.method.teacher_path, dtype=_DTYPES[cfg.model.dtype])
    return student_init


def quantize_api():
    try:
        from .. import quantize as Q
        Q.prepare, Q.calibrate  # noqa: B018
    except (ImportError, AttributeError) as e:
        raise ImportError(f"qatfactory.quantize.prepare/calibrate are not available ({e}); "
                          f"train with format=bf16 meanwhile") from None
    return Q


class StudentLM(nn.Module):
    """The module DeepSpeed wraps: forward runs the backbone and the chunked loss (or eval sums)."""

    def __init__(self, lm: nn.Module, loss_cfg):
        super().__init__()
        self.lm = lm
        self.loss_cfg = loss_cfg
        backbone, head = split_causal_lm(lm)
        # kept outside the module tree: they are already registered under self.lm
        object.__setattr__(self, "_backbone", backbone)
        object.__setattr__(self, "_head", head)

    def head_param(self):
        return head_weight(self._head)

    def forward(self, input_ids, attn, mask, teacher=None, metrics: bool = False):
        out = self._backbone(input_ids=input_ids, attention_mask=attn, use_cache=False)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        w = head_weight(self._head)
        if w is None:                       # a quantized / biased head: its own forward, then the loss on logits
            h = self._head(h)
        h = h[:, :-1]
        labels = input_ids[:, 1:]
        m = mask[:, 1:] & attn[:, 1:].bool()
        if isinstance(teacher, TopKTeacherOut):
            teacher = TopKTeacherOut(teacher.logprobs[:, :-1], teacher.indices[:, :-1])
        elif teacher is not None:
            teacher = LiveTeacherOut(teacher.hidden[:, :-1], teacher.weight)
        if metrics:
            s = lm_metrics(h, w, labels, m, teacher, self.loss_cfg.chunk_tokens, vocab_chunk=self.loss_cfg.vocab_chunk)
            return torch.tensor([s["tokens"], s["kl_sum"], s["ce_sum"], s["agree_sum"]], dtype=torch.float64,
                                device=input_ids.device)
        return lm_loss(h, w, labels, m, teacher if self.loss_cfg.needs_teacher else None, self.loss_cfg)


def lr_lambda(tcfg):
    """LR factor per optimizer step. With train.quant_start (issue 19) the schedule runs over the
    full-precision steps, then restarts over the quantized ones, scaled by quant_lr / lr."""
    warm, total, floor = int(tcfg.warmup_steps), int(tcfg.max_steps), float(tcfg.min_lr_ratio)
    s0 = quant_switch_step(tcfg)
    ratio = float(tcfg.quant_lr or tcfg.lr) / float(tcfg.lr)

    def sched(step: int, length: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if tcfg.schedule == "constant":
            return 1.0
        prog = min(1.0, (step - warm) / max(1, length - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * prog))

    def f(step: int) -> float:
        if step < s0:
            return sched(step, s0)
        return ratio * sched(step - s0, total - s0)
    return f


# ----------------------------------------------------------------------------- issue 19: quant_start
# ParetoQ's schedule, in these helpers and the marked lines of _run until issue 15 moves it behind
# the method seam: quantizers off for the first quant_switch_step() steps, then the switch.
def quant_switch_step(tcfg) -> int:
    """Optimizer steps trained with quantization off (round(quant_start * max_steps))."""
    return int(round(float(getattr(tcfg, "quant_start", 0.0) or 0.0) * int(tcfg.max_steps)))


def switch_quantization_on(engine, model, calib, method: str) -> None:
    """Quantizers on, scales calibrated from the weights trained so far, the optimizer's fp32 masters
    re-read from the module (calibration wrote the scales there) and its state cleared (a fresh
    AdamW, as ParetoQ's QAT starts from a full-precision checkpoint)."""
    Q = quantize_api()
    Q.set_quantization(model, True)
    Q.calibrate(model, calib, method)
    opt = engine.optimizer
    if opt is not None:
        if hasattr(opt, "refresh_fp32_params"):      # DeepSpeed's ZeRO-1/2 and bf16 wrappers
            opt.refresh_fp32_params()
        base = opt
        while not isinstance(base, torch.optim.Optimizer) and getattr(base, "optimizer", None) is not None:
            base = base.optimizer
        if isinstance(base, torch.optim.Optimizer):
            base.state.clear()
    step_cache.weights_changed()


def ds_config(cfg: RunConfig, device: str, with_optimizer: bool) -> Dict[str, Any]:
    t = cfg.train
    d: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.clip if t.clip > 0 else 0.0,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if t.zero_stage == 3:
        d["zero_optimization"].update({"stage3_gather_16bit_weights_on_model_save": False})
    if with_optimizer and t.optimizer == "adamw_fused":
        if device != "cuda":
            raise ValueError("train.optimizer='adamw_fused' needs CUDA (it JIT-builds FusedAdam); "
                             "allowed on CPU: adamw_torch")
        d["optimizer"] = {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas),
                                                      "weight_decay": t.weight_decay}}
    return d


# ----------------------------------------------------------------------------- the run
class _Teacher:
    """Uniform access to a live or cached teacher for train and eval samples."""

    def __init__(self, live: Optional[LiveTeacher] = None, train_cache=None, eval_cache=None):
        self.live, self.caches = live, {"train": train_cache, "eval": eval_cache}

    def batch(self, split: str, batch: Dict[str, torch.Tensor], device):
        import contextlib
        if self.live is not None:
            return self.live.outputs(batch["input_ids"].to(device), batch["attn"].to(device))
        t = self.caches[split].get(batch["sample_ids"])
        return contextlib.nullcontext(TopKTeacherOut(t.logprobs.to(device), t.indices.to(device)))


def evaluate(engine, samples, teacher: _Teacher, cfg: RunConfig, rank: int, world: int, device) -> Dict[str, float]:
    """KL to the teacher, CE, perplexity and top-1 agreement on the held-out samples (all ranks)."""
    n = len(samples) if not cfg.train.eval_samples else min(len(samples), cfg.train.eval_samples)
    mb = cfg.train.micro_batch
    sums = torch.zeros(4, dtype=torch.float64)
    was_training = engine.module.training
    engine.eval()
    with torch.no_grad():
        # every rank runs the same number of forwards (ZeRO-3 gathers are collective)
        per_rank = math.ceil(math.ceil(n / world) / mb)
        for i in range(per_rank):
            lo = (i * world + rank) * mb
            idx = list(range(lo, min(lo + mb, n)))
            real = bool(idx)
            if not real:
                idx = [0]
            b = samples.select(idx)
            with teacher.batch("eval", b, device) if teacher is not None else _null() as t:
                s = engine(b["input_ids"].to(device), b["attn"].to(device), b["mask"].to(device), t, metrics=True)
            if real:
                sums += s.cpu()
    if was_training:
        engine.train()
    if world > 1:
        st = sums.to(device)
        torch.distributed.all_reduce(st)
        sums = st.cpu()
    tok = max(float(sums[0]), 1.0)
    out = {"eval/tokens": float(sums[0]), "eval/ce": float(sums[2]) / tok}
    out["eval/ppl"] = math.exp(min(out["eval/ce"], 50.0))
    if teacher is not None and (teacher.live is not None or teacher.caches["eval"] is not None):
        out["eval/kl"] = float(sums[1]) / tok
        out["eval/top1"] = float(sums[3]) / tok
    return out


def run(cfg: RunConfig, eval_only: bool = False) -> Dict[str, Any]:
    """Train (or only calibrate and evaluate, for ptq) as cfg says; returns the summary dict.
    ``eval_only``: restore cfg.resume and evaluate it, no training."""
    # --- issue 20 (RL): method=grpo|dapo run their own loop (train/rl_loop.py) until the Method seam
    if cfg.method.name in ("grpo", "dapo"):
        from .rl_loop import run as run_rl
        return run_rl(cfg, eval_only)
    # --- end issue 20
    # --- issue 18 (scale adapters): method=scale_adapter runs its own loop (train/scale_loop.py) until the seam
    if cfg.method.name == "scale_adapter":
        from .scale_loop import run as run_scale
        return run_scale(cfg, eval_only)
    # --- end issue 18
    # fused-group amax etc. computed once per optimizer step (weights_changed() after each)
    with step_cache.enabled():
        return _run(cfg, eval_only)


def _run(cfg: RunConfig, eval_only: bool) -> Dict[str, Any]:
    import deepspeed
    cfg = validate(cfg)
    t = cfg.train
    device = _resolve_device(t.device)
    init_distributed(device)
    rank, world = _rank_world()
    dev = torch.device(device, int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")
    seed_all(t.seed)
    # which directory, whether it may be written, whether a resume is the same run: all checked
    # before any work (rundir.py); rank 0 writes the run record and config.yaml
    run_dir, resume_from, decision = rundir.prepare(cfg, rank, world, eval_only)
    t0 = time.time()

    # -- data and models
    model, tok, source_dir = build_model(cfg, dev)
    if device == "cuda":
        # calibration and the teacher copy then run on the GPU (DeepSpeed would move it anyway)
        model.to(dev)
    vocab = model.get_output_embeddings().weight.shape[0]
    train_s, eval_s = load_data(cfg.data, tok, vocab, t.seed)
    m = cfg.method
    # qad needs the teacher to train; qat/ptq load it only to report KL and top-1 agreement
    wants_teacher = m.loss.needs_teacher or m.eval_teacher
    teacher_init = copy.deepcopy(model) if (wants_teacher and not m.teacher_path) else None

    quantized = cfg.quant.weight_format not in NO_QUANT
    if quantized:
        Q = quantize_api()
        model = Q.prepare(model, cfg.quant) or model
        if rank == 0:
            tot = Q.coverage(model).totals
            print(f"[qatfactory] quantized {100 * tot['asked_fraction']:.1f}% of the {tot['asked_params']:,} "
                  f"Linear-like parameters asked for ({tot['bits_per_quantized_param']:.3f} bits each)"
                  + ("" if tot["asked_fraction"] >= 1.0 else f"; kept as they are: {tot['not_quantized'][:4]}"),
                  flush=True)
        n = min(m.calib_samples, len(train_s))
        calib = [{"input_ids": b["input_ids"].to(dev), "attention_mask": b["attn"].to(dev)}
                 for b in (train_s.select([i]) for i in range(n))]
        if m.calibrate and resume_from is None:
            Q.calibrate(model, calib, cfg.quant.calib_method)
    if t.grad_ckpt:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    tdtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    teacher = None
    if wants_teacher:
        tmodel = load_teacher_model(cfg, teacher_init)
        zero3 = ds_config(cfg, device, False) if t.zero_stage == 3 else None
        if m.teacher == "cached":
            cache_root = Path(m.teacher_cache or (run_dir / "teacher_cache"))
            for split, s in (("train", train_s), ("eval", eval_s)):
                if eval_only and not (cache_root / split / "meta.json").exists():
                    # an evaluation writes nothing but its own result file
                    raise FileNotFoundError(f"method.teacher=cached: {cache_root / split / 'meta.json'} not found; "
                                            f"evaluate with the run's teacher cache, or method.teacher=live")
                # rank 0 alone decides and writes; every rank passes the barrier either way
                if rank == 0 and not (cache_root / split / "meta.json").exists():
                    lt = LiveTeacher(tmodel, tdtype, dev)
                    precompute_topk(lt, s, str(cache_root / split), m.topk, batch_size=t.micro_batch,
                                    chunk_tokens=m.loss.chunk_tokens, logprob_dtype=m.cache_dtype,
                                    teacher_name=m.teacher_path or cfg.model.name, vocab=vocab)
                _barrier()
            del tmodel
            teacher = _Teacher(None, CachedTeacher(str(cache_root / "train"), train_s.fingerprint(), cfg.data.seq_len),
                               CachedTeacher(str(cache_root / "eval"), eval_s.fingerprint(), cfg.data.seq_len))
        else:
            teacher = _Teacher(LiveTeacher(tmodel, tdtype, dev, zero3_config=zero3))
    teacher_init = None

    # -- DeepSpeed
    student = StudentLM(model, m.loss)
    hw = student.head_param()
    if t.zero_stage == 3:
        if hw is not None:
            deepspeed.zero.register_external_parameter(student, hw)
        if quantized:
            # fused q/k/v (gate/up) share one amax computed from all members' weights
            quantize_api().register_zero3_external_params(model)
    train_now = m.name != "ptq" and not eval_only
    params = [p for p in student.parameters() if p.requires_grad]
    if train_now and not params:
        raise ValueError(f"method={m.name}: no trainable parameters after quantize.prepare")
    dcfg = ds_config(cfg, device, train_now)
    kw: Dict[str, Any] = {}
    if train_now:
        kw["model_parameters"] = params
        if "optimizer" not in dcfg:
            kw["optimizer"] = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))
    engine, *_ = deepspeed.initialize(model=student, config=dcfg, **kw)
    step_cache.weights_changed()     # DeepSpeed may have cast / moved / partitioned the weights

    step, position, history = 0, 0, []
    logger_start = 0
    st: Dict[str, Any] = {}
    if resume_from is not None:
        st = ckpt.load(engine, resume_from, rank)
        step_cache.weights_changed()
        step, position, history = st["step"], st["position"], st.get("eval_history", [])
        logger_start = step
    # issue 19: quantization off until step s0 (train.quant_start); a checkpoint says which side it is on
    s0 = quant_switch_step(t) if quantized else 0
    quant_on = True
    if s0 > 0:
        quant_on = bool(st.get("quant_on", step > s0))
        quantize_api().set_quantization(model, quant_on)
    # an eval of a checkpoint leaves the run's own logs alone
    log = RunLogger(run_dir, rank == 0 and not eval_only, t.tensorboard, t.progress,
                    t.max_steps if train_now else 0, logger_start)
    if decision.get("restart"):
        log.truncate_after(-1)           # the same run starting over: its old records are redone
    if resume_from is not None:
        log.truncate_after(step)
        if rank == 0:
            print(f"[qatfactory] resumed from {resume_from} at step {step}", flush=True)

    def do_eval():
        r = evaluate(engine, eval_s, teacher, cfg, rank, world, dev)
        r["step"] = step
        if s0 > 0:
            r["quant_on"] = quant_on
        history.append(r)
        log.log(r)
        return r

    if resume_from is None or eval_only:
        do_eval()
    tokens_per_step = t.micro_batch * world * t.grad_accum * cfg.data.seq_len
    order = Order(len(train_s), t.seed)

    def state():
        d = {"step": step, "position": position, "eval_history": history, "config": to_dict(cfg),
             "world_size": world}
        if s0 > 0:
            d["quant_on"] = quant_on
        return d

    def quant_switch():            # issue 19: the full-precision model's eval, then quantization on
        nonlocal quant_on
        if not history or history[-1]["step"] != step:
            do_eval()
        switch_quantization_on(engine, model, calib, cfg.quant.calib_method if m.calibrate else "max")
        quant_on = True
        if rank == 0:
            print(f"[qatfactory] step {step}: quantization on ({cfg.quant.weight_format}), scales calibrated, "
                  f"LR schedule restarted", flush=True)

    while train_now and step < t.max_steps:
        if not quant_on and step >= s0:
            quant_switch()
        ts = time.time()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        lr_now = float(engine.get_lr()[0])
        for _ in range(t.grad_accum):
            b = rank_batch(train_s, order, position, t.micro_batch, rank, world)
            position += t.micro_batch * world
            with teacher.batch("train", b, dev) if teacher is not None else _null() as tout:
                loss = engine(b["input_ids"].to(dev), b["attn"].to(dev), b["mask"].to(dev), tout)
            # the chunked loss took its gradients in forward: the teacher (and its gathered
            # lm_head under ZeRO-3) is no longer needed for backward
            engine.backward(loss)
            engine.step()
            step_cache.weights_changed()
            loss_sum += loss.detach().double()      # stays on the device: one host sync per step
        step += 1
        if world > 1:
            torch.distributed.all_reduce(loss_sum)
            loss_sum = loss_sum / world
        loss_sum = loss_sum.cpu()
        loss_v = float(loss_sum) / t.grad_accum
        dt = time.time() - ts
        rec = {"step": step, "loss": loss_v, "lr": lr_now, "step_ms": dt * 1000.0,
               "tokens_per_s": tokens_per_step / max(dt, 1e-9), "mem_gb": memory_gb()}
        lc = m.loss
        if lc.kind == "forward_kl" and lc.ce_weight == 0 and lc.kd_weight == 1 and lc.temperature == 1:
            rec["kl"] = loss_v       # the loss is then exactly the mean KL(teacher || student)
        if step % t.log_every == 0 or step == t.max_steps:
            log.log(rec)
        post = {"loss": loss_v}
        if "kl" in rec:
            post["kl"] = rec["kl"]
        elif history and "eval/kl" in history[-1]:
            post["eval_kl"] = history[-1]["eval/kl"]
        log.progress(1, **post, lr=rec["lr"], tok_s=int(rec["tokens_per_s"]), mem=f"{rec['mem_gb']:.1f}G")
        if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
            do_eval()
        if t.save_every and step % t.save_every == 0 and step != t.max_steps:
            ckpt.save(engine, run_dir, step, state(), t.keep_last, rank)
    if train_now:
        if not quant_on:           # quant_start = 1: full precision all along, then PTQ of the result
            quant_switch()
        if not history or history[-1]["step"] != step or history[-1].get("quant_on") is False:
            do_eval()
        if t.save_final:
            ckpt.save(engine, run_dir, step, state(), t.keep_last, rank)
    log.close()

    summary = {"run_dir": str(run_dir), "method": m.name, "format": cfg.quant.name or cfg.quant.weight_format,
               "steps": step, "tokens": step * tokens_per_step, "time_s": time.time() - t0, "world_size": world,
               "eval_first": history[0] if history else None, "eval_last": history[-1] if history else None,
               "eval_history": history}
    if not eval_only:
        # ZeRO-3: the last forward can leave prefetched parameters in flight; release them all
        # before _finalize gathers the full weights (GatheredParameters refuses in-flight ones)
        engine.empty_partition_cache()
        summary.update(_finalize(cfg, student, run_dir, rank, source_dir, decision.get("export_dir")))
    if rank == 0:
        name = f"eval-step-{step:06d}.json" if eval_only else "summary.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        from .. import _fsutil
        _fsutil.write_text_atomic(run_dir / name, json.dumps(summary, indent=1, default=str))
        if t.plots and not eval_only:
            plot_curves(run_dir)
        print(summary_text(summary), flush=True)
    summary["engine"] = engine
    return summary


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _finalize(cfg: RunConfig, student: StudentLM, run_dir: Path, rank: int, source_dir,
              export_dir: Optional[str] = None) -> Dict[str, Any]:
    """Save the student (quantize.save_student: weights + quantizer state) and, when export.enabled,
    convert() it and hand it to the exporter, then verify the export. Rank 0 does the writing;
    under ZeRO-3 every rank joins the gathers first, one layer at a time into a CPU copy on rank 0
    (stream_export.py; ``summary["gather"]``). A gate that does not PASS moves the export to
    ``<dir>.FAILED`` with a FAILED.json inside (``summary["verify"]`` says why)."""
    out: Dict[str, Any] = {}
    quantized = cfg.quant.weight_format not in NO_QUANT
    if cfg.export.enabled and not quantized:
        raise ValueError("export.enabled with format=bf16: nothing is quantized; pick a format recipe")
    if not (cfg.train.save_student or cfg.export.enabled):
        return out
    import contextlib
    lm = student.lm
    if any(hasattr(p, "ds_id") for p in student.parameters()):
        # ZeRO-3: gathered one layer at a time into a CPU copy on rank 0, never the whole model
        # on a GPU (issue 23, stream_export.py); every rank joins each gather
        from .stream_export import cpu_student
        lm, out["gather"] = cpu_student(student.lm, rank)
    with contextlib.nullcontext():
        if rank == 0:
            sdir = run_dir / "student"
            if quantized:
                from .. import quantize as Q
                Q.save_student(lm, str(sdir))
            elif cfg.train.save_student:
                from .. import _fsutil
                with _fsutil.atomic_dir(sdir, replace=True, kinds=("student",), what="save_student") as tmp:
                    lm.save_pretrained(str(tmp))   # a plain HF model
                    (tmp / _fsutil.STUDENT_RECORD).write_text(json.dumps({"quant_config": None, "plain": True}))
            out["student_dir"] = str(sdir)
            if cfg.export.enabled:
                from .. import quantize as Q
                try:
                    from ..exporters import export, verify
                except ImportError as e:
                    raise ImportError(f"export.enabled but qatfactory.exporters is not available ({e})") from None
                converted = Q.convert(lm)
                if source_dir and converted.source_dir is None:
                    converted.source_dir = source_dir
                edir = Path(export_dir or cfg.export.out_dir or (run_dir / f"export-{cfg.export.engine}"))
                # force replaces only an empty directory or an earlier export of ours (checked
                # before training too, in rundir.prepare); never a user directory
                r = export(converted, str(edir), engine=cfg.export.engine, flavour=cfg.export.flavour, force=True)
                out["export_dir"] = str(r.path)
                if cfg.export.verify:
                    res = verify(r.path, converted)
                    out["verify"] = gate_summary(res)
                    out["verify_ok"] = out["verify"]["verdict"] == "PASS"
                    if not out["verify_ok"]:
                        out["export_dir"] = str(mark_failed(r.path, out["verify"]))
                        out["verify"]["moved_to"] = out["export_dir"]
    _barrier()
    return out


def gate_summary(res) -> Dict[str, Any]:
    """Verdict and reasons of an exporters.verify result: ``res.verdict`` (PASS / FAIL / INCOMPLETE)
    when the gate has it, else PASS exactly when ``res.ok``."""
    v = getattr(res, "verdict", None)
    v = v if v in ("PASS", "FAIL", "INCOMPLETE") else ("PASS" if bool(res.ok) else "FAIL")
    if v != "PASS" and bool(getattr(res, "ok", False)):
        v = "FAIL"
    checks = list(getattr(res, "checks", []) or [])
    bad = [c for c in checks if str(getattr(c, "status", "")).upper() not in ("OK", "SKIP", "PASS")]
    reasons = [f"{getattr(c, 'tensor', '')}: {getattr(c, 'check', '')}: {getattr(c, 'status', '')}: "
               f"{getattr(c, 'detail', '')}" for c in bad][:10]
    if v != "PASS" and not reasons:
        reasons = [f"{sum(1 for c in checks if str(getattr(c, 'status', '')).upper() == 'SKIP')} required "
                   f"check(s) did not run" if checks else "no check ran"]
    return {"verdict": v, "reasons": reasons, "checks": len(checks)}


def mark_failed(edir: Path, gate: Dict[str, Any]) -> Path:
    """Move a failed export out of the way: ``<dir>.FAILED`` with FAILED.json (verdict, reasons)
    inside, so nothing serves it by its usual path; an earlier ``.FAILED`` of ours is replaced."""
    from .. import _fsutil
    edir = Path(edir)
    failed = edir.with_name(edir.name + ".FAILED")
    _fsutil.write_text_atomic(edir / "FAILED.json", json.dumps(
        {"verdict": gate["verdict"], "reasons": gate["reasons"], "exported_as": str(edir),
         "what": "the parity gate did not PASS on this export; do not serve it (see README, reliability)"},
        indent=1))
    _fsutil.check_replaceable(failed, ("export",), "export.out_dir")
    _fsutil.swap_in(edir, failed)
    return failed
