"""The peers' training steps, on the same random model and batch as benchmarks/step.py.

Each row is a plain PyTorch loop written out here (no qatfactory code in it), so what it measures is
the peer, not us:

* ``plain loop, bf16 params``: the model in bf16, torch's fused AdamW on the bf16 parameters (no master
  weights: a small update rounds away; the ``changed`` column shows how much of one step survives);
* ``plain loop, fp32 masters``: fp32 parameters and AdamW states, bf16 autocast (what our trainer does);
* ``ModelOpt W4A16 QAT`` / ``W4A4 QAT``: the same loops after ``mtq.quantize(model, W4A16_NVFP4_CFG |
  NVFP4_DEFAULT_CFG)`` (NVIDIA Model Optimizer's own fake quantization; CUDA only);
* ``ModelOpt QAD``: a frozen bf16 teacher beside the W4A16 student, forward KL over the full vocabulary
  (Model Optimizer's ``LogitsDistillationLoss``), the loop of its distillation examples.

The MoE shapes (``--model moe`` / ``moe_smoke``: transformers' Qwen3MoeForCausalLM, fused 3-D experts).
Model Optimizer 0.47 does quantize those experts: ``mtq.quantize`` wraps each fused experts module in
its ``_QuantFusedExperts`` (one NVFP4 weight quantizer per expert for gate_up and for down, one input
quantizer per projection shared by the experts) -- and, to see the per-expert matmuls at all, switches
the model to transformers' ``eager`` experts implementation (a Python loop over the experts hit, one
``F.linear`` each), where the plain loops and our trainer run ``grouped_mm``. So the MoE table has one
more row, ``plain loop, fp32 masters, eager experts``: the plain loop on the implementation Model
Optimizer forces, which splits its time into the eager loop's cost and its quantizers'. Every MoE row
of Model Optimizer carries a note read from the quantized model itself (how many expert tensors have
enabled quantizers, the experts implementation in effect); a row whose experts came out unquantized is
marked ``not comparable`` and its goal line says so instead of a ratio (tests/benchmarks/test_step_bench.py checks
on a CPU that 0.47 reaches the experts).

    python benchmarks/step_peers.py --only "plain loop, bf16 params" [--steps 10 --model llama1b]

benchmarks/step.py runs these in their own processes, interleaved with ours (``--peers``), and prints
one table. ``--smoke`` runs the plain loops on a CPU-sized model (checks the script, measures nothing;
``--smoke --model moe_smoke``: the CPU-sized MoE).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the shapes of benchmarks/step.py's MODELS (kept in step with it by tests/benchmarks/test_step_bench.py)
SHAPES = {
    "llama1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, experts of width 768, top-8) with
    # 64 experts and 8 layers: why these sizes, benchmarks/step.py's docstring
    "moe": dict(arch="qwen3_moe", vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False),
    "moe_smoke": dict(arch="qwen3_moe", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
}

# name -> (parameter dtype, ModelOpt config name or None, distill)
PEERS = {       # equal precision (fp32 masters) first: a round cut short by its time budget loses the rest
    "plain loop, fp32 masters": ("float32", None, False),
    "ModelOpt W4A16 QAT, fp32 masters": ("float32", "W4A16_NVFP4_CFG", False),
    "ModelOpt W4A4 QAT, fp32 masters": ("float32", "NVFP4_DEFAULT_CFG", False),
    "ModelOpt QAD W4A16, fp32 masters": ("float32", "W4A16_NVFP4_CFG", True),
    "plain loop, fp32 masters, eager experts": ("float32", None, False),
    "plain loop, bf16 params": ("bfloat16", None, False),
    "ModelOpt W4A16 QAT, bf16 params": ("bfloat16", "W4A16_NVFP4_CFG", False),
    "ModelOpt QAD W4A16, bf16 params": ("bfloat16", "W4A16_NVFP4_CFG", True),
    "ModelOpt W4A4 QAT, bf16 params": ("bfloat16", "NVFP4_DEFAULT_CFG", False),
}
MOE_ONLY = ("plain loop, fp32 masters, eager experts",)


def is_moe(shape: str) -> bool:
    return SHAPES[shape].get("arch", "llama") == "qwen3_moe"


def peer_names(shape: str):
    """The peers that apply to a shape (the eager-experts row: MoE shapes only)."""
    return [n for n in PEERS if is_moe(shape) or n not in MOE_ONLY]


def hf_config(shape: str):
    """(transformers class, config) of a shape, written out here (not our trainer's builder)."""
    import transformers as T
    sh = dict(SHAPES[shape])
    arch = sh.pop("arch", "llama")
    if arch == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(max_position_embeddings=4096, **sh)
    # every layer sparse (decoder_sparse_step 1, no mlp_only_layers): no dense MLP anywhere
    return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(max_position_embeddings=4096, decoder_sparse_step=1,
                                                   mlp_only_layers=[], **sh)


def build(shape: str, dtype, device, seed: int = 0, experts: Optional[str] = None):
    import torch
    cls, cfg = hf_config(shape)
    if experts is not None:
        cfg._experts_implementation = experts
    torch.manual_seed(seed)
    with torch.device(device):
        m = cls(cfg)
    return m.to(dtype)


def autocast_experts(model) -> int:
    """Fused experts of an fp32 model compute on bf16 casts of their 3-D weights, as autocast casts an
    F.linear's: transformers' grouped_mm is outside autocast and casts the input to the weight's dtype,
    and torch's grouped_mm in fp32 on CUDA is a loop of mm over the experts, so an fp32-master loop
    would otherwise time fp32 expert GEMMs that neither our trainer (bf16 weights, fp32 masters in the
    optimizer) nor Model Optimizer (eager F.linear under autocast) runs. Returns the modules patched."""
    import torch
    n = 0
    for m in model.modules():
        p = m._parameters
        if not (getattr(p.get("gate_up_proj"), "ndim", 0) == 3 and getattr(p.get("down_proj"), "ndim", 0) == 3):
            continue

        def fwd(*a, _m=m, _f=m.forward, **k):
            d = _m.__dict__
            d["gate_up_proj"] = _m._parameters["gate_up_proj"].to(torch.bfloat16)
            d["down_proj"] = _m._parameters["down_proj"].to(torch.bfloat16)
            try:
                return _f(*a, **k)
            finally:
                del d["gate_up_proj"], d["down_proj"]
        m.forward = fwd
        n += 1
    return n


def modelopt_coverage(model) -> dict:
    """What ``mtq.quantize`` left quantized in a model: enabled weight quantizers on linears and on the
    fused 3-D expert tensors (Model Optimizer's per-expert ModuleLists), and the experts implementation
    in effect. Read from the quantized model, so the row says what the peer actually trained."""
    import torch.nn as nn
    out = {"linears": 0, "linears_quantized": 0, "expert_tensors": 0, "expert_tensors_quantized": 0,
           "experts_implementation": getattr(getattr(model, "config", None), "_experts_implementation", None)}

    def on(q):
        return q is not None and bool(getattr(q, "is_enabled", False))
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith("lm_head"):
            out["linears"] += 1
            out["linears_quantized"] += on(getattr(m, "weight_quantizer", None))
        for w in ("gate_up_proj", "down_proj"):
            p = m._parameters.get(w)
            if p is None or p.ndim != 3:
                continue
            out["expert_tensors"] += 1
            qs = getattr(m, f"{w}_weight_quantizers", None)
            # quantized only when every expert of the tensor has an enabled quantizer
            out["expert_tensors_quantized"] += bool(qs is not None and len(qs) == p.shape[0] and all(on(q) for q in qs))
    return out


def coverage_note(cov: dict) -> tuple:
    """(note, comparable) of a Model Optimizer row from :func:`modelopt_coverage`."""
    lin = f"linears {cov['linears_quantized']}/{cov['linears']}"
    if not cov["expert_tensors"]:
        return lin, cov["linears_quantized"] == cov["linears"]
    ex = f"expert tensors {cov['expert_tensors_quantized']}/{cov['expert_tensors']} (per-expert NVFP4)"
    impl = f"experts {cov['experts_implementation']} (forced by ModelOpt)" \
        if cov["experts_implementation"] == "eager" else f"experts {cov['experts_implementation']}"
    ok = cov["expert_tensors_quantized"] == cov["expert_tensors"] and cov["linears_quantized"] == cov["linears"]
    return ("" if ok else "NOT COMPARABLE: not all weights quantized; ") + f"{lin}, {ex}, {impl}", ok


def run_peer(name: str, shape: str, steps: int, warmup: int, batch: int, seq: int, lr: float,
             device: Optional[str] = None, profile_steps: int = 0) -> dict:
    """Time steps warmup+1..steps; with ``profile_steps``, one more step and then that many profiled
    (benchmarks/step_profile.py: GPU busy vs wall), not timed."""
    import contextlib
    import torch
    import torch.nn.functional as F
    pdt, mto, distill = PEERS[name]
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    if name not in peer_names(shape):
        return {"variant": name, "not_run": f"MoE shapes only (--model {shape} has no experts)"}
    if mto is not None and not cuda:
        return {"variant": name, "not_run": "CUDA only (Model Optimizer's NVFP4 fake quantization)"}
    dtype = getattr(torch, pdt)
    model = build(shape, dtype, dev, experts="eager" if name in MOE_ONLY else None)
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), generator=g).to(dev) for _ in range(4)]
    teacher = None
    if distill:
        teacher = build(shape, torch.bfloat16, dev).eval().requires_grad_(False)
    note, comparable = None, True
    if mto is not None:
        import modelopt.torch.quantization as mtq
        model = mtq.quantize(model, getattr(mtq, mto), forward_loop=lambda m: m(data[0][:1]))
        note, comparable = coverage_note(modelopt_coverage(model))
    elif is_moe(shape):
        note = f"experts {model.config._experts_implementation}"
        if pdt == "float32" and model.config._experts_implementation != "eager" and autocast_experts(model):
            note += " on bf16 casts of the fp32 weights (autocast does not reach grouped_mm)"
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=pdt == "float32")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            fused=cuda)
    kd = None
    if distill:
        import modelopt.torch.distill as mtd
        kd = mtd.LogitsDistillationLoss()
    times, first_changed = [], None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    total = steps + (1 + profile_steps if profile_steps else 0)
    sp = None
    if profile_steps:
        from step_profile import StepProfile
        sp = StepProfile(skip=steps + 1, steps=profile_steps, device=dev.type)
    with sp if sp is not None else contextlib.nullcontext():
        first_changed = _loop(model, teacher, kd, opt, data, autocast, distill, total, times, cuda, F)
    timed = times[warmup:steps] or times[:steps]
    row = {"variant": name, "ms_per_step": statistics.median(timed), "step_ms_all": [round(t, 1) for t in timed],
           "tokens_per_s": batch * seq / (statistics.median(timed) / 1000),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "weights_changed_by_step_1": first_changed, "lr": lr}
    if note is not None:
        row["note"] = note
    if not comparable:
        row["comparable"] = False
    if sp is not None:
        row["profile"] = sp.result
    return row


def _loop(model, teacher, kd, opt, data, autocast, distill, steps, times, cuda, F):
    """The plain training loop; appends each step's ms to ``times``; returns the fraction of the
    trainable weights that the first optimizer step changed."""
    import torch
    first_changed = None
    for step in range(steps):
        ids = data[step % len(data)]
        before = None
        if step == 0:
            before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            logits = model(input_ids=ids).logits
            if distill:
                with torch.no_grad():
                    tl = teacher(input_ids=ids).logits
                loss = kd(logits[:, :-1].float(), tl[:, :-1].float())
            else:
                loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
        if before is not None:
            after = [p.detach() for p in model.parameters() if p.requires_grad]
            n = sum(b.numel() for b in before)
            first_changed = sum(int((a != b).sum()) for a, b in zip(after, before)) / n
            before = after = None
            if cuda:   # peak memory from here on: not the copy above, as ours excludes its setup
                torch.cuda.reset_peak_memory_stats()
    return first_changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", required=True, choices=sorted(PEERS))
    ap.add_argument("--model", default="llama1b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-6, help="the QAD default: the changed column depends on it")
    ap.add_argument("--smoke", action="store_true",
                    help="a CPU-sized model, 2 steps (checks the script): smoke, or moe_smoke with --model moe_smoke")
    a = ap.parse_args(argv)
    if a.smoke:
        a.model = "moe_smoke" if a.model == "moe_smoke" else "smoke"
        a.steps, a.warmup, a.batch, a.seq = 2, 0, 2, 32
    row = run_peer(a.only, a.model, a.steps, a.warmup, a.batch, a.seq, a.lr)
    print("ROW " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
