"""The training loop under DeepSpeed: :func:`run`, from a RunConfig to a run dir and a Student.

    run_dir/config.yaml        the resolved config
    run_dir/metrics.jsonl      one line per logged step and per evaluation (tb/ too when installed)
    run_dir/checkpoints/       step-N directories (see checkpoint.py), last keep_last kept
    run_dir/teacher_cache/     cached-teacher runs: top-k log-probabilities (train/ and eval/)
    run_dir/plots/*.png        curves; run_dir/summary.json + printed summary at the end
    run_dir/student/           quantize.save_student (train.save_student), input of `qatfactory export`

The loop owns distributed init, the DeepSpeed engine, data order, the optimizer and LR schedule,
logging, evaluation, checkpoints and resume; the method (train/methods/, picked by method.name)
says what it needs, prepares the student, gives the loss of each micro-batch and what it exports.
The run returns the student (``summary["student"]``, a methods.Student); the face ships it
(``qatfactory.ship``: export + the parity gate into run_dir/export-<engine>/ when export.enabled).

Launch: ``qatfactory train k=v ...`` / ``python -m qatfactory.train k=v ...`` (one process; the env
vars DeepSpeed expects are set here) or ``deepspeed --num_gpus N -m qatfactory.train k=v ...``.
Every rank reads the same data and takes its slice of each global micro-batch (data.py).

Order of work: distributed init -> tokenizer, data -> student (and teacher copy) -> Method.prepare
(quantize.prepare, calibrate) -> teacher -> deepspeed.initialize -> [resume] -> Method.begin -> eval at
start -> train/eval/save -> Method.end, final eval, checkpoint, summary, plots -> Method.export.
``ptq`` (needs.trains False) stops after the first evaluation.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from .. import _fsutil, assets
from .. import quantize as Q
from .._inputs import check_model_config
from ..distill.losses import LiveTeacherOut, TopKTeacherOut, lm_metrics
from ..distill.teachers import (
    CachedTeacher,
    LiveTeacher,
    head_weight,
    precompute_topk,
    split_causal_lm,
    weights_sha256,
)
from ..exitcodes import CorruptFileError, UsageError
from . import checkpoint as ckpt
from . import levers, rundir, runlock
from .config import NO_QUANT, RunConfig, to_dict, validate
from .data import Order, load_data, load_tokenizer, rank_batch
from .methods import Context, Method, Student, get_method
from .runlog import RunLogger, memory_gb, plot_curves, summary_text
from .stream_export import cpu_student

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# ----------------------------------------------------------------------------- distributed
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(addr: str, port: Optional[str]) -> bool:
    try:
        with socket.socket() as s:
            s.bind((addr, int(port)))
        return False
    except (OSError, TypeError, ValueError):
        return True


def init_distributed(device: str) -> None:
    """Join the launcher's process group, or make a one-process group when run without one.

    Without RANK/WORLD_SIZE DeepSpeed falls back to MPI discovery (and dies without mpi4py), so
    a plain ``python -m qatfactory.train`` sets them itself. The shm comm op is switched off first:
    on CPU it would otherwise be JIT-compiled (minutes) before the first collective."""
    import deepspeed.ops  # noqa: PLC0415 (optional: deepspeed)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    if torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    elif os.environ["WORLD_SIZE"] == "1" and \
            _port_in_use(os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT")):
        # a one-process group whose port is taken: the variables were inherited from a parent that ran a
        # trainer in its own process (its store still listens there), not set by a launcher for this process
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
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
def tiny_config(t):
    """(model class, transformers config) of a random model (config.TinyModelConfig): a Llama, or a
    Qwen3-MoE whose every layer is a sparse MoE block (fused 3-D experts; transformers picks its
    grouped_mm experts implementation, which the W4A4 expert quantizers need: nn/experts.py)."""
    import transformers as T  # noqa: PLC0415 (heavy: transformers)
    common = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
                  num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                  tie_word_embeddings=t.tie_word_embeddings, max_position_embeddings=t.max_position_embeddings,
                  initializer_range=t.initializer_range, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    if t.arch == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(intermediate_size=t.intermediate_size, **common)
    if t.arch == "qwen3_moe":
        hd = t.head_dim if t.head_dim is not None else t.hidden_size // t.num_attention_heads
        # no dense layers (mlp_only_layers, decoder_sparse_step 1), so intermediate_size is unused
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            head_dim=hd, num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
            moe_intermediate_size=t.moe_intermediate_size, norm_topk_prob=t.norm_topk_prob, decoder_sparse_step=1,
            mlp_only_layers=[], intermediate_size=t.moe_intermediate_size, **common)
    raise ValueError(f"model.tiny.arch={t.arch!r}; allowed: ['llama', 'qwen3_moe']")


def build_model(cfg: RunConfig, device: Optional[torch.device] = None):
    """(model, tokenizer, source_dir) of cfg.model, in model.dtype. A random-init model is built
    directly on ``device`` when that is a GPU (seconds instead of a minute of CPU init for 1B)."""
    m = cfg.model
    dtype = _DTYPES[m.dtype]
    path = m.path
    if path is None and m.asset:
        path = str(assets.prepare_model_dir(m.asset))
    if path is None:
        cls, hf = tiny_config(m.tiny)
        on_gpu = device is not None and device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if on_gpu else []):
            torch.manual_seed(m.init_seed)
            with torch.device(device if on_gpu else "cpu"):
                model = cls(hf)
        return model.to(dtype), load_tokenizer(m.tokenizer), None
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.path={path!r} is not a directory (a local Hugging Face model dir)")
    # config.json read with limits and held against the tensors' headers before a model of its sizes
    # is allocated; the tokenizer before any weight, so a vocabulary it overflows costs nothing
    hf_cfg = check_model_config(path)
    tok = load_tokenizer(m.tokenizer or path)
    check_vocab(tok, int(hf_cfg.get("vocab_size") or 0), "model.tokenizer" if m.tokenizer else None,
                f"{path}/config.json")
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)   # never trust_remote_code
    return model, tok, str(path)


def check_vocab(tok, vocab: int, given: Optional[str], where: str) -> None:
    """The tokenizer's ids must fit the model's vocabulary (a larger id indexes past the embedding).
    ``given``: the setting that chose the tokenizer (a bad setting, exit 3), else the model folder's own
    tokenizer (a bad input folder, exit 4)."""
    n = len(tok) if hasattr(tok, "__len__") else int(getattr(tok, "vocab_size", 0) or 0)
    if vocab and n > vocab:
        msg = (f"{where}: vocab_size = {vocab}, smaller than the tokenizer's {n} tokens; allowed: a vocabulary "
               f">= {n} (ids past it index outside the embedding)")
        raise (UsageError(f"{given}: {msg}") if given else CorruptFileError(msg))


def load_teacher_model(cfg: RunConfig, student_init: nn.Module) -> nn.Module:
    if cfg.method.teacher_path:
        check_model_config(cfg.method.teacher_path)
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
        return AutoModelForCausalLM.from_pretrained(cfg.method.teacher_path, dtype=_DTYPES[cfg.model.dtype])
    return student_init


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

    def head_param(self):
        return head_weight(self._head)

    def shifted(self, input_ids, attn, mask, teacher=None):
        """(hidden [B, T-1, H] or logits when the head is not a plain linear, head weight or None,
        next-token labels, the mask of counted targets, the teacher's outputs at the same positions)."""
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
        return h, w, labels, m, teacher

    def forward(self, input_ids, attn, mask, teacher=None, metrics: bool = False):
        if metrics:
            h, w, labels, m, t = self.shifted(input_ids, attn, mask, teacher)
            s = lm_metrics(h, w, labels, m, t, self.loss_cfg.chunk_tokens, vocab_chunk=self.loss_cfg.vocab_chunk)
            return torch.tensor([s["tokens"], s["kl_sum"], s["ce_sum"], s["agree_sum"]], dtype=torch.float64,
                                device=input_ids.device)
        method = self._method if self._method is not None else Method()
        return method.loss(self, input_ids, attn, mask, teacher)


def lr_lambda(tcfg, restart: Tuple[int, float] = (0, 1.0)):
    """LR factor per optimizer step: warmup, then constant or cosine to min_lr_ratio. ``restart``
    (step s0, factor r; Method.lr_restart): the schedule runs over the first s0 steps, then starts
    again over the rest, scaled by r (ParetoQ's quant_start: r = quant_lr / lr)."""
    warm, total, floor = int(tcfg.warmup_steps), int(tcfg.max_steps), float(tcfg.min_lr_ratio)
    s0, ratio = int(restart[0]), float(restart[1])

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
    # DeepSpeed's throughput timer syncs the device twice a step (off unless train.ds_timers)
    d.update(levers.ds_config(t))
    if t.grad_accum_dtype is not None:
        # bf16 weights with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer (ZeRO-1 and up)
        d["data_types"] = {"grad_accum_dtype": t.grad_accum_dtype}
        d["bf16"]["immediate_grad_update"] = bool(t.immediate_grad_update)
    if with_optimizer and t.optimizer == "adamw_fused":
        if device != "cuda":
            raise ValueError("train.optimizer='adamw_fused' needs CUDA (it JIT-builds FusedAdam); "
                             "allowed on CPU: adamw_torch")
        d["optimizer"] = {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas),
                                                      "weight_decay": t.weight_decay}}
    return d


def _base_optimizer(engine):
    base = engine.optimizer
    while base is not None and not isinstance(base, torch.optim.Optimizer) \
            and getattr(base, "optimizer", None) is not None:
        base = base.optimizer
    return base if isinstance(base, torch.optim.Optimizer) else None


def _optimizer_stepped(engine) -> bool:
    """Whether the optimizer has already taken a step before any training step (DeepSpeed's ZeRO-0
    bf16/fp16 wrappers take one with zero gradients when they are built; ZeRO-1/2/3 do not)."""
    base = _base_optimizer(engine)
    if base is None:
        return False
    for st in base.state.values():
        step = st.get("step") if isinstance(st, dict) else None
        if step is not None and float(step) > 0:
            return True
    return False


def reset_optimizer(engine, lv: levers.Levers) -> None:
    """The optimizer's fp32 masters re-read from the module (after something wrote the weights,
    e.g. a calibration) and its state cleared: the next step is a fresh AdamW's first."""
    opt = engine.optimizer
    if opt is not None:
        if hasattr(opt, "refresh_fp32_params"):      # DeepSpeed's ZeRO-1/2 and bf16 wrappers
            opt.refresh_fp32_params()
        base = _base_optimizer(engine)
        if base is not None:
            base.state.clear()
    lv.weights_changed()


# ----------------------------------------------------------------------------- the run
class _Teacher:
    """Uniform access to a live or cached teacher for train and eval samples."""

    def __init__(self, live: Optional[LiveTeacher] = None, train_cache=None, eval_cache=None):
        self.live, self.caches = live, {"train": train_cache, "eval": eval_cache}

    @property
    def has_eval(self) -> bool:
        """Whether evaluations see the teacher (KL, top-1 agreement)."""
        return self.live is not None or self.caches["eval"] is not None

    def batch(self, split: str, batch: Dict[str, torch.Tensor], device):
        if self.live is not None:
            return self.live.outputs(batch["input_ids"].to(device), batch["attn"].to(device))
        t = self.caches[split].get(batch["sample_ids"])
        return contextlib.nullcontext(TopKTeacherOut(t.logprobs.to(device), t.indices.to(device)))


def evaluate(model, samples, teacher, n: int, micro_batch: int, rank: int, world: int, device) -> Dict[str, float]:
    """KL to the teacher, CE, perplexity and top-1 agreement over the first ``n`` held-out samples
    (all ranks). ``model``: a StudentLM, or the DeepSpeed engine wrapping one; ``teacher``: an
    object with ``batch(split, batch, device)`` (a context manager of the teacher's outputs) and
    ``has_eval``, or None."""
    mb = micro_batch
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
            b = samples.select(idx)
            with teacher.batch("eval", b, device) if teacher is not None else contextlib.nullcontext() as t:
                s = model(b["input_ids"].to(device), b["attn"].to(device), b["mask"].to(device), t, metrics=True)
            if real:
                sums += s.cpu()
    if was_training:
        model.train()
    if world > 1:
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


def eval_count(cfg: RunConfig, samples) -> int:
    """How many held-out samples an evaluation reads (train.eval_samples; 0: all)."""
    return len(samples) if not cfg.train.eval_samples else min(len(samples), cfg.train.eval_samples)


def run(cfg: RunConfig, eval_only: bool = False) -> Dict[str, Any]:
    """Train (or only calibrate and evaluate, for ptq) as cfg says; returns the summary dict, with
    ``summary["student"]`` (methods.Student: what the face ships) and ``summary["engine"]``.
    ``eval_only``: restore cfg.resume and evaluate it, no training. A method with a loop of its
    own (Method.own_loop: RL, scale adapters) runs that instead."""
    cfg = validate(cfg)
    method = get_method(cfg.method.name)
    if method.own_loop is not None:
        if cfg.quant.kquant_refresh_every != 1:
            raise ValueError(f"quant.kquant_refresh_every={cfg.quant.kquant_refresh_every}: method={cfg.method.name} "
                             f"runs a loop of its own, which does not keep k-quant scales between searches; "
                             f"allowed: 1 for this method")
        with runlock.held():        # the run directory stays locked to this process until the run ends
            return method.own_loop(cfg, eval_only)
    # the performance levers, from the config alone (train/levers.py): scoped to the run, undone after it
    lv = levers.Levers(cfg, training=method.needs.trains and not eval_only)
    with runlock.held(), lv:
        return _run(cfg, method, eval_only, lv)


def _load_teacher(cfg: RunConfig, kind: Optional[str], teacher_init, train_s, eval_s, run_dir: Path, rank: int,
                  device: str, dev, vocab: int, eval_only: bool) -> Optional[_Teacher]:
    """The teacher the method asked for: live (a frozen copy, ZeRO-3-partitioned like the student),
    or a top-k cache (rank 0 writes it once when missing; the teacher is then dropped)."""
    if kind is None:
        return None
    t, m = cfg.train, cfg.method
    tdtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    tmodel = load_teacher_model(cfg, teacher_init)
    zero3 = ds_config(cfg, device, False) if t.zero_stage == 3 else None
    if kind == "live":
        return _Teacher(LiveTeacher(tmodel, tdtype, dev, zero3_config=zero3))
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
        _barrier()
    del tmodel

    def expect(s):
        return {"teacher_sha256": tsha, "fingerprint": s.fingerprint(), "k": m.topk, "seq_len": cfg.data.seq_len,
                "logprob_dtype": m.cache_dtype, "temperature": 1.0}
    return _Teacher(None, CachedTeacher(str(cache_root / "train"), expect=expect(train_s)),
                    CachedTeacher(str(cache_root / "eval"), expect=expect(eval_s)))


def _run(cfg: RunConfig, method: Method, eval_only: bool, lv: levers.Levers) -> Dict[str, Any]:
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
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
    # the teacher the method trains from, or one loaded only to report KL and top-1 agreement
    tkind = method.teacher(cfg)
    teacher_init = copy.deepcopy(model) if (tkind and not m.teacher_path) else None

    ctx = Context(cfg=cfg, rank=rank, world=world, device=dev, run_dir=run_dir, model=model, train_data=train_s,
                  eval_data=eval_s, source_dir=source_dir, resumed=resume_from is not None)
    method.prepare(ctx)
    model = ctx.model
    quantized = cfg.quant.weight_format not in NO_QUANT
    lv.install(model)                 # train.lean_act: less activation memory, the same bits
    if t.grad_ckpt:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    teacher = _load_teacher(cfg, tkind, teacher_init, train_s, eval_s, run_dir, rank, device, dev, vocab, eval_only)
    teacher_init = None

    # -- DeepSpeed
    student = StudentLM(model, m.loss, method)
    hw = student.head_param()
    if t.zero_stage == 3:
        if hw is not None:
            deepspeed.zero.register_external_parameter(student, hw)
        if quantized:
            # fused q/k/v (gate/up) share one amax computed from all members' weights
            Q.register_zero3_external_params(model)
    train_now = method.needs.trains and not eval_only
    params = [p for p in student.parameters() if p.requires_grad]
    if train_now and not params:
        raise ValueError(f"method={m.name}: no trainable parameters after quantize.prepare")
    dcfg = ds_config(cfg, device, train_now)
    kw: Dict[str, Any] = {}
    if train_now:
        kw["model_parameters"] = params
        if "optimizer" not in dcfg:
            kw["optimizer"] = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        restart = method.lr_restart(cfg)
        kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t, restart))
    engine, *_ = deepspeed.initialize(model=student, config=dcfg, **kw)
    lv.attach(engine, world)          # train.lean_step, train.lowbit_batch (levers.py)
    if train_now and t.fresh_adam and _optimizer_stepped(engine):
        reset_optimizer(engine, lv)   # the first update is AdamW's step 1 (config.py: fresh_adam)

    position, logger_start = 0, 0
    st: Dict[str, Any] = {}
    if resume_from is not None:
        st = ckpt.load(engine, resume_from, rank)
        lv.weights_changed()
        ctx.step, position, ctx.history = st["step"], st["position"], st.get("eval_history", [])
        logger_start = ctx.step
    history = ctx.history
    # an eval of a checkpoint leaves the run's own logs alone
    log = RunLogger(run_dir, rank == 0 and not eval_only, t.tensorboard, t.progress,
                    t.max_steps if train_now else 0, logger_start)
    if decision.get("restart"):
        log.truncate_after(-1)           # the same run starting over: its old records are redone
    if resume_from is not None:
        log.truncate_after(ctx.step)
        if rank == 0:
            print(f"[qatfactory] resumed from {resume_from} at step {ctx.step}", flush=True)

    def do_eval():
        r = evaluate(engine, eval_s, teacher, eval_count(cfg, eval_s), t.micro_batch, rank, world, dev)
        r["step"] = ctx.step
        r.update(method.eval_tags())
        history.append(r)
        log.log(r)
        return r

    def forward(b, tout):
        lv.forward()
        return engine(b["input_ids"].to(dev), b["attn"].to(dev), b["mask"].to(dev), tout)

    def teacher_outputs(split, b):
        return teacher.batch(split, b, dev) if teacher is not None else contextlib.nullcontext()

    ctx.forward, ctx.evaluate, ctx.teacher_outputs = forward, do_eval, teacher_outputs
    ctx.reset_optimizer = lambda: reset_optimizer(engine, lv)
    method.begin(ctx, st)

    if resume_from is None or eval_only:
        do_eval()
    tokens_per_step = t.micro_batch * world * t.grad_accum * cfg.data.seq_len
    order = Order(len(train_s), t.seed)

    def state():
        d = {"step": ctx.step, "position": position, "eval_history": history, "config": to_dict(cfg),
             "world_size": world}
        d.update(method.state())
        return d

    while train_now and ctx.step < t.max_steps:
        method.before_step(ctx)
        ts = time.time()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        lr_now = float(engine.get_lr()[0])
        # quant.kquant_refresh_every > 1: the k-quant scale search runs on steps 0, K, 2K, ... only;
        # evaluations and exports (outside this block) always run it (nn/kquant_refresh.py)
        with lv.step(ctx.step):
            for _ in range(t.grad_accum):
                b = rank_batch(train_s, order, position, t.micro_batch, rank, world)
                position += t.micro_batch * world
                loss = method.train_step(ctx, b)
                # the chunked loss took its gradients in forward: the teacher (and its gathered
                # lm_head under ZeRO-3) is no longer needed for backward
                engine.backward(loss)
                # the weights change only at the accumulation boundary: the other micro-batches reuse the
                # step's fake-quantized weights (nn/weight_cache.py; torch optimizers also signal it)
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                if boundary:
                    lv.weights_changed()
                loss_sum += loss.detach().double()      # stays on the device: one host sync per step
        ctx.step += 1
        step = ctx.step
        if world > 1:
            torch.distributed.all_reduce(loss_sum)
            loss_sum = loss_sum / world
        loss_sum = loss_sum.cpu()
        loss_v = float(loss_sum) / t.grad_accum
        dt = time.time() - ts
        rec = {"step": step, "loss": loss_v, "lr": lr_now, "step_ms": dt * 1000.0,
               "tokens_per_s": tokens_per_step / max(dt, 1e-9), "mem_gb": memory_gb()}
        lc = m.loss
        if lc.kind == "forward_kl" and lc.ce_weight == 0 and lc.kd_weight == 1 and lc.temperature == 1 \
                and type(method).loss is Method.loss:
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
    step = ctx.step
    if train_now:
        changed = method.end(ctx)
        if changed or not history or history[-1]["step"] != step:
            do_eval()
        if t.save_final:
            ckpt.save(engine, run_dir, step, state(), t.keep_last, rank)
    log.close()

    summary = {"run_dir": str(run_dir), "method": m.name, "format": cfg.quant.name or cfg.quant.weight_format,
               "steps": step, "tokens": step * tokens_per_step, "time_s": time.time() - t0, "world_size": world,
               "eval_first": history[0] if history else None, "eval_last": history[-1] if history else None,
               "eval_history": history}
    handed = Student(model=model)
    if not eval_only:
        # ZeRO-3: the last forward can leave prefetched parameters in flight; release them all
        # before the hand-over gathers the full weights (GatheredParameters refuses in-flight ones)
        engine.empty_partition_cache()
        handed = _hand_over(ctx, method, student, decision.get("export_dir"))
        if handed.student_dir:
            summary["student_dir"] = handed.student_dir
    if rank == 0:
        name = f"eval-step-{step:06d}.json" if eval_only else "summary.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        _fsutil.write_text_atomic(run_dir / name, json.dumps(summary, indent=1, default=str))
        if t.plots and not eval_only:
            plot_curves(run_dir)
        print(summary_text(summary), flush=True)
    summary["student"] = handed
    summary["engine"] = engine
    return summary


def _hand_over(ctx: Context, method: Method, student: StudentLM, export_dir: Optional[str]) -> Student:
    """Method.export on rank 0 with the full weights (every rank joins the ZeRO-3 gather first):
    the student directory, and the converted model when the run asks for an export (the face
    ships it). Nothing happens when the run saves no student and exports nothing."""
    cfg = ctx.cfg
    out = Student(model=ctx.model)
    if not (cfg.train.save_student or cfg.export.enabled):
        return out
    if any(hasattr(p, "ds_id") for p in student.parameters()):
        # ZeRO-3: gathered one layer at a time into a CPU copy on rank 0, never the whole model on a
        # GPU (stream_export.py); every rank joins each gather
        lm, gathered = cpu_student(student.lm, ctx.rank)
        if ctx.rank == 0:
            out = method.export(dataclasses.replace(ctx, model=lm)).request(cfg, ctx.run_dir, export_dir)
            out.gather = gathered
        _barrier()
        return out
    if ctx.rank == 0:
        out = method.export(ctx).request(cfg, ctx.run_dir, export_dir)
    _barrier()
    return out
