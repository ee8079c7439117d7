"""The trainer's runtime services, public to every method and benchmark: the process group (init,
rank / world, barrier), the device, seeding, building the model a run names, the DeepSpeed config,
the LR schedule and resetting the optimizer. Nothing here knows a method or the loop (train/loop.py)."""
from __future__ import annotations

import math
import os
import random
import socket
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from .. import assets
from .._inputs import check_model_config
from ..exitcodes import CorruptFileError, UsageError
from . import levers
from .data import load_tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


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


def rank_world():
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def resolve_device(d: str) -> str:
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA device is visible; use train.device=cpu")
    return d


def local_device(device: str) -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK) or the CPU."""
    return torch.device(device, int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")


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


def build_model(cfg, device: Optional[torch.device] = None):
    """(model, tokenizer, source_dir) of cfg.model, in model.dtype. A random-init model is built
    directly on ``device`` when that is a GPU (seconds instead of a minute of CPU init for 1B)."""
    m = cfg.model
    dtype = DTYPES[m.dtype]
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


def load_teacher_model(cfg, student_init: nn.Module) -> nn.Module:
    if cfg.method.teacher_path:
        check_model_config(cfg.method.teacher_path)
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
        return AutoModelForCausalLM.from_pretrained(cfg.method.teacher_path, dtype=DTYPES[cfg.model.dtype])
    return student_init


def lr_lambda(tcfg, restart: Tuple[int, float] = (0, 1.0), total: Optional[int] = None):
    """LR factor per optimizer step: warmup, then constant or cosine to min_lr_ratio. ``restart``
    (step s0, factor r; Method.lr_restart): the schedule runs over the first s0 steps, then starts
    again over the rest, scaled by r (ParetoQ's quant_start: r = quant_lr / lr). ``total``: the optimizer
    steps of the run when they are not train.max_steps (RL: several updates per rollout step)."""
    warm, floor = int(tcfg.warmup_steps), float(tcfg.min_lr_ratio)
    total = int(tcfg.max_steps if total is None else total)
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


def ds_config(cfg, device: str, with_optimizer: bool, grad_accum: Optional[int] = None) -> Dict[str, Any]:
    """DeepSpeed's config for this run; ``grad_accum``: micro-batches per optimizer step when the method
    derives them (RL: completions per minibatch / train.micro_batch) instead of train.grad_accum."""
    t = cfg.train
    d: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum if grad_accum is None else int(grad_accum),
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


def base_optimizer(engine):
    base = engine.optimizer
    while base is not None and not isinstance(base, torch.optim.Optimizer) \
            and getattr(base, "optimizer", None) is not None:
        base = base.optimizer
    return base if isinstance(base, torch.optim.Optimizer) else None


def optimizer_stepped(engine) -> bool:
    """Whether the optimizer has already taken a step before any training step (DeepSpeed's ZeRO-0
    bf16/fp16 wrappers take one with zero gradients when they are built; ZeRO-1/2/3 do not)."""
    base = base_optimizer(engine)
    if base is None:
        return False
    for st in base.state.values():
        step = st.get("step") if isinstance(st, dict) else None
        if step is not None and float(step) > 0:
            return True
    return False


def reset_optimizer(engine) -> None:
    """The optimizer's fp32 masters re-read from the module (after something wrote the weights,
    e.g. a calibration) and its state cleared: the next step is a fresh AdamW's first. The weights
    changed for the step levers too: the caller tells them."""
    opt = engine.optimizer
    if opt is not None:
        if hasattr(opt, "refresh_fp32_params"):      # DeepSpeed's ZeRO-1/2 and bf16 wrappers
            opt.refresh_fp32_params()
        base = base_optimizer(engine)
        if base is not None:
            base.state.clear()


