"""Exhaustive tests of qatfactory.formats.codecs against independent casts:
ml_dtypes (float4_e2m1fn, float8_e4m3fn, float8_e8m0fnu) and torch's float8 casts
(torch.float8_e4m3fn `.to()` == the NVIDIA cvt.rn.satfinite rule, formats.md 0.2 / 5)."""
import numpy as np
import pytest
import torch

from qatfactory.formats import codecs as C
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with

F32 = np.float32


def _nextafter(a, direction):
    return np.nextafter(np.asarray(a, F32), F32(direction)).astype(F32)


# ----------------------------------------------------------------------------- E2M1
def _e2m1_oracle_ml(v: np.ndarray) -> np.ndarray:
    """ml_dtypes RNE cast (saturating to +-6, sign bit copied) -> code 0..15."""
    return np.asarray(v, F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def _e2m1_brute(v: np.ndarray, ties: str) -> np.ndarray:
    """Nearest of the 8 magnitudes in float64 (exact distances); ties -> even mantissa (RNE)
    or the smaller magnitude (toward zero). Sign bit = (v < 0) (ModelOpt's rule)."""
    a = np.minimum(np.abs(np.asarray(v, np.float64)), 8.0)   # beyond 6 saturates; keeps distances exact
    vals = C.E2M1_VALUES[:8].astype(np.float64)
    d = np.abs(a[..., None] - vals)
    best = d.min(-1, keepdims=True)
    cand = d == best
    if ties == "toward_zero":
        idx = np.argmax(cand, axis=-1)                      # first = smallest magnitude
    else:
        even = (np.arange(8) % 2 == 0)                      # codes 0,2,4,6 have mantissa bit 0
        idx = np.where(cand.sum(-1) > 1, np.argmax(cand & even, axis=-1), np.argmax(cand, axis=-1))
    return (idx | ((np.asarray(v) < 0) << 3)).astype(np.uint8)


def _e2m1_probe_values():
    bounds = C._E2M1_BOUNDS.astype(F32)
    vals = list(C.E2M1_VALUES[:8]) + list(bounds)
    vals += list(_nextafter(bounds, np.inf)) + list(_nextafter(bounds, -np.inf))
    vals += list(_nextafter(C.E2M1_VALUES[:8], np.inf)) + list(_nextafter(C.E2M1_VALUES[1:8], -np.inf))
    vals += [6.5, 7.0, 100.0, 3e38, 1e-30, 1e-45]
    rng = np.random.default_rng(0)
    dense = np.concatenate([np.linspace(0, 8, 200001, dtype=F32), rng.uniform(0, 7, 100000).astype(F32)])
    pos = np.concatenate([np.array(vals, F32), dense])
    return np.concatenate([pos, -pos[pos > 0]])


def test_e2m1_decode_all_16_codes_vs_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    ml = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)
    np.testing.assert_array_equal(C.e2m1_decode_np(codes), ml)
    np.testing.assert_array_equal(np.signbit(C.e2m1_decode_np(codes)), np.signbit(ml))
    np.testing.assert_array_equal(C.e2m1_decode(torch.from_numpy(codes)).numpy(), ml)


def test_e2m1_rne_every_tie_vs_ml_dtypes_and_bruteforce():
    v = _e2m1_probe_values()
    ours = C.e2m1_encode_np(v, "rne")
    ml = _e2m1_oracle_ml(v)
    # ml_dtypes copies the sign bit, ModelOpt (and this codec) use v < 0: equal here since v != -0.0
    np.testing.assert_array_equal(ours, ml)
    np.testing.assert_array_equal(ours, _e2m1_brute(v, "rne"))
    np.testing.assert_array_equal(C.e2m1_encode(torch.from_numpy(v), "rne").numpy(), ours)
    # the ties go where RNE says (formats.md 0.1 table)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    assert C.e2m1_decode_np(C.e2m1_encode_np(ties, "rne")).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_e2m1_toward_zero_vs_bruteforce():
    v = _e2m1_probe_values()
    ours = C.e2m1_encode_np(v, "toward_zero")
    np.testing.assert_array_equal(ours, _e2m1_brute(v, "toward_zero"))
    np.testing.assert_array_equal(C.e2m1_encode(torch.from_numpy(v), "toward_zero").numpy(), ours)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    assert C.e2m1_decode_np(C.e2m1_encode_np(ties, "toward_zero")).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4]


def test_e2m1_sign_of_zero_and_saturation():
    v = np.array([-0.0, -0.1, -0.25, -7.0, 1e30], F32)
    assert C.e2m1_encode_np(v).tolist() == [0, 8, 8, 15, 7]          # v < 0 decides the sign bit
    assert C.e2m1_encode_np(v, negative_zero=False).tolist() == [0, 0, 0, 15, 7]  # ggml: +0
    assert C.e2m1_encode(torch.from_numpy(v)).tolist() == [0, 8, 8, 15, 7]
    assert C.e2m1_encode(torch.from_numpy(v), negative_zero=False).tolist() == [0, 0, 0, 15, 7]
    with pytest.raises(ValueError, match="tie rule"):
        C.e2m1_encode_np(v, "away")
    with pytest.raises(ValueError, match="tie rule"):
        C.e2m1_encode(torch.from_numpy(v), "away")


def test_e2m1_torch_float4_cast_where_available():
    v = _e2m1_probe_values()[:1000]
    try:
        t = torch.from_numpy(v).to(torch.float4_e2m1fn_x2)
    except (AttributeError, NotImplementedError, RuntimeError, TypeError) as e:
        pytest.skip(f"torch {torch.__version__} has no float32 -> float4_e2m1fn_x2 cast: {type(e).__name__}")
    got = t.view(torch.uint8).numpy()  # pragma: no cover - not available in torch 2.13 CPU
    np.testing.assert_array_equal(got, C.pack_pairs_np(_e2m1_oracle_ml(v)))


# ----------------------------------------------------------------------------- E4M3
def test_e4m3_decode_all_256_bytes():
    b = np.arange(256, dtype=np.uint8)
    ml = b.view(ml_dtypes.float8_e4m3fn).astype(F32)
    th = torch.from_numpy(b).view(torch.float8_e4m3fn).float().numpy()
    for got in (C.e4m3_decode_np(b), C.e4m3_decode(torch.from_numpy(b)).numpy()):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ml))
        ok = ~np.isnan(ml)
        np.testing.assert_array_equal(got[ok], ml[ok])
        np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(ml[ok]))
        np.testing.assert_array_equal(got[ok], th[ok])
    assert np.isnan(ml[[0x7F, 0xFF]]).all() and C.e4m3_decode_np(np.uint8(0x7E)) == 448.0


def _e4m3_probe_values():
    """Every positive E4M3 value, every midpoint between neighbours (all exact in fp32: the RNE
    tie points), one float32 ulp either side of each, the saturation region, and random fill."""
    pos = np.unique(np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    mids = ((pos[1:] + pos[:-1]) / 2).astype(F32)
    assert np.array_equal(mids.astype(np.float64), (pos[1:] + pos[:-1]) / 2)   # exact
    pts = np.concatenate([pos.astype(F32), mids, _nextafter(mids, np.inf), _nextafter(mids, -np.inf),
                          np.array([448, 449, 460, 463.99, 464, 480, 500, 1e4, 3e38, np.inf,
                                    2.0 ** -10, 1.5 * 2.0 ** -9, 2.0 ** -9, 2.0 ** -6, 1e-45, 1e-38, 0], F32)])
    rng = np.random.default_rng(1)
    bits = rng.integers(0x30000000, 0x44000000, 2_000_000, dtype=np.uint32).view(F32)   # ~4.7e-10 .. 512
    v = np.concatenate([pts, bits])
    return np.concatenate([v, -v])


def test_e4m3_encode_vs_torch_cast_all_transitions_ties_saturation():
    v = _e4m3_probe_values()
    oracle = torch.from_numpy(v).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    big = np.abs(v) > 448
    # torch 2.13 saturates (== hardware satfinite, formats.md 0.2); older torch gave NaN: then the
    # hardware rule is 0x7E with the sign, which is what we expect either way
    oracle = np.where(big, np.where(v < 0, 0xFE, 0x7E), oracle).astype(np.uint8)
    np.testing.assert_array_equal(C.e4m3_encode_np(v), oracle)
    np.testing.assert_array_equal(C.e4m3_encode(torch.from_numpy(v)).numpy(), oracle)
    # ml_dtypes agrees once clamped (it does not saturate by itself)
    ml = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(C.e4m3_encode_np(v), ml)


def test_e4m3_specials():
    v = np.array([0.0, -0.0, np.nan, 2.0 ** -10, 1.5 * 2.0 ** -9, 432.0, np.inf], F32)
    assert C.e4m3_encode_np(v).tolist() == [0x00, 0x80, 0x7F, 0x00, 0x02, 0x7E, 0x7E]
    assert C.e4m3_encode(torch.from_numpy(v)).tolist() == [0x00, 0x80, 0x7F, 0x00, 0x02, 0x7E, 0x7E]


# ----------------------------------------------------------------------------- E8M0
def test_e8m0_decode_all_256_bytes():
    b = np.arange(256, dtype=np.uint8)
    ml = b.view(ml_dtypes.float8_e8m0fnu).astype(F32)
    th = torch.from_numpy(b).view(torch.float8_e8m0fnu).float().numpy()
    for got in (C.e8m0_decode_np(b), C.e8m0_decode(torch.from_numpy(b)).numpy()):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ml))
        np.testing.assert_array_equal(got[:255], ml[:255])
        np.testing.assert_array_equal(got[:255], th[:255])
    assert C.e8m0_decode_np(np.uint8(0)) == np.float32(2.0 ** -127)
    assert C.e8m0_decode_np(np.uint8(127)) == 1.0 and np.isnan(C.e8m0_decode_np(np.uint8(255)))


# ----------------------------------------------------------------------------- packing / ints
def test_pack_pairs_round_trip_and_layout():
    rng = np.random.default_rng(2)
    c = rng.integers(0, 16, (3, 5, 64), dtype=np.uint8)
    p = C.pack_pairs_np(c)
    assert p.shape == (3, 5, 32)
    np.testing.assert_array_equal(p, C.pack_pairs(torch.from_numpy(c)).numpy())
    np.testing.assert_array_equal(C.unpack_pairs_np(p), c)
    np.testing.assert_array_equal(C.unpack_pairs(torch.from_numpy(p)).numpy(), c)
    assert C.pack_pairs_np(np.array([1, 2, 15, 0], np.uint8)).tolist() == [0x21, 0x0F]


def test_pack_split_halves_round_trip_and_layout():
    rng = np.random.default_rng(3)
    for block in (16, 32):
        c = rng.integers(0, 16, (4, 128), dtype=np.uint8)
        p = C.pack_split_halves_np(c, block)
        np.testing.assert_array_equal(p, C.pack_split_halves(torch.from_numpy(c), block).numpy())
        np.testing.assert_array_equal(C.unpack_split_halves_np(p, block), c)
        np.testing.assert_array_equal(C.unpack_split_halves(torch.from_numpy(p), block).numpy(), c)
        h = block // 2
        np.testing.assert_array_equal(p[:, :h], c[:, :h] | (c[:, h:block] << 4))


def test_fp16_bits_and_nearest_int():
    v = np.array([1.0, 65504, 70000, 2.0 ** -25, -0.0], F32)
    np.testing.assert_array_equal(C.fp16_bits_np(v), v.astype(np.float16).view(np.uint16))
    assert C.fp16_bits_np(np.float32(70000)) == 0x7C00
    assert C.nearest_int_np(np.array([0.5, 1.5, 2.5, -0.5, -1.5], F32)).tolist() == [0, 2, 2, 0, -2]
