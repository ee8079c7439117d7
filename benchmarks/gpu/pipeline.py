"""One GPU pipeline for two acceptance runs, sized for ~6 minutes on 2 H200s (tools/gpu/run.sh stage ``pipeline``).

Part 1: ``deepspeed --num_gpus N -m qatfactory.train`` ZeRO-3 QAD (live bf16 teacher,
nvfp4_w4a16) of a ~1.1B random Llama-shaped model (hidden 2048, 16 layers, vocab 32000, untied) on
synthetic tokens, seq 2048. Launch 1 runs all N steps and checkpoints at step k; launch 2 resumes
from that checkpoint into another run directory and finishes. The losses of steps k+1..N of the two
launches are compared (max abs difference, reported, not demanded to be zero on GPU), then the final
student is exported (vLLM ModelOpt NVFP4, llama.cpp GGUF) and ``qatfactory verify`` checks each export.

Part 2: SmolLM2-135M-Instruct from its packaged GGUF, carried in ``split -b`` parts
(``smollm2.gguf.part-aa`` ...) found in ``.gpu/`` and ``/tmp/qf-parts/`` (earlier calls may have
stashed some there), reassembled and checked against the sha256 of the asset's provenance record,
turned into a local HF directory by ``qatfactory.assets.prepare_model_dir``; the Wikipedia split is
written to JSONL files by ``qatfactory.train.heldout.prepare_data``; QAD under the deepspeed launcher
(``train=gpu_1x`` with ZeRO-2 by default, ``--p2-train``/``--p2-zero``; ``model=local``, ``data=files``, seq
2048, ``method=qad``: 5e-6 constant),
then held-out KL to the teacher and perplexity for teacher / PTQ / QAD with the demo's evaluation
(``qatfactory.train.heldout.HeldOut``), export (vLLM + GGUF) and verify; optionally GSM8K (greedy).

CPU work overlaps GPU work: the asset preparation of part 2 runs while part 1 trains, the exports
and verifications of part 1 run while part 2 trains. A time budget (``--budget``) skips what no
longer fits, and ``pipeline.json`` / ``pipeline.md`` are rewritten after every stage, so a run cut
short still reports what it measured.

    python benchmarks/gpu/pipeline.py --out $OUT --budget 340     # the GPU run (via pipeline.sh / tools/gpu/run.sh)
    python benchmarks/gpu/pipeline.py --smoke --out /tmp/pipe     # CPU: tiny model, 2 gloo ranks, same code path

Output (``--out``): ``pipeline.json`` (every number), ``pipeline.md`` (tables), ``pipeline_launches.log``
(head and tail of each subprocess log), ``pipeline_curves.png`` (losses). Bulky files (checkpoints,
students, exports) stay in ``--work``.
"""
# The jobs live beside this entry point (arguments, main, the final verdict): supervise.py (clock,
# budget, child processes, GPU monitor; the run's shared state), tools/gpu/staging.py (GGUF parts, manifest,
# stash, asset cache), launches.py (training launches, export + verify jobs), part1_zero3.py,
# part2_smollm2.py, pipeline_report.py (pipeline.json / .md, plot, logs).
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

# supervise first: importing it starts T0, the clock that the budget and the log count from, and the
# budget has always included the heavy imports below (torch, transformers)
from supervise import NCCL_ENV, REPO, T0, Budget, GpuMonitor, say, stop_children

# staging.py (the carried GGUF parts and assets) sits with the GPU machine's other logistics in tools/gpu
sys.path.insert(0, str(REPO / "tools" / "gpu"))
# isort: split
import torch

from launches import ExportJob
from part1_zero3 import part1
from part2_smollm2 import part2, prep_part2
from pipeline_report import Report, collect_logs, plot
from qatfactory.train.config import recipes_dir
from staging import STASH_DIR


class Interrupted(BaseException):
    """SIGTERM (tools/gpu/run.sh's timeout): stop children, write the report, exit."""


# ============================================================================ arguments
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or f"runs/gpu-pipeline-{time.strftime('%Y%m%d-%H%M%S')}",
                   help="summary files (default: $OUT)")
    p.add_argument("--work", default=None, help="checkpoints, students, exports, logs (default: /tmp/qf-pipeline, "
                                                "smoke: <out>/work)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, 2 gloo ranks, a few steps, same code path")
    p.add_argument("--parts", default="1,2", help="which parts to run: 1, 2 or 1,2")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 340; smoke 900)")
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs) per launch")
    p.add_argument("--asset-dirs", default=f"{REPO / '.gpu'}:{STASH_DIR}",
                   help="where the GGUF parts and .../assets/<name>/ files are looked for (':'-separated)")
    p.add_argument("--stash-dir", default=None, help=f"copy .gpu/ parts and assets here (GPU default: {STASH_DIR})")
    g = p.add_argument_group("part 1")
    g.add_argument("--p1-layers", type=int, default=None, help="default 16 (smoke 2)")
    g.add_argument("--p1-steps", type=int, default=None, help="default 12 (smoke 4)")
    g.add_argument("--p1-ckpt", type=int, default=None, help="checkpoint step k < steps; default 6 (smoke 2)")
    g.add_argument("--p1-seq", type=int, default=None, help="default 2048 (smoke 32)")
    g.add_argument("--p1-micro", type=int, default=None, help="micro-batch per rank; default 2 (smoke 1)")
    g.add_argument("--p1-optimizer", default="adamw_torch", choices=("adamw_torch", "adamw_fused"),
                   help="adamw_fused JIT-builds DeepSpeed's FusedAdam first (~1 min on a fresh machine)")
    g.add_argument("--p1-cap", type=float, default=None, help="seconds per launch at most (default 180)")
    g = p.add_argument_group("part 2")
    g.add_argument("--p2-formats", default=None, help="default nvfp4_w4a16,mxfp4_w4a4 (the second one only if "
                                                      "time allows; smoke: nvfp4_w4a16)")
    g.add_argument("--p2-steps", type=int, default=None, help="default 60 (smoke 2)")
    g.add_argument("--p2-seq", type=int, default=None, help="default 2048 (smoke 64)")
    g.add_argument("--p2-micro", type=int, default=None, help="micro-batch per rank; default 4 (smoke 1)")
    g.add_argument("--p2-accum", type=int, default=None,
                   help="gradient accumulation; default 1 (smoke 1): a 135M model is host-bound, so every extra "
                        "micro-step costs a whole forward/backward of kernel launches")
    g.add_argument("--p2-grad-ckpt", type=int, default=0, choices=(0, 1),
                   help="activation checkpointing (gpu_1x turns it on; off by default here: the 135M model needs "
                        "~10 GiB without it, and recomputing costs 1.6x per step on the H200)")
    g.add_argument("--p2-lr", type=float, default=5e-6, help="constant (method=qad's 5e-6)")
    g.add_argument("--p2-eval-samples", type=int, default=None, help="held-out samples; default 10 (smoke 2)")
    g.add_argument("--p2-calib", type=int, default=None, help="calibration samples; default 8 (smoke 2)")
    g.add_argument("--p2-optimizer", default="adamw_torch", choices=("adamw_torch", "adamw_fused"))
    g.add_argument("--p2-train", default="gpu_1x",
                   help="train recipe of the SmolLM2 run (default gpu_1x: ZeRO-3's per-module gathers made a 135M "
                        "model take 3.1 s per 16K-token step on 2 H200s with gpu_multi)")
    g.add_argument("--p2-zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage of the SmolLM2 run")
    g.add_argument("--p2-cap", type=float, default=None, help="seconds per training launch at most (default 150)")
    g.add_argument("--gsm8k", type=int, default=None, help="GSM8K problems for teacher/PTQ/QAD (0: off); default 50 "
                                                          "when time is left (smoke 2)")
    g.add_argument("--gsm8k-tokens", type=int, default=None, help="new tokens per answer; default 256 (smoke 4)")
    a = p.parse_args(list(argv))
    smoke = a.smoke
    dflt = dict(budget=(900.0, 340.0), p1_layers=(2, 16), p1_steps=(4, 12), p1_ckpt=(2, 6), p1_seq=(32, 2048),
                p1_micro=(1, 2), p1_cap=(300.0, 180.0), p2_formats=("nvfp4_w4a16", "nvfp4_w4a16,mxfp4_w4a4"),
                p2_steps=(2, 60), p2_seq=(64, 2048), p2_micro=(1, 4), p2_accum=(1, 1), p2_eval_samples=(2, 10),
                p2_calib=(2, 8), p2_cap=(300.0, 150.0), gsm8k=(2, 50), gsm8k_tokens=(4, 256))
    for k, (s, g_) in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, s if smoke else g_)
    a.p2_formats = [f.strip() for f in a.p2_formats.split(",") if f.strip()]
    a.parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    a.asset_dirs = [Path(x) for x in a.asset_dirs.split(":") if x]
    if a.stash_dir is None and not smoke:
        a.stash_dir = str(STASH_DIR)
    if a.work is None:
        a.work = str(Path(a.out) / "work") if smoke else "/tmp/qf-pipeline"
    a.work = str(Path(a.work).resolve())
    a.out = str(Path(a.out).resolve())
    a.p1_exports = [("vllm", "modelopt"), ("llama_cpp", "gguf")]
    # smallest remaining time worth starting a stage with
    a.p1_min_s = 20.0 if smoke else 90.0
    a.p2_min_s = 20.0 if smoke else 75.0
    a.p2_export_s = 10.0 if smoke else 35.0     # a later format's exports + verify must fit too
    a.gsm8k_min_s = 5.0 if smoke else 25.0
    a.p2_cpu_precision = "bf16"
    return a


def check_args(a) -> None:
    bad = sorted(a.parts - {"1", "2"})
    if bad or not a.parts:
        raise ValueError(f"--parts={','.join(sorted(a.parts))!r}; allowed: 1, 2 or 1,2")
    for k in ("p1_layers", "p1_steps", "p1_ckpt", "p1_seq", "p1_micro", "p2_steps", "p2_seq", "p2_micro", "p2_accum",
              "p2_eval_samples", "p2_calib", "world"):
        if int(getattr(a, k)) < 1:
            raise ValueError(f"--{k.replace('_', '-')}={getattr(a, k)!r}; allowed: an int >= 1")
    if not a.p1_ckpt < a.p1_steps:
        raise ValueError(f"--p1-ckpt={a.p1_ckpt} must be below --p1-steps={a.p1_steps} (the resumed launch needs "
                         f"steps left to compare)")
    if a.gsm8k < 0 or a.gsm8k_tokens < 1:
        raise ValueError(f"--gsm8k={a.gsm8k}, --gsm8k-tokens={a.gsm8k_tokens}; allowed: >= 0 and >= 1")
    if not a.p2_lr > 0 or not a.budget > 0:
        raise ValueError(f"--p2-lr={a.p2_lr}, --budget={a.budget}; allowed: numbers > 0")
    known = {p.stem for p in (recipes_dir() / "format").glob("*.yaml")}
    unknown = [f for f in a.p2_formats if f not in known or f == "bf16"]
    if unknown or not a.p2_formats:
        raise ValueError(f"--p2-formats: unknown {unknown}; allowed: {sorted(known - {'bf16'})}")
    a.gpu = not a.smoke
    if a.gpu:
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible; the CPU check of this script is --smoke")
        if torch.cuda.device_count() < a.world:
            raise ValueError(f"--world={a.world} but {torch.cuda.device_count()} GPU(s) are visible")


# ============================================================================ main
def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(a)
    except ValueError as e:
        print(f"pipeline: {e}", file=sys.stderr)
        return 2
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Path(a.work).mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget)
    rep = Report(a)
    say(f"{'SMOKE (CPU) ' if a.smoke else ''}pipeline: parts {sorted(a.parts)}, budget {a.budget:.0f} s, "
        f"out {a.out}, work {a.work}")
    rep.save()

    def on_term(signum, frame):
        raise Interrupted()
    signal.signal(signal.SIGTERM, on_term)

    mon = GpuMonitor(a.gpu)
    jobs: List[ExportJob] = []
    prep: Dict[str, Any] = {}
    prep_thread = threading.Thread(target=prep_part2, args=(a, prep), daemon=True)
    rc = 0
    try:
        if "2" in a.parts:
            prep_thread.start()          # CPU work, while part 1 keeps the GPUs busy
        if "1" in a.parts:
            jobs += part1(a, rep, budget, mon)
            rep.save()
        if "2" in a.parts:
            jobs += part2(a, rep, budget, mon, prep, prep_thread)
            rep.save()
            if rep.data["part2"]["status"] in ("waiting for the asset preparation",):
                rep.data["part2"]["status"] = "done"
        for j in jobs:
            j.join(budget.left())
            rep.save()
    except Interrupted:
        say("SIGTERM: stopping children, writing the report")
        rep.data["interrupted"] = "SIGTERM (time limit)"
        rc = 124
    except Exception as e:
        rep.data["crash"] = traceback.format_exc()[-4000:]
        say(f"pipeline crashed: {type(e).__name__}: {e}")
        rc = 1
    finally:
        stop_children()
        mon.close()
        finalize_status(rep.data)
        try:
            plot(rep.data, Path(a.out))
        except Exception as e:      # a plot never hides the numbers
            say(f"plot failed: {e}")
        collect_logs(Path(a.work), Path(a.out))
        rep.save(final=True)
    say(f"done in {time.time() - T0:.0f} s: {a.out}/pipeline.md")
    ok = rep.data.get("verdict", {}).get("ok", False)
    return rc or (0 if ok else 1)


def finalize_status(d: Dict[str, Any]) -> None:
    """One verdict: every stage that ran succeeded (launches rc 0, every export written and verified
    PASS); stages skipped for lack of time are listed, not failed."""
    problems, skipped = [], []
    P = d["part1"]
    if P.get("status", "").startswith("skipped") or P.get("status") == "not run":
        skipped.append(f"part 1: {P.get('status')}")
    else:
        for k in ("run1", "run2"):
            if k in P and P[k]["rc"] != 0:
                problems.append(f"part 1 {k}: rc {P[k]['rc']}")
        if P.get("status", "").startswith(("failed", "partial")):
            problems.append(f"part 1: {P['status']}")
        bad = [e for e in P.get("exports") or [] if e["status"] != "PASS"]
        problems += [f"part 1 export {e['engine']}/{e['flavour']}: {e['status']}" for e in bad]
        if "exports" in P:
            P["status"] = "done" if not bad else "exports with problems"
    Q = d["part2"]
    if Q.get("status", "").startswith("skipped") or Q.get("status") == "not run":
        skipped.append(f"part 2: {Q.get('status')}")
    for fmt, F in (Q.get("formats") or {}).items():
        if F["status"].startswith("skipped"):
            skipped.append(f"part 2 {fmt}: {F['status']}")
            continue
        if F["status"].startswith("failed") or F.get("eval_error"):
            problems.append(f"part 2 {fmt}: {F['status']} {F.get('eval_error', '')}".strip())
        for e in F.get("exports") or []:
            if e["status"] != "PASS":
                problems.append(f"part 2 {fmt} export {e['engine']}/{e['flavour']}: {e['status']}")
        if F["status"].startswith("trained"):
            F["status"] = "done"
    if Q.get("formats") and Q.get("status") not in (None,) and not Q["status"].startswith("skipped"):
        Q["status"] = "done" if not any(p.startswith("part 2") for p in problems) else "with failures"
    if d.get("interrupted"):
        problems.append(d["interrupted"])
    if d.get("crash"):
        problems.append("crash: " + d["crash"].strip().splitlines()[-1])
    d["verdict"] = {"ok": not problems, "problems": problems, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())
