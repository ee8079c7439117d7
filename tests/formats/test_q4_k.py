"""q4_k (llama.cpp Q4_K) against libggml bytes, gguf decode and the autograd contract.

Oracles: libggml-python 0.20.2.post1 (ggml_quantize_chunk -> quantize_row_q4_K_ref without
imatrix, quantize_row_q4_K_impl with one; dequantize_row_q4_K) through tests/ggml_oracle.py,
and gguf 0.19 ``gguf.quants.dequantize``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ggml_oracle
from qatfactory.formats import get_format

F = get_format("q4_k")


K = 1024
BB = 144


def assert_same_bytes(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Byte equality; on failure name the first differing super-block and its bytes."""
    per_row = max(1, np.shape(ours)[-1] // BB)
    a = np.ascontiguousarray(ours, dtype=np.uint8).reshape(-1, BB)
    b = np.ascontiguousarray(ref, dtype=np.uint8).reshape(-1, BB)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    bad = np.nonzero((a != b).any(axis=1))[0]
    if bad.size:
        i = int(bad[0])
        pos = np.nonzero(a[i] != b[i])[0]
        fields = ["d" if p < 2 else "dmin" if p < 4 else "scales" if p < 16 else "qs" for p in pos[:8]]
        raise AssertionError(
            f"{what}: {bad.size} of {a.shape[0]} super-blocks differ; first is #{i} (row {i // per_row}, "
            f"block {i % per_row}); byte offsets {pos[:8].tolist()} ({fields}): ours {a[i, pos[:8]].tolist()} "
            f"vs libggml {b[i, pos[:8]].tolist()}")


def assert_same_floats(a, b, what: str) -> None:
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    bad = np.nonzero(a.view(np.uint32).reshape(-1) != b.view(np.uint32).reshape(-1))[0]
    assert bad.size == 0, (f"{what}: {bad.size} values differ; first at flat index {bad[0]} "
                           f"(super-block {bad[0] // 256}): {a.reshape(-1)[bad[0]]!r} vs {b.reshape(-1)[bad[0]]!r}")


def _pow2_edges(rng, rows):
    """Each sub-block's max is 2^e, or one ulp below / above it."""
    x = rng.uniform(-1, 1, (rows, K)).astype(np.float32)
    sub = x.reshape(rows, K // 32, 32)
    e = rng.integers(-6, 7, sub.shape[:2]).astype(np.float32)
    top = np.ldexp(np.float32(1), e.astype(np.int32)).astype(np.float32)
    kind = rng.integers(0, 3, sub.shape[:2])
    below, above = np.nextafter(top, np.float32(0)), np.nextafter(top, np.float32(np.inf))
    top = np.where(kind == 0, below, np.where(kind == 2, above, top))
    sub *= (top / 1.0001)[..., None]
    sub[..., 7] = top
    return x


def _grid(rng, rows):
    """Values exactly on a 16-level grid d*q - m per sub-block (d, m fp16-ish)."""
    q = rng.integers(0, 16, (rows, K // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15
    d = rng.choice(np.float32([2.0 ** -6, 0.125, 0.1, 1 / 3, 1.0, 3.0]), (rows, K // 32, 1)).astype(np.float32)
    m = (rng.integers(0, 64, (rows, K // 32, 1)) * d / 4).astype(np.float32)
    return (d * q - m).astype(np.float32).reshape(rows, K)


def _cases():
    rng = np.random.default_rng(1234)
    c = {}
    c["normal"] = rng.standard_normal((192, K)).astype(np.float32)
    c["student_t"] = rng.standard_t(2.0, (96, K)).astype(np.float32)
    c["all_positive"] = (np.abs(rng.standard_normal((48, K))) + 0.25).astype(np.float32)
    c["all_negative"] = (-np.abs(rng.standard_normal((16, K))) - 0.25).astype(np.float32)
    levels = np.float32([0.0, 1.0, -1.0, 0.3, -7.5, 1e-3])
    const = np.repeat(rng.choice(levels, (24, 1)), K, 1).astype(np.float32)
    const[12:] = np.repeat(rng.standard_normal((12, K // 32, 1)).astype(np.float32), 32, 2).reshape(12, K)
    c["constant"] = const
    c["zero"] = np.zeros((4, K), np.float32)
    c["tiny_1e-8"] = (rng.standard_normal((24, K)) * 1e-8).astype(np.float32)
    c["huge_1e4"] = (rng.standard_normal((24, K)) * 1e4).astype(np.float32)
    c["bf16_values"] = torch.randn(48, K, generator=torch.Generator().manual_seed(5)).bfloat16().float().numpy()
    c["pow2_edges"] = _pow2_edges(rng, 32)
    c["grid16"] = _grid(rng, 32)
    mixed = rng.standard_normal((48, K // 32, 32)) * 10.0 ** rng.uniform(-4, 3, (48, K // 32, 1))
    c["mixed_subblock_scales"] = mixed.astype(np.float32).reshape(48, K)
    sparse = rng.standard_normal((24, K)).astype(np.float32) * (rng.random((24, K)) < 0.1)
    sparse[:, ::97] = 40.0
    c["sparse_outliers"] = sparse.astype(np.float32)
    return c


CASES = _cases()


def _imatrices():
    rng = np.random.default_rng(99)
    pos = (rng.random(K) * 10.0 ** rng.uniform(-2, 2, K)).astype(np.float32) + np.float32(1e-3)
    zeros = rng.random(K).astype(np.float32)
    zeros[rng.random(K) < 0.2] = 0
    zeros[64:96] = 0   # one whole sub-block without weight
    return {"none": None, "positive": pos, "with_zeros": zeros}


IMATRICES = _imatrices()


def test_enough_coverage():
    n = sum(v.size for v in CASES.values())
    assert n * 2 >= 1_000_000, n   # every case runs without and with (two) imatrices


@pytest.mark.parametrize("im_name", ["none", "positive", "with_zeros"])
def test_bytes_match_libggml(im_name):
    im = IMATRICES[im_name]
    for name, x in CASES.items():
        if im_name == "with_zeros" and name not in ("normal", "student_t", "constant", "zero", "grid16"):
            continue
        want = ggml_oracle.quantize(x, "q4_k", im)
        assert want.shape == (x.shape[0], K // 256 * BB)
        assert_same_bytes(F.quantize_ref(x, imatrix=im), want, f"numpy reference, {name}, imatrix={im_name}")
        p = F.quantize(torch.from_numpy(x), imatrix=None if im is None else torch.from_numpy(im))
        assert_same_bytes(F.to_bytes(p), want, f"torch emulator, {name}, imatrix={im_name}")


def test_row_ref_entry_point():
    """quantize_row_q4_K_ref directly (the no-imatrix path of ggml_quantize_chunk)."""
    x = CASES["student_t"][:8]
    want = np.stack([ggml_oracle.quantize_row_ref(r, "q4_k") for r in x])
    assert_same_bytes(F.quantize_ref(x), want, "numpy reference vs quantize_row_q4_K_ref")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x = torch.from_numpy(CASES["normal"][:32]).to(dtype)
    want = ggml_oracle.quantize(x.float().numpy(), "q4_k")
    p = F.quantize(x)
    assert_same_bytes(F.to_bytes(p), want, f"torch emulator from {dtype}")


def test_three_d_experts_with_per_expert_imatrix():
    rng = np.random.default_rng(7)
    E, N = 3, 8
    x = rng.standard_normal((E, N, K)).astype(np.float32)
    im = rng.random((E, K)).astype(np.float32)
    want = np.stack([ggml_oracle.quantize(x[e], "q4_k", im[e]) for e in range(E)])
    p = F.quantize(torch.from_numpy(x), imatrix=torch.from_numpy(im))
    assert p.codes.shape == (E, N, K) and p.scales.shape == (E, N, K // 32, 2)
    assert p.extra["d"].shape == (E, N, K // 256) and p.extra["d"].dtype == torch.float16
    got = F.to_bytes(p)
    assert got.shape == (E, N, K // 256 * BB)
    assert_same_bytes(got, want, "3-D emulator, per-expert imatrix")
    assert_same_bytes(F.quantize_ref(x, imatrix=im), want, "3-D numpy reference, per-expert imatrix")
    # a shared imatrix [K] broadcasts over experts
    want1 = ggml_oracle.quantize(x.reshape(E * N, K), "q4_k", im[0]).reshape(E, N, -1)
    assert_same_bytes(F.to_bytes(F.quantize(torch.from_numpy(x), imatrix=torch.from_numpy(im[0]))), want1,
                      "3-D emulator, shared imatrix")
    with pytest.raises(ValueError, match="imatrix shape"):
        F.quantize(torch.from_numpy(x), imatrix=torch.ones(K + 1))


def test_dequantize_matches_gguf_and_libggml():
    import gguf
    x = np.concatenate([CASES["normal"][:32], CASES["mixed_subblock_scales"][:16], CASES["tiny_1e-8"][:4]])
    b = ggml_oracle.quantize(x, "q4_k")
    want_c = ggml_oracle.dequantize(b, "q4_k", K)
    want_py = gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q4_K)
    assert_same_floats(want_py, want_c, "gguf vs libggml (oracles agree)")
    assert_same_floats(F.dequantize(F.from_bytes(b, K)).numpy(), want_c, "emulator dequantize")
    assert_same_floats(F.dequantize_ref(b, K), want_c, "numpy dequantize_ref")
    p = F.quantize(torch.from_numpy(x))
    assert_same_floats(F.dequantize(p).numpy(), want_c, "dequantize(quantize(x))")


def test_packed_fields_round_trip():
    x = torch.from_numpy(CASES["student_t"][:16])
    p = F.quantize(x)
    assert p.codes.dtype == torch.uint8 and int(p.codes.max()) <= 15
    assert p.scales.dtype == torch.uint8 and int(p.scales.max()) <= 63
    q = F.from_bytes(F.to_bytes(p), K)
    assert torch.equal(q.codes, p.codes) and torch.equal(q.scales, p.scales)
    assert torch.equal(q.extra["d"].view(torch.int16), p.extra["d"].view(torch.int16))
    assert torch.equal(q.extra["dmin"].view(torch.int16), p.extra["dmin"].view(torch.int16))
    with pytest.raises(ValueError, match="1024"):
        F.from_bytes(F.to_bytes(p), 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_value_and_identity_ste(dtype):
    x = torch.from_numpy(CASES["normal"][:8]).to(dtype).requires_grad_(True)
    y = F.fake_quantize(x)
    assert y.dtype == dtype
    want = F.dequantize(F.quantize(x.detach())).to(dtype)
    assert torch.equal(y.detach(), want)
    assert not torch.equal(y.detach(), x.detach())
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_clipped_ste_mask():
    x = torch.from_numpy(CASES["student_t"][:16]).requires_grad_(True)
    p = F.quantize(x.detach())
    mask = F.clip_mask(x.detach(), p)
    assert mask.shape == x.shape and mask.dtype == torch.bool
    assert 0 < int((~mask).sum()) < mask.numel() // 4
    # outside the sub-block's range the code saturated at 0 or 15
    assert bool(((p.codes[~mask] == 0) | (p.codes[~mask] == 15)).all())
    deq = F.dequantize(p)
    below = ~mask & (x.detach() < deq)
    above = ~mask & (x.detach() > deq)
    # code 0 decodes to exactly -dmin*lm and code 15 to d*ls*15 - dmin*lm: the mask's bounds
    assert torch.equal(below | above, ~mask), "masked elements must lie outside what the block can represent"
    y = F.fake_quantize(x, ste="clipped")
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, mask.float())


def test_bad_shapes_and_values():
    with pytest.raises(ValueError, match=r"q4_k.*576.*256.*q5_0"):
        F.quantize(torch.zeros(4, 576))
    with pytest.raises(ValueError, match=r"q4_k.*256.*q5_0"):
        F.quantize_ref(np.zeros((4, 576), np.float32))
    with pytest.raises(ValueError, match=r"q4_k.*576.*256.*q5_0"):
        F.fake_quantize(torch.zeros(576))
    x = torch.randn(2, 256)
    x[1, 7] = float("nan")
    with pytest.raises(ValueError, match="q4_k.*NaN"):
        F.quantize(x)
    with pytest.raises(ValueError, match="q4_k.*NaN"):
        F.quantize_ref(x.numpy())
    with pytest.raises(ValueError, match="amax= is not supported"):
        F.quantize(torch.randn(2, 256), amax=torch.tensor(3.0))
    im = torch.ones(256)
    im[3] = float("inf")
    with pytest.raises(ValueError, match="imatrix contains NaN or Inf"):
        F.quantize(torch.randn(2, 256), imatrix=im)


def test_all_zero_has_no_nan():
    p = F.quantize(torch.zeros(2, 512))
    assert torch.equal(F.dequantize(p), torch.zeros(2, 512))
    assert not torch.isnan(p.extra["d"].float()).any() and not torch.isnan(p.extra["dmin"].float()).any()


def test_spec_fields():
    s = F.spec
    assert (s.ggml_type, s.block_size, s.super_block, s.bytes_per_block) == (12, 32, 256, 144)
    assert s.bits_per_weight == 4.5 and s.symmetric is False and s.scale_codec == "fp16+6bit"
    assert "q5_0" in s.fallback


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_emulator_matches_libggml():
    for im_name in ("none", "positive"):
        im = IMATRICES[im_name]
        for name in ("normal", "student_t", "mixed_subblock_scales", "tiny_1e-8", "pow2_edges", "grid16"):
            x = CASES[name]
            want = ggml_oracle.quantize(x, "q4_k", im)
            p = F.quantize(torch.from_numpy(x).cuda(), imatrix=None if im is None else torch.from_numpy(im).cuda())
            assert p.codes.is_cuda
            assert_same_bytes(F.to_bytes(p), want, f"CUDA emulator, {name}, imatrix={im_name}")
            assert_same_floats(F.dequantize(p).cpu().numpy(), ggml_oracle.dequantize(want, "q4_k", K),
                               f"CUDA dequantize, {name}")
