"""nvfp4 / nvfp4_act / nvfp4_ggml against their engines' own code:
nvidia-modelopt NVFP4QTensor (and compressed-tensors), a float64->float32 transcription of
vLLM's cvt_warp_fp16_to_fp4, and libggml (ggml_quantize_chunk / dequantize_row_nvfp4) plus
gguf.quants.dequantize. Every comparison is byte-exact (atol=0)."""
import types

import numpy as np
import pytest
import torch

import ggml_oracle
from optional_imports import lazy
from qatfactory.formats import get_format
from qatfactory.formats.nvfp4 import near_threshold_mask, scales_from_block_amax

F32 = np.float32
NV = get_format("nvfp4")
ACT = get_format("nvfp4_act")
GG = get_format("nvfp4_ggml")
# lazily: the vLLM transcription uses its casts; the CUDA tests (and the data they share) do not
ml_dtypes = lazy("ml_dtypes")


@pytest.fixture(scope="module")
def modelopt():
    mo = pytest.importorskip("modelopt.torch.quantization.qtensor")
    return mo.NVFP4QTensor


def _random_weights(rows, k, seed, dtype=torch.float32):
    """Gaussian rows with per-row magnitudes spread over 1e-4 .. 1e2 (many scale exponents)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(rows, 1).uniform_(-9, 4.6, generator=g))
    x = torch.randn(rows, k, generator=g) * mag
    x[:, ::97] *= 8.0          # outliers so blocks differ in amax
    return x.to(dtype)


def _edge_weights(k=256):
    """Rows of awkward blocks around one huge element (tensor amax 1e4)."""
    rows = []
    z = np.zeros(k, F32)
    z[0] = 1e4
    rows.append(z)                                             # zero blocks after the first
    rng = np.random.default_rng(5)
    t = rng.standard_normal(k).astype(F32) * F32(1e-8)
    t[:16] = 1e4
    rows.append(t)                                             # tiny blocks (1e-8)
    # block maxima one ulp around powers of two times the block scale step
    g = F32(1e4) / F32(2688)
    for p in range(-9, 9):
        m = F32(2.0 ** p) * (F32(6) * g)
        r = rng.uniform(-1, 1, k).astype(F32) * m
        for j, mm in enumerate([np.nextafter(m, F32(0)), m, np.nextafter(m, F32(np.inf))]):
            r[16 * j::48][:1] = mm
        r[-1] = -m
        rows.append(r)
    return np.stack(rows).astype(F32)


def _ulps(a, n):
    return (a.view(np.int32) + n.astype(np.int32)).view(F32)


def _e4m3_values() -> np.ndarray:
    """The 126 finite positive E4M3 values (bytes 0x01..0x7E), decoded by torch's float8 dtype."""
    return torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()


def _adversarial(seed, rows=64, k=1024):
    """Blocks whose scale amax_b/(6g) sits within 3 ulp of an E4M3 rounding midpoint, and
    elements within 2 ulp of an E2M1 threshold times the block scale: there the association
    of every float32 op decides the byte (random data almost never gets there)."""
    rng = np.random.default_rng(seed)
    amax = F32(rng.uniform(1, 8))
    g = amax / F32(2688)
    six_g = F32(6) * g
    pos = np.unique(_e4m3_values())
    mids = (pos[1:] + pos[:-1]) / 2
    nb = rows * k // 16
    m = rng.choice(mids[(mids > 2.0 ** -7) & (mids < 400)], nb).astype(F32)
    ab = _ulps((m * six_g).astype(F32), rng.integers(-3, 4, nb))
    s8 = torch.from_numpy(np.clip(ab / six_g, F32(2.0 ** -9), F32(448))).to(torch.float8_e4m3fn).float().numpy()
    t = rng.choice(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32), (nb, 15))
    xe = _ulps((t * (s8 * g)[:, None]).astype(F32), rng.integers(-2, 3, (nb, 15)))
    x = np.zeros((nb, 16), F32)
    x[:, 1:] = np.minimum(xe, ab[:, None]) * np.where(rng.random((nb, 15)) < 0.5, F32(-1), F32(1))
    x[:, 0] = ab
    x = x.reshape(rows, k)
    x[0, 0] = amax
    return x


def _modelopt_nvfp4(NVQ, w, g=None, s8=None):
    qt, sc, gg = NVQ.quantize(w.clone(), 16, weights_scaling_factor=s8, weights_scaling_factor_2=g)
    dq = qt.dequantize(torch.float32, scale=sc, double_scale=gg, block_sizes={-1: 16})
    return qt._quantized_data, sc.view(torch.uint8), gg, dq


def _assert_same_as_modelopt(NVQ, w, **kw):
    p = NV.quantize(w, **kw)
    amax = kw.get("amax")
    g = None if amax is None else torch.as_tensor(amax, dtype=torch.float32) / 2688.0
    s8 = None if kw.get("scales") is None else kw["scales"].view(torch.float8_e4m3fn)
    codes, scales, gg, dq = _modelopt_nvfp4(NVQ, w, g, s8)
    diff = (codes != p.codes).nonzero()
    assert diff.numel() == 0, f"codes differ at {diff[:5].tolist()}: modelopt {codes[tuple(diff[0])]}"
    assert torch.equal(scales, p.scales)
    assert gg.float().item() == p.global_scale.item()
    assert torch.equal(dq, NV.dequantize(p))
    # numpy reference == torch emulator
    ref = NV.quantize_ref(w.float().numpy(), amax=amax, scales=kw.get("scales"))
    np.testing.assert_array_equal(ref, NV.to_bytes(p))
    return p


# ============================================================================ nvfp4 (ModelOpt)
@pytest.mark.parametrize("dtype,rows", [(torch.float32, 512), (torch.bfloat16, 256), (torch.float16, 128)])
def test_nvfp4_vs_modelopt_random(modelopt, dtype, rows):
    w = _random_weights(rows, 2048, seed=rows, dtype=dtype)   # 1M fp32 + 0.5M bf16 + 0.25M fp16
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    _assert_same_as_modelopt(modelopt, w)


def test_nvfp4_vs_modelopt_edges(modelopt):
    w = torch.from_numpy(_edge_weights())
    _assert_same_as_modelopt(modelopt, w)
    _assert_same_as_modelopt(modelopt, w.to(torch.bfloat16))


def test_nvfp4_vs_modelopt_adversarial(modelopt):
    from qatfactory.formats import codecs as C
    w = torch.from_numpy(_adversarial(0))
    p = _assert_same_as_modelopt(modelopt, w)
    # the data can tell the associations apart: other orders give other bytes
    g = w.abs().max() / 2688.0
    wb = w.reshape(64, -1, 16)
    alt_s = C.e4m3_encode(((wb.abs().amax(-1) / 6) / g).clamp(2.0 ** -9, 448))        # torchao order
    alt_v = wb * (1.0 / (C.e4m3_decode(p.scales) * g)).unsqueeze(-1)                   # reciprocal multiply
    assert int((alt_s != p.scales).sum()) > 10
    assert int((C.pack_pairs(C.e2m1_encode(alt_v).reshape(w.shape)) != p.codes).sum()) > 100


def test_nvfp4_e2m1_ties_exact(modelopt):
    # amax 2688 -> g = 1 exactly; block max 6 -> scale byte 1.0, so v == x: every RNE tie is hit
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    blk = np.concatenate([ties, -ties, [6.0, 0.0]]).astype(F32)
    near = np.concatenate([np.nextafter(ties, F32(9)), np.nextafter(ties, F32(-9))] + [[6.0, -6.0]])
    w = torch.from_numpy(np.stack([blk, near.astype(F32)]))
    p = _assert_same_as_modelopt(modelopt, w, amax=2688.0)
    assert NV.dequantize(p)[0, :7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_nvfp4_experts_and_shared_amax(modelopt):
    w = _random_weights(3 * 64, 512, seed=11).reshape(3, 64, 512)
    w[1] *= 30.0
    amax = w.abs().amax(dim=(1, 2))
    p = NV.quantize(w, amax=amax)
    assert p.global_scale.shape == (3,)
    for e in range(3):
        codes, scales, gg, dq = _modelopt_nvfp4(modelopt, w[e], amax[e] / 2688.0)
        assert torch.equal(codes, p.codes[e]) and torch.equal(scales, p.scales[e])
        assert gg.item() == p.global_scale[e].item()
        assert torch.equal(dq, NV.dequantize(p)[e])
    np.testing.assert_array_equal(NV.quantize_ref(w.numpy(), amax=amax.numpy()), NV.to_bytes(p))
    # fused q/k/v: one supplied amax larger than this shard's own
    q = w[0]
    _assert_same_as_modelopt(modelopt, q, amax=float(w.abs().max()))
    with pytest.raises(ValueError, match="prefix"):
        NV.quantize(w, amax=torch.ones(64))
    with pytest.raises(ValueError, match="finite"):
        NV.quantize(q, amax=-1.0)


def test_nvfp4_supplied_scales_match_modelopt(modelopt):
    w = _random_weights(64, 1024, seed=3)
    g = torch.Generator().manual_seed(4)
    s8 = torch.randint(0x20, 0x70, (64, 64), generator=g, dtype=torch.uint8)
    p = _assert_same_as_modelopt(modelopt, w, scales=s8, amax=float(w.abs().max()))
    assert torch.equal(p.scales, s8)
    for bad, msg in [(torch.zeros(64, 64, dtype=torch.uint8), "0x00"),
                     (torch.full((64, 64), 0xB8, dtype=torch.uint8), "0xB8"),
                     (torch.ones(64, 63, dtype=torch.uint8), "expected")]:
        with pytest.raises(ValueError, match=msg):
            NV.quantize(w, scales=bad)


def test_scales_from_block_amax_vs_modelopt_static(modelopt):
    w = _random_weights(128, 1024, seed=8)
    w[0, :32] = 0                                   # zero blocks: 1.0 before the rescale
    block_amax = w.reshape(128, 64, 16).abs().amax(-1)
    block_amax[5] *= 0.7                            # a calibrator may shrink them
    gamax = w.abs().max()
    quant = types.SimpleNamespace(global_amax=gamax, _amax=block_amax.reshape(-1, 1), block_sizes={-1: 16})
    ref, _ = modelopt.get_weights_scaling_factor_from_quantizer(quant, w)
    ours = scales_from_block_amax(block_amax, gamax)
    assert torch.equal(ref.view(torch.uint8), ours)
    assert int(ours[0, 0]) == 0x7E or gamax / 6 * 448 / (gamax / 6) <= 448


def test_nvfp4_vs_compressed_tensors():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = _random_weights(256, 1024, seed=21, dtype=torch.bfloat16)
    M, K = w.shape
    wf = w.float()                                  # fp32 statistics (formats.md 1.5)
    gs = generate_gparam(wf.amin(), wf.amax())
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                            symmetric=True, scale_dtype=torch.float8_e4m3fn)
    wb = wf.reshape(M, K // 16, 16)
    s, _ = calculate_qparams(wb.amin(-1), wb.amax(-1), args, global_scale=gs)
    packed = quantize_and_pack_fp4(w, s, global_scale=gs, group_size=16)
    p = NV.quantize(w)
    # CT and ModelOpt disagree by design where the block scale underflows: CT turns a zero scale
    # into 0.125 (0x20), ModelOpt clamps to 2^-9 (0x01) and maps zero blocks to 1.0 (0x38).
    # Everywhere else (here ~2/3 of the blocks) they must agree byte for byte.
    agree = (p.scales > 1) & (wb.abs().amax(-1) > 0)
    assert agree.float().mean() > 0.5
    assert torch.equal(s.to(torch.float8_e4m3fn).view(torch.uint8)[agree], p.scales[agree])
    # CT copies the sign of v into the code (code 8 for -0.0); ModelOpt uses v < 0: the only
    # difference allowed is code 8 vs 0 for elements equal to -0.0
    from qatfactory.formats.codecs import unpack_pairs
    a, b = unpack_pairs(packed), unpack_pairs(p.codes)
    neg0 = (w.float() == 0) & torch.signbit(w.float())
    a = torch.where(neg0 & (a == 8), torch.zeros_like(a), a)
    m = agree.repeat_interleave(16, dim=-1)
    assert torch.equal(a[m], b[m])


def test_nvfp4_all_zero_tensor_and_bad_input():
    for dt in (torch.float32, torch.bfloat16):
        z = torch.zeros(4, 64, dtype=dt)
        p = NV.quantize(z)
        assert p.global_scale.item() == np.float32(1.0) / np.float32(2688)
        assert (p.scales == 0x38).all() and (p.codes == 0).all()
        assert torch.equal(NV.dequantize(p), torch.zeros(4, 64))
        assert not torch.isnan(NV.fake_quantize(z)).any()
        np.testing.assert_array_equal(NV.quantize_ref(z.float().numpy()), NV.to_bytes(p))
    for x in (torch.tensor([[float("nan")] * 16]), torch.tensor([[float("inf")] * 16])):
        with pytest.raises(ValueError, match="NaN or Inf"):
            NV.quantize(x)
    with pytest.raises(ValueError, match=r"K=40 is not a multiple of the block size 16.*exclude"):
        NV.quantize(torch.ones(2, 40))
    with pytest.raises(ValueError, match=r"nvfp4_act: last dimension K=24"):
        ACT.quantize(torch.ones(2, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="imatrix"):
        NV.quantize(torch.ones(2, 16), imatrix=torch.ones(16))


def test_nvfp4_bytes_round_trip():
    w = _random_weights(8, 256, seed=1)
    p = NV.quantize(w)
    b = NV.to_bytes(p)
    assert b.shape == (8, 128 + 16) and NV.spec.bits_per_weight == 4.5
    q = NV.from_bytes(b, global_scale=p.global_scale)
    assert torch.equal(q.codes, p.codes) and torch.equal(q.scales, p.scales)
    assert torch.equal(NV.dequantize(q), NV.dequantize(p))
    np.testing.assert_array_equal(NV.dequantize_ref(b, 256, global_scale=p.global_scale), NV.dequantize(p).numpy())
    with pytest.raises(ValueError, match="global_scale"):
        NV.dequantize(NV.from_bytes(b))


# ============================================================================ nvfp4_act (vLLM kernel)
def _rn(a):
    return np.asarray(a, np.float64).astype(F32)


def _vllm_act_transcription(x16, amax):
    """vLLM cvt_warp_fp16_to_fp4 with exact reciprocals, every op in float64 then rounded to
    float32 (exact for one +,-,*,/ of float32 operands), ml_dtypes for the e4m3/e2m1 casts."""
    x = np.asarray(x16, np.float64)
    input_scale = _rn(np.float64(F32(amax)) / 2688.0)
    S = _rn(1.0 / np.float64(input_scale))
    xb = x.reshape(-1, 16)
    vmax = np.abs(xb).max(-1)
    sf = _rn(np.float64(S) * np.float64(_rn(vmax * np.float64(_rn(1.0 / 6.0)))))
    s8 = np.minimum(sf, F32(448)).astype(ml_dtypes.float8_e4m3fn)
    sfd = s8.astype(np.float64)
    inv_s = np.float64(_rn(1.0 / np.float64(S)))
    with np.errstate(divide="ignore", over="ignore"):
        out = np.where(sfd != 0, _rn(1.0 / np.float64(_rn(sfd * inv_s))), F32(0))
    v = _rn(xb * out[:, None].astype(np.float64))
    codes = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF     # RNE, saturating, sign copied
    return codes.reshape(x16.shape), s8.view(np.uint8).reshape(*x16.shape[:-1], -1), input_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_act_vs_vllm_transcription(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(512, 2048, generator=g) * torch.exp(torch.empty(512, 1).uniform_(-4, 3, generator=g)))
    x[:, ::61] *= 20
    x[3, :32] = 0
    x = x.to(dtype)
    amax = float(x.float().abs().max()) * 0.8     # static calibrated amax below the live max: saturation
    for a in (amax, None):
        p = ACT.quantize(x, amax=a)
        codes, s8, in_scale = _vllm_act_transcription(x.float().numpy(), amax if a is not None else
                                                      float(x.float().abs().max()))
        from qatfactory.formats.codecs import unpack_pairs
        np.testing.assert_array_equal(unpack_pairs(p.codes).numpy(), codes)
        np.testing.assert_array_equal(p.scales.numpy(), s8)
        assert p.global_scale.item() == in_scale
        np.testing.assert_array_equal(ACT.quantize_ref(x.float().numpy(), amax=a), ACT.to_bytes(p))
    n_near = int(near_threshold_mask(x, amax).sum())
    print(f"nvfp4_act {dtype}: {n_near} of {x.numel()} elements within 4 ulp of an E2M1 threshold")
    assert n_near < x.numel() * 1e-3


def test_nvfp4_act_adversarial_fp32():
    x = _adversarial(1)
    amax = float(np.abs(x).max())
    p = ACT.quantize(torch.from_numpy(x), amax=amax)
    codes, s8, _ = _vllm_act_transcription(x, amax)
    from qatfactory.formats.codecs import e4m3_encode_np, unpack_pairs
    np.testing.assert_array_equal(unpack_pairs(p.codes).numpy(), codes)
    np.testing.assert_array_equal(p.scales.numpy(), s8)
    # the other association of step 2, (S * vmax) * RN(1/6), gives other scale bytes here
    S = F32(1) / (F32(amax) / F32(2688))
    alt = e4m3_encode_np((S * np.abs(x.reshape(-1, 16)).max(-1)) * F32(1.0 / 6.0)).reshape(s8.shape)
    assert int((alt != s8).sum()) > 10


def test_nvfp4_act_near_threshold_and_zero_block():
    # amax 2688 -> input_scale 1, S 1; block max 6 -> SF 1.0 -> outScale 1: v == x exactly
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0, 0, 0, 0, 0, 0, 0, 0.1], F32)
    x = torch.from_numpy(np.stack([ties, np.zeros(16, F32)])).to(torch.bfloat16)
    m = near_threshold_mask(x, 2688.0)
    assert m[0, :7].all() and not m[0, 7:].any() and not m[1].any()
    p = ACT.quantize(x, amax=2688.0)
    assert int(p.scales[1]) == 0 and torch.equal(ACT.dequantize(p)[1], torch.zeros(16))
    assert ACT.dequantize(p)[0, :8].tolist() == [0, 1, 1, 2, 2, 4, 4, 6]
    z = ACT.quantize(torch.zeros(2, 32, dtype=torch.bfloat16))     # dynamic, all zero: no NaN
    assert not torch.isnan(ACT.dequantize(z)).any() and (z.scales == 0).all()
    with pytest.raises(ValueError, match="scalar"):
        ACT.quantize(x, amax=torch.ones(2))


# ============================================================================ nvfp4_ggml (libggml)
def _ggml_edge_rows():
    rng = np.random.default_rng(9)
    rows = [np.zeros(64, F32), rng.standard_normal(64).astype(F32) * F32(1e-8),
            rng.standard_normal(64).astype(F32) * F32(1e4)]
    # element ties: d = 0.5 (block max 6) so k*d hits 0.25 .. 5 exactly, plus 1 ulp around
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    r = np.zeros(64, F32)
    r[0:7], r[7] = ties, 6.0
    r[8:15], r[15] = -ties, -0.0
    r[16:23], r[23] = np.nextafter(ties, F32(9)), 6.0
    r[24:31], r[31] = np.nextafter(ties, F32(-9)), 6.0
    r[32:64] = r[0:32] * F32(1.0 / 3.0)                       # non-exact scales: rounded errors
    rows.append(r)
    # block maxima around every scale quirk: 6 * (UE4M3 values, midpoints, 248, 256, 448, > 448)
    s = np.concatenate([_e4m3_values().astype(F32),
                        np.array([2.0 ** -10, 7.5 * 2.0 ** -9, 240, 247.9, 248, 255.9, 256, 416, 448, 500], F32)])
    s = np.concatenate([s, s * F32(1.0625), np.nextafter(s, F32(0)), np.nextafter(s, F32(1e9))])
    blk = rng.uniform(-1, 1, (s.size, 16)).astype(F32) * (s * F32(6))[:, None]
    blk[:, 5] = s * F32(6)
    pad = (-blk.shape[0]) % 4
    blk = np.concatenate([blk, np.ones((pad, 16), F32)]).reshape(-1, 64)
    return np.concatenate([np.stack(rows), blk])


def test_nvfp4_ggml_vs_libggml_random_and_edges():
    x = _random_weights(256, 4096, seed=12).numpy()            # 1M elements
    for xs in (x, _ggml_edge_rows()):
        ref = ggml_oracle.quantize(xs, "nvfp4")
        np.testing.assert_array_equal(GG.quantize_ref(xs), ref)
        p = GG.quantize(torch.from_numpy(xs))
        np.testing.assert_array_equal(GG.to_bytes(p), ref)
        deq = ggml_oracle.dequantize(ref, "nvfp4", xs.shape[-1])
        np.testing.assert_array_equal(GG.dequantize(p).numpy(), deq)
        np.testing.assert_array_equal(GG.dequantize_ref(ref), deq)
        q = GG.from_bytes(ref)
        assert torch.equal(q.codes, p.codes) and torch.equal(q.scales, p.scales)


def test_nvfp4_ggml_vs_gguf_dequantize_and_bf16():
    gguf = pytest.importorskip("gguf")
    x = _random_weights(64, 1024, seed=13, dtype=torch.bfloat16)
    ref = ggml_oracle.quantize(x.float().numpy(), "nvfp4")
    p = GG.quantize(x)
    np.testing.assert_array_equal(GG.to_bytes(p), ref)
    deq = gguf.quants.dequantize(ref, gguf.GGMLQuantizationType.NVFP4)
    np.testing.assert_array_equal(GG.dequantize(p).numpy(), deq)
    assert GG.spec.ggml_type == int(gguf.GGMLQuantizationType.NVFP4) == 40


def test_nvfp4_ggml_nan_inf_follow_ggml():
    x = np.random.default_rng(14).standard_normal((2, 64)).astype(F32)
    x[0, 3], x[0, 20], x[1, 40] = np.nan, np.inf, -np.inf
    ref = ggml_oracle.quantize(x, "nvfp4")
    np.testing.assert_array_equal(GG.quantize_ref(x), ref)
    np.testing.assert_array_equal(GG.to_bytes(GG.quantize(torch.from_numpy(x))), ref)


def test_nvfp4_ggml_supplied_scales_and_errors():
    x = _random_weights(4, 128, seed=15)
    p = GG.quantize(x)
    q = GG.quantize(x, scales=p.scales)
    assert torch.equal(p.codes, q.codes)
    np.testing.assert_array_equal(GG.quantize_ref(x.numpy(), scales=p.scales.numpy()), GG.to_bytes(p))
    with pytest.raises(ValueError, match=r"nvfp4_ggml.*K=96.*block size 64.*F16"):
        GG.quantize(torch.ones(2, 96))
    with pytest.raises(ValueError, match="no per-tensor scale"):
        GG.quantize(x, amax=1.0)


# ============================================================================ fake quant / STE
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_act", "nvfp4_ggml"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_value_dtype_and_ste(name, dtype):
    f = get_format(name)
    x = _random_weights(8, 128, seed=16).clamp(-100, 100).to(dtype)
    kw = {} if name == "nvfp4_ggml" else {"amax": float(x.float().abs().max()) * 0.5}  # forces saturation
    y = f.fake_quantize(x, **kw)
    assert y.dtype == dtype
    assert torch.equal(y, f.dequantize(f.quantize(x, **kw)).to(dtype))
    xi = x.clone().requires_grad_(True)
    f.fake_quantize(xi, **kw).sum().backward()
    assert torch.equal(xi.grad, torch.ones_like(x))
    xc = x.clone().requires_grad_(True)
    f.fake_quantize(xc, ste="clipped", **kw).sum().backward()
    mask = f.clip_mask(x, f.quantize(x, **kw))
    assert torch.equal(xc.grad, mask.to(dtype))
    if name != "nvfp4_ggml":
        assert 0 < int((~mask).sum()) < x.numel()           # the halved amax clips some elements
    # a clipped element is one whose dequantized magnitude is below its input's
    y32 = f.dequantize(f.quantize(x, **kw))
    assert bool((y32.abs()[~mask] < x.float().abs()[~mask]).all())


def test_registry_specs():
    for name, bpw in (("nvfp4", 4.5), ("nvfp4_act", 4.5), ("nvfp4_ggml", 4.5)):
        assert get_format(name).spec.bits_per_weight == bpw
    assert ACT.spec.role == "activation" and NV.spec.global_scale and GG.spec.global_scale is None


@pytest.mark.cuda
def test_scales_from_block_amax_cuda_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w = _random_weights(64, 1024, seed=18)
    ba = w.reshape(64, -1, 16).abs().amax(-1)
    assert torch.equal(scales_from_block_amax(ba, w.abs().max()),
                       scales_from_block_amax(ba.cuda(), w.abs().max().cuda()).cpu())


@pytest.mark.cuda
def test_cuda_emulators_equal_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    xs = [_random_weights(64, 1024, seed=17, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    xs += [torch.from_numpy(_adversarial(2)), torch.from_numpy(_ggml_edge_rows())]
    for f in (NV, ACT, GG):
        for x in xs:
            pc, pg = f.quantize(x), f.quantize(x.cuda())
            np.testing.assert_array_equal(f.to_bytes(pc), f.to_bytes(pg))
            if pc.global_scale is not None:
                assert torch.equal(pc.global_scale, pg.global_scale.cpu())
            assert torch.equal(f.dequantize(pc), f.dequantize(pg).cpu())
