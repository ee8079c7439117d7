"""Part 1 of the GPU pipeline (benchmarks/gpu/pipeline.py): ``deepspeed --num_gpus N -m
qatfactory.train`` ZeRO-3 QAD (live bf16 teacher, nvfp4_w4a16) of a ~1.1B random Llama-shaped model on
synthetic tokens. Launch 1 runs all N steps and checkpoints at step k; launch 2 resumes from that
checkpoint into another run directory and finishes; the losses of steps k+1..N are compared; the final
student is exported (vLLM ModelOpt NVFP4, llama.cpp GGUF) and each export verified.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List

from launches import CkptWatch, ExportJob, run_launch
from pipeline_report import Report
from supervise import Budget, GpuMonitor, du, say


def p1_overrides(a) -> List[str]:
    if a.smoke:
        model = ["model=tiny_llama", "model.dtype=float32", "model.tiny.tie_word_embeddings=false",
                 f"model.tiny.num_hidden_layers={a.p1_layers}", "model.tiny.initializer_range=0.3"]
        prec = ["train.precision=fp32", "train.device=cpu"]
    else:
        # benchmarks/step.py's model: a random Llama, hidden 2048, 16 heads / 8 KV heads, MLP 5632, vocab 32000
        model = ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=32000",
                 "model.tiny.hidden_size=2048", "model.tiny.intermediate_size=5632",
                 f"model.tiny.num_hidden_layers={a.p1_layers}", "model.tiny.num_attention_heads=16",
                 "model.tiny.num_key_value_heads=8", "model.tiny.tie_word_embeddings=false"]
        prec = ["train.precision=bf16", "train.device=cuda"]
    n = a.p1_steps * a.p1_micro * a.world
    return model + prec + [
        "method=qad", "format=nvfp4_w4a16", "train=gpu_multi", "data=synthetic", f"data.synthetic={n}",
        f"data.seq_len={a.p1_seq}", "data.eval_samples=2", f"train.max_steps={a.p1_steps}",
        # keep every periodic checkpoint: the one of step k must survive for the resumed launch
        f"train.save_every={a.p1_ckpt}", "train.save_final=false", f"train.keep_last={a.p1_steps // a.p1_ckpt + 1}",
        f"train.micro_batch={a.p1_micro}", "train.grad_accum=1", f"train.optimizer={a.p1_optimizer}",
        "train.eval_every=0", "train.eval_samples=2", "train.progress=false", "train.plots=false",
        "train.tensorboard=false", "method.calib_samples=2"]


def compare_losses(first: Dict[str, float], resumed: Dict[str, float], k: int, n: int) -> Dict[str, Any]:
    steps = list(range(k + 1, n + 1))
    missing = [s for s in steps if str(s) not in first or str(s) not in resumed]
    if missing:
        return {"steps": steps, "missing_steps": missing, "max_abs_diff": None, "bit_equal": False}
    a = [first[str(s)] for s in steps]
    b = [resumed[str(s)] for s in steps]
    d = [abs(x - y) for x, y in zip(a, b)]
    return {"steps": steps, "uninterrupted": a, "resumed": b, "abs_diff": d, "max_abs_diff": max(d),
            "max_rel_diff": max(x / max(abs(y), 1e-30) for x, y in zip(d, a)), "bit_equal": a == b}


def part1(a, rep: "Report", budget: Budget, mon: GpuMonitor) -> List[ExportJob]:
    P = rep.data["part1"]
    P.update(status="running", model_layers=a.p1_layers, steps=a.p1_steps, ckpt_step=a.p1_ckpt, seq_len=a.p1_seq,
             micro_batch_per_rank=a.p1_micro, world=a.world, optimizer=a.p1_optimizer,
             tokens_per_step=a.p1_micro * a.world * a.p1_seq)
    work = Path(a.work) / "p1"
    if work.exists():
        shutil.rmtree(work)
    over = p1_overrides(a)
    run1, run2 = work / "run1", work / "run2"
    if budget.left() < a.p1_min_s:
        P["status"] = f"skipped: {budget.left():.0f} s left, part 1 needs ~{a.p1_min_s:.0f} s"
        return []
    watch = CkptWatch(run1, a.p1_ckpt)
    r1 = run_launch(a, "p1-run1", over + ["train.save_student=false", f"run_dir={run1}"], run1, budget,
                    a.p1_cap, mon, watch)
    P["run1"] = r1
    ck = run1 / "checkpoints" / f"step-{a.p1_ckpt:06d}"
    if ck.is_dir():
        mt = [f.stat().st_mtime for f in ck.rglob("*") if f.is_file()]
        # two views of the save time: the directory watch from outside (0.2 s polls) and the span of
        # the files' modification times (first file finished -> last file finished)
        P["checkpoint"] = {"step": a.p1_ckpt, "bytes": du(ck), "save_s": watch.seconds(), "path": str(ck),
                           "files": len(mt), "mtime_span_s": max(mt) - min(mt) if mt else None}
    rep.save()
    if r1["rc"] != 0 or not ck.is_dir():
        P["status"] = "failed: launch 1" + ("" if ck.is_dir() else f" (no checkpoint {ck.name})")
        return []
    if budget.left() < a.p1_min_s * 0.8:
        P["status"] = f"partial: no time left for the resumed launch ({budget.left():.0f} s)"
        return []
    r2 = run_launch(a, "p1-run2", over + ["train.save_student=true", f"run_dir={run2}", f"resume={ck}"], run2,
                    budget, a.p1_cap, mon)
    P["run2"] = r2
    P["resume"] = compare_losses(r1.get("losses", {}), r2.get("losses", {}), a.p1_ckpt, a.p1_steps)
    rs = P["resume"]
    if rs["max_abs_diff"] is not None:
        say(f"p1 resume: steps {a.p1_ckpt + 1}..{a.p1_steps}, max |loss diff| {rs['max_abs_diff']:.3g}, "
            f"bit equal: {rs['bit_equal']}")
    rep.save()
    student = run2 / "student"
    if r2["rc"] != 0 or not student.is_dir():
        P["status"] = "failed: launch 2 (resume)" + ("" if student.is_dir() else ", no student")
        return []
    P["status"] = "trained; exports running"
    jobs = [ExportJob(a, "p1", student, eng, fl, work / "exports", budget) for eng, fl in a.p1_exports]
    P["exports"] = [j.rec for j in jobs]
    return jobs
