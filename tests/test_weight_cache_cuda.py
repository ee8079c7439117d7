"""The per-step weight cache on the GPU (run on the H200: benchmarks/gpu/step.sh runs this file first):
with the CUDA kernels the recompute-in-backward path is taken and the fills are batched (``auto``), and
training still gives the per-forward path's losses, gradients and eval logits bit for bit."""
import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from qatfactory.kernels import loader  # noqa: E402
from qatfactory.nn import weight_cache  # noqa: E402

ok, why = loader.probe()
if not ok:
    pytest.skip(f"CUDA kernels unavailable: {why}", allow_module_level=True)

from tests.test_weight_cache import _all_sites, _model, _train  # noqa: E402


@pytest.mark.parametrize("kind,preset,calib", [("llama", "nvfp4_w4a16", True), ("llama", "nvfp4_w4a4", True),
                                               ("llama", "mxfp4_w4a4", True), ("llama", "q4_k", False),
                                               ("qwen3_moe", "nvfp4_w4a4", True), ("qwen3_moe", "mxfp4_w4a16", True)])
def test_cached_training_on_the_kernels_is_bit_identical(kind, preset, calib, monkeypatch):
    weight_cache.set_batching("auto")
    monkeypatch.setattr(weight_cache, "CHUNK_ELEMS", 1 << 15)
    try:
        a, b = _model(kind, preset, calib).cuda(), _model(kind, preset, calib).cuda()
        sites = _all_sites(a)
        assert all(m.recompute_in_backward() for m in a.modules() if hasattr(m, "recompute_in_backward"))
        weight_cache.reset_stats()
        got = _train(a, True, 3, 2, None)
        st = weight_cache.stats()
        want = _train(b, False, 3, 2, None)
    finally:
        weight_cache.set_batching(None)
    for g, w in zip(got, want):
        assert torch.equal(g[3], w[3]), g[:3]
    assert len(got) == len(want)
    assert st["fills"] == len(sites) * 4 and st["batched_sites"] > len(sites), st
