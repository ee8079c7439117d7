"""Where the memory of a training step goes, decomposed on a CPU and scaled to the H200 shape (why:
live QAD peaked at 27.2 GiB on the H200, the goal is <= 25 GiB with fp32 masters and fp32 Adam states).

    python benchmarks/step_memory.py                  # the decomposition and the predicted peaks (~5 min)
    python benchmarks/step_memory.py --json out.json

Nothing here runs on a GPU and no figure is a GPU measurement; each part is measured on a CPU in the
real code and scaled by what it is proportional to:

1. Per parameter, persistent: the tensors DeepSpeed's optimizer wrapper keeps (read from its attributes:
   flat bf16 weights, fp32 masters, Adam's exp_avg / exp_avg_sq, gradient buffers) for each path (ZeRO-0
   FP16_Optimizer with FusedAdam as on the GPU, lean and stock; ZeRO-1; BF16_Optimizer), in the trainer
   on benchmarks/step_counts.py's 16-layer thin Llama; bytes per trainable parameter.
2. Per parameter, transient: the CPU allocator's live bytes (torch.profiler ``profile_memory``) during one
   training step: what is live when the optimizer step starts (the gradients; the activations are freed
   by then) and what the step adds above that (its flat fp32 gradient and casts; the CPU FusedAdam
   stand-in's foreach temporaries left out: the CUDA kernel makes none). ZeRO-1's reduce bucket
   (``reduce_bucket_size`` elements, in the backward) is the difference of the backward's live peak.
3. Per token: what autograd keeps for the backward (saved tensors, unique storages, parameters aside) in
   Hugging Face's Llama at the H200 widths (hidden 2048, MLP 5632, 16/8 heads), 1 and 2 layers, 128
   tokens; the difference is one layer. With and without train.lean_act (nn/lean_act.py).
4. The loss: its saved tensors (the head gradient in fp32, the hidden gradient), and the transient per
   token of a chunk at the H200 hidden and vocabulary (profile_memory, the slope between chunks of 64 and
   128 tokens, fp32 inputs: a CPU's bf16 GEMM upcasts into temporaries a GPU's does not make), times
   2048 (step.py's chunk).

The peak of a variant is the larger of the end of its forward (1 + teacher + fq(W) + 3 + 4) and its
optimizer step (1 + teacher + fq(W) + 2), printed beside the H200's measured peak (benchmarks/RESULTS.md).
CPU allocations, not CUDA's caching allocator: its block rounding and cuBLAS/NCCL workspaces are not in them.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

GiB = float(2 ** 30)
# the H200 shape of benchmarks/step.py (MODELS["llama1b"])
H200 = dict(vocab=32000, hidden=2048, inter=5632, layers=16, heads=16, kv_heads=8, tokens=4 * 2048, chunk=2048)


def h200_params():
    """(all trainable parameters, those of the quantized linears) of the H200 Llama."""
    h, i, v, L = H200["hidden"], H200["inter"], H200["vocab"], H200["layers"]
    kv = h * H200["kv_heads"] // H200["heads"]
    linear = L * (2 * h * h + 2 * h * kv + 3 * h * i)
    return linear + 2 * v * h + (2 * L + 1) * h, linear


# --------------------------------------------------------------------------------------- 1 + 2
# the tensors each DeepSpeed wrapper keeps, by attribute (DeepSpeed 0.19.8): category of each
_NAMED = {"bf16 weights (flat)": ("fp16_groups_flat", "bf16_groups_flat", "bit16_groups_flat"),
          "fp32 masters": ("fp32_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"),
          "gradient buffers": ("fp32_groups_gradients_flat", "averaged_gradients", "ipg_buckets")}


def _tensors(x, depth=0):
    import torch
    if isinstance(x, torch.Tensor):
        yield x
    elif depth < 4 and isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and hasattr(x, "buffer"):          # a ZeRO reduce bucket
        yield from _tensors(getattr(x, "buffer"), depth + 1)


def optimizer_buffers(engine) -> dict:
    """Bytes of the tensors the engine's optimizer holds (unique storages), by category; plus the
    module's own weights that are not views of those."""
    opt = engine.optimizer
    held, by = set(), collections.Counter()

    def add(cat, x):
        for t in _tensors(x):
            st = t.untyped_storage()
            if st.data_ptr() and st.data_ptr() not in held:
                held.add(st.data_ptr())
                by[cat] += st.nbytes()
    for cat, names in _NAMED.items():
        for nm in names:
            if hasattr(opt, nm):
                add(cat, getattr(opt, nm))
    base = getattr(opt, "optimizer", None)
    if base is not None and hasattr(base, "state"):
        add("Adam exp_avg + exp_avg_sq (fp32)", [{k: v for k, v in st.items() if k.startswith("exp_avg")}
                                                  for st in base.state.values()])
    for k, v in vars(opt).items():                    # anything else the wrapper keeps
        add("other", v)
    own = 0
    for p in engine.module.parameters():
        if p.untyped_storage().data_ptr() not in held:
            own += p.untyped_storage().nbytes()
    if own:
        by["module weights outside the optimizer's buffers"] += own
    n = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return {"params": n, "bytes": dict(by), "bytes_per_param": {k: v / n for k, v in by.items()}}


def _timeline(trace_events):
    """From a chrome trace of one step: per phase the max live bytes above the window's start, the phase of
    the peak, the live bytes when the optimizer step starts (the gradients: the activations are freed by
    then) and the most that step adds above that."""
    ranges = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"][3:]) for e in trace_events
              if e.get("ph") == "X" and e.get("name", "").startswith("qf:")]
    ranges += [(e["ts"], e["ts"] + e.get("dur", 0), "adam") for e in trace_events
               if e.get("ph") == "X" and e.get("name", "").startswith("Optimizer.step#")]
    mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in trace_events
                 if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0)
    if not mem:
        return {}, None, 0, 0
    base = mem[0][1] - mem[0][2]
    peak = collections.Counter()
    top = (None, -1)
    step = [r for r in ranges if r[2] == "ds_step"]
    t_step = step[0][0] if step else None
    at_step, step_max = None, 0
    for ts, tot, nbytes in mem:
        inside = [r for r in ranges if r[0] <= ts <= r[1]]
        ph = min(inside, key=lambda r: r[1] - r[0])[2] if inside else "loop"
        live = tot - base
        peak[ph] = max(peak[ph], live)
        if live > top[1]:
            top = (ph, live)
        if t_step is not None and ts >= t_step and ts <= step[0][1]:
            if at_step is None:
                at_step = live - nbytes
            if ph != "adam":
                # the CPU stand-in's foreach AdamW allocates temporaries the CUDA kernel does not
                step_max = max(step_max, live)
    return dict(peak), top[0], at_step or 0, max(0, step_max - (at_step or 0))


def measure_path(name: str, over, args) -> dict:
    """One run of a step.py variant at the thin width: the optimizer's buffers and the step's live bytes."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.profiler import ProfilerActivity, profile, schedule

    import fused_adam_cpu
    import qatfactory.train.methods.base as E
    import step
    import step_counts
    step.MODELS["thin16"] = step_counts.THIN
    got = {}
    destroy = DeepSpeedEngine.destroy

    def grab(self):
        if "buffers" not in got and self.optimizer is not None:
            got["buffers"] = optimizer_buffers(self)
        return destroy(self)
    init = deepspeed.initialize

    def initialize(*a, **kw):
        if isinstance(kw.get("optimizer"), __import__("torch").optim.AdamW):
            kw["optimizer"] = fused_adam_cpu.swap_in(kw["optimizer"])
        return init(*a, **kw)
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                   schedule=schedule(wait=args.skip, warmup=1, active=1, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(trace))
    draw = E.rank_batch

    def marked(*a, **kw):
        prof.step()
        return draw(*a, **kw)
    ns = argparse.Namespace(device="cpu", model="thin16", workdir=args.workdir, steps=args.skip + 3, warmup=0,
                            batch=args.batch, seq=args.seq, chunk=args.chunk, profile_steps=0, op_table=None,
                            out=None)
    DeepSpeedEngine.destroy, deepspeed.initialize, E.rank_batch = grab, initialize, marked
    try:
        with step_counts.instrumented_phases(), prof:
            step.one(name, [step_counts.GPU_FILL, *over], ns, tag=f"mem{int(time.time() * 1000) % 100000}")
    finally:
        DeepSpeedEngine.destroy, deepspeed.initialize, E.rank_batch = destroy, init, draw
    with open(trace) as f:
        data = json.load(f)
    os.unlink(trace)
    peak, where, at_step, step_add = _timeline(data["traceEvents"] if isinstance(data, dict) else data)
    n = got["buffers"]["params"]
    return {"variant": name, **got["buffers"], "live_peak_by_phase": peak, "peak_phase": where,
            "grads_per_param": at_step / n, "step_transient_per_param": step_add / n}


# --------------------------------------------------------------------------------------- 3
def saved_per_token(lean: bool, quant=None) -> dict:
    """Bytes autograd keeps per token per layer (and once per model) in HF's Llama at the H200 widths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.nn import lean_act
    res = {}
    T = 128
    for L in (1, 2):
        cfg = LlamaConfig(vocab_size=512, hidden_size=H200["hidden"], intermediate_size=H200["inter"],
                          num_hidden_layers=L, num_attention_heads=H200["heads"],
                          num_key_value_heads=H200["kv_heads"], tie_word_embeddings=False)
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).bfloat16()
        if lean:
            lean_act.register(m)
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen.setdefault(st.data_ptr(), st.nbytes())
            return t
        ids = torch.randint(0, 512, (1, T))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m.model(input_ids=ids, attention_mask=torch.ones(1, T, dtype=torch.long))
        res[L] = sum(seen.values())
    per_layer = (res[2] - res[1]) / T
    return {"per_token_per_layer": per_layer, "per_token_once": res[1] / T - per_layer}


# --------------------------------------------------------------------------------------- 4
def loss_live(kind: str, chunks=(64, 128), fp32: bool = True) -> dict:
    """The chunked loss at the H200 hidden and vocabulary (2 chunks of each size in ``chunks``): what it
    keeps for the backward (its saved tensors: the hidden and head gradients it computed in the forward)
    and, per token of a chunk, the transient above that while a chunk runs (the CPU allocator's live
    bytes, profile_memory; the slope between the two chunk sizes: ``cpu_fixed_bytes`` is what does not
    grow with the chunk). ``fp32``: fp32 inputs, because a CPU's bf16 GEMM upcasts its operands into
    temporaries a GPU's does not make; the loss computes in fp32 either way, and its peak (the chunk's
    fp32 log-softmaxes) holds no bf16 buffer, so the per-token transient is the bf16 run's. The kept
    gradients are counted from the saved tensors in bf16 (the hidden gradient is in the model dtype)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from qatfactory.distill.losses import LiveTeacherOut, LossConfig, lm_loss
    h_, v_ = H200["hidden"], H200["vocab"]
    g = torch.Generator().manual_seed(0)
    dt = torch.float32 if fp32 else torch.bfloat16
    w = (torch.randn(v_, h_, generator=g) * 0.02).to(dt).requires_grad_()
    tw = (torch.randn(v_, h_, generator=g) * 0.02).to(dt)
    trans, kept = {}, {}
    for chunk in chunks:
        n = 2 * chunk
        hs = (torch.randn(n, h_, generator=g) * 0.5).to(dt).requires_grad_()
        t = LiveTeacherOut((torch.randn(n, h_, generator=g) * 0.5).to(dt), tw) if kind == "forward_kl" else None
        lab = torch.randint(0, v_, (n,), generator=g)
        fd, trace = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            loss = lm_loss(hs, w, lab, None, t, LossConfig(kind=kind, chunk_tokens=chunk))
        p.export_chrome_trace(trace)
        with open(trace) as f:
            ev = json.load(f)["traceEvents"]
        os.unlink(trace)
        saved = sum(x.untyped_storage().nbytes() for x in loss.grad_fn.saved_tensors if x is not None)
        if fp32:      # the hidden gradient is kept in the model dtype: bf16 in the trainer
            saved_bf16 = saved - n * h_ * 2
        else:
            saved_bf16 = saved
        mem = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in ev
                     if e.get("name") == "[memory]")
        peak = max(m[1] for m in mem) - (mem[0][1] - mem[0][2])      # above the live bytes at the start
        trans[chunk], kept[chunk] = peak - saved, (saved_bf16, n)
        del loss
    c0, c1 = chunks
    per_tok = (trans[c1] - trans[c0]) / (c1 - c0)
    (s0, n0), (s1, n1) = kept[c0], kept[c1]
    kept_tok = (s1 - s0) / (n1 - n0)
    return {"transient_bytes_per_chunk_token": per_tok, "cpu_fixed_bytes": trans[c0] - per_tok * c0,
            "kept_per_token_bytes": kept_tok, "kept_fixed_bytes": s0 - kept_tok * n0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=31)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    import step
    allv = step.variants("nvfp4", before=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "h200_shape": H200}
    n, n_lin = h200_params()
    out["h200_params"], out["h200_linear_params"] = n, n_lin
    paths = {}
    with tempfile.TemporaryDirectory(prefix="qf-step-mem-") as td:
        args.workdir = td
        for name in ("bf16 SFT (no quant, CE)", "bf16 SFT (no quant, CE) [before: stock DeepSpeed step]",
                     "bf16 SFT, ZeRO-1", "bf16 SFT, ZeRO-1 BF16_Optimizer (fp32 grads, immediate update)"):
            paths[name] = measure_path(name, allv[name], args)
            print(f"[mem] {name}: {json.dumps({k: v for k, v in paths[name].items() if k != 'variant'})}",
                  flush=True)
    out["paths"] = paths
    out["saved"] = {"default": saved_per_token(False), "lean_act": saved_per_token(True)}
    print(f"[mem] saved: {out['saved']}", flush=True)
    out["loss"] = {"ce": loss_live("ce"), "forward_kl": loss_live("forward_kl")}
    print(f"[mem] loss: {out['loss']}", flush=True)
    out["table"] = report(out)
    print("\n" + out["table"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


def report(out) -> str:
    """The H200 decomposition of each variant's two candidate peaks (end of the forward, optimizer step)."""
    n, n_lin = out["h200_params"], out["h200_linear_params"]
    tok, L, chunk = H200["tokens"], H200["layers"], H200["chunk"]
    paths = out["paths"]
    sft, z1, bf = "bf16 SFT (no quant, CE)", "bf16 SFT, ZeRO-1", \
        "bf16 SFT, ZeRO-1 BF16_Optimizer (fp32 grads, immediate update)"

    def act(kind):
        s = out["saved"][kind]
        return (s["per_token_per_layer"] * L + s["per_token_once"]) * tok

    def loss(kind):
        lo = out["loss"][kind]
        return lo["kept_fixed_bytes"] + lo["kept_per_token_bytes"] * tok + lo["transient_bytes_per_chunk_token"] * chunk
    # ZeRO-1's reduce bucket (reduce_bucket_size elements, allocated in the backward): a fixed size, the
    # difference of the backward's live peak against ZeRO-0's on the same model
    bucket = max(0.0, max(paths[z1]["live_peak_by_phase"].get(k, 0) for k in ("backward", "ds_backward"))
                 - max(paths[sft]["live_peak_by_phase"].get(k, 0) for k in ("backward", "ds_backward")))
    fqw, teacher, t_hidden = 2.0 * n_lin, 2.0 * n, tok * H200["hidden"] * 2.0
    # (column, optimizer path, fq(W), live teacher, loss, activations)
    spec = [("bf16 SFT", sft, 0, False, "ce", "default"),
            ("QAT W4A16", sft, fqw, False, "ce", "default"),
            ("QAD W4A16 live", sft, fqw, True, "forward_kl", "default"),
            ("QAD live, lean activations", sft, fqw, True, "forward_kl", "lean_act"),
            ("QAD live, ZeRO-1", z1, fqw, True, "forward_kl", "default"),
            ("QAD live, BF16_Optimizer imm.", bf, fqw, True, "forward_kl", "default")]
    cats = sorted({c for p in paths.values() for c in p["bytes_per_param"] if c != "other"})
    rows = collections.OrderedDict()
    for c in cats:
        rows[f"{c} (B/param: " + "/".join(f"{paths[x]['bytes_per_param'].get(c, 0):.0f}" for x in (sft, z1, bf))
             + " for ZeRO-0/ZeRO-1/BF16_Optimizer)"] = [paths[s_[1]]["bytes_per_param"].get(c, 0) * n for s_ in spec]
    rows["teacher weights, bf16"] = [teacher if s_[3] else 0.0 for s_ in spec]
    rows["weight cache fq(W), bf16 (2 B per quantized weight)"] = [s_[2] for s_ in spec]
    rows["activations autograd keeps (HF Llama, per token and layer x 16 x 8192)"] = [act(s_[5]) for s_ in spec]
    rows["loss: head grad (fp32) + hidden grad (bf16) kept, one 2048-token chunk's transient"] = \
        [loss(s_[4]) for s_ in spec]
    rows["live teacher's final hidden states (bf16)"] = [t_hidden if s_[3] else 0.0 for s_ in spec]
    rows["ZeRO-1 reduce bucket (allocated in the backward)"] = [bucket if s_[1] == z1 else 0.0 for s_ in spec]
    fwd = [sum(r[i] for r in rows.values()) for i in range(len(spec))]
    persist = [sum(paths[s_[1]]["bytes_per_param"].get(c, 0) for c in cats) * n for s_ in spec]
    stp = [persist[i] + spec[i][2] + (teacher if spec[i][3] else 0.0)
           + (paths[spec[i][1]]["grads_per_param"] + paths[spec[i][1]]["step_transient_per_param"]) * n
           for i in range(len(spec))]
    T = ["| GiB at the H200 shape (1B Llama, 4 x 2048 tokens) | " + " | ".join(s_[0] for s_ in spec) + " |",
         "|---|" + "---:|" * len(spec)]
    for k, vals in rows.items():
        T.append(f"| {k} | " + " | ".join(f"{v / GiB:.2f}" for v in vals) + " |")
    T.append("| **sum: the peak at the end of the forward** | " + " | ".join(f"**{v / GiB:.1f}**" for v in fwd) + " |")
    T.append("| the optimizer step: persistent + teacher + fq(W) + gradients + what the step adds | "
             + " | ".join(f"{v / GiB:.1f}" for v in stp) + " |")
    meas = {"bf16 SFT": 23.7, "QAT W4A16": 25.1, "QAD W4A16 live": 27.2}
    T.append("| measured on the H200, 2026-12-01 (torch.cuda.max_memory_allocated) | "
             + " | ".join(f"{meas[s_[0]]:.1f}" if s_[0] in meas else "-" for s_ in spec) + " |")
    P = ["| DeepSpeed path (bytes per parameter, measured on the thin model) | " + " | ".join(cats)
         + " | live when the step starts (gradients) | the step adds (CPU stand-in's Adam temporaries aside) |",
         "|---|" + "---:|" * len(cats) + "---:|---:|"]
    for name, p in paths.items():
        P.append(f"| {name} | " + " | ".join(f"{p['bytes_per_param'].get(c, 0):.2f}" for c in cats)
                 + f" | {p['grads_per_param']:.2f} | {p['step_transient_per_param']:.2f} |")
    return "\n".join(T) + "\n\n" + "\n".join(P)


if __name__ == "__main__":
    sys.exit(main())
