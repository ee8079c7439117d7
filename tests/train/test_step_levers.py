"""The step levers (train/ds_step.py, the loss's chunk test, the DeepSpeed bf16 paths): each trains
the same weights as the path it replaces, bit for bit where the computation is the same, within a stated
bound where DeepSpeed's stages legitimately sum in another order; and the host work they remove is gone
(counted, not timed).

The trainer runs bf16 DeepSpeed on a CPU with DeepSpeed's FusedAdam type (benchmarks/fused_adam_cpu.py:
its kernel as foreach ops), so that ZeRO-0 takes ``FP16_Optimizer``, the wrapper a GPU run takes."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

BASE = ["train=cpu_tiny", "train.precision=bf16", "model.dtype=bfloat16", "data.synthetic=24", "data.seq_len=32",
        "data.eval_samples=2", "train.eval_every=0", "train.max_steps=4", "train.lr=1e-2", "train.clip=0.05",
        "method=qat", "method.eval_teacher=false", "format=bf16", "model.tiny.num_hidden_layers=2"]


def _run(tmp_path, monkeypatch, name, *over, nan_at=None, fused=True, count=None):
    """A trainer run; returns (bf16 weights, fp32 masters, per-step losses, engine facts)."""
    import deepspeed

    import fused_adam_cpu
    import qatfactory.train.methods.base as E
    from qatfactory.train.loop import run
    from qatfactory.train.config import compose
    init = deepspeed.initialize
    seen = {"step": 0}

    def initialize(*a, **kw):
        if fused and isinstance(kw.get("optimizer"), torch.optim.AdamW):
            kw["optimizer"] = fused_adam_cpu.swap_in(kw["optimizer"])
        if nan_at is not None:
            p = next(p for n, p in kw["model"].named_parameters() if n.endswith("layers.1.mlp.up_proj.weight"))
            p.register_hook(lambda g: g * float("nan") if seen["step"] == nan_at else g)
        return init(*a, **kw)
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    draw = E.rank_batch

    def counted(*a, **kw):
        seen["step"] += 1
        if count is not None:
            count.step_now()
        return draw(*a, **kw)
    monkeypatch.setattr(E, "rank_batch", counted)
    cfg = compose(BASE + [f"run_dir={tmp_path / name}", *over])
    if count is not None:
        with count.host, count.prof:
            s = run(cfg)
    else:
        s = run(cfg)
    eng = s.pop("engine")
    weights = {k: v.detach().clone() for k, v in eng.module.lm.state_dict().items()}
    opt = eng.optimizer
    flat = getattr(opt, "fp32_groups_flat", None) or getattr(opt, "single_partition_of_fp32_groups", None) \
        or getattr(opt, "fp32_groups_flat_partition", None)
    masters = torch.cat([f.detach().reshape(-1) for f in flat]).clone()
    facts = {"wrapper": type(opt).__name__, "norm": float(eng.get_global_grad_norm() or 0.0),
             "allreduce": eng.enable_backward_allreduce, "skipped": eng.skipped_steps}
    eng.destroy()
    recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return weights, masters, [r["loss"] for r in recs if "loss" in r], facts


def _same(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k].view(torch.int16) if a[k].dtype == torch.bfloat16 else a[k],
                                           b[k].view(torch.int16) if b[k].dtype == torch.bfloat16 else b[k])]
    assert not bad, f"weights differ: {bad[:5]}"


@pytest.mark.parametrize("over", [[], ["train.grad_accum=2"], ["format=nvfp4_w4a16"], ["format=paretoq_4bit"],
                                  ["format=paretoq_2bit", "quant.weight_format=int2_seq_q4_0", "train.quant_start=0.5"]],
                         ids=["sft", "grad_accum", "qat_w4a16", "paretoq_lsq", "paretoq_seq_quant_start"])
def test_lean_step_trains_deepspeeds_bits(tmp_path, monkeypatch, over):
    """train.lean_step (the default) against DeepSpeed's own FP16_Optimizer step, all-reduce and timer:
    the same weights and fp32 masters bit for bit after 4 steps with clipping active."""
    w0, m0, l0, f0 = _run(tmp_path, monkeypatch, "stock", "train.lean_step=false", "train.ds_timers=true", *over)
    w1, m1, l1, f1 = _run(tmp_path, monkeypatch, "lean", *over)
    assert f0["wrapper"] == f1["wrapper"] == "FP16_Optimizer"
    assert f0["allreduce"] and not f1["allreduce"]
    assert f0["norm"] > 0.05 and f0["norm"] == f1["norm"]          # the clip at 0.05 was active
    _same(w0, w1)
    assert torch.equal(m0, m1) and l0 == l1 and len(l0) == 4


def test_zero0_adam_starts_one_step_ahead_and_fresh_adam_clears_it(tmp_path, monkeypatch):
    """DeepSpeed's FP16_Optimizer runs a zero-gradient FusedAdam step when it is built: the counter starts
    at 1. train.fresh_adam (the default) clears it; with it off the run differs from the first update on."""
    import deepspeed
    steps = []
    init = deepspeed.initialize

    def spy(*a, **kw):
        out = init(*a, **kw)
        steps.append([st.get("step") for st in out[0].optimizer.optimizer.state.values()])
        return out
    monkeypatch.setattr(deepspeed, "initialize", spy)
    w0, m0, l0, _ = _run(tmp_path, monkeypatch, "deepspeeds", "train.max_steps=2", "train.fresh_adam=false")
    w1, m1, l1, _ = _run(tmp_path, monkeypatch, "default", "train.max_steps=2")
    assert steps == [[1], [1]]          # both built the same way; fresh_adam clears it after the build
    assert l0[0] == l1[0] and l0[1] != l1[1] and not torch.equal(m0, m1)


@pytest.mark.parametrize("over", [["train.zero_stage=1"],
                                  ["train.zero_stage=1", "train.grad_accum_dtype=fp32"],
                                  ["train.zero_stage=1", "train.grad_accum_dtype=fp32",
                                   "train.immediate_grad_update=true"]],
                         ids=["zero1", "bf16_optimizer", "immediate_grad_update"])
def test_zero1_paths_train_zero0s_bits_or_within_the_norms_rounding(tmp_path, monkeypatch, over):
    """ZeRO-1 on one rank (DeepSpeedZeroOptimizer: flat bf16 buffers, one overflow read) and DeepSpeed's
    BF16_Optimizer (fp32 gradient accumulation, optionally folded per gradient in the backward) against
    ZeRO-0 with the same Adam start (fresh_adam): without clipping, the same bits; with clipping, each
    path computes the global norm in its own order (a flat fp32 norm squared in Python doubles; per-tensor
    norms stacked), so the clip factor and the weights may differ by that rounding: bounded here."""
    fresh = "train.fresh_adam=true"
    w0, m0, l0, f0 = _run(tmp_path, monkeypatch, "z0", "train.clip=0", fresh)
    w1, m1, l1, f1 = _run(tmp_path, monkeypatch, "z1", "train.clip=0", *over)
    assert f0["wrapper"] == "FP16_Optimizer" and f1["wrapper"] != "FP16_Optimizer"
    _same(w0, w1)
    assert torch.equal(m0, m1) and l0 == l1
    w0, m0, l0, f0 = _run(tmp_path, monkeypatch, "z0c", fresh)
    w1, m1, l1, f1 = _run(tmp_path, monkeypatch, "z1c", *over)
    assert f0["norm"] > 0.05 and abs(f1["norm"] - f0["norm"]) <= 1e-4 * f0["norm"]
    # 4 steps at lr 1e-2: the masters moved up to ~4e-2. Adam cancels the clip factor's rounding itself
    # (~1e-4 relative, so ~1e-6 of a step); what remains is that rounding flipping a bf16 weight, which changes
    # the next steps' gradients. Measured: max 4.9-5.1% of one step, ~0.25% of the masters above 1% of a step
    # (an AVX2 EPYC, 2026-12-07; under 5% on another x86 CPU). Bounded at 10% of a step for the
    # worst element and 1% of the masters beyond 1% of a step. A wrong update moves most masters beyond it
    # (measured the same day): no clip 92%, an LR 10% off 98%, one step fewer 99%.
    d = (m1 - m0).abs()
    assert d.max().item() <= 0.10 * 1e-2
    assert (d > 0.01 * 1e-2).float().mean().item() <= 0.01
    assert max(abs(a - b) for a, b in zip(l0, l1)) <= 1e-3


def test_lean_step_skips_a_non_finite_gradient_like_deepspeed(tmp_path, monkeypatch):
    """A NaN gradient at step 2: DeepSpeed's per-parameter check skipped that step; without the check the
    global norm is invalid and the same step is skipped; the weights after 4 steps are the same."""
    w0, m0, l0, f0 = _run(tmp_path, monkeypatch, "stock", "train.lean_step=false", nan_at=2)
    w1, m1, l1, f1 = _run(tmp_path, monkeypatch, "lean", nan_at=2)
    wc, mc, lc, fc = _run(tmp_path, monkeypatch, "clean")
    assert f0["skipped"] == f1["skipped"] == 1 and fc["skipped"] == 0
    _same(w0, w1)
    assert torch.equal(m0, m1) and l0 == l1
    assert not torch.equal(m1, mc) and all(math.isfinite(x) for x in m1[:1000].tolist())


def test_lean_step_reads_no_scalar_per_parameter(tmp_path, monkeypatch):
    """The host work the lean step removes, counted (benchmarks/step_counts.py's counter): DeepSpeed's
    step reads one device scalar per parameter; the lean one reads the norm (2), nothing per parameter,
    and issues no per-parameter copies; the backward has no all-reduce on one rank."""
    import step_counts
    rows = {}
    for name, over in (("stock", ["train.lean_step=false", "train.ds_timers=true"]), ("lean", [])):
        c = step_counts.Counts(skip=1, steps=2)
        with step_counts.instrumented_phases():
            _run(tmp_path, monkeypatch, name, *over, count=c)
        rows[name] = c.result()
    n_params = 2 * 9 + 2            # 2 layers x (7 linears + 2 norms) + embedding + final norm (tied head)
    stock, lean = rows["stock"], rows["lean"]
    assert stock["host_reads_by_phase"]["ds_step"] >= n_params + 2
    assert lean["host_reads_by_phase"].get("ds_step", 0) <= 2
    assert stock["launches_by_phase"]["ds_step"] > 6 * n_params > 10 * lean["launches_by_phase"]["ds_step"]
    assert stock["launches_by_phase"].get("ds_backward", 0) >= n_params and \
        lean["launches_by_phase"].get("ds_backward", 0) <= 2
    sync = {k for k in stock["host_read_sites"] if "device synchronize" in k}
    assert sync and not any("device synchronize" in k for k in lean["host_read_sites"])


def test_loss_reads_the_host_once_for_all_chunks(monkeypatch):
    """The chunked loss decides which chunks to skip with one host read, and skips the same ones."""
    from torch.profiler import ProfilerActivity, profile
    tolist = torch.Tensor.tolist
    calls = []

    def counted(t):
        calls.append(t.numel())
        return tolist(t)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)

    from qatfactory.distill.losses import LossConfig, _chunks_counted, lm_loss, naive_lm_loss
    g = torch.Generator().manual_seed(0)
    for n, step in ((10, 3), (10, 4), (10, 10), (7, 20), (64, 8)):
        w = (torch.rand(n, generator=g) > 0.6).float()
        w[: min(step, n)] = 0                      # a chunk without a counted token
        want = [bool((w[s:s + step] != 0).any()) for s in range(0, n, step)]
        assert _chunks_counted(w, step) == want
    h = torch.randn(2, 40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    lab = torch.randint(0, 50, (2, 40), generator=g)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :30] = False                           # the first two chunks of 10 count nothing
    cfg = LossConfig(kind="ce", chunk_tokens=10)
    calls.clear()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        got = lm_loss(h, wt, lab, mask, cfg=cfg)
    assert calls == [8]                            # 80 tokens in chunks of 10: one read of 8 flags
    reads = sum(1 for e in p.events() if e.name == "aten::_local_scalar_dense")
    ref = naive_lm_loss(h, wt, lab, mask, cfg=cfg)
    assert torch.allclose(got, ref, rtol=1e-12, atol=0)
    gh, gw = torch.autograd.grad(got, (h, wt))
    rh, rw = torch.autograd.grad(ref, (h, wt))
    assert torch.allclose(gh, rh, rtol=1e-10, atol=1e-15) and torch.allclose(gw, rw, rtol=1e-10, atol=1e-15)
    assert reads == 0       # (the per-chunk bool() this replaced read 8 here)


def test_fused_adam_stand_in_is_adamw_and_counts_cuda_launches():
    """The CPU stand-in computes AdamW (torch's, to float rounding) through DeepSpeed's own FusedAdam.step;
    the CUDA launch count follows multi_tensor_apply's tables (36 tensors, 320 blocks of 65,536 per launch)."""
    import fused_adam_cpu as F
    from deepspeed.ops.adam import FusedAdam
    g = torch.Generator().manual_seed(0)
    p0 = [torch.randn(300, generator=g), torch.randn(7, 5, generator=g)]
    a = [x.clone().requires_grad_() for x in p0]
    b = [x.clone().requires_grad_() for x in p0]
    opt_a = F.fused_adam_cpu_class()(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_b = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    assert isinstance(opt_a, FusedAdam)
    for _ in range(3):
        grads = [torch.randn(x.shape, generator=g) for x in p0]
        for x, y, gr in zip(a, b, grads):
            x.grad, y.grad = gr.clone(), gr.clone()
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    assert F.cuda_launches([1]) == 1 and F.cuda_launches([65536 * 320]) == 1
    assert F.cuda_launches([65536 * 320 + 1]) == 2 and F.cuda_launches([10] * 36) == 1
    assert F.cuda_launches([10] * 37) == 2 and F.cuda_launches([886_100_000]) == 43
