"""Host work of one training step per weight format, in the real trainer (why ParetoQ QAT steps
crawled on the H200 while NVFP4 ones did not).

A GPU step of a small model is bound by the host: every aten op is a kernel launch the CPU has to issue,
and every host<->device scalar read (``.item()``, ``bool(t)``, ``torch.equal``, ``.cpu()`` of a scalar)
makes the CPU wait until the GPU has drained its queue, so launch overhead and GPU time add up instead of
overlapping. Both can be counted without a GPU: the dispatcher runs the same ops on a CPU (a few
CUDA-only branches aside: the fused kernels of nvfp4 run there instead of the emulator).

    python benchmarks/lowbit_step.py                      # SmolLM2-135M's layer structure, thin, CPU
    python benchmarks/lowbit_step.py --formats paretoq_4bit,nvfp4_w4a16 --steps 6 --json out.json

Per format (a recipe of recipes/format/): a run of ``qatfactory.train`` on a random Llama with
SmolLM2-135M's 30 layers x 7 linears (hidden 64 by default: op counts do not depend on the width), CE
loss (method=qat) with a live teacher only for evaluation (as paretoq_bits.py runs it), the trainer's
fp32 or bf16 DeepSpeed mode. The profiler (CPU ops) records optimizer steps ``skip+1 .. skip+steps``;
reported per step: all aten ops, host<->device scalar reads (aten::_local_scalar_dense, what
``.item()`` / ``bool()`` / ``float()`` of a tensor call on any device; aten::equal returns a Python bool
too), copies (aten::copy_, aten::_to_copy), and the wall ms per step of the unprofiled steps from
metrics.jsonl (CPU speed, not GPU speed: the counts are what carry over).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# a scalar read reaches aten::_local_scalar_dense whichever way it is asked for (item, bool, float,
# is_nonzero); aten::equal answers a Python bool (on CUDA by an item() inside; on a CPU it does not)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::equal")
# leaf ops that launch nothing on a GPU (allocation, metadata, views)
NO_KERNEL = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::reshape",
             "aten::_reshape_alias", "aten::as_strided", "aten::detach", "aten::alias", "aten::t", "aten::transpose",
             "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice", "aten::permute",
             "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::_unsafe_view", "aten::split",
             "aten::unbind", "aten::narrow", "aten::chunk", "aten::set_", "aten::resize_", "aten::result_type",
             "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::size", "aten::stride",
             "aten::lift", "aten::numpy_T", "aten::contiguous", "aten::flatten", "aten::view_as",
             "aten::expand_as", "aten::_has_compatible_shallow_copy_type", "aten::is_same_size", "aten::zeros",
             "aten::dim", "aten::is_floating_point", "aten::cudnn_is_acceptable", "aten::to", "aten::type_as")
COPY_OPS = ("aten::copy_", "aten::_to_copy")
SMOLLM2_LAYERS = 30


def layout(fmt: str, hidden: int, inter: int):
    """ParetoQ grids in 256-element llama.cpp types: their ``*_q4_0`` twin for rows that do not fit."""
    sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
    import paretoq_common as C
    from omegaconf import OmegaConf
    wf = OmegaConf.load(REPO / "recipes" / "format" / f"{fmt}.yaml").get("weight_format")
    if not wf or wf == "none":
        return []
    return C.layout_rules(wf, C.llama_in_features(hidden, inter))


def overrides(fmt: str, run_dir: Path, steps: int, args) -> list:
    if args.model == "smollm2":        # the real SmolLM2-135M-Instruct (the packaged asset)
        model = ["model=smollm2_135m", f"model.dtype={'bfloat16' if args.precision == 'bf16' else 'float32'}"]
        dims = (576, 1536)
    else:
        h = args.hidden
        model = ["model=tiny_llama", "model.dtype=float32", f"model.tiny.hidden_size={h}",
                 f"model.tiny.intermediate_size={2 * h}", f"model.tiny.num_hidden_layers={args.layers}",
                 "model.tiny.num_attention_heads=4", "model.tiny.num_key_value_heads=2"]
        dims = (h, 2 * h)
    return layout(fmt, *dims) + model + [
        f"format={fmt}", "method=qat", "method.eval_teacher=true",
        "train=cpu_tiny", f"train.precision={args.precision}", f"train.max_steps={steps}", "train.lr=1e-4",
        f"train.micro_batch={args.micro}", "train.eval_every=0", "train.clip=1.0", "train.progress=false",
        "data.synthetic=64", f"data.seq_len={args.seq}", "data.eval_samples=2", f"run_dir={run_dir}",
        *args.extra]


def _kernel_like(ev) -> bool:
    """An op that stands for (at least) one kernel launch on a GPU: an aten op that is not allocation,
    metadata or a view, called from outside any other such op (a composite such as ``isfinite`` or a
    CPU-only internal dtype conversion inside a bf16 op counts once, as the dispatcher call it is; a
    multi-tensor ``aten::_foreach_*`` op counts once, where a CPU loops over its tensors)."""
    if not ev.name.startswith("aten::") or ev.name in NO_KERNEL:
        return False
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") and p.name not in NO_KERNEL:
            return False
        p = p.cpu_parent
    return True


def _phase(ev) -> str:
    """optimizer (inside torch.optim's step), backward (inside an autograd node), else forward/other
    (the forward, the loss, DeepSpeed's own per-parameter loops around the optimizer)."""
    p = ev
    while p is not None:
        n = p.name
        if n.startswith("Optimizer.step#"):
            return "optimizer"
        if n.startswith("autograd::engine::evaluate_function"):
            return "backward"
        p = p.cpu_parent
    return "forward_other"


def profile_format(fmt: str, args) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    from qatfactory.train.config import compose
    from qatfactory.train.loop import run

    total = args.skip + 2 + args.steps + args.timed
    with tempfile.TemporaryDirectory() as td:
        cfg = compose(overrides(fmt, Path(td) / "run", total, args))
        counts: collections.Counter = collections.Counter()
        leaves: collections.Counter = collections.Counter()
        phases: collections.Counter = collections.Counter()
        syncs_out: collections.Counter = collections.Counter()
        by_phase_op: collections.Counter = collections.Counter()
        window = {"wall": None}

        def ready(prof):
            for ev in prof.events():
                counts[ev.name] += 1
                if ev.name in SYNC_OPS and _phase(ev) != "optimizer":
                    syncs_out[ev.name] += 1
                if _kernel_like(ev):
                    leaves[ev.name] += 1
                    phases[_phase(ev)] += 1
                    by_phase_op[(_phase(ev), ev.name)] += 1

        prof = profile(activities=[ProfilerActivity.CPU],
                       schedule=schedule(wait=args.skip, warmup=1, active=args.steps, repeat=1), on_trace_ready=ready)
        state = {"n": 0, "t": None}
        import qatfactory.train.methods.base as E
        rank_batch = E.rank_batch

        def at_step_start(*a, **kw):
            # the loop takes each step's micro-batch first (grad_accum 1): the window starts and ends
            # between steps, outside any optimizer or autograd range
            state["n"] += 1
            if state["n"] == args.skip + 2:
                state["t"] = time.perf_counter()
            elif state["n"] == args.skip + 2 + args.steps:
                window["wall"] = (time.perf_counter() - state["t"]) / args.steps
            prof.step()
            return rank_batch(*a, **kw)

        E.rank_batch = at_step_start
        t0 = time.time()
        try:
            with prof:
                s = run(cfg)
        finally:
            E.rank_batch = rank_batch
        s.pop("engine").destroy()
        recs = [json.loads(line) for line in (Path(td) / "run" / "metrics.jsonl").read_text().splitlines()]
        timed = [r["step_ms"] for r in recs if "step_ms" in r and r["step"] > args.skip + 2 + args.steps]
    per = {k: v / args.steps for k, v in counts.items()}
    aten = sum(v for k, v in per.items() if k.startswith("aten::"))
    return {"format": fmt, "aten_ops_per_step": aten,
            "kernel_like_ops_per_step": sum(leaves.values()) / args.steps,
            "kernel_like_by_phase": {k: v / args.steps for k, v in sorted(phases.items())},
            "scalar_syncs_per_step": sum(per.get(k, 0.0) for k in SYNC_OPS),
            "syncs_by_op": {k: per[k] for k in SYNC_OPS if per.get(k)},
            # torch.optim's AdamW reads its per-parameter step counters, CPU tensors also on a GPU (not
            # capturable): host-only there. Everything else reads a tensor on the model's device
            "syncs_outside_optimizer": sum(syncs_out.values()) / args.steps,
            "copies_per_step": sum(per.get(k, 0.0) for k in COPY_OPS),
            "ms_per_step_unprofiled": statistics.median(timed) if timed else None,
            "ms_per_step_profiled": None if window["wall"] is None else window["wall"] * 1000.0,
            "top_kernel_like_ops": [(f"{ph} {name}", v / args.steps) for (ph, name), v in by_phase_op.most_common(25)],
            "run_s": time.time() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="paretoq_4bit,paretoq_3bit,paretoq_2bit,paretoq_ternary,paretoq_binary,"
                                         "nvfp4_w4a16,bf16")
    ap.add_argument("--model", default="thin", choices=["thin", "smollm2"],
                    help="thin: a random Llama with SmolLM2's 30 x 7 linears, --hidden wide; smollm2: the real one")
    ap.add_argument("--layers", type=int, default=SMOLLM2_LAYERS)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--skip", type=int, default=2, help="steps before the profiled window")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--timed", type=int, default=4, help="unprofiled steps after the window (ms per step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="more trainer overrides")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    for fmt in args.formats.split(","):
        r = profile_format(fmt, args)
        rows.append(r)
        ph = r["kernel_like_by_phase"]
        print(f"{fmt:18s} kernel-like ops/step {r['kernel_like_ops_per_step']:7.0f} (forward/other "
              f"{ph.get('forward_other', 0):.0f}, backward {ph.get('backward', 0):.0f}, optimizer "
              f"{ph.get('optimizer', 0):.0f}); scalar reads/step {r['scalar_syncs_per_step']:.0f} (outside the "
              f"optimizer {r['syncs_outside_optimizer']:.0f}); all aten ops {r['aten_ops_per_step']:.0f}; "
              f"ms/step {r['ms_per_step_unprofiled']:.1f}", flush=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "device": "cpu", "threads": args.threads, "setting": {k: v for k, v in vars(args).items() if k != "json"},
           "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
