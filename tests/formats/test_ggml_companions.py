"""q5_0 / q6_k / q8_0 against libggml (libggml-python 0.20.2 = ggml 0.20.2) and gguf-py.

Oracles: ``ggml_quantize_chunk`` (what llama-quantize calls), ``quantize_row_<t>_ref``,
``dequantize_row_<t>`` through tests/ggml_oracle.py; ``gguf.quants`` (gguf 0.19) for
dequantization of all three and quantization of q5_0 / q8_0. Every case runs the numpy
reference and the torch emulator; each format sees well over 1M elements in total.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ggml_oracle as O
from qatfactory.formats import get_format

try:  # the GPU machine has no gguf; only the CPU oracle tests need it
    import gguf
    import gguf.quants as gguf_quants
except ImportError:  # pragma: no cover
    gguf = gguf_quants = None

FORMATS = ["q5_0", "q6_k", "q8_0"]
IMATRIX_FORMATS = ["q5_0", "q6_k"]
GGUF_TYPE = {n: getattr(gguf.GGMLQuantizationType, n.upper()) for n in FORMATS} if gguf else {}
K = 2048


# ----------------------------------------------------------------------------- helpers
def assert_bytes_equal(got: np.ndarray, want: np.ndarray, fmt: str, what: str) -> None:
    """Byte equality; on failure name the first differing block and show both byte strings."""
    got = np.asarray(got, dtype=np.uint8)
    want = np.asarray(want, dtype=np.uint8)
    assert got.shape == want.shape, f"{fmt} {what}: shape {got.shape} != {want.shape}"
    if np.array_equal(got, want):
        return
    bpb = get_format(fmt).spec.bytes_per_block
    g = got.reshape(-1, bpb)
    w = want.reshape(-1, bpb)
    bad = np.nonzero((g != w).any(axis=1))[0]
    i = int(bad[0])
    nb_row = got.shape[-1] // bpb
    offs = np.nonzero(g[i] != w[i])[0]
    raise AssertionError(
        f"{fmt} {what}: {bad.size} of {g.shape[0]} blocks differ; first: flat block {i} "
        f"(row {i // nb_row}, block {i % nb_row}), byte offsets {offs[:12].tolist()}\n"
        f"  got  {g[i].tobytes().hex()}\n  want {w[i].tobytes().hex()}")


def assert_floats_bitwise(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
    diff = (got.view(np.uint32) != want.view(np.uint32)) & ~gn
    if diff.any():
        idx = np.unravel_index(int(np.argmax(diff.reshape(-1))), got.shape)
        raise AssertionError(f"{what}: {int(diff.sum())} values differ; first at {idx}: "
                             f"{got[idx]!r} ({got[idx].view(np.uint32):#010x}) vs "
                             f"{want[idx]!r} ({want[idx].view(np.uint32):#010x})")


def oracle_bytes(x: np.ndarray, fmt: str, imatrix=None) -> np.ndarray:
    """libggml bytes for x [..., K]; a per-expert imatrix [E, 1, K] is passed expert by expert
    (as llama-quantize does for 3-D tensors)."""
    if imatrix is not None and imatrix.ndim > 1:
        return np.stack([O.quantize(x[e], fmt, imatrix[e].reshape(-1)) for e in range(x.shape[0])])
    return O.quantize(x, fmt, imatrix)


def check_case(fmt: str, x: np.ndarray, imatrix=None, what: str = "") -> np.ndarray:
    """numpy reference and torch emulator == libggml bytes; decoders == libggml/gguf bitwise."""
    if gguf is None:
        pytest.skip("gguf is not installed (pip install gguf)")
    f = get_format(fmt)
    want = oracle_bytes(x, fmt, imatrix)
    assert_bytes_equal(f.quantize_ref(x, imatrix=imatrix), want, fmt, f"{what}: numpy reference vs libggml")
    im_t = None if imatrix is None else torch.from_numpy(imatrix)
    p = f.quantize(torch.from_numpy(x), imatrix=im_t)
    assert p.codes.shape == x.shape
    assert_bytes_equal(f.to_bytes(p), want, fmt, f"{what}: torch emulator vs libggml")
    k = x.shape[-1]
    ref_deq = O.dequantize(want, fmt, k)
    assert_floats_bitwise(f.dequantize(p).numpy(), ref_deq, f"{fmt} {what}: dequantize vs libggml")
    assert_floats_bitwise(f.dequantize_ref(want, k), ref_deq, f"{fmt} {what}: dequantize_ref vs libggml")
    with np.errstate(over="ignore", invalid="ignore"):  # the fp16-overflow case, in gguf-py
        assert_floats_bitwise(gguf_quants.dequantize(want, GGUF_TYPE[fmt]), ref_deq,
                              f"{fmt} {what}: gguf.quants.dequantize vs libggml")
        if imatrix is None and fmt != "q6_k":
            gq = gguf_quants.quantize(x.reshape(-1, k), GGUF_TYPE[fmt]).reshape(want.shape)
            assert_bytes_equal(gq, want, fmt, f"{what}: gguf.quants.quantize vs libggml")
    return want


def _pow2_edges(rng, rows: int, k: int, block: int) -> np.ndarray:
    """Blocks whose largest |x| sits one ulp below / at / above a power of two."""
    x = (rng.standard_normal((rows, k)) * 0.25).astype(np.float32)
    xb = x.reshape(-1, block)
    n = xb.shape[0]
    e = rng.integers(-20, 12, n).astype(np.float32)
    base = np.ldexp(np.float32(1), e.astype(np.int32)).astype(np.float32)
    ulp = rng.integers(-1, 2, n)
    top = np.where(ulp < 0, np.nextafter(base, np.float32(0)),
                   np.where(ulp > 0, np.nextafter(base, np.float32(np.inf)), base)).astype(np.float32)
    xb *= (base / np.float32(8))[:, None]  # the rest of the block stays below the max
    pos = rng.integers(0, block, n)
    sign = np.where(rng.random(n) < 0.5, np.float32(-1), np.float32(1))
    xb[np.arange(n), pos] = sign * top
    return xb.reshape(rows, k)


def _ties(rng, rows: int, k: int, fmt: str) -> np.ndarray:
    """Values exactly at the half-steps of the element grid."""
    if fmt == "q8_0":   # amax = 127 -> d = 1 exactly, x*id hits n + 0.5
        v = (rng.integers(-127, 127, (rows, k)) + 0.5).astype(np.float32)
        v.reshape(-1, 32)[:, 0] = 127.0
    elif fmt == "q5_0":  # max = -16 -> d = 1; x + 16.5 lands on integers (trunc boundaries)
        v = (rng.integers(-15, 16, (rows, k)) - 0.5).astype(np.float32)
        v.reshape(-1, 32)[:, 0] = -16.0
    else:               # half-integers on a few scales: nearest_int ties in the rmse search
        v = (rng.integers(-63, 64, (rows, k)) * 0.5).astype(np.float32)
        v *= np.ldexp(np.float32(1), rng.integers(-4, 4, (rows, 1))).astype(np.float32)
    return v


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).bfloat16().float().numpy()


def _cases(fmt: str):
    rng = np.random.default_rng({"q5_0": 5, "q6_k": 6, "q8_0": 8}[fmt])
    sub = 16 if fmt == "q6_k" else 32
    mixed = (rng.standard_normal((8, K)) * 0.02).astype(np.float32)
    mb = mixed.reshape(-1, sub)
    mb[::3] = 0.0                                   # zero sub-blocks among live ones
    mb[1::7] *= np.float32(1e-6)                    # sub-blocks whose scale rounds to 0
    return {
        "normal": (rng.standard_normal((160, K)) * 0.02).astype(np.float32),
        "heavy_tailed": (rng.standard_t(2, (64, K)) * 0.05).astype(np.float32),
        "all_positive": rng.random((32, K)).astype(np.float32),
        "constant": np.repeat(rng.standard_normal((16, 1)).astype(np.float32), K, axis=1),
        "zero": np.zeros((4, K), np.float32),
        "tiny_1e-8": (rng.standard_normal((16, K)) * 1e-8).astype(np.float32),
        "below_eps_1e-17": (rng.standard_normal((2, K)) * 1e-17).astype(np.float32),
        "huge_1e4": (rng.standard_normal((16, K)) * 1e4).astype(np.float32),
        "fp16_overflow_1e9": (rng.standard_normal((2, K)) * 1e9).astype(np.float32),
        "bf16_valued": _bf16((rng.standard_normal((64, K)) * 0.02).astype(np.float32)),
        "pow2_edges": _pow2_edges(rng, 64, K, sub),
        "ties": _ties(rng, 64, K, fmt),
        "mixed_zero_subblocks": mixed,
    }


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_match_libggml(fmt):
    total = 0
    for what, x in _cases(fmt).items():
        check_case(fmt, x, None, what)
        total += x.size
    assert total >= 1_000_000


@pytest.mark.parametrize("fmt", IMATRIX_FORMATS)
def test_bytes_match_libggml_with_imatrix(fmt):
    rng = np.random.default_rng(11)
    total = 0
    for i, (what, x) in enumerate(_cases(fmt).items()):
        if x.shape[0] > 32:
            x = x[:32]
        im = (rng.random(K) ** 2).astype(np.float32)
        if i % 3 == 0:
            im[rng.random(K) < 0.1] = 0.0           # columns the calibration never saw
        check_case(fmt, x, im, what + "+imatrix")
        total += x.size
    assert total >= 500_000


@pytest.mark.parametrize("fmt", IMATRIX_FORMATS)
@pytest.mark.parametrize("cols", [None, 7])
def test_imatrix_search_in_uneven_passes(fmt, cols, monkeypatch):
    """The torch candidate search runs in passes of ``QX_COLS_CPU`` groups: SmolLM2's 576-wide rows
    (q5_0, llama-quantize's fallback of Q4_K) give group counts that are no multiple of it, so the
    last pass is short. Bytes vs libggml at the real width with the real pass size, and with a
    pass of 7 groups x 3 candidates (many passes, short last ones) on live, zero and tiny groups."""
    import qatfactory.formats.q6_k as q6
    if cols is not None:
        monkeypatch.setattr(q6, "QX_COLS_CPU", cols)
        monkeypatch.setattr(q6, "QX_CANDS_CPU", 3)   # 19 candidates: 6 groups of 3 and one of 1
    rng = np.random.default_rng(21)
    k = 576 if fmt == "q5_0" else 768
    rows = 37 if cols is None else 5         # 666 / 1776 groups, or 90 / 240 in passes of 7
    x = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
    xb = x.reshape(-1, 16)
    xb[::5] = 0.0
    xb[3::11] *= np.float32(1e-6)
    im = (rng.random(k) ** 2).astype(np.float32)
    im[rng.random(k) < 0.1] = 0.0
    what = f"{rows}x{k}, passes of {cols or q6.QX_COLS_CPU} groups"
    check_case(fmt, x, im, what + " +imatrix")
    check_case(fmt, x, None, what)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_ref_and_3d(fmt):
    """quantize_row_<t>_ref on one flat row == chunk bytes; 3-D input (experts) with a
    per-expert imatrix where the format uses one."""
    f = get_format(fmt)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 3, 512)) * 0.1).astype(np.float32)
    want = check_case(fmt, x, None, "3-D")
    assert_bytes_equal(O.quantize_row_ref(x.reshape(-1), fmt).reshape(want.shape), want, fmt,
                       "quantize_row_ref vs ggml_quantize_chunk")
    if fmt in IMATRIX_FORMATS:
        im = (rng.random((4, 1, 512)) + 0.01).astype(np.float32)
        check_case(fmt, x, im, "3-D per-expert imatrix")
    # any leading shape, including none
    one = x[0, 0]
    assert_bytes_equal(f.to_bytes(f.quantize(torch.from_numpy(one))), O.quantize(one[None], fmt)[0],
                       fmt, "1-D input")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(fmt, dtype):
    x16 = (torch.randn(16, 1024, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    f = get_format(fmt)
    want = O.quantize(x16.float().numpy(), fmt)
    assert_bytes_equal(f.to_bytes(f.quantize(x16)), want, fmt, f"{dtype} input")


# ----------------------------------------------------------------------------- bytes round trip
@pytest.mark.parametrize("fmt", FORMATS)
def test_from_bytes_round_trip(fmt):
    f = get_format(fmt)
    x = (np.random.default_rng(2).standard_normal((2, 3, 512)) * 0.3).astype(np.float32)
    b = O.quantize(x, fmt)
    p = f.from_bytes(b, 512)
    assert p.shape == x.shape and p.format == fmt
    assert_bytes_equal(f.to_bytes(p), b, fmt, "to_bytes(from_bytes(b))")
    q = f.quantize(torch.from_numpy(x))
    assert torch.equal(p.codes, q.codes) and torch.equal(p.scales, q.scales)
    with pytest.raises(ValueError, match=fmt):
        f.from_bytes(b[..., :-1])
    with pytest.raises(ValueError, match="K=1024"):
        f.from_bytes(b, 1024)


# ----------------------------------------------------------------------------- fake quant / STE
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_value_dtype_ste(fmt, dtype):
    f = get_format(fmt)
    x = (torch.randn(4, 512, generator=torch.Generator().manual_seed(4)) * 0.1).to(dtype).requires_grad_(True)
    y = f.fake_quantize(x)
    assert y.dtype == dtype and y.shape == x.shape
    want = f.dequantize(f.quantize(x.detach())).to(dtype)
    assert torch.equal(y.detach(), want)
    # the quantized values really are the engine's: decode libggml's bytes
    ref = O.dequantize(O.quantize(x.detach().float().numpy(), fmt), fmt, 512)
    assert torch.equal(y.detach(), torch.from_numpy(ref).to(dtype))
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)                    # identity STE
    if fmt in IMATRIX_FORMATS:                       # extra kwargs reach quantize()
        im = torch.rand(512, generator=torch.Generator().manual_seed(5))
        yi = f.fake_quantize(x.detach(), imatrix=im)
        ref = O.dequantize(O.quantize(x.detach().float().numpy(), fmt, im.numpy()), fmt, 512)
        assert torch.equal(yi, torch.from_numpy(ref).to(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_accepts_bf16_arrays(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = (np.random.default_rng(7).standard_normal((4, 512)) * 0.1).astype(ml_dtypes.bfloat16)
    assert_bytes_equal(get_format(fmt).quantize_ref(x), O.quantize(x.astype(np.float32), fmt), fmt,
                       "numpy reference on an ml_dtypes bfloat16 array")


def test_clipped_ste_q8_0_frozen_scales():
    """Frozen scales half the size the block needs: the top half of the range saturates at
    +-127 and the clipped STE passes no gradient there."""
    f = get_format("q8_0")
    x = torch.linspace(-1, 1, 64).reshape(1, 64)
    d = torch.full((1, 2), 1.0 / 254, dtype=torch.float16)
    p = f.quantize(x, scales=d)
    assert p.codes.abs().max() == 127
    mask = f.clip_mask(x, p)
    id_ = 1.0 / d.float()[0, 0]
    inside = (torch.round(x.abs() * id_) <= 127)
    assert torch.equal(mask, inside) and (~mask).any() and mask.any()
    xr = x.clone().requires_grad_(True)
    y = f.fake_quantize(xr, ste="clipped", scales=d)
    y.sum().backward()
    assert torch.equal(xr.grad, mask.float())
    assert torch.equal(y.detach(), f.dequantize(p))
    # the engine's own scale never clips
    assert f.clip_mask(x, f.quantize(x)).all()


def test_q5_0_clip_mask_marks_saturated_side():
    """ggml maps the block max to level -16; values of the other sign beyond 15.5/16 of it
    saturate at +15, and clip_mask says so."""
    f = get_format("q5_0")
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 1] = -1.0      # -1 * id + 16.5 = 32.5 -> clipped to 31
    x[0, 2] = -0.9      # inside
    p = f.quantize(x)
    assert p.codes[0, 0] == 0 and p.codes[0, 1] == 31
    m = f.clip_mask(x, p)
    assert not m[0, 1] and m[0, 0] and m[0, 2]


def test_q6_k_clipped_ste_with_halved_super_scale():
    """Halving d doubles x/ds: the outer part of each sub-block saturates at -32 / 31 and
    the clipped STE passes no gradient there."""
    f = get_format("q6_k")
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(8))
    p = f.quantize(x)
    d2 = (p.extra["d"].float() / 2).half()
    q = f.quantize(x, scales=p.scales, d=d2)
    ds = (d2.float().repeat_interleave(16, dim=-1) * q.scales.float()).repeat_interleave(16, dim=-1)
    lvl = torch.round(x / ds)
    want = (lvl >= -32) & (lvl <= 31)
    assert (~want).any() and want.any()
    assert torch.equal(f.clip_mask(x, q), want)
    assert torch.equal(q.codes.long() - 32, lvl.clamp(-32, 31).long())
    assert f.clip_mask(x, p).all()
    xr = x.clone().requires_grad_(True)
    f.fake_quantize(xr, ste="clipped", scales=p.scales, d=d2).sum().backward()
    assert torch.equal(xr.grad, want.float())


def test_q6_k_frozen_scales_reproduce_codes():
    f = get_format("q6_k")
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(9))
    p = f.quantize(x)
    q = f.quantize(x, scales=p.scales, d=p.extra["d"])
    assert torch.equal(q.codes, p.codes)
    with pytest.raises(ValueError, match="together"):
        f.quantize(x, scales=p.scales)


def test_q8_0_frozen_scales_exact_when_d_is_fp16():
    """When amax/127 is exact in fp16 the supplied scales give the engine's bytes."""
    f = get_format("q8_0")
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (4, 256)).astype(np.float32)
    xb = x.reshape(-1, 32)
    p2 = np.ldexp(np.float32(1), rng.integers(-8, 2, xb.shape[0])).astype(np.float32)
    xb *= p2[:, None]
    xb[:, 0] = 127 * p2
    d = torch.from_numpy(np.abs(xb[:, 0]) / 127).reshape(4, 8).half()
    assert_bytes_equal(f.to_bytes(f.quantize(torch.from_numpy(x), scales=d)), O.quantize(x, "q8_0"),
                       "q8_0", "frozen exact scales")


# ----------------------------------------------------------------------------- errors
FALLBACK_WORD = {"q5_0": "F16", "q6_k": "Q8_0", "q8_0": "F16"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_k_names_format_block_and_fallback(fmt):
    f = get_format(fmt)
    sb = f.spec.super_block
    x = torch.randn(2, sb + 16)
    for fn in (f.quantize, f.fake_quantize):
        with pytest.raises(ValueError) as e:
            fn(x)
        msg = str(e.value)
        assert fmt in msg and str(sb) in msg and FALLBACK_WORD[fmt] in msg, msg
    with pytest.raises(ValueError, match=str(sb)):
        f.quantize_ref(x.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_finite_sees_every_position(dtype):
    """The input check (one min/max pass) refuses NaN, +Inf and -Inf wherever they sit (first and
    last element, vector lanes and tails, a non-contiguous view) and passes finite extremes."""
    from qatfactory.formats.spec import Format
    big = torch.finfo(dtype).max
    for n in (1, 2, 15, 16, 17, 31, 33, 64, 127, 129, 4097):
        for pos in sorted({0, n // 2, n - 1}):
            for bad in (float("nan"), float("inf"), -float("inf")):
                x = torch.randn(n).to(dtype)
                x[pos] = bad
                with pytest.raises(ValueError, match="NaN or Inf"):
                    Format.check_finite("t", x)
    ok = torch.tensor([big, -big, 0.0, -0.0, torch.finfo(dtype).tiny / 4, 1.0]).to(dtype)
    Format.check_finite("t", ok)
    x = torch.randn(8, 66).to(dtype)
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        Format.check_finite("t", x[:, 1:])
    Format.check_finite("t", x[:, 2:])
    Format.check_finite("t", torch.empty(0, dtype=dtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_raise(fmt, bad):
    f = get_format(fmt)
    x = torch.randn(2, 256)
    x[1, 7] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        f.quantize(x)
    with pytest.raises(ValueError, match="NaN or Inf"):
        f.quantize_ref(x.numpy())
    if fmt in IMATRIX_FORMATS:
        im = torch.ones(256)
        im[3] = bad
        with pytest.raises(ValueError, match="imatrix"):
            f.quantize(torch.randn(2, 256), imatrix=im)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_arguments(fmt):
    f = get_format(fmt)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="amax"):
        f.quantize(x, amax=torch.tensor(1.0))
    with pytest.raises(TypeError, match="unexpected"):
        f.quantize(x, bogus=1)
    with pytest.raises(ValueError, match="floating"):
        f.quantize(torch.ones(2, 256, dtype=torch.int32))
    if fmt in IMATRIX_FORMATS:
        for bad_im in (torch.ones(128), torch.ones(3, 256), torch.ones(1, 1, 2, 256)):
            with pytest.raises(ValueError, match="K=256"):
                f.quantize(x, imatrix=bad_im)
            with pytest.raises(ValueError, match="imatrix"):
                f.quantize_ref(x.numpy(), imatrix=bad_im.numpy())


def test_specs():
    s5, s6, s8 = (get_format(n).spec for n in FORMATS)
    assert (s5.ggml_type, s6.ggml_type, s8.ggml_type) == (6, 14, 8)
    assert (s5.bytes_per_block, s6.bytes_per_block, s8.bytes_per_block) == (22, 210, 34)
    assert (s5.super_block, s6.super_block, s8.super_block) == (32, 256, 32)
    assert s6.block_size == 16 and s6.bits_per_weight == 6.5625
    for n in FORMATS:
        assert O.GGML_SIZES[n] == (get_format(n).spec.super_block, get_format(n).spec.bytes_per_block)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_emulator_matches_reference(fmt):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    f = get_format(fmt)
    total = 0
    for what, x in _cases(fmt).items():
        for im in ([None, (np.random.default_rng(1).random(K) ** 2).astype(np.float32)]
                   if fmt in IMATRIX_FORMATS else [None]):
            want = f.quantize_ref(x, imatrix=im)
            p = f.quantize(torch.from_numpy(x).cuda(), imatrix=None if im is None else torch.from_numpy(im).cuda())
            assert_bytes_equal(f.to_bytes(p), want, fmt, f"{what} imatrix={im is not None}: CUDA vs numpy reference")
            assert_floats_bitwise(f.dequantize(p).cpu().numpy(), f.dequantize_ref(want, K),
                                  f"{fmt} {what}: CUDA dequantize")
            total += x.size
        xb = torch.from_numpy(x).cuda().bfloat16()
        assert_bytes_equal(f.to_bytes(f.quantize(xb)), f.quantize_ref(xb.float().cpu().numpy()), fmt,
                           f"{what}: CUDA bf16")
    assert total >= 1_000_000


@pytest.mark.parametrize("name", ["q5_0", "q8_0", "q6_k"])
def test_signed_zero_blocks_match_libggml(name):
    """All -0.0 blocks: C starts its running max at +0.0f, so the stored scale's sign comes from
    that constant, not from the data (q5_0 stores d = +0/-16 = -0.0)."""
    import ggml_oracle
    f = get_format(name)
    k = f.spec.super_block
    x = torch.full((3, k), -0.0)
    x[1] = 0.0
    x[2, : k // 2] = 0.0
    ref = ggml_oracle.quantize(x.numpy(), name)
    assert np.array_equal(f.to_bytes(f.quantize(x)), ref)
    assert np.array_equal(f.quantize_ref(x.numpy()), ref)
