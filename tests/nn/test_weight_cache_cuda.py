"""The per-step weight cache on the GPU (run on the H200: benchmarks/gpu/step.sh runs this file first).
With the CUDA kernels the training forward takes the recompute-in-backward path and the fills are
batched (``auto``): dense training still gives the per-forward path's losses, gradients and eval logits
bit for bit, and the kept MoE expert tensors are the per-forward fake quant's bits.

GPU runs are compared bit for bit only where the model is deterministic: eager attention (SDPA's fused
backward kernels may accumulate in any order), deterministic algorithms where torch has them, cuBLAS
with a fixed workspace. A mismatch reports whether the uncached reference even reproduces itself."""
import os

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from qatfactory.kernels import loader  # noqa: E402
from qatfactory.nn import step_cache, weight_cache  # noqa: E402

ok, why = loader.probe()
if not ok:
    pytest.skip(f"CUDA kernels unavailable: {why}", allow_module_level=True)

from test_weight_cache import _all_sites, _model, _train  # noqa: E402

EAGER = {"attn_implementation": "eager"}


@pytest.fixture
def deterministic():
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    weight_cache.set_batching("auto")
    yield
    weight_cache.set_batching(None)
    torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


@pytest.mark.parametrize("preset,calib", [("nvfp4_w4a16", True), ("nvfp4_w4a4", True), ("mxfp4_w4a4", True),
                                          ("q4_k", False)])
def test_cached_dense_training_on_the_kernels_is_bit_identical(preset, calib, deterministic, monkeypatch):
    monkeypatch.setattr(weight_cache, "CHUNK_ELEMS", 1 << 15)        # several chunks per batched fill
    a = _model("llama", preset, calib, model_kw=EAGER).cuda()
    b = _model("llama", preset, calib, model_kw=EAGER).cuda()
    sites = _all_sites(a)
    if preset != "q4_k":       # ggml types that take an importance matrix keep F.linear (linear.py)
        assert all(m.recompute_in_backward() for m in a.modules() if hasattr(m, "recompute_in_backward"))
    weight_cache.reset_stats()
    got = _train(a, True, 3, 2, None)
    st = weight_cache.stats()
    want = _train(b, False, 3, 2, None)
    assert len(got) == len(want)
    bad = [g[:3] for g, w in zip(got, want) if not torch.equal(g[3], w[3])]
    if bad:
        again = _train(_model("llama", preset, calib, model_kw=EAGER).cuda(), False, 3, 2, None)
        same = all(torch.equal(x[3], y[3]) for x, y in zip(want, again))
        pytest.fail(f"cached != per-forward at {bad[:4]} ({len(bad)} records); the per-forward reference "
                    f"{'reproduces itself' if same else 'does NOT reproduce itself (nondeterminism on this GPU)'}")
    assert st["fills"] == len(sites) * 4 and st["batched_sites"] > len(sites), st


@pytest.mark.parametrize("preset", ["nvfp4_w4a4", "mxfp4_w4a16"])
def test_kept_expert_tensors_are_the_per_forward_bits(preset, deterministic, monkeypatch):
    """MoE routing combines experts with atomics on the GPU, so its training is not compared bit for bit;
    the kept tensors are (batched over experts and linears, several chunks)."""
    monkeypatch.setattr(weight_cache, "CHUNK_ELEMS", 1 << 14)
    m = _model("qwen3_moe", preset, model_kw=EAGER).cuda()
    sites = _all_sites(m)
    with step_cache.enabled(weights=True):
        for _ in range(2):                     # epoch 1 fills one by one, epoch 2 batched
            weight_cache.reset_stats()
            kept = [(s, weight_cache.lookup(s)) for s in sites]
            st = weight_cache.stats()
            for s, e in kept:
                with torch.no_grad():
                    ref = s.quantize_now(s.param().detach(), s.amax_now())
                assert torch.equal(e.wq, ref), s.name
            step_cache.weights_changed()
        assert st["batched_sites"] == len(sites) and st["batched_launches"] > 2, st
