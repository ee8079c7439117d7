"""The peers' training steps, on the same random Llama and batch as benchmarks/step.py (issue 17).

Each row is a plain PyTorch loop written out here (no qatfactory code in it), so what it measures is
the peer, not us:

* ``plain loop, bf16 params``: the model in bf16, torch's fused AdamW on the bf16 parameters (no master
  weights: a small update rounds away; the ``changed`` column shows how much of one step survives);
* ``plain loop, fp32 masters``: fp32 parameters and AdamW states, bf16 autocast (what our trainer does);
* ``ModelOpt W4A16 QAT`` / ``W4A4 QAT``: the same loops after ``mtq.quantize(model, W4A16_NVFP4_CFG |
  NVFP4_DEFAULT_CFG)`` (NVIDIA Model Optimizer's own fake quantization; CUDA only);
* ``ModelOpt QAD``: a frozen bf16 teacher beside the W4A16 student, forward KL over the full vocabulary
  (Model Optimizer's ``LogitsDistillationLoss``), the loop of its distillation examples.

    python benchmarks/step_peers.py --only "plain loop, bf16 params" [--steps 10 --model llama1b]

benchmarks/step.py runs these in their own processes, interleaved with ours (``--peers``), and prints
one table. ``--smoke`` runs the plain loops on a CPU-sized model (checks the script, measures nothing).
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

# the shapes of benchmarks/step.py's MODELS (kept in step with it by tests/test_step_bench.py)
SHAPES = {
    "llama1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}

# name -> (parameter dtype, ModelOpt config name or None, distill)
PEERS = {
    "plain loop, bf16 params": ("bfloat16", None, False),
    "plain loop, fp32 masters": ("float32", None, False),
    "ModelOpt W4A16 QAT, bf16 params": ("bfloat16", "W4A16_NVFP4_CFG", False),
    "ModelOpt W4A4 QAT, bf16 params": ("bfloat16", "NVFP4_DEFAULT_CFG", False),
    "ModelOpt QAD W4A16, bf16 params": ("bfloat16", "W4A16_NVFP4_CFG", True),
    "ModelOpt W4A16 QAT, fp32 masters": ("float32", "W4A16_NVFP4_CFG", False),
    "ModelOpt W4A4 QAT, fp32 masters": ("float32", "NVFP4_DEFAULT_CFG", False),
    "ModelOpt QAD W4A16, fp32 masters": ("float32", "W4A16_NVFP4_CFG", True),
}


def build(shape: str, dtype, device, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(max_position_embeddings=4096, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        m = LlamaForCausalLM(cfg)
    return m.to(dtype)


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
    if mto is not None and not cuda:
        return {"variant": name, "not_run": "CUDA only (Model Optimizer's NVFP4 fake quantization)"}
    dtype = getattr(torch, pdt)
    model = build(shape, dtype, dev)
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), generator=g).to(dev) for _ in range(4)]
    teacher = None
    if distill:
        teacher = build(shape, torch.bfloat16, dev).eval().requires_grad_(False)
    if mto is not None:
        import modelopt.torch.quantization as mtq
        model = mtq.quantize(model, getattr(mtq, mto), forward_loop=lambda m: m(data[0][:1]))
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
    ap.add_argument("--smoke", action="store_true", help="a CPU-sized model, 2 steps (checks the script)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.model, a.steps, a.warmup, a.batch, a.seq = "smoke", 2, 0, 2, 32
    row = run_peer(a.only, a.model, a.steps, a.warmup, a.batch, a.seq, a.lr)
    print("ROW " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
