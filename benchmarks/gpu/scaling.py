"""Strong and weak scaling of live-teacher QAD (NVFP4 W4A16) across GPUs under ZeRO-3 / ZeRO-2.

    python benchmarks/gpu/scaling.py run --model llama8b --zero 3 --worlds 2 4 8 --modes strong weak --out DIR
    python benchmarks/gpu/scaling.py run --model qwen3moe --moe-layers 24 --zero 3 --worlds 8 --profile extra --out DIR
    python benchmarks/gpu/scaling.py report DIR [DIR...] > tables.md
    python benchmarks/gpu/scaling.py run --model llama1b --zero 3 --worlds 2 4 8 --sp all --seq 131072 --out DIR
    python benchmarks/gpu/scaling.py run --model tiny --cpu ...       # CPU gloo, a tiny shape (the test's smoke)

Models (random weights, synthetic tokens; nothing downloaded):
  llama8b   Llama-3-8B's shape: hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocab 128256, untied
  llama1b   Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128256, tied
  qwen3moe  Qwen3-30B-A3B's shape: hidden 2048, 48 layers (--moe-layers to trim), 32 heads / 4 KV heads
            (head_dim 128), 128 experts of 768, 8 active, vocab 151936, untied; written once as a local HF
            directory (its random weights and a small BPE tokenizer) because the trainer's random-init
            path builds Llamas only
  tiny / tiny_moe   the same two architectures at hidden 64, 2 layers (CPU)

Each point is one ``deepspeed --num_gpus N`` launch of the real trainer (``qatfactory.train``): live bf16
teacher (ZeRO-3 partitions it too), student NVFP4 W4A16 with fp32 masters, fused AdamW, gradient
checkpointing, ``--steps`` optimizer steps of which the first ``--warmup`` are not timed.
  strong: a fixed global batch (--global-batch sequences of --seq tokens), micro_batch --micro, the
          accumulation steps fill the rest: gas = global / (micro x N)
  weak:   a fixed batch per GPU (--micro x --gas sequences), so the global batch grows with N
Recorded per point from the run's metrics.jsonl (rank 0): median step time, tokens/s (all GPUs and per
GPU), peak memory of rank 0's GPU (torch.cuda.max_memory_allocated), and the scaling efficiency against
the smallest N that ran (1, or 2 where 1 does not fit): strong t(b)*b / (t(N)*N), weak per-GPU tokens/s
ratio. ``--sp K`` (or ``all``: K = N) runs Ulysses sequence parallelism (``train.sequence_parallel=K``): each
sequence is spread over K GPUs and the data-parallel degree is N / K, which the global batch is counted in.
``--method`` / ``--format`` (qad, nvfp4_w4a16) and ``--set KEY=VALUE`` (repeatable: e.g. the live top-k loss
``method.loss.kind=topk_kl``) change the run; ``--label`` names the arm in the tags and the report (one GPU,
long sequences: ``--worlds 1 --seq 32768 ...`` gives the step time and peak memory of one length, or the
out-of-memory that says it does not fit).
A launch that fails (out of memory, a timeout) is recorded with its reason and the rest go on.
``--profile extra`` adds one launch per point under torch.profiler (rank 0, after the warmup steps): the time
in parameter all-gathers (ZeRO-3's per-module fetch), reduce-scatters and all-reduces per step and per
1K tokens, next to the step time; the profiler's table is kept. Not a test: nothing is asserted here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
RANK = Path(__file__).with_name("scaling_rank.py")

LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
QWEN3MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, tie_word_embeddings=False, max_position_embeddings=40960)
TINY_MOE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                tie_word_embeddings=False, max_position_embeddings=4096)
LLAMA1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
MODELS = {"llama8b": ("llama", LLAMA8B), "llama1b": ("llama", LLAMA1B), "tiny": ("llama", TINY), "qwen3moe": ("moe", QWEN3MOE),
          "tiny_moe": ("moe", TINY_MOE)}


def say(msg: str) -> None:
    print(f"[scaling] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moe_dir(shape: Dict[str, Any], layers: Optional[int], root: Path, cpu: bool) -> Path:
    """A random-weight Qwen3-MoE as a local HF directory (written once), with a small BPE tokenizer."""
    shape = dict(shape, **({"num_hidden_layers": layers} if layers else {}))
    d = root / f"qwen3moe-h{shape['hidden_size']}-l{shape['num_hidden_layers']}-e{shape['num_experts']}"
    if (d / "config.json").is_file() and (d / "tokenizer.json").is_file():
        return d
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dev = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    say(f"writing a random Qwen3-MoE ({shape['num_hidden_layers']} layers) to {d} on {dev}")
    cfg = Qwen3MoeConfig(**shape, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32     # bf16 from the start: 30B in fp32 is 122 GB
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            m = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    m.save_pretrained(tmp)
    del m
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["random weights, synthetic tokens: the tokenizer is never used for data"] * 4,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(tmp)
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def model_overrides(a) -> List[str]:
    kind, shape = MODELS[a.model]
    dtype = "float32" if a.cpu else "bfloat16"
    if kind == "llama":
        return ["model=tiny_llama", f"model.dtype={dtype}"] + [f"model.tiny.{k}={v}" for k, v in shape.items()] + \
               ([f"model.tiny.num_hidden_layers={a.layers}"] if a.layers else [])
    d = moe_dir(shape, a.moe_layers or a.layers, Path(a.work), a.cpu)
    return [f"model.path={d}", f"model.name={a.model}", f"model.dtype={dtype}"]


def sp_of(a, n: int) -> int:
    """The sequence-parallel size at N GPUs (--sp: an int, or all = N)."""
    return n if a.sp == "all" else int(a.sp)


def point_overrides(a, mode: str, n: int) -> Optional[List[str]]:
    sp = sp_of(a, n)
    if n % sp:
        return None                          # N GPUs do not form groups of sp
    dp = n // sp                             # the data-parallel degree: sequences in flight
    if mode == "strong":
        per = a.global_batch // dp
        if per * dp != a.global_batch or per % a.micro:
            return None                      # this N does not divide the global batch
        micro, gas = a.micro, per // a.micro
    else:
        micro, gas = a.micro, a.gas
    samples = micro * gas * dp * a.steps
    hw = ["train.precision=fp32", "train.device=cpu", "train.optimizer=adamw_torch"] if a.cpu else \
         ["train.precision=bf16", "train.device=cuda", f"train.optimizer={a.optimizer}"]
    arm = [f"method={a.method}", f"format={a.format}"] + \
        (["method.teacher=live"] if a.method.startswith("qad") else ["method.eval_teacher=false"])
    return model_overrides(a) + hw + arm + [
        "data=synthetic", f"data.synthetic={samples}",
        f"data.seq_len={a.seq}", "data.eval_samples=1", f"train.max_steps={a.steps}", f"train.micro_batch={micro}",
        f"train.grad_accum={gas}", f"train.zero_stage={a.zero_stage}", f"train.grad_ckpt={str(not a.cpu).lower()}",
        "train.eval_every=0", "train.eval_samples=1", "train.save_every=0", "train.save_final=false",
        "train.save_student=false", "train.progress=false", "train.plots=false", "train.tensorboard=false",
        "method.calib_samples=1", "train.lr=1e-5"] + ([f"train.sequence_parallel={sp}"] if sp > 1 else []) + \
        list(a.set)


def launch(a, tag: str, over: List[str], n: int, profile: bool) -> Dict[str, Any]:
    out = Path(a.out)
    run_dir = Path(a.work) / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if a.cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    env["SCALING_PROFILE"] = str(out / f"{tag}.profile.json") if profile else ""
    env["SCALING_WARMUP"] = str(a.warmup)
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    cmd = [launcher, "--num_gpus", str(n), "--master_port", str(free_port()), str(RANK), *over, f"run_dir={run_dir}"]
    t0 = time.time()
    log = out / f"{tag}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    rec: Dict[str, Any] = {"tag": tag, "rc": rc, "wall_s": round(time.time() - t0, 1)}
    text = log.read_text(errors="replace")
    if rc != 0:
        oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
        rec["error"] = "out of memory" if oom else (f"timeout after {a.timeout} s" if rc == "timeout" else
                                                    next((l.strip() for l in reversed(text.splitlines())
                                                          if "Error" in l or "RUN_FAILED" in l), f"rc={rc}")[:300])
        return rec
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r for r in recs if "step_ms" in r and r["step"] > a.warmup]
    if not steps:
        rec["error"] = f"no step after the {a.warmup} warmup steps"
        return rec
    rec.update(step_ms=statistics.median(r["step_ms"] for r in steps),
               tokens_per_s=statistics.median(r["tokens_per_s"] for r in steps),
               peak_mem_gb=max(r["mem_gb"] for r in recs if "mem_gb" in r), timed_steps=len(steps),
               loss_last=steps[-1]["loss"])
    if profile and Path(env["SCALING_PROFILE"]).is_file():
        rec["profile"] = json.loads(Path(env["SCALING_PROFILE"]).read_text())
    return rec


def run(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    results = out / "scaling.jsonl"
    for zero in a.zero:
        a.zero_stage = zero
        for mode in a.modes:
            for n in a.worlds:
                over = point_overrides(a, mode, n)
                if over is None:
                    say(f"skip {mode} N={n}: the global batch {a.global_batch} does not split over {n} x micro {a.micro}")
                    continue
                for profile in {"none": [False], "extra": [False, True], "only": [True]}[a.profile]:
                    sp = sp_of(a, n)
                    tag = f"{a.model}-z{zero}-{mode}-n{n}{f'-sp{sp}' if sp > 1 else ''}{f'-{a.label}' if a.label else ''}" \
                          f"{'-profile' if profile else ''}"
                    say(f"{tag}: {' '.join(o for o in over if o.startswith(('train.micro', 'train.grad_accum', 'data.seq')))}")
                    rec = launch(a, tag, over, n, profile)
                    rec.update(model=a.model, layers=a.moe_layers or a.layers or MODELS[a.model][1]["num_hidden_layers"],
                               zero=zero, mode=mode, world=n, seq=a.seq, sp=sp, label=a.label,
                               micro=int(next(o for o in over if o.startswith("train.micro_batch=")).split("=")[1]),
                               gas=int(next(o for o in over if o.startswith("train.grad_accum=")).split("=")[1]),
                               profiled=profile, device="cpu" if a.cpu else "cuda",
                               date=time.strftime("%Y-%m-%d"))
                    with open(results, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    say(f"{tag}: " + (f"{rec['step_ms']:.0f} ms/step, {rec['tokens_per_s']:.0f} tok/s, "
                                      f"{rec['peak_mem_gb']:.1f} GB" if "step_ms" in rec else rec.get("error", "?")))
    return 0


# ----------------------------------------------------------------------------- report
def _table(rows: List[Dict[str, Any]]) -> List[str]:
    """One scaling table: a row per GPU count from the timed launch; a profiled launch adds its
    collective times (and stands in for the row, marked *, when it is the only launch of that N)."""
    timed = {r["world"]: r for r in rows if "step_ms" in r and not r.get("profiled")}
    prof = {r["world"]: r for r in rows if r.get("profiled")}
    base = timed[min(timed)] if timed else None
    lines = ["| GPUs | micro x accum | global batch (seqs) | step (ms) | tokens/s | tokens/s per GPU | peak GB (rank 0) "
             "| efficiency | all-gather / reduce-scatter / all-reduce ms per step (profiled) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for n in sorted({r["world"] for r in rows}):
        r = timed.get(n) or next((x for x in rows if x["world"] == n and not x.get("profiled")), None) or prof[n]
        p = (prof.get(n) or {}).get("profile")
        comm = (f"{p['per_step_ms'].get('all_gather', 0):.1f} / {p['per_step_ms'].get('reduce_scatter', 0):.1f} / "
                f"{p['per_step_ms'].get('all_reduce', 0):.1f} of {p['step_ms']:.0f}") if p else \
            (prof[n].get("error", "-") if n in prof else "-")
        g = r["micro"] * r["gas"] * r["world"] // r.get("sp", 1)
        if "step_ms" not in r:
            lines.append(f"| {n} | {r['micro']} x {r['gas']} | {g} | - | - | - | - | {r.get('error', '?')} | {comm} |")
            continue
        star = "*" if r.get("profiled") else ""
        step = p["step_ms"] if star and p else r["step_ms"]
        tps = r["tokens_per_s"] if not (star and p) else p["tokens_per_step"] / (p["step_ms"] / 1000.0)
        per = tps / n
        if base is None or star:
            eff = "-"
        elif r["mode"] == "strong":
            eff = f"{base['step_ms'] * base['world'] / (r['step_ms'] * n):.2f} (vs {base['world']})"
        else:
            eff = f"{per / (base['tokens_per_s'] / base['world']):.2f} (vs {base['world']})"
        lines.append(f"| {n} | {r['micro']} x {r['gas']} | {g} | {step:.0f}{star} | {tps:.0f}{star} | {per:.0f}{star} | "
                     f"{r['peak_mem_gb']:.1f} | {eff} | {comm} |")
    if any(r.get("profiled") and "step_ms" in r and r["world"] not in timed for r in rows):
        lines.append("\n\\* from the profiled launch (torch.profiler running: slower than a timed launch)")
    return lines


def report(a) -> int:
    rows: List[Dict[str, Any]] = []
    for d in a.dirs:
        p = Path(d) / "scaling.jsonl" if Path(d).is_dir() else Path(d)
        rows += [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    def key(r):
        sp = r.get("sp", 1)
        return r["model"], r["layers"], r["zero"], r["mode"], r["seq"], r["device"], \
            "all" if sp == r["world"] and sp > 1 else str(sp), r.get("label", "")
    for k in sorted({key(r) for r in rows}):
        model, layers, zero, mode, seq, dev, sp, label = k
        sel = [r for r in rows if key(r) == k]
        spt = "" if sp == "1" else (", each sequence over all GPUs (Ulysses)" if sp == "all" else
                                  f", each sequence over {sp} GPUs (Ulysses)")
        print(f"### {model} ({layers} layers){f' {label}' if label else ''}, ZeRO-{zero}, {mode} scaling, "
              f"{seq} tokens/sequence{spt}, {dev} "
              f"({sel[0].get('date', '?')})\n")
        print("\n".join(_table(sel)) + "\n")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    r.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    r.add_argument("--moe-layers", type=int, default=None, help="qwen3moe: layers (48 = the real model)")
    r.add_argument("--zero", type=int, nargs="+", default=[3], choices=[2, 3])
    r.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    r.add_argument("--modes", nargs="+", default=["strong", "weak"], choices=["strong", "weak"])
    r.add_argument("--seq", type=int, default=4096)
    r.add_argument("--micro", type=int, default=1)
    r.add_argument("--gas", type=int, default=2, help="weak scaling: accumulation steps per GPU")
    r.add_argument("--global-batch", type=int, default=16, help="strong scaling: sequences per optimizer step")
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--optimizer", default="adamw_fused", choices=["adamw_fused", "adamw_torch"])
    r.add_argument("--profile", choices=["none", "extra", "only"], default="none",
                   help="extra: one more launch per point under torch.profiler; only: the profiled launch alone")
    r.add_argument("--timeout", type=int, default=540, help="seconds per launch")
    r.add_argument("--cpu", action="store_true", help="CPU gloo, fp32 (the smoke test)")
    r.add_argument("--sp", default="1", help="Ulysses sequence-parallel size: an int, or all (= each N)")
    r.add_argument("--method", default="qad", help="the method recipe (qad; qat with --format bf16: plain SFT)")
    r.add_argument("--format", default="nvfp4_w4a16", help="the format recipe (bf16: no quantization)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more override (repeatable)")
    r.add_argument("--label", default="", help="the arm's name in tags and tables")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default=os.environ.get("SCALING_WORK", "/tmp/qf-scaling"))
    q = sub.add_parser("report")
    q.add_argument("dirs", nargs="+")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return run(a) if a.cmd == "run" else report(a)


if __name__ == "__main__":
    sys.exit(main())
