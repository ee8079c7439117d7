"""method=scale_adapter: train the block scales of a native NVFP4 / MXFP4 checkpoint under DeepSpeed (ZeRO 0-2).

    qatfactory train method=scale_adapter model.path=<native 4-bit export> data.train=[sft.jsonl] export=vllm

The loop of the registered method scale_adapter (train/methods/scale_adapter.py, ``Method.own_loop``),
like rl_loop.py; it reuses the trainer's distributed init, the loss module (StudentLM: next-token CE on
the masked targets, e.g. the assistant turn of chat records), evaluation, DeepSpeed config, LR schedule,
logger and run-directory rules, and returns its student (``summary["student"]``) for the face to ship.

    run_dir/config.yaml, metrics.jsonl (+ scales/changed, scales/saturated, scales/abs_theta, scales/pulled_back)
    run_dir/scales.safetensors   the task's scale bytes (native.save_scale_file): the merge, a few % of the
                                 checkpoint, applies onto the base's code plane (``qatfactory scales``)
    run_dir/export-<engine>/     when export.enabled (shipped by the face, qatfactory.ship): the base's codes
                                 + these scale bytes for vLLM/SGLang (ModelOpt / compressed-tensors) or
                                 llama.cpp (GGUF), through the gate with two more rows: codes == the base's
                                 (Student.native_base), logits == the training forward (Student.training_logits)

The model (native.build_model): every 4-bit linear a ScaleAdapterLinear (codes and scale bytes uint8
buffers, so ZeRO neither casts nor partitions them; the per-tensor scale frozen, so still shared across
fused shards), theta the only trainable tensors, everything else frozen. After every optimizer step
nn.scale_adapter.limit_changed keeps at most method.scale.max_changed of the blocks off the base's bytes
(auto: 0.3 % on MXFP4's power-of-two grid, where AdamW would otherwise flip thousands of blocks by a factor of
2 in the same step; no limit on NVFP4's E4M3). Refused: ZeRO-3, resume, a model
that is not a native NVFP4/MXFP4 checkpoint (one line, exit code 4). train.save_every is ignored (the
scale file is written at the end).
"""
from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from .. import _fsutil
from .. import native as NT
from ..exitcodes import BadInputError, UsageError
from ..nn import scale_adapter as SA
from . import rundir
from .config import RunConfig, validate
from .data import Order, load_data, load_tokenizer, rank_batch
from .engine import (
    StudentLM,
    _barrier,
    _rank_world,
    _resolve_device,
    ds_config,
    eval_count,
    evaluate,
    init_distributed,
    lr_lambda,
    seed_all,
)
from .methods import Student
from .runlog import RunLogger, memory_gb, plot_curves, summary_text

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def check(cfg: RunConfig) -> None:
    t = cfg.train
    if t.zero_stage == 3:
        raise UsageError("method=scale_adapter: train.zero_stage=3 is not supported (tested: 0, 1, 2); the scale "
                         "offsets are 1/16 (NVFP4) or 1/32 (MXFP4) of the weights, ZeRO-2 partitions their optimizer")
    if cfg.resume:
        raise UsageError("method=scale_adapter: resume is not implemented yet; start a fresh run_dir")
    if not cfg.model.path:
        raise BadInputError("method=scale_adapter needs model.path=<a native NVFP4/MXFP4 export> (ModelOpt or "
                            "compressed-tensors safetensors directory, or a GGUF); it trains that checkpoint's scales")
    if cfg.method.loss.needs_teacher:
        raise UsageError(f"method=scale_adapter trains on CE (method.loss.kind=ce); got {cfg.method.loss.kind!r}")


def _tokenizer(cfg: RunConfig, ck: NT.NativeCheckpoint):
    if cfg.model.tokenizer or ck.source_dir:
        return load_tokenizer(cfg.model.tokenizer or ck.source_dir)
    if ck.gguf_file:
        from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: transformers)
        return AutoTokenizer.from_pretrained(str(ck.path), gguf_file=ck.gguf_file)
    raise BadInputError(f"{ck.path}: no tokenizer files; give model.tokenizer=<a tokenizer directory>")


def run(cfg: RunConfig, eval_only: bool = False) -> Dict[str, Any]:
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    if eval_only:
        raise UsageError("method=scale_adapter: eval-only runs are not implemented; runs evaluate at start and end")
    cfg = validate(cfg)
    check(cfg)
    t, s = cfg.train, cfg.method.scale
    device = _resolve_device(t.device)
    init_distributed(device)
    rank, world = _rank_world()
    dev = torch.device(device, int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")
    seed_all(t.seed)
    # a base that is not native 4-bit, or a target that cannot hold its bytes: refused before any directory
    ck = NT.read_native(cfg.model.path)
    target = NT.resolve_target(ck, s.target)
    run_dir, _, decision = rundir.prepare(cfg, rank, world, False)
    t0 = time.time()
    model = NT.build_model(ck, target, s.param, s.rank, s.ste, list(s.targets), _DTYPES[cfg.model.dtype])
    model.to(dev)
    model.train()
    tok = _tokenizer(cfg, ck)
    vocab = model.get_output_embeddings().weight.shape[0]
    train_s, eval_s = load_data(cfg.data, tok, vocab, t.seed)
    if t.grad_ckpt:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student = StudentLM(model, cfg.method.loss)
    params = [p for p in SA.parameters(model) if p.requires_grad]
    max_changed = SA.default_max_changed(target, s.param) if s.max_changed is None else float(s.max_changed)
    if rank == 0:
        nb = ck.nbytes()
        lim = "no limit" if max_changed >= 1 else f"at most {max_changed:.2%} of the blocks"
        print(f"[qatfactory] scale adapter on {ck.container} {ck.layout} ({ck.base_format} -> target {target}): "
              f"{len(SA.modules(model))} linears, {sum(p.numel() for p in params):,} trainable offsets "
              f"({s.param}); codes {nb['codes']:,} B frozen, scales {nb['scales']:,} B; changed scale bytes: "
              f"{lim} (method.scale.max_changed)", flush=True)
    dcfg = ds_config(cfg, device, True)
    kw: Dict[str, Any] = {"model_parameters": params,
                          "lr_scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))}
    if "optimizer" not in dcfg:
        kw["optimizer"] = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    engine, *_ = deepspeed.initialize(model=student, config=dcfg, **kw)
    lm = engine.module.lm
    log = RunLogger(run_dir, rank == 0, t.tensorboard, t.progress, t.max_steps, 0)
    if decision.get("restart"):
        log.truncate_after(-1)
    if rank == 0 and t.save_every:
        print(f"[qatfactory] method=scale_adapter: no mid-run checkpoints (train.save_every={t.save_every} is "
              f"ignored); the scale file is written at the end", flush=True)
    history: List[Dict[str, float]] = []
    step, position = 0, 0

    def do_eval():
        r = evaluate(engine, eval_s, None, eval_count(cfg, eval_s), t.micro_batch, rank, world, dev)
        r.update(SA.scale_stats(lm))
        r["step"] = step
        history.append(r)
        log.log(r)

    do_eval()
    order = Order(len(train_s), t.seed)
    tokens_per_step = t.micro_batch * world * t.grad_accum * cfg.data.seq_len
    while step < t.max_steps:
        ts = time.time()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        lr_now = float(engine.get_lr()[0])
        for _ in range(t.grad_accum):
            b = rank_batch(train_s, order, position, t.micro_batch, rank, world)
            position += t.micro_batch * world
            loss = engine(b["input_ids"].to(dev), b["attn"].to(dev), b["mask"].to(dev), None)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().double()
        pulled = SA.limit_changed(lm, max_changed)     # the same theta on every rank, so the same pull-back
        if pulled:
            _refresh_masters(engine)
        step += 1
        if world > 1:
            torch.distributed.all_reduce(loss_sum)
            loss_sum = loss_sum / world
        loss_v = float(loss_sum.cpu()) / t.grad_accum
        dt = time.time() - ts
        rec = {"step": step, "loss": loss_v, "lr": lr_now, "step_ms": dt * 1000.0,
               "tokens_per_s": tokens_per_step / max(dt, 1e-9), "mem_gb": memory_gb(), "scales/pulled_back": pulled}
        if step % t.log_every == 0 or step == t.max_steps:
            rec.update(SA.scale_stats(lm))       # also raises on a NaN offset (a diverged run)
            log.log(rec)
        log.progress(1, loss=loss_v, changed=f"{rec.get('scales/changed', float('nan')):.4f}", lr=lr_now)
        if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
            do_eval()
    if not history or history[-1]["step"] != step:
        do_eval()
    log.close()
    summary: Dict[str, Any] = {"run_dir": str(run_dir), "method": "scale_adapter", "format": target,
                               "base": str(ck.path), "base_container": ck.container, "steps": step,
                               "tokens": step * tokens_per_step, "time_s": time.time() - t0, "world_size": world,
                               "eval_first": history[0] if history else None,
                               "eval_last": history[-1] if history else None, "eval_history": history}
    out, student = _finalize(cfg, lm, ck, run_dir, rank, max_changed)
    summary.update(out)
    student.request(cfg, run_dir, decision.get("export_dir"))
    _barrier()
    if rank == 0:
        _fsutil.write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=1, default=str))
        if t.plots:
            plot_curves(run_dir)
        print(summary_text(summary), flush=True)
        print(f"scale_file: {summary['scale_file']}", flush=True)
    summary["student"] = student
    summary["engine"] = engine
    return summary


def _refresh_masters(engine) -> None:
    """After limit_changed wrote theta in the module: the optimizer's own fp32 copies (DeepSpeed's ZeRO-1/2 and
    bf16 wrappers keep them) re-read it, its moments kept; a plain torch optimizer steps the module's tensors."""
    opt = engine.optimizer
    if opt is not None and hasattr(opt, "refresh_fp32_params"):
        opt.refresh_fp32_params()


@torch.no_grad()
def training_logits(lm, ck: NT.NativeCheckpoint, prompt: List[int]):
    """(logits [T, V] float32 on CPU, how): the trained module itself when it already runs float32 on the
    CPU; else a float32 CPU copy of it (the same ScaleAdapterLinear code, the same scale bytes)."""
    ids = torch.tensor([prompt])
    on_cpu_fp32 = all(p.device.type == "cpu" and (not p.is_floating_point() or p.dtype == torch.float32)
                      for p in lm.parameters())
    was = lm.training
    if on_cpu_fp32:
        lm.eval()
        out = lm(input_ids=ids, use_cache=False).logits[0].float()
        lm.train(was)
        return out, "the trained module (float32, CPU)"
    cp = copy.deepcopy(lm).to("cpu").float().eval()
    return cp(input_ids=ids, use_cache=False).logits[0].float(), "a float32 CPU copy of the trained module"


def _finalize(cfg: RunConfig, lm, ck: NT.NativeCheckpoint, run_dir: Path, rank: int, max_changed: float = 1.0):
    """Rank 0: the scale file, and (export.enabled) the merged model for the face to ship, with the
    gate's two extra rows: the export's code plane must be the base's, its logits the training
    forward's. Returns (summary entries, Student)."""
    out: Dict[str, Any] = {}
    student = Student(model=lm)
    if rank != 0:
        return out, student
    f = run_dir / "scales.safetensors"
    # the trust region the run held the bytes to goes into the file: an apply refuses bytes outside it
    meta = NT.save_scale_file(lm, ck, f, task=cfg.method.scale.task, max_changed=max_changed)
    nb = ck.nbytes()
    out.update(scale_file=str(f), scale_file_bytes=f.stat().st_size, checkpoint_bytes=nb["total"],
               code_plane_sha256=meta["base_code_plane_sha256"], scales_final=SA.scale_stats(lm))
    if cfg.export.enabled:
        student.converted = NT.merged_converted(lm, ck)
        student.native_base = str(ck.path)
        student.training_logits = lambda prompt: training_logits(lm, ck, prompt)
    return out, student


def fraction(summary: Dict[str, Any]) -> float:
    """The scale file's size as a fraction of the checkpoint's tensor bytes."""
    return summary["scale_file_bytes"] / max(summary["checkpoint_bytes"], 1)


__all__ = ["run", "check", "training_logits", "fraction"]
