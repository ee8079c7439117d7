"""Training step time on one GPU: bf16 SFT vs QAT (W4A16, W4A4), QAD (live, cached teacher), LoRA-QAD,
beside the peers (plain PyTorch loops, NVIDIA Model Optimizer; benchmarks/step_peers.py), in one table.

    python benchmarks/step.py --out DIR                  # all variants + peers: DIR/step.md, step.json
    python benchmarks/step.py --before --variants "W4A16,W4A4,live,cached,SFT" --budget 270 --out DIR
    python benchmarks/step.py --loss               # the KD loss alone: naive vs token / token x vocab chunks
    python benchmarks/step.py --loss --loss-smoke  # the same rows at CPU size (checks the script only)
    python benchmarks/step.py --device cpu --model smoke --seq 64 --batch 2 ...   # CPU smoke of the script
    python benchmarks/step.py --model moe --out DIR       # the MoE table (Qwen3-MoE-like, 64 experts, top-8)

Model: a random Llama, hidden 2048, 16 layers (16 heads, 8 KV heads, MLP 5632, vocab 32000, untied),
batch 4 x 2048 tokens, bf16, DeepSpeed ZeRO-0 with fused AdamW (FusedAdam), chunked loss, through the
real trainer (qatfactory.train.loop.run). ``--before`` adds, beside each QAT/QAD row, the same run with
the switchable step levers off (train.weight_cache=false: fq(W) every forward; method.loss.fused=false:
autograd per loss chunk; the per-linear launch plan cannot be switched off and is in both), and beside SFT,
W4A4 and live QAD a "[before: stock DeepSpeed step]" row (train.lean_step=false train.ds_timers=true:
DeepSpeed's per-parameter bf16 step, one-rank all-reduce and timer syncs; benchmarks/step_counts.py counts
them). Rows to measure beside the default: ZeRO-1, BF16_Optimizer, lean activations (a memory lever).

``--model moe``: the same table for a random Qwen3-MoE (model=tiny_qwen3_moe: transformers'
Qwen3MoeForCausalLM, fused 3-D experts, grouped_mm), same batch. Qwen3-30B-A3B's layer -- hidden 2048,
32 query / 4 KV heads of 128, experts of width 768, 8 routed per token, top-k weights renormalised --
with 64 experts (half of the 30B's 128) and 8 layers (of its 48), vocab 32000
(the Llama rows'; Qwen3's 151936 would put a 311M head and full-vocabulary logits, not experts, into
the comparison), untied. Per layer 302M expert + 19M attention parameters, 2.70B in all, 0.52B active
per token: ~30 TFLOP per training step, attention included. Why this size: QAD with a live teacher
holds about 20 bytes per parameter in the trainer (bf16 weights and gradients, fp32 masters, an fp32
gradient copy, two fp32 Adam moments) plus a 2-byte bf16 teacher and the 2-byte kept fake-quantized
weights, ~60 GiB, plus ~1 GiB of saved expert activations per layer at 4 x 2048 tokens x top-8:
~70 GiB expected (not measured), well inside an H200's 139 GiB with room for Model Optimizer's
fp32-master QAD (16 bytes per parameter, its full-vocabulary logits, per-expert fake-quantized
copies); 16 layers (5.3B) would pass 120 GiB. If the grouped expert GEMMs ran as fast as the Llama
rows' dense ones (~300 TFLOP/s of GPU-busy time in its SFT row) the step's math would take ~100 ms,
plus a third more for the live teacher's forward: a QAD step of a few hundred ms. The routers
(mlp.gate) stay bf16 on every row; Model Optimizer runs the experts eager (benchmarks/step_peers.py
says why and what its rows note). Not yet measured on a GPU. ``--model moe_smoke``: a CPU-sized
Qwen3-MoE (8 experts, top-2) that checks the script and measures nothing.

Every job runs on one of two persistent workers (ours / peers, benchmarks/step_workers.py), one job at a
time, in interleaved rounds (``--repeat``, cut short by ``--budget``); the first --warmup steps of a
run are excluded from its timing and round 0 also profiles --profile-steps more steps (GPU busy vs
wall, benchmarks/step_profile.py). ``--fresh``: a new process per job instead (slower; for a check).
Not a test: nothing is asserted; the lead runs it on an H200 (benchmarks/gpu/step.sh) and copies the
table to RESULTS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=32000", "model.tiny.hidden_size=2048",
         "model.tiny.intermediate_size=5632", "model.tiny.num_hidden_layers=16", "model.tiny.num_attention_heads=16",
         "model.tiny.num_key_value_heads=8", "model.tiny.tie_word_embeddings=false"]
# --model smollm2: SmolLM2-135M's shape (the pipeline's part 2 model), random weights; 4 x 2048 tokens is
# what one rank of that run computes per optimizer step (2 x 2048 x accum 2); --model smoke: a CPU-sized
# Llama that checks the script end to end and measures nothing
MODELS = {"llama1b": MODEL,
          "smollm2": ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=49152",
                      "model.tiny.hidden_size=576", "model.tiny.intermediate_size=1536",
                      "model.tiny.num_hidden_layers=30", "model.tiny.num_attention_heads=9",
                      "model.tiny.num_key_value_heads=3", "model.tiny.tie_word_embeddings=true"],
          "smoke": ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=512",
                    "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
                    "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=4",
                    "model.tiny.num_key_value_heads=2", "model.tiny.tie_word_embeddings=false"],
          # the MoE table's shape (see the docstring) and its CPU smoke
          "moe": ["model=tiny_qwen3_moe", "model.dtype=bfloat16", "model.tiny.arch=qwen3_moe",
                  "model.tiny.vocab_size=32000", "model.tiny.hidden_size=2048", "model.tiny.num_hidden_layers=8",
                  "model.tiny.num_attention_heads=32", "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=128",
                  "model.tiny.num_experts=64", "model.tiny.num_experts_per_tok=8",
                  "model.tiny.moe_intermediate_size=768", "model.tiny.norm_topk_prob=true",
                  "model.tiny.tie_word_embeddings=false"],
          "moe_smoke": ["model=tiny_qwen3_moe", "model.dtype=bfloat16", "model.tiny.arch=qwen3_moe",
                        "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_hidden_layers=2",
                        "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2",
                        "model.tiny.head_dim=16", "model.tiny.num_experts=8", "model.tiny.num_experts_per_tok=2",
                        "model.tiny.moe_intermediate_size=32", "model.tiny.norm_topk_prob=true",
                        "model.tiny.tie_word_embeddings=false"]}
SHAPE_NAMES = {"llama1b": "random Llama hidden 2048 x 16 layers",
               "smollm2": "random Llama, SmolLM2-135M shape (576 x 30 layers)",
               "smoke": "random Llama, CPU smoke shape (64 x 2 layers): checks the script, measures nothing",
               "moe": "random Qwen3-MoE hidden 2048 x 8 layers, 64 experts (width 768), top-8, 2.70B parameters",
               "moe_smoke": "random Qwen3-MoE, CPU smoke shape (64 x 2 layers, 8 experts, top-2): checks the "
                            "script, measures nothing"}
BEFORE = " [before: weight cache off, unfused loss]"
BEFORE_OVER = ["method.loss.fused=false", "train.weight_cache=false"]
HAS_BEFORE = ("QAT W4A16 (CE)", "QAT W4A4 (CE)", "QAD W4A16 live teacher", "QAD W4A16 cached teacher (top-64)")
# the host work of the step (train/ds_step.py; the same bits, tests/train/test_step_levers.py): DeepSpeed's
# own bf16 ZeRO-0 step (a host read and copies per parameter), its one-rank all-reduce and throughput timer
BEFORE_DS = " [before: stock DeepSpeed step]"
BEFORE_DS_OVER = ["train.lean_step=false", "train.ds_timers=true"]
HAS_BEFORE_DS = ("bf16 SFT (no quant, CE)", "QAT W4A4 (CE)", "QAD W4A16 live teacher")
# (before suffix, the variants that have one, what the before row turns off): the levers table pairs them
BEFORE_KINDS = ((BEFORE, HAS_BEFORE, "train.weight_cache=false method.loss.fused=false; the launch plan is in both"),
                (BEFORE_DS, HAS_BEFORE_DS, "train.lean_step=false train.ds_timers=true"))


def variants(fmt: str, before: bool = False):
    w16, w4 = f"format={fmt}_w4a16", f"format={fmt}_w4a4"
    base = {
        "bf16 SFT (no quant, CE)": ["method=qat", "format=bf16", "method.eval_teacher=false"],
        "QAT W4A16 (CE)": ["method=qat", w16, "method.eval_teacher=false"],
        "QAT W4A4 (CE)": ["method=qat", w4, "method.eval_teacher=false"],
        "QAD W4A16 live teacher": ["method=qad", w16],
        "QAD W4A16 live teacher, grad ckpt": ["method=qad", w16, "train.grad_ckpt=true"],
        "QAD W4A16 cached teacher (top-64)": ["method=qad", w16, "method.teacher=cached", "method.topk=64"],
        "LoRA-QAD W4A16 (r=16)": ["method=qad_lora", w16, "quant.lora.rank=16"],
        # the DeepSpeed step paths and the activation-memory lever (rows to measure beside the default;
        # tests/train/test_step_levers.py, tests/nn/test_lean_act.py say what they compute)
        "bf16 SFT, ZeRO-1": ["method=qat", "format=bf16", "method.eval_teacher=false", "train.zero_stage=1"],
        "bf16 SFT, ZeRO-1 BF16_Optimizer (fp32 grads, immediate update)":
            ["method=qat", "format=bf16", "method.eval_teacher=false", "train.zero_stage=1",
             "train.grad_accum_dtype=fp32", "train.immediate_grad_update=true"],
        "QAD W4A16 live teacher, lean activations": ["method=qad", w16, "train.lean_act=true"],
    }
    out = {}
    for name, over in base.items():
        if before and name in HAS_BEFORE:
            out[name + BEFORE] = over + BEFORE_OVER
        if before and name in HAS_BEFORE_DS:
            out[name + BEFORE_DS] = over + BEFORE_DS_OVER
        out[name] = over
    return out


@contextlib.contextmanager
def _env(over):
    """Apply the ``env:K=V`` items of a variant for the run; returns the Hydra overrides."""
    env = dict(o[4:].split("=", 1) for o in over if o.startswith("env:"))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield [o for o in over if not o.startswith("env:")]
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def peak_after_first_step(cuda: bool):
    """Peak memory counted from the first optimizer step on (setup, calibration, a teacher cache pass
    excluded; the optimizer states exist by then), as the peers' loops count theirs."""
    if not cuda:
        yield
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    done = []

    def hook(opt, a, k):
        if not done:
            done.append(1)
            torch.cuda.reset_peak_memory_stats()
    h = register_optimizer_step_post_hook(hook)
    try:
        yield
    finally:
        h.remove()


def _slug(name: str) -> str:
    # letters, digits and _ only: the path is a Hydra override value (a comma would make it a sweep)
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def one(name: str, over, args, profile: bool = False, tag: str = "") -> dict:
    """One run of a variant through the trainer: timing of steps warmup+1..steps; with ``profile``,
    1 + profile_steps more steps profiled (GPU busy vs wall; not timed)."""
    import torch
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    from step_profile import StepProfile
    cuda = args.device == "cuda"
    profile = profile and args.profile_steps > 0          # --profile-steps 0: no profiled steps at all
    run_dir = Path(args.workdir) / (_slug(name) + (f"_{tag}" if tag else ""))
    total = args.steps + (1 + args.profile_steps if profile else 0)
    with _env(over) as hydra:
        # the variant's own overrides last: a lever row may override the fixed ones (train.zero_stage=1)
        cfg = compose(MODELS[args.model] + [
            f"run_dir={run_dir}", "data.synthetic=%d" % (total * args.batch), f"data.seq_len={args.seq}",
            "data.eval_samples=1", f"train.micro_batch={args.batch}", "train.grad_accum=1", "train.precision=bf16",
            f"train.optimizer={'adamw_fused' if cuda else 'adamw_torch'}", "train.zero_stage=0",
            f"train.max_steps={total}", "train.eval_every=0", "train.eval_samples=1", "train.save_final=false",
            "train.save_student=false", "train.progress=false", "train.plots=false", "train.tensorboard=false",
            f"train.device={args.device}", "method.calib_samples=2", f"method.loss.chunk_tokens={args.chunk}"] + hydra)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sp = StepProfile(skip=args.steps + 1, steps=args.profile_steps, device=args.device,
                         op_table=bool(args.op_table and args.op_table in name)) if profile else None
        with sp if sp is not None else contextlib.nullcontext(), peak_after_first_step(cuda):
            s = run(cfg)
        s.pop("engine").destroy()
        note = quantized_note(s["student"].model)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_ms" in r and args.warmup < r["step"] <= args.steps]
    ms = statistics.median(r["step_ms"] for r in steps)
    row = {"variant": name, "ms_per_step": ms, "step_ms_all": [round(r["step_ms"], 1) for r in steps],
           "tokens_per_s": args.batch * args.seq / (ms / 1000.0),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "steps_timed": len(steps), "final_loss": steps[-1]["loss"] if steps else None}
    if note:
        row["note"] = note
    if sp is not None:
        row["profile"] = sp.result
        if sp.op_text and args.out:
            Path(args.out, f"profile_{_slug(name)}.txt").write_text(sp.op_text)
    return row


def quantized_note(model) -> str:
    """What our run trained quantized, read from the student (MoE: the expert tensors and the experts
    implementation); empty for a dense model."""
    from qatfactory.nn import QuantExpertsMixin, QuantLinear
    fused = [m for m in model.modules() if getattr(m._parameters.get("gate_up_proj"), "ndim", 0) == 3]
    if not fused:
        return ""
    import torch.nn as nn
    lin = [m for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear)) and not n.endswith("lm_head")]
    q_lin = sum(isinstance(m, QuantLinear) for m in lin)
    q_exp = sum(isinstance(m, QuantExpertsMixin) for m in fused)
    impl = getattr(model.config, "_experts_implementation", None)
    if not q_lin and not q_exp:
        return f"experts {impl}"
    return (f"linears {q_lin}/{len(lin)}, expert tensors {2 * q_exp}/{2 * len(fused)} (per-expert scale), "
            f"experts {impl}")


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


# the step-time goals, ours against a peer: (ours, peer, allowed ratio)
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
            last = runs[name][-1]
            key = "not_run" if "not_run" in last else "error"
            out.append({"kind": kind, "variant": name, key: last.get(key, "?")})
            continue
        ms = [r["ms_per_step"] for r in ok]
        # the job's own peak: what was still allocated when it started (another job's leftover, reported in
        # the notes) is not its memory; measured 2026-12-03: Model Optimizer's jobs leave 9.97 GiB behind in
        # the peer worker, which made every later peer row 10 GiB heavier than the peer is
        mem = [r["peak_mem_gib"] - (r.get("mem_before_gib") or 0.0) for r in ok if r.get("peak_mem_gib") is not None]
        tps = [r["tokens_per_s"] for r in ok if "tokens_per_s" in r]
        out.append({"kind": kind, "variant": name, "ms_per_step": statistics.median(ms), "min_ms": min(ms),
                    "max_ms": max(ms), "rounds": len(ms), "note": ok[0].get("note"),
                    "comparable": all(r.get("comparable", True) for r in ok),
                    "tokens_per_s": statistics.median(tps) if tps else 4 * 2048 / (statistics.median(ms) / 1000),
                    "peak_mem_gib": max(mem) if mem else None,
                    "weights_changed_by_step_1": ok[0].get("weights_changed_by_step_1"), "runs": ok})
    return out


def table(rows) -> str:
    by = {r["variant"]: r for r in rows if "ms_per_step" in r}
    base = by.get("plain loop, fp32 masters")
    notes = any(r.get("note") for r in rows)
    L = ["| variant | ms/step | spread | tokens/s | vs plain fp32-master loop | peak GiB | weights changed by step 1 |"
         + (" note |" if notes else ""), "|---|---:|---|---:|---:|---:|---:|" + ("---|" if notes else "")]
    tail = " |" if notes else ""
    for r in rows:
        if "not_run" in r:
            L.append(f"| {r['variant']} | not run: {r['not_run'][:90]} | | | | | |" + tail)
            continue
        if "error" in r:
            L.append(f"| {r['variant']} | failed | | | | | {r['error'][:90]} |" + tail)
            continue
        rel = f"{r['ms_per_step'] / base['ms_per_step']:.2f}x" if base else "-"
        ch = r.get("weights_changed_by_step_1")
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        chg = "-" if ch is None else f"{100 * ch:.1f}%"
        L.append(f"| {'ours: ' if r['kind'] == 'ours' else ''}{r['variant']} | {r['ms_per_step']:.1f} | "
                 f"{r['min_ms']:.1f}..{r['max_ms']:.1f} | {r['tokens_per_s']:.0f} | {rel} | {mem} | {chg} |"
                 + (f" {r.get('note') or ''} |" if notes else ""))
    L += ["", "| goal | ours / peer | allowed | met |", "|---|---:|---:|---|"]
    for ours, peer, lim in GOALS:
        if ours in by and peer in by:
            q = by[ours]["ms_per_step"] / by[peer]["ms_per_step"]
            if by[peer].get("comparable") is False or by[ours].get("comparable") is False:
                # a peer that left weights unquantized did less work: no ratio is a verdict then
                L.append(f"| {ours} vs {peer} | not comparable ({q:.2f}) | <= {lim:.2f} | - |")
                continue
            # Model Optimizer switches MoE experts to transformers' eager loop: the ratio then measures that loop
            # as much as the quantizer (the "plain loop ..., eager experts" row separates the two)
            eager = " (the peer's experts ran eager)" if "experts eager" in (by[peer].get("note") or "") else ""
            L.append(f"| {ours} vs {peer} | {q:.2f} | <= {lim:.2f} | {'yes' if q <= lim else 'NO'}{eager} |")
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


def run_job(kind: str, job: dict, args) -> dict:
    """A worker's job: one run of an ours or a peer variant."""
    if kind == "ours":
        vs = variants(args.format, before=True)
        return one(job["name"], vs[job["name"]], args, profile=job.get("profile", False), tag=f"r{job['round']}")
    import step_peers
    return step_peers.run_peer(job["name"], args.model, args.steps, args.warmup, args.batch, args.seq, args.lr,
                               device=args.device, profile_steps=args.profile_steps if job.get("profile") else 0)


def _keys(spec: str):
    """Substrings separated by '|' (names hold commas), or by ',' when there is no '|'."""
    return [k.strip() for k in spec.split("|" if "|" in spec else ",") if k.strip()]


def _common(args):
    out = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--format", args.format, "--chunk",
           str(args.chunk), "--model", args.model, "--device", args.device, "--seq", str(args.seq), "--batch",
           str(args.batch), "--workdir", args.workdir, "--profile-steps", str(args.profile_steps), "--lr",
           str(args.lr)]
    if args.op_table:
        out += ["--op-table", args.op_table]
    if args.out:
        out += ["--out", args.out]
    return out


def levers(rows) -> str:
    """Each variant run with and without the switchable step levers: before, after, the ratio."""
    by = {r["variant"]: r for r in rows if "ms_per_step" in r}
    L = ["| variant | before (what is off) | before ms/step | after ms/step | after / before | before peak GiB "
         "| after peak GiB |", "|---|---|---:|---:|---:|---:|---:|"]
    gib = lambda r: "-" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.1f}"   # noqa: E731
    for suffix, names, what in BEFORE_KINDS:
        for name in names:
            b, a = by.get(name + suffix), by.get(name)
            if a is None or b is None:
                continue
            L.append(f"| {name} | {what} | {b['ms_per_step']:.1f} | {a['ms_per_step']:.1f} | "
                     f"{a['ms_per_step'] / b['ms_per_step']:.2f} | {gib(b)} | {gib(a)} |")
    return "\n".join(L) if len(L) > 2 else ""


def report(order, runs, notes, args, versions_line=None) -> str:
    import step_workers
    order = [o for o in order if o[0] == "ours"] + [o for o in order if o[0] != "ours"]
    rows = summarize(order, runs)
    L = [f"step time, {SHAPE_NAMES[args.model]}, batch {args.batch} x {args.seq}, bf16, {args.steps} steps "
         f"({args.warmup} warm-up excluded), format {args.format}, device {args.device}, up to {args.repeat} "
         f"interleaved rounds (median of the rounds' medians; spread = min..max over rounds)"
         f"{versions() if versions_line is None else versions_line}", "",
         table(rows), "",
         "step levers (each before row turns off what its column says):",
         "", levers(rows) or "(no before/after pairs ran)", "",
         f"profile (round 0, {args.profile_steps} steps after the timed ones; GPU busy = union of kernel/copy "
         f"intervals; idle = wall - busy, the host-bound share):", "", step_workers.profile_table(order, runs)]
    leaks = [f"{r['variant']} (round {r['round']}): {r['mem_before_gib']:.2f} GiB"
             for rs in runs.values() for r in rs if (r.get("mem_before_gib") or 0) > 0.05]
    if leaks:
        notes = notes + ["memory still allocated when a job started (a leak from an earlier job): " + "; ".join(leaks)]
    swaps = [f"{r['variant']} (round {r['round']}): {r['mem_after_gib']:.2f} GiB"
             for rs in runs.values() for r in rs if r.get("worker_restarted")]
    if swaps:
        notes = notes + ["jobs that left memory allocated after they ended (their worker was replaced before the "
                         "next job): " + "; ".join(swaps)]
    if notes:
        L += ["", "notes:"] + [f"- {n}" for n in notes]
    return "\n".join(L), rows


def remake_report(path: Path, out_dir) -> int:
    """step.md again from a step.json (its per-round records), e.g. after a change to how rows are summarized."""
    d = json.loads(path.read_text())
    a = argparse.Namespace(**d["args"])
    order = [(r["kind"], r["variant"]) for r in d["rows"]]
    runs = {r["variant"]: (r.get("runs") or [{k: r[k] for k in ("error", "not_run") if k in r}]) for r in d["rows"]}
    notes = [n for n in d.get("notes", []) if not n.startswith(("memory still allocated", "jobs that left memory"))]
    md, rows = report(order, runs, notes, a, versions_line=d.get("versions") or "")
    if out_dir is None:
        print(md)
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "step.md").write_text(md + "\n")
    (out_dir / "step.json").write_text(json.dumps(dict(d, rows=rows, notes=notes), indent=1, default=str))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--chunk", type=int, default=2048, help="loss chunk (tokens)")
    ap.add_argument("--model", default="llama1b", choices=sorted(MODELS),
                    help="llama1b: the table's model (default); moe: the MoE table's Qwen3-MoE (64 experts, "
                         "top-8); smollm2: SmolLM2-135M's shape; smoke, moe_smoke: CPU-sized")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-6, help="the peers' AdamW rate (the changed column depends on it)")
    ap.add_argument("--only", default=None, help="run one of our variants in this process (prints its ROW)")
    ap.add_argument("--serve", default=None, choices=["ours", "peer"], help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="a folder: step.md, step.json (and profile_*.txt) go there")
    ap.add_argument("--variants", default=None,
                    help="substrings (',' or '|'-separated): run only our variants whose name contains one")
    ap.add_argument("--peers", default=None, help="substrings ('|'-separated): only these peers (default: all)")
    ap.add_argument("--skip", default=None, help="substrings: leave out our variants whose name contains one")
    ap.add_argument("--before", action="store_true",
                    help="add each QAT/QAD variant with the step levers off (weight cache, fused loss)")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps profiled in round 0 (0: none)")
    ap.add_argument("--op-table", default=None,
                    help="a variant substring: its profile also records CPU ops and writes op tables to --out")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds of every variant")
    ap.add_argument("--budget", type=float, default=0, help="seconds: start no job that would end after it")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--fresh", action="store_true", help="a new worker process per job")
    ap.add_argument("--no-peers", dest="peers_on", action="store_false",
                    help="leave out the peers' rows (plain loops, Model Optimizer; benchmarks/step_peers.py)")
    ap.add_argument("--loss", action="store_true", help="only the chunked-vs-naive loss memory table")
    ap.add_argument("--loss-smoke", action="store_true", help="with --loss: CPU-sized shapes (checks the script)")
    ap.add_argument("--report", default=None, metavar="STEP_JSON",
                    help="re-make step.md (to --out, else stdout) from an earlier run's step.json; runs nothing")
    args = ap.parse_args(argv)
    if args.report:
        return remake_report(Path(args.report), Path(args.out) if args.out else None)
    if args.loss:
        return loss_memory(args)
    # DeepSpeed's op builder cannot parse "9.0a" (the H200 image's default); FusedAdam needs a plain arch
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").endswith("a"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ["TORCH_CUDA_ARCH_LIST"].rstrip("a")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="qf-step-bench-")
    if args.serve:
        import step_workers
        return step_workers.serve(args.serve, lambda job: run_job(args.serve, job, args))
    vs = variants(args.format, before=args.before)
    if args.variants:
        keys = _keys(args.variants)
        vs = {n: o for n, o in vs.items() if any(k in n for k in keys)}
        if not vs:
            ap.error(f"--variants {args.variants!r} matches none of {list(variants(args.format, args.before))}")
    if args.skip:
        vs = {n: o for n, o in vs.items() if not any(k in n for k in _keys(args.skip))}
    if args.only is not None:
        row = one(args.only, variants(args.format, before=True)[args.only], args)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    import step_peers
    import step_workers
    jobs = [("ours", name, True) for name in vs]
    if args.peers_on:
        keys = _keys(args.peers or "")
        jobs += [("peer", name, True) for name in step_peers.peer_names(args.model)
                 if not keys or any(k in name for k in keys)]
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    cmds = {"ours": me + ["--serve", "ours"] + _common(args), "peer": me + ["--serve", "peer"] + _common(args)}
    order, runs, notes = step_workers.run_rounds(jobs, cmds, args, out_dir or Path(args.workdir))
    md, rows = report(order, runs, notes, args)
    print("\n" + md)
    if out_dir is not None:
        (out_dir / "step.md").write_text(md + "\n")
        (out_dir / "step.json").write_text(json.dumps({"args": vars(args), "rows": rows, "notes": notes,
                                                       "versions": versions()}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
