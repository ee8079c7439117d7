"""Training step time on one GPU: bf16 SFT vs QAT (W4A16, W4A4), QAD (live, cached teacher), LoRA-QAD.

    python benchmarks/step.py                      # all variants, markdown table on stdout
    python benchmarks/step.py --steps 12 --format nvfp4 --out benchmarks/step.json
    python benchmarks/step.py --loss               # the KD loss alone: naive vs token / token x vocab chunks
    python benchmarks/step.py --loss --loss-smoke  # the same rows at CPU size (checks the script only)

Model: a random Llama, hidden 2048, 16 layers (16 heads, 8 KV heads, MLP 5632, vocab 32000, untied),
batch 4 x 2048 tokens, bf16, DeepSpeed ZeRO-0 with fused AdamW (FusedAdam), chunked loss.
Each variant runs in its own process (clean peak-memory numbers) through the real trainer
(qatfactory.train.engine.run); the first --warmup steps are excluded from the timings.
Not a test: nothing is asserted; the lead runs it on an H200 and copies the table to RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODEL = ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=32000", "model.tiny.hidden_size=2048",
         "model.tiny.intermediate_size=5632", "model.tiny.num_hidden_layers=16", "model.tiny.num_attention_heads=16",
         "model.tiny.num_key_value_heads=8", "model.tiny.tie_word_embeddings=false"]
# --model smollm2: SmolLM2-135M's shape (the pipeline's part 2 model), random weights; 4 x 2048 tokens is
# what one rank of that run computes per optimizer step (2 x 2048 x accum 2)
MODELS = {"llama1b": MODEL,
          "smollm2": ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=49152",
                      "model.tiny.hidden_size=576", "model.tiny.intermediate_size=1536",
                      "model.tiny.num_hidden_layers=30", "model.tiny.num_attention_heads=9",
                      "model.tiny.num_key_value_heads=3", "model.tiny.tie_word_embeddings=true"]}


def variants(fmt: str):
    w16, w4 = f"format={fmt}_w4a16", f"format={fmt}_w4a4"
    return {
        "bf16 SFT (no quant, CE)": ["method=qat", "format=bf16", "method.eval_teacher=false"],
        "QAT W4A16 (CE)": ["method=qat", w16, "method.eval_teacher=false"],
        "QAT W4A4 (CE)": ["method=qat", w4, "method.eval_teacher=false"],
        "QAD W4A16 live teacher": ["method=qad", w16],
        "QAD W4A16 live teacher, grad ckpt": ["method=qad", w16, "train.grad_ckpt=true"],
        "QAD W4A16 cached teacher (top-64)": ["method=qad", w16, "method.teacher=cached", "method.topk=64"],
        "LoRA-QAD W4A16 (r=16)": ["method=qad_lora", w16, "quant.lora.rank=16"],
    }


def one(name: str, over, args) -> dict:
    import torch
    from qatfactory.train.config import compose
    from qatfactory.train.engine import run
    # letters, digits and _ only: the path is a Hydra override value (a comma would make it a sweep)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", name.split(" (")[0]).strip("_")
    run_dir = Path(args.workdir) / (slug + (f"_{args.tag}" if args.tag else ""))
    n = args.steps * 4
    cfg = compose(MODELS[args.model] + list(over) + [
        f"run_dir={run_dir}", "data.synthetic=%d" % n, "data.seq_len=2048", "data.eval_samples=1",
        "train.micro_batch=4", "train.grad_accum=1", "train.precision=bf16", "train.optimizer=adamw_fused",
        "train.zero_stage=0", f"train.max_steps={args.steps}", "train.eval_every=0", "train.eval_samples=1",
        "train.save_final=false", "train.progress=false", "train.plots=false", "train.tensorboard=false",
        "train.device=cuda", "method.calib_samples=2", f"method.loss.chunk_tokens={args.chunk}"])
    torch.cuda.reset_peak_memory_stats()
    if args.profile:
        # where the time goes (not a timing run: the profiler slows the host side)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            s = run(cfg)
        ka = prof.key_averages()
        txt = [f"profile of '{name}', {args.steps} steps (setup included)\n"]
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            txt.append(f"\n== top 30 by {key}\n" + ka.table(sort_by=key, row_limit=30))
        dest = Path(args.profile_dir or args.workdir) / ("profile_" + re.sub(r"[^A-Za-z0-9]+", "_", name.split(" (")[0]).strip("_") + ".txt")
        dest.write_text("".join(txt))
        print(f"[bench] profile written to {dest}", file=sys.stderr, flush=True)
    else:
        s = run(cfg)
    s.pop("engine").destroy()
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_ms" in r and r["step"] > args.warmup]
    ms = statistics.median(r["step_ms"] for r in steps)
    return {"variant": name, "ms_per_step": ms, "step_ms_all": [round(r["step_ms"], 1) for r in steps],
            "tokens_per_s": 4 * 2048 / (ms / 1000.0),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "steps_timed": len(steps),
            "final_loss": steps[-1]["loss"] if steps else None}


def loss_memory(args) -> int:
    """Chunked vs naive KD loss alone: peak memory and time of forward+backward at a Llama-3 vocabulary,
    chunked over tokens only and over tokens and vocabulary. ``--loss-smoke`` (or no GPU): a CPU-sized
    run of the same rows (shapes / 16, time only) to check the script, not to quote."""
    import time
    import torch
    from qatfactory.distill.losses import LiveTeacherOut, LossConfig, lm_loss, naive_lm_loss
    smoke = args.loss_smoke or not torch.cuda.is_available()
    dev = "cpu" if smoke else "cuda"
    d = 16 if smoke else 1               # CPU smoke: every size divided by 16
    n, h, v = 4 * 2048 // d, 4096 // d, 128256 // d
    g = torch.Generator(device=dev).manual_seed(0)
    hs = (torch.randn(n, h, device=dev, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device=dev, generator=g) * 0.02).bfloat16().requires_grad_()
    th = (torch.randn(n, h, device=dev, generator=g) * 0.5).bfloat16()
    tw = (torch.randn(v, h, device=dev, generator=g) * 0.02).bfloat16()
    t = LiveTeacherOut(th, tw)
    specs = [("naive (full fp32 logits)", naive_lm_loss, LossConfig())]
    # token chunks alone, then token x vocabulary slices (2 passes over the head for forward KL, 3 for
    # reverse KL / JSD); the reverse-KL pair shows the price of the extra pass
    # fused: the closed-form gradient of the forward-KL chunks (the default); False: autograd per chunk
    for c, vc, kind, fused in ((1024, None, "forward_kl", False), (1024, None, "forward_kl", True),
                               (4096, None, "forward_kl", False), (4096, None, "forward_kl", True),
                               (1024, 16384, "forward_kl", True), (4096, 32768, "forward_kl", True),
                               (4096, None, "reverse_kl", True), (4096, 32768, "reverse_kl", True)):
        name = f"chunked, {c // d} tokens" + ("" if vc is None else f" x {vc // d} vocab") + "/chunk"
        name += ", reverse KL" if kind == "reverse_kl" else ""
        name += ", autograd per chunk (fused=False)" if not fused else ""
        specs.append((name, lm_loss, LossConfig(kind=kind, chunk_tokens=c // d, fused=fused,
                                                vocab_chunk=None if vc is None else vc // d)))
    rows = []
    for name, fn, cfg in specs:
        ms, peak = float("nan"), float("nan")
        for rep in range(1 if smoke else 3):
            hs.grad = w.grad = None
            if not smoke:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                fn(hs, w, teacher=t, cfg=cfg).backward()
                if not smoke:
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                ms = (time.perf_counter() - t0) * 1000
            except torch.OutOfMemoryError:
                ms, peak = float("nan"), float("inf")
        rows.append((name, ms, peak))
    print(f"\nKD loss (forward KL unless named) forward+backward, {n} tokens, hidden {h}, vocab {v}, bf16 inputs"
          + (" [CPU smoke: not a measurement]" if smoke else "") + "\n")
    print("| loss | ms | peak extra memory (GiB) |\n|---|---:|---:|")
    for name, ms, peak in rows:
        print(f"| {name} | {ms:.1f} | {peak:.2f} |")
    return 0


# the goals of issue 17: (ours, peer, allowed ratio)
GOALS = [
    ("QAT W4A16 (CE)", "ModelOpt W4A16 QAT, fp32 masters", 1.0),
    ("QAT W4A4 (CE)", "ModelOpt W4A4 QAT, fp32 masters", 1.0),
    ("QAD W4A16 live teacher", "ModelOpt QAD W4A16, fp32 masters", 1.0),
    ("QAD W4A16 cached teacher (top-64)", "QAT W4A16 (CE)", 1.10),
    ("bf16 SFT (no quant, CE)", "plain loop, fp32 masters", 1.10),
    ("QAT W4A16 (CE)", "ModelOpt W4A16 QAT, bf16 params", 1.0),
    ("QAD W4A16 live teacher", "ModelOpt QAD W4A16, bf16 params", 1.0),
]


def summarize(order, runs) -> list:
    out = []
    for kind, name in order:
        ok = [r for r in runs[name] if "ms_per_step" in r]
        if not ok:
            out.append({"kind": kind, "variant": name, "error": runs[name][-1].get("error", "?")})
            continue
        ms = [r["ms_per_step"] for r in ok]
        mem = [r["peak_mem_gib"] for r in ok if r.get("peak_mem_gib") is not None]
        out.append({"kind": kind, "variant": name, "ms_per_step": statistics.median(ms), "min_ms": min(ms),
                    "max_ms": max(ms), "rounds": len(ms), "tokens_per_s": 4 * 2048 / (statistics.median(ms) / 1000),
                    "peak_mem_gib": max(mem) if mem else None,
                    "weights_changed_by_step_1": ok[0].get("weights_changed_by_step_1"), "runs": ok})
    return out


def table(rows) -> str:
    by = {r["variant"]: r for r in rows if "ms_per_step" in r}
    base = by.get("plain loop, fp32 masters")
    L = ["| variant | ms/step | spread | tokens/s | vs plain fp32-master loop | peak GiB | weights changed by step 1 |",
         "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            L.append(f"| {r['variant']} | failed | | | | | {r['error'][:90]} |")
            continue
        rel = f"{r['ms_per_step'] / base['ms_per_step']:.2f}x" if base else "-"
        ch = r.get("weights_changed_by_step_1")
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        chg = "-" if ch is None else f"{100 * ch:.1f}%"
        L.append(f"| {'ours: ' if r['kind'] == 'ours' else ''}{r['variant']} | {r['ms_per_step']:.1f} | "
                 f"{r['min_ms']:.1f}..{r['max_ms']:.1f} | {r['tokens_per_s']:.0f} | {rel} | {mem} | {chg} |")
    L += ["", "| goal | ours / peer | allowed | met |", "|---|---:|---:|---|"]
    for ours, peer, lim in GOALS:
        if ours in by and peer in by:
            q = by[ours]["ms_per_step"] / by[peer]["ms_per_step"]
            L.append(f"| {ours} vs {peer} | {q:.2f} | <= {lim:.2f} | {'yes' if q <= lim else 'NO'} |")
    return "\n".join(L)


def versions() -> str:
    import importlib.metadata as md
    v = []
    for pkg in ("torch", "deepspeed", "nvidia-modelopt", "transformers"):
        try:
            v.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    try:
        import torch
        if torch.cuda.is_available():
            v.append(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    return "; " + ", ".join(v) if v else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--chunk", type=int, default=2048, help="loss chunk (tokens)")
    ap.add_argument("--model", default="llama1b", choices=sorted(MODELS),
                    help="llama1b: the table's model (default); smollm2: SmolLM2-135M's shape")
    ap.add_argument("--only", default=None, help="run one variant (internal: used by the parent process)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here (a folder: <folder>/step.json)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated substrings: run only the variants whose name contains one of them")
    ap.add_argument("--profile", default=None,
                    help="also run this variant once more under torch.profiler (a substring of its name); "
                         "the op table goes to <--out folder>/profile_<variant>.txt")
    ap.add_argument("--profile-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds of every variant")
    ap.add_argument("--no-peers", dest="peers", action="store_false",
                    help="leave out the peers' rows (plain loops, Model Optimizer; benchmarks/step_peers.py)")
    ap.add_argument("--loss", action="store_true", help="only the chunked-vs-naive loss memory table")
    ap.add_argument("--loss-smoke", action="store_true", help="with --loss: CPU-sized shapes (checks the script)")
    args = ap.parse_args()
    if args.loss:
        return loss_memory(args)
    # DeepSpeed's op builder cannot parse "9.0a" (the H200 image's default); FusedAdam needs a plain arch
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").endswith("a"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ["TORCH_CUDA_ARCH_LIST"].rstrip("a")
    vs = variants(args.format)
    if args.variants:
        keys = [k.strip() for k in args.variants.split(",") if k.strip()]
        vs = {n: o for n, o in vs.items() if any(k in n for k in keys)}
        if not vs:
            ap.error(f"--variants {args.variants!r} matches none of {list(variants(args.format))}")
    if args.only is not None:
        args.profile = args.profile if args.profile_dir else None
        row = one(args.only, vs[args.only], args)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="qf-step-bench-")
    out_dir = Path(args.out) if args.out and Path(args.out).is_dir() else None
    jobs = [("ours", name, []) for name in vs]
    if args.peers:
        import step_peers
        jobs += [("peer", name, []) for name in step_peers.PEERS]
    profile_job = None
    if args.profile:
        hit = [n for n in vs if args.profile in n]
        if not hit:
            ap.error(f"--profile {args.profile!r} matches no selected variant")
        profile_job = ("ours", hit[0], ["--profile", args.profile, "--profile-dir", str(out_dir or work), "--steps", "5"])
    runs: dict = {}
    order = []
    # every variant once per round, rounds repeated: drift over the run lands in the spread, not in a ratio
    for rnd in range(args.repeat):
        for kind, name, extra in jobs + ([profile_job] if profile_job and rnd == 0 else []):
            if kind == "ours":
                cmd = [sys.executable, str(Path(__file__).resolve()), "--only", name, "--workdir", work,
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--format", args.format,
                       "--chunk", str(args.chunk), "--model", args.model, "--tag", f"r{rnd}"] + extra
            else:
                cmd = [sys.executable, str(Path(__file__).resolve().parent / "step_peers.py"), "--only", name,
                       "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup)]
            p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")))
            line = [l for l in p.stdout.splitlines() if l.startswith("ROW ")]
            if "--profile" in extra:          # the profiled run: its timings are not comparable
                print(f"[bench] {name}: profiled", file=sys.stderr, flush=True)
                continue
            if p.returncode != 0 or not line:
                row = {"variant": name, "error": (p.stderr or p.stdout)[-400:].replace("\n", " ")}
                print(f"[bench] {name}: FAILED\n{p.stderr[-3000:]}", file=sys.stderr, flush=True)
            else:
                row = json.loads(line[-1][4:])
                row["variant"] = name
            if name not in runs:
                order.append((kind, name))
            runs.setdefault(name, []).append(row)
            # every row as soon as it exists: a run cut short by its time limit still reports it
            print(f"[bench] {name} (round {rnd}): " + json.dumps(row), file=sys.stderr, flush=True)
    rows = summarize(order, runs)
    shape = "hidden 2048 x 16 layers" if args.model == "llama1b" else "SmolLM2-135M shape (576 x 30 layers)"
    print(f"\nstep time, random Llama {shape}, batch 4 x 2048, bf16, {args.steps} steps ({args.warmup} warm-up "
          f"excluded), format {args.format}, {args.repeat} interleaved rounds (median of the rounds' medians; "
          f"spread = min..max over rounds){versions()}\n")
    print(table(rows))
    if args.out:
        (out_dir / "step.json" if out_dir else Path(args.out)).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
