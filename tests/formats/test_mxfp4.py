"""MXFP4 family against independent oracles, byte for byte.

mxfp4        torchao 0.18 to_mx(FLOOR)                       (scales, packed codes, to_dtype decode)
mxfp4_even   torchao 0.18 to_mx(EVEN) + compressed-tensors generate_mx_scales
mxfp4_rceil  exact rational derivation (fractions) of triton_kernels ROUND_UP + ml_dtypes E2M1 RNE;
             torchao RCEIL must agree except at its documented float-log2 edges
mxfp4_ggml   libggml-python 0.20.2 (ggml_quantize_chunk, dequantize_row_mxfp4) and gguf 0.19 quants

Every flavour also checks: numpy reference == torch emulator (bytes), dequantize == oracle decode,
fake_quantize value / dtype / STE gradients, 3-D inputs, supplied scales, error messages.
"""
from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from optional_imports import lazy
from qatfactory.formats import get_format

# lazily: only the CPU oracle tests use it, the CUDA test must run where it is not installed
ml_dtypes = lazy("ml_dtypes")

FLAVOURS = ["mxfp4", "mxfp4_rceil", "mxfp4_even", "mxfp4_ggml"]
F32 = np.float32
RNG_SEED = 20261130


# ----------------------------------------------------------------------------- data
def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)


def _random_blocks(rng, nblocks: int) -> np.ndarray:
    """Gaussian blocks with a log-uniform magnitude per block (1e-6 .. 1e4)."""
    mag = np.exp(rng.uniform(np.log(1e-6), np.log(1e4), size=(nblocks, 1)))
    return (rng.standard_normal((nblocks, 32)) * mag).astype(F32)


def _with_max(rng, amax: np.ndarray) -> np.ndarray:
    """One block per amax: random fill strictly below amax, the max at a random position/sign."""
    amax = np.asarray(amax, dtype=F32)
    n = amax.shape[0]
    fill = (rng.uniform(-1, 1, size=(n, 32)) * amax[:, None]).astype(F32)
    fill = np.clip(fill, -np.nextafter(amax, F32(0))[:, None], np.nextafter(amax, F32(0))[:, None])
    pos = rng.integers(0, 32, size=n)
    sign = np.where(rng.random(n) < 0.5, F32(-1), F32(1))
    fill[np.arange(n), pos] = sign * amax
    return fill


def _edge_blocks(rng) -> np.ndarray:
    blocks = []
    # ties at every E2M1 threshold (and one ulp either side), block max 6 -> scale 1 in every flavour
    th = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    for vals in (th, np.nextafter(th, F32(0)), np.nextafter(th, F32(10))):
        row = np.concatenate([vals, -vals, [6.0, -6.0], vals[:7], -vals[:7], [0.0, -0.0, 4.0, 0.5]])[:32]
        for k in (-120, -20, -3, 0, 1, 7, 50, 120):      # same ties at other scales (exact)
            blocks.append(np.ldexp(row.astype(np.float64), k).astype(F32))
    # zero blocks: +0, -0, mixed
    blocks += [np.zeros(32, F32), np.full(32, -0.0, F32), np.where(np.arange(32) % 2, F32(-0.0), F32(0.0))]
    # tiny: 1e-8 and subnormal blocks, including maxima of 1..4 smallest subnormals
    blocks += list((rng.standard_normal((4, 32)) * 1e-8).astype(F32))
    blocks += list((rng.standard_normal((4, 32)) * 1e-40).astype(F32))
    blocks += list(_with_max(rng, _f32([1, 2, 3, 4, 5, 7, 1 << 20, (1 << 23) - 1, 1 << 23])))
    # huge: 1e4, 1e38, FLT_MAX
    blocks += list((rng.standard_normal((4, 32)) * 1e4).astype(F32))
    blocks += list(np.clip(rng.standard_normal((4, 32)) * 1e38, -3.4e38, 3.4e38).astype(F32))
    blocks += list(_with_max(rng, np.array([np.finfo(F32).max, np.nextafter(np.finfo(F32).max, F32(0))], F32)))
    # block maxima at, one ulp below and one ulp above 2^k, 1.5 * 2^k (= 6 * 2^(k-2)) and 1.75 * 2^k
    ks = np.arange(-148, 128)
    for m in (1.0, 1.5, 1.75):
        p = np.ldexp(F32(m), ks).astype(F32)
        p = p[(p > 0) & np.isfinite(p)]
        blocks += list(_with_max(rng, np.concatenate([p, np.nextafter(p, F32(0)), np.nextafter(p, F32(np.inf))])))
    return np.stack([np.asarray(b, F32) for b in blocks])


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(RNG_SEED)
    rand = _random_blocks(rng, 32768).reshape(1024, 1024)          # 1M elements
    edges = _edge_blocks(rng)
    pad = (-edges.shape[0]) % 8
    edges = np.concatenate([edges, np.zeros((pad, 32), F32)]).reshape(-1, 256)
    return {"rand": rand, "edges": edges}


def _first_diff(a: np.ndarray, b: np.ndarray, k: int, what: str) -> str:
    """Name the first differing block (row, block index within the row) and the differing bytes."""
    a2 = a.reshape(-1, a.shape[-1])
    b2 = b.reshape(-1, b.shape[-1])
    r, c = np.argwhere(a2 != b2)[0]
    n = int((a2 != b2).sum())
    width = a2.shape[-1]
    if width == k // 32 * 17 and "ggml" in what:
        where = f"block {c // 17} ({'scale byte' if c % 17 == 0 else 'code byte %d' % (c % 17 - 1)})"
    elif width == k // 32 * 17:
        where = f"block {c // 16} (codes)" if c < k // 2 else f"block {c - k // 2} (scale byte)"
    elif width == k // 2:
        where = f"block {c // 16} (codes)"
    elif width == k // 32:
        where = f"block {c} (scale byte)"
    else:
        where = f"byte {c}"
    return (f"{what}: {n} bytes differ; first at row {r}, {where} (K={k}): "
            f"{a2[r, c]:#04x} != {b2[r, c]:#04x}")


def _assert_bytes(a, b, k, what):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} != {b.shape}"
    if not np.array_equal(a, b):
        pytest.fail(_first_diff(a, b, k, what))


def _assert_f32_bits(a, b, what):
    a = np.asarray(a, F32)
    b = np.asarray(b, F32)
    # compare as bits, NaN == NaN
    ab, bb = a.view(np.uint32), b.view(np.uint32)
    same = (ab == bb) | (np.isnan(a) & np.isnan(b))
    if not same.all():
        i = np.argwhere(~same)[0]
        blk = tuple(i[:-1]) + (int(i[-1]) // 32,)
        pytest.fail(f"{what}: {int((~same).sum())} values differ; first in block {blk}: "
                    f"{a[tuple(i)]!r} ({ab[tuple(i)]:#010x}) != {b[tuple(i)]!r} ({bb[tuple(i)]:#010x})")


def _emulator_bytes(f, x: np.ndarray):
    p = f.quantize(torch.from_numpy(x))
    return p, f.to_bytes(p)


# ----------------------------------------------------------------------------- oracles
def _torchao(x: torch.Tensor, mode: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    s, d = to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, getattr(ScaleCalculationMode, mode))
    return s.view(torch.uint8).numpy(), d.view(torch.uint8).numpy()


def _torchao_decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    from torchao.prototype.mx_formats.mx_tensor import to_dtype
    c = torch.from_numpy(np.ascontiguousarray(codes)).reshape(-1, codes.shape[-1])
    s = torch.from_numpy(np.ascontiguousarray(scales)).reshape(-1, scales.shape[-1]).view(torch.float8_e8m0fnu)
    out = to_dtype(c, s, torch.float4_e2m1fn_x2, 32, torch.float32)
    return out.numpy().reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def _e2m1_rne_oracle(v: np.ndarray) -> np.ndarray:
    """ml_dtypes float4_e2m1fn cast (RNE, saturating, sign kept) -> code 0..15."""
    return v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def _rceil_byte_exact(amax: float) -> int:
    """triton_kernels ROUND_UP byte from exact rationals: q = RN(amax/6); 0 if q == 0, else the
    smallest e >= -126 with q <= 2^e (a subnormal q rounds up to 2^-126), byte e + 127."""
    a = Fraction(amax)
    if a == 0:
        return 0
    if a / 6 <= Fraction(1, 2 ** 150):   # RN(amax/6) == 0 (the tie at 2^-150 goes to the even 0)
        return 0
    # q is rounded to fp32 first; that only matters if q lies within half an ulp above a power of
    # two, which a/6 cannot (a has 24 significant bits; see mxfp4.py), so use the exact a/6
    e = max(math.frexp(amax)[1] - 5, -126)          # a < 2^ex, so a/6 < 2^(ex-2): start below
    while a > 6 * Fraction(2) ** e:
        e += 1
    return e + 127


def _rceil_reference_codes(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """codes = E2M1_RNE(x * quant_scale), quant_scale = 0 for byte 0 else 2^(127-b) (exact ldexp)."""
    xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    qs = np.where(b == 0, 0.0, np.ldexp(1.0, 127 - b.astype(np.int64)))
    v = (xb * qs[..., None]).astype(F32)          # exact in float64, one rounding to fp32
    v = np.where(np.signbit(xb), -np.abs(v), np.abs(v)).astype(F32)   # keep -0.0
    return _e2m1_rne_oracle(v).reshape(x.shape)


def _pack_pairs(c: np.ndarray) -> np.ndarray:
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


# ----------------------------------------------------------------------------- reference == emulator
@pytest.mark.parametrize("name", FLAVOURS)
def test_reference_equals_emulator(name, data):
    f = get_format(name)
    for key, x in data.items():
        _, emu = _emulator_bytes(f, x)
        ref = f.quantize_ref(x)
        _assert_bytes(emu, ref, x.shape[-1], f"{name} {key}: emulator vs numpy reference")
        # engine bytes round-trip through from_bytes
        p2 = f.from_bytes(ref, x.shape[-1])
        _assert_bytes(f.to_bytes(p2), ref, x.shape[-1], f"{name} {key}: from_bytes/to_bytes")


# ----------------------------------------------------------------------------- torchao FLOOR / EVEN
@pytest.mark.parametrize("name,mode", [("mxfp4", "FLOOR"), ("mxfp4_even", "EVEN")])
def test_ocp_against_torchao(name, mode, data):
    f = get_format(name)
    for key, x in data.items():
        p, _ = _emulator_bytes(f, x)
        s, d = _torchao(torch.from_numpy(x), mode)
        _assert_bytes(p.scales.numpy(), s, x.shape[-1], f"{name} {key}: scale bytes vs torchao {mode}")
        _assert_bytes(p.codes.numpy(), d, x.shape[-1], f"{name} {key}: codes vs torchao {mode}")
        _assert_f32_bits(f.dequantize(p).numpy(), _torchao_decode(d, s), f"{name} {key}: dequant vs torchao")
        _assert_f32_bits(f.dequantize_ref(f.to_bytes(p)), _torchao_decode(d, s), f"{name} {key}: dequantize_ref")


def test_even_against_compressed_tensors(data):
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
    f = get_format("mxfp4_even")
    x = data["rand"]
    amax = torch.from_numpy(np.abs(x.reshape(-1, 32)).max(-1))
    ct = generate_mx_scales(amax).numpy()          # float exponents, unclamped
    assert np.all(ct >= 0) and np.all(ct <= 254)   # random data stays inside the E8M0 range
    ours = f.quantize(torch.from_numpy(x)).scales.numpy().reshape(-1)
    _assert_bytes(ours, ct.astype(np.uint8), 32, "mxfp4_even vs compressed-tensors generate_mx_scales")


def test_bf16_fp16_inputs(data):
    x = torch.from_numpy(data["rand"][:256]).to(torch.bfloat16)
    for name, mode in [("mxfp4", "FLOOR"), ("mxfp4_even", "EVEN")]:
        f = get_format(name)
        p = f.quantize(x)
        s, d = _torchao(x, mode)
        _assert_bytes(p.scales.numpy(), s, 1024, f"{name} bf16: scales vs torchao")
        _assert_bytes(p.codes.numpy(), d, 1024, f"{name} bf16: codes vs torchao")
        _assert_bytes(f.to_bytes(p), f.quantize_ref(x.float().numpy()), 1024, f"{name} bf16: reference")
    # fp16 inputs: the same bytes as their exact float32 values, and libggml agrees for ggml
    xh = torch.from_numpy(data["rand"][:256]).clamp(-6e4, 6e4).to(torch.float16)
    for name in FLAVOURS:
        f = get_format(name)
        _assert_bytes(f.to_bytes(f.quantize(xh)), f.to_bytes(f.quantize(xh.float())), 1024, f"{name} fp16")
    import ggml_oracle as go
    f = get_format("mxfp4_ggml")
    _assert_bytes(f.to_bytes(f.quantize(x)), go.quantize(x.float().numpy(), "mxfp4"), 1024, "mxfp4_ggml bf16")
    _assert_bytes(f.to_bytes(f.quantize(xh)), go.quantize(xh.float().numpy(), "mxfp4"), 1024, "mxfp4_ggml fp16")


# ----------------------------------------------------------------------------- RCEIL
def test_rceil_exact_derivation(data):
    f = get_format("mxfp4_rceil")
    for key, x in data.items():
        p, _ = _emulator_bytes(f, x)
        amax = np.abs(x.reshape(*x.shape[:-1], -1, 32)).max(-1)
        want = np.array([_rceil_byte_exact(float(a)) for a in amax.reshape(-1)], np.uint8).reshape(amax.shape)
        _assert_bytes(p.scales.numpy(), want, x.shape[-1], f"mxfp4_rceil {key}: bytes vs exact rational rule")
        codes = _rceil_reference_codes(x, want)
        _assert_bytes(p.codes.numpy(), _pack_pairs(codes), x.shape[-1], f"mxfp4_rceil {key}: codes vs ml_dtypes")
        # RCEIL never clips: every block max is representable without saturation
        dq = f.dequantize(p).numpy()
        nz = want > 0
        rb = want.astype(np.int64)
        assert np.all((amax <= np.ldexp(6.0, rb - 127)) | ~nz)
        _assert_f32_bits(dq, _torchao_decode(p.codes.numpy(), p.scales.numpy()), f"mxfp4_rceil {key}: dequant")


def test_rceil_vs_torchao_edges(data):
    """torchao's eager RCEIL uses ceil(torch.log2(amax/6)); it must agree with us everywhere except
    (a) amax/6 a few ulp above a power of two (fp32 log2 rounds down onto the integer) and
    (b) amax/6 below 2^-126 (torchao emits byte 0 and does not scale x). Count both."""
    f = get_format("mxfp4_rceil")
    counts = {}
    for key, x in data.items():
        p, _ = _emulator_bytes(f, x)
        s, d = _torchao(torch.from_numpy(x), "RCEIL")
        ours = p.scales.numpy().astype(np.int64)
        amax = np.abs(x.reshape(*x.shape[:-1], -1, 32)).max(-1)
        q = (amax / F32(6)).astype(F32)
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.log2(q.astype(np.float64)) - np.floor(np.log2(q.astype(np.float64)))
        log2_edge = (s.astype(np.int64) == ours - 1) & (_bits(q) & 0x7FFFFF > 0) & \
                    (frac < 1e-6)
        tiny = q < F32(2.0 ** -126)
        diff = s.astype(np.int64) != ours
        unexplained = diff & ~(log2_edge | tiny)
        assert not unexplained.any(), f"{key}: {int(unexplained.sum())} blocks differ from torchao RCEIL " \
                                      f"without a documented reason; first {np.argwhere(unexplained)[0]}"
        same = ~diff
        ob = p.codes.numpy().reshape(*amax.shape, 16)[same]
        tb = d.reshape(*amax.shape, 16)[same]
        _assert_bytes(ob, tb, x.shape[-1], f"mxfp4_rceil {key}: codes vs torchao where the bytes agree")
        # and where the scales differ, torchao's codes are its own scale's rounding of the same x: the
        # difference is the scale rule alone (every block compared, not only the agreeing ones)
        edge = diff & log2_edge
        if edge.any():
            tc = _pack_pairs(_rceil_reference_codes(x, s.astype(np.uint8))).reshape(*amax.shape, 16)
            _assert_bytes(d.reshape(*amax.shape, 16)[edge], tc[edge], 16,
                          f"mxfp4_rceil {key}: torchao's codes at its own scale on the log2-edge blocks")
        counts[key] = (int((diff & log2_edge).sum()), int((diff & tiny).sum()), int(diff.size))
    # the edge set really is exercised
    assert counts["edges"][0] > 0 and counts["edges"][1] > 0, counts
    print("torchao RCEIL differences (log2 edge, tiny, blocks):", counts)


# ----------------------------------------------------------------------------- ggml
def test_ggml_against_libggml_and_gguf(data):
    import gguf
    import ggml_oracle as go
    f = get_format("mxfp4_ggml")
    for key, x in data.items():
        p, emu = _emulator_bytes(f, x)
        with np.errstate(all="ignore"):
            gg = gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)
        _assert_bytes(emu, go.quantize(x, "mxfp4"), x.shape[-1], f"mxfp4_ggml {key}: bytes vs libggml")
        _assert_bytes(emu, gg, x.shape[-1], f"mxfp4_ggml {key}: bytes vs gguf.quants")
        dq = go.dequantize(emu, "mxfp4", x.shape[-1])
        _assert_f32_bits(f.dequantize(p).numpy(), dq, f"mxfp4_ggml {key}: dequant vs libggml")
        _assert_f32_bits(f.dequantize_ref(emu), dq, f"mxfp4_ggml {key}: dequantize_ref vs libggml")
        _assert_f32_bits(gguf.quants.dequantize(emu, gguf.GGMLQuantizationType.MXFP4), dq,
                         f"mxfp4_ggml {key}: gguf dequant vs libggml")


def test_ggml_log2f_edges_exhaustive():
    """Every k in [-149, 128): the 48 floats just below 2^k, 2^k itself and 2 above, as block max."""
    import ggml_oracle as go
    f = get_format("mxfp4_ggml")
    rng = np.random.default_rng(1)
    ks = np.arange(-149, 128)
    top = _bits(np.ldexp(F32(1), ks).astype(F32))
    offs = np.arange(-48, 3)
    bits = (top[:, None] + offs[None, :]).reshape(-1)
    bits = np.unique(bits[bits > 0])
    x = _with_max(rng, _f32(bits))
    x = x.reshape(-1, 32 * 8) if x.shape[0] % 8 == 0 else np.concatenate(
        [x, np.zeros(((-x.shape[0]) % 8, 32), F32)]).reshape(-1, 256)
    _, emu = _emulator_bytes(f, x)
    _assert_bytes(emu, go.quantize(x, "mxfp4"), 256, "mxfp4_ggml log2f edges vs libggml")
    # the edge behaviour is real: some maxima below 2^k get the byte of 2^k
    floor_byte = (((bits >> 23) & 0xFF) - 2).clip(0)
    got = emu.reshape(-1, 17)[: len(bits), 0].astype(np.int64)
    normal = (bits >> 23) > 3
    assert int((got[normal] > floor_byte[normal]).sum()) > 0


def test_ggml_split_halves_layout():
    f = get_format("mxfp4_ggml")
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0       # element 0 -> low nibble of byte 1; element 16 -> high nibble of byte 1
    x[0, 16] = -6.0
    x[0, 1] = 3.0
    b = f.to_bytes(f.quantize(x))
    assert b.shape == (1, 17)
    assert b[0, 0] == 127                        # floor(log2 6) - 2 + 127
    assert b[0, 1] == (7 | (15 << 4))
    assert b[0, 2] == 5                          # element 1 = 3 -> kvalue 6 -> code 5; element 17 = 0
    p = f.quantize(x)
    assert p.codes[0, 0].item() == (7 | (5 << 4)) and p.codes[0, 8].item() == 15   # pairs in PackedTensor


# ----------------------------------------------------------------------------- API behaviour
@pytest.mark.parametrize("name", FLAVOURS)
def test_fake_quantize_and_ste(name, data):
    f = get_format(name)
    for key, x in data.items():                   # fake_quantize skips the packing: same values
        xt = torch.from_numpy(x)
        assert torch.equal(f.fake_quantize(xt), f.dequantize(f.quantize(xt))), key
    x32 = torch.from_numpy(data["rand"][:64, :256].copy())
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = x32.to(dt).detach().clone().requires_grad_(True)
        y = f.fake_quantize(x)
        assert y.dtype == dt
        assert torch.equal(y.detach(), f.dequantize(f.quantize(x.detach())).to(dt))
        y.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))
    # clipped STE: gradient 0 exactly where the element saturated, 1 elsewhere
    x = x32.clone().requires_grad_(True)
    y = f.fake_quantize(x, ste="clipped")
    g = torch.randn_like(x)
    (y * g).sum().backward()
    p = f.quantize(x32)
    b = p.scales.long().repeat_interleave(32, -1)
    scale = torch.ldexp(torch.ones_like(x32), (127 - b).to(torch.int32))
    if name == "mxfp4_rceil":
        scale = torch.where(b == 0, torch.zeros_like(scale), scale)
    clipped = (x32 * scale).abs() > 6
    assert torch.equal(x.grad, torch.where(clipped, torch.zeros_like(g), g))
    if name in ("mxfp4", "mxfp4_ggml"):
        assert clipped.any()          # FLOOR rules clip ~40% of block maxima
    if name == "mxfp4_rceil":
        assert not clipped.any()


@pytest.mark.parametrize("name", FLAVOURS)
def test_3d_and_shapes(name, data):
    f = get_format(name)
    x = data["rand"][:96, :128].reshape(4, 24, 128)           # [E, N, K]
    p = f.quantize(torch.from_numpy(x))
    assert p.codes.shape == (4, 24, 64) and p.scales.shape == (4, 24, 4) and p.global_scale is None
    assert p.codes.dtype == torch.uint8 and p.scales.dtype == torch.uint8
    b = f.to_bytes(p)
    assert b.shape == (4, 24, 68)
    flat = f.to_bytes(f.quantize(torch.from_numpy(x.reshape(96, 128))))
    _assert_bytes(b.reshape(96, 68), flat, 128, f"{name}: 3-D vs 2-D")
    _assert_bytes(b, f.quantize_ref(x), 128, f"{name}: 3-D reference")
    assert f.dequantize(p).shape == (4, 24, 128)
    assert f.from_bytes(b).shape == (4, 24, 128)


@pytest.mark.parametrize("name", FLAVOURS)
def test_supplied_scales(name, data):
    f = get_format(name)
    x = data["rand"][:32, :256]
    xt = torch.from_numpy(x)
    p = f.quantize(xt)
    again = f.quantize(xt, scales=p.scales.clone())
    assert torch.equal(again.codes, p.codes) and torch.equal(again.scales, p.scales)
    rng = np.random.default_rng(3)
    s = (p.scales.numpy().astype(np.int64) + rng.integers(-2, 3, size=p.scales.shape)).clip(1, 254).astype(np.uint8)
    q = f.quantize(xt, scales=torch.from_numpy(s))
    assert np.array_equal(q.scales.numpy(), s)
    assert torch.equal(f.quantize(xt, scales=s).codes, q.codes)          # numpy bytes accepted too
    _assert_bytes(f.to_bytes(q), f.quantize_ref(x, scales=s), 256, f"{name}: supplied scales, reference")
    # element step against the independent E2M1 oracle (ggml: ties toward zero, +0)
    xb = x.reshape(32, 8, 32).astype(np.float64)
    v = (xb * np.ldexp(1.0, 127 - s.astype(np.int64))[..., None]).astype(F32)
    if name == "mxfp4_ggml":
        a = np.abs(v)
        mag = np.searchsorted(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32), a, side="left")
        want = (mag | (((v < 0) & (mag > 0)) << 3)).astype(np.uint8)
    else:
        want = _e2m1_rne_oracle(np.where(np.signbit(xb), -np.abs(v), np.abs(v)).astype(F32))
    _assert_bytes(q.codes.numpy(), _pack_pairs(want.reshape(32, 256)), 256, f"{name}: supplied scales, oracle")


@pytest.mark.parametrize("name", FLAVOURS)
def test_errors(name):
    f = get_format(name)
    with pytest.raises(ValueError) as e:
        f.quantize(torch.randn(4, 48))
    msg = str(e.value)
    assert name in msg and "32" in msg and "48" in msg and "fallback" in msg
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(2, 32)
        x[1, 5] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            f.quantize(x)
        with pytest.raises(ValueError, match="NaN or Inf"):
            f.quantize_ref(x.numpy())
    with pytest.raises(ValueError, match="amax"):
        f.quantize(torch.randn(2, 32), amax=torch.tensor(1.0))
    with pytest.raises(ValueError, match="shape"):
        f.quantize(torch.randn(2, 64), scales=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        f.quantize(torch.randn(2, 64), scales=torch.zeros(2, 2))
    if name != "mxfp4_ggml":
        with pytest.raises(ValueError, match="255"):
            f.quantize(torch.randn(2, 64), scales=torch.full((2, 2), 255, dtype=torch.uint8))
    # imatrix is accepted and ignored, like ggml's quantize_mxfp4
    x = torch.randn(2, 64)
    assert torch.equal(f.quantize(x, imatrix=torch.rand(64)).codes, f.quantize(x).codes)


@pytest.mark.parametrize("name", FLAVOURS)
def test_spec_fields(name):
    s = get_format(name).spec
    assert (s.block_size, s.super_block, s.bytes_per_block, s.scale_codec) == (32, 32, 17, "e8m0")
    assert s.element == "e2m1" and s.role == "both" and s.global_scale is None
    assert s.bits_per_weight == 4.25
    assert s.ggml_type == (39 if name == "mxfp4_ggml" else None)
    assert s.nibble_order == ("split_halves" if name == "mxfp4_ggml" else "pairs")


def test_zero_tensor_never_nan():
    for name in FLAVOURS:
        f = get_format(name)
        for z in (torch.zeros(3, 64), torch.full((3, 64), -0.0)):
            p = f.quantize(z)
            y = f.dequantize(p)
            assert not torch.isnan(y).any() and torch.equal(y, torch.zeros_like(y))
            assert int(p.scales.max()) == 0           # every flavour: zero block -> byte 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FLAVOURS)
def test_cuda_equals_cpu(name, data):
    f = get_format(name)
    for key, x in data.items():
        xt = torch.from_numpy(x)
        pc = f.quantize(xt)
        pg = f.quantize(xt.cuda())
        _assert_bytes(f.to_bytes(pg), f.to_bytes(pc), x.shape[-1], f"{name} {key}: cuda vs cpu")
        assert torch.equal(f.dequantize(pg).cpu(), f.dequantize(pc))
        xb = xt.clamp(-1e38, 1e38).to(torch.bfloat16)      # FLT_MAX would round to bf16 Inf
        assert torch.equal(f.fake_quantize(xb.cuda()).cpu(), f.fake_quantize(xb))
