"""KV-cache formats (qatfactory/formats/kv*.py): every rule against a third-party implementation.

fp8_e4m3 (vLLM)         torch's float8_e4m3fn cast and ml_dtypes' (after the satfinite clip) of fp32 x/s
fp8_e4m3_sglang         ml_dtypes bfloat16 then float8_e4m3fn (non-saturating, like torch's CUDA cast)
nvfp4_kv                ml_dtypes float8_e4m3fn / float4_e2m1fn casts in vLLM's float32 order (the
                        order is a transcription: the writer kernel runs on Blackwell only)
q8_0_kv q4_0_kv q5_0_kv libggml's reference quantizers and dequantizers (ggml 0.20.2)
q8_0_kv_x86             libggml's CPU backend quantize_row_q8_0 (the AVX from_float llama.cpp writes with)
plus: numpy reference == torch emulator for every format, the scale the checkpoint carries, and the
llama architecture's K order against transformers' GGUF un-permutation.
"""
import numpy as np
import pytest
import torch

import ggml_oracle as G
from qatfactory.formats.kv import (amax_over_448, get_kv_format, gguf_k_order, kv_formats_for,
                                   list_kv_formats)
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with

E4M3 = ml_dtypes.float8_e4m3fn
ALL = list_kv_formats()


def _kv(seed=0, shape=(2, 2, 48, 64), dtype=torch.float32):
    """K-like data: per-channel spread with two outlier channels, a zero row, a tiny and a huge head."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.linspace(0.2, 2.0, shape[-1])
    x[..., 5] *= 12.0
    x[..., 37] *= -7.0
    x[0, 0, 0] = 0.0
    x[0, 1, 1] *= 1e-5
    x[1, 0, 2] *= 50.0
    return x.to(dtype)


def _scale(f, x):
    return f.scale(x.float().abs().amax()) if f.spec.static_scale else None


def test_registry_names_each_engines_rule():
    assert set(ALL) == {"fp8_e4m3", "fp8_e4m3_sglang", "nvfp4_kv", "q8_0_kv", "q8_0_kv_x86", "q4_0_kv", "q5_0_kv"}
    assert kv_formats_for("vllm") == ["fp8_e4m3", "nvfp4_kv"]
    assert kv_formats_for("sglang") == ["fp8_e4m3_sglang"]
    assert kv_formats_for("llama_cpp") == ["q4_0_kv", "q5_0_kv", "q8_0_kv", "q8_0_kv_x86"]
    for n in ALL:
        s = get_kv_format(n).spec
        assert s.engine and s.oracle and s.rounding and s.scale_rule
    with pytest.raises(ValueError, match="unknown KV-cache format 'fp9'.*registered"):
        get_kv_format("fp9")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_emulator_and_fake_quant(name, dtype):
    f = get_kv_format(name)
    x = _kv(1, dtype=dtype)
    s = _scale(f, x)
    b = f.encode(x, s)
    ref = f.encode_ref(x, s)
    assert b.dtype == torch.uint8 and b.shape[-1] == f.row_bytes(64)
    assert np.array_equal(ref, b.numpy()), f"{name}: {int((ref != b.numpy()).sum())} bytes differ"
    y = f.decode(b, 64, s)
    assert np.array_equal(f.decode_ref(ref, 64, s), y.numpy())
    assert torch.equal(f.values(x, s), y)
    xr = x.clone().requires_grad_(True)
    fq = f.fake_quantize(xr, s)
    assert fq.dtype == dtype and torch.equal(fq.detach(), y.to(dtype))
    fq.float().sum().backward()
    assert torch.equal(xr.grad, torch.ones_like(x))            # straight-through
    rel = float((y - x.float()).norm() / x.float().norm())
    assert 0 < rel < {8.0: 0.05, 8.5: 0.01, 5.5: 0.06, 4.5: 0.15}[f.spec.bits_per_element], rel
    assert torch.equal(y[0, 0, 0], torch.zeros(64))             # a zero row stays zero


@pytest.mark.parametrize("name", ALL)
def test_bad_input_is_refused_with_a_reason(name):
    f = get_kv_format(name)
    s = _scale(f, torch.ones(1))
    x = torch.ones(1, 64)
    x[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        f.encode(x, s)
    if f.spec.block:
        with pytest.raises(ValueError, match=f"head_dim=40 is not a multiple of the block size {f.spec.block}"):
            f.encode(torch.ones(1, 40), s)
    if f.spec.static_scale:
        with pytest.raises(ValueError, match="needs the per-layer scale"):
            f.encode(torch.ones(1, 64))
        with pytest.raises(ValueError, match="finite float32 > 0"):
            f.encode(torch.ones(1, 64), torch.tensor(0.0))
    else:
        with pytest.raises(ValueError, match="no per-tensor scale"):
            f.encode(torch.ones(1, 64), torch.tensor(1.0))


def _bf16_up_oracle(v: np.float32) -> np.float32:
    """The smallest bfloat16 >= v by ml_dtypes: its nearest bf16, stepped up once if that lies below v."""
    b = np.float32(v).astype(ml_dtypes.bfloat16)
    if b.astype(np.float32) < v:
        b = np.nextafter(b, ml_dtypes.bfloat16(np.inf))
    return b.astype(np.float32)


def test_scale_is_amax_over_448_in_float32_rounded_up_to_bf16():
    for amax in (1.0, 3.0, 17.3125, 1234.5, 1e-3, 0.6054687, 16.875, 16.8759, 3e-30):
        a = np.float32(amax)
        q = (a / np.float32(448.0)).astype(np.float32)
        want = _bf16_up_oracle(q)
        got = amax_over_448("t", torch.tensor(amax))
        assert got.dtype == torch.float32 and got.shape == () and got.numpy().view(np.uint32) == want.view(np.uint32)
        assert float(got) >= float(q) and a / got.numpy() <= np.float32(448.0)   # the calibrated amax never saturates
    assert float(amax_over_448("t", 0.0)) == 1.0                 # vLLM's default scale, not a zero divisor
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite float >= 0"):
            amax_over_448("t", bad)


def test_the_scale_survives_how_vllm_and_sglang_hold_it():
    """vLLM 0.24 (quantization/kv_cache.py, a transcription): KVCacheScaleParameter is torch.tensor(-1.0)
    made while torch's default dtype is the model's, then param.data.copy_(loaded float32 scale); SGLang
    0.5.17 makes it float32. The scale must come back unchanged in every case (measured on an H100,
    2026-12-06: the plain amax / 448 came back moved by up to 0.32% from a bf16 model)."""
    rng = np.random.default_rng(0)
    moved_before = 0
    for amax in np.exp(rng.uniform(np.log(0.03), np.log(3000.0), 500)).astype(np.float32):
        s = amax_over_448("t", torch.tensor(amax))
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            old = torch.get_default_dtype()
            torch.set_default_dtype(dt)
            try:
                held = torch.tensor(-1.0)
            finally:
                torch.set_default_dtype(old)
            held.copy_(s)
            assert held.dtype == dt and held.tolist() == float(s), (amax, dt)
        q = np.float32(amax) / np.float32(448.0)
        moved_before += float(torch.tensor(q).to(torch.bfloat16)) != float(q)
    assert moved_before > 400          # the old scale (amax / 448 alone) did not survive in most cases


def _fp8_edge_inputs(s: float) -> torch.Tensor:
    """Every positive E4M3 value, every midpoint between neighbours (the ties), beyond 448, times s."""
    codes = np.arange(0x00, 0x7F, dtype=np.uint8)
    vals = codes.view(E4M3).astype(np.float32)
    mids = (vals[:-1] + vals[1:]) / 2
    extra = np.array([448.0, 449.0, 463.9, 464.0, 470.0, 500.0, 1e4, 2.0 ** -10, 2.0 ** -11, 1e-30],
                     dtype=np.float32)
    v = np.concatenate([vals, mids, extra])
    v = np.concatenate([v, -v, [np.float32(-0.0)]])
    return torch.from_numpy((v.astype(np.float64) * s).astype(np.float32))


def test_fp8_e4m3_is_vllms_quotient_rne_satfinite():
    f = get_kv_format("fp8_e4m3")
    for s_val in (1.0, 0.0123, 3.75):
        s = torch.tensor(s_val, dtype=torch.float32)
        x = torch.cat([_fp8_edge_inputs(s_val), _kv(2).reshape(-1)])
        x = x[: x.numel() // 64 * 64].reshape(-1, 64)
        got = f.encode(x, s).numpy()
        q = (x / s).numpy()
        md = np.clip(q, -448, 448).astype(E4M3).view(np.uint8)       # SATFINITE = clip, then RNE
        assert np.array_equal(got, md), f"s={s_val}: {int((got != md).sum())} bytes differ from ml_dtypes"
        tc = (x / s).to(torch.float8_e4m3fn).view(torch.uint8).numpy()   # torch 2.13 CPU saturates itself
        assert np.array_equal(got, tc)
        dec = f.decode(torch.from_numpy(got), 64, s).numpy()
        assert np.array_equal(dec, (md.view(E4M3).astype(np.float32) * np.float32(s_val)).astype(np.float32))
    # every code survives decode -> encode
    allc = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    allc = allc[(allc & 0x7F) != 0x7F]
    s = torch.tensor(0.37)
    v = f.decode(allc, 64, s)
    assert torch.equal(f.encode(v, s), allc)


def test_fp8_sglang_is_dtype_rounded_then_non_saturating_cast():
    f, v = get_kv_format("fp8_e4m3_sglang"), get_kv_format("fp8_e4m3")
    x = torch.cat([_fp8_edge_inputs(0.05), _kv(3).reshape(-1)])
    x = x[: x.numel() // 64 * 64].reshape(-1, 64).to(torch.bfloat16)
    s = torch.tensor(0.05, dtype=torch.float32)
    got = f.encode(x, s).numpy()
    r = np.float32(1.0) / np.float32(0.05)
    y = (x.float().numpy() * r).astype(np.float32).astype(ml_dtypes.bfloat16)
    md = y.astype(E4M3).view(np.uint8)
    nan_got, nan_md = (got & 0x7F) == 0x7F, (md & 0x7F) == 0x7F
    assert np.array_equal(nan_got, nan_md) and nan_got.any()      # |y| > 464 -> NaN, as ml_dtypes
    assert np.array_equal(got[~nan_got], md[~nan_md])
    assert not nan_got[np.abs(y.astype(np.float32)) <= 464].any()    # 448..464 round to 448
    # the same checkpoint scale, another rule: bytes differ where the bf16 rounding of x/s lands on an
    # E4M3 tie (measured: 2.35% of the elements of this bf16 K-like data), always by one E4M3 step
    big = _kv(4, shape=(64, 4, 64, 64)).to(torch.bfloat16)
    s2 = torch.tensor(float(big.float().abs().amax()) / 448.0)
    a, b = v.encode(big, s2), f.encode(big, s2)
    differ = a != b
    assert 0.01 < float(differ.float().mean()) < 0.05, float(differ.float().mean())
    step = (a[differ].to(torch.int16) - b[differ].to(torch.int16)).abs()
    assert int(step.max()) == 1


def test_nvfp4_kv_is_vllms_fp4_quantizer_with_the_checkpoint_scale():
    f = get_kv_format("nvfp4_kv")
    x = _kv(5, dtype=torch.bfloat16)
    amax = x.float().abs().amax()
    s = f.scale(amax)
    got = f.encode(x, s).numpy()
    # composition with ml_dtypes' casts, in the order of vLLM's cvt_warp_fp16_to_fp4
    xb = x.float().numpy().reshape(*x.shape[:-1], -1, 16)
    S = np.float32(1) / np.float32(s)
    sf = (S * (np.abs(xb).max(-1) * (np.float32(1) / np.float32(6))).astype(np.float32)).astype(np.float32)
    s8 = np.clip(sf, -448, 448).astype(E4M3)
    sfd = s8.astype(np.float32)
    with np.errstate(divide="ignore"):
        out = np.where(sfd != 0, np.float32(1) / (sfd * (np.float32(1) / S)).astype(np.float32), np.float32(0))
    e2 = (xb * out[..., None].astype(np.float32)).astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
    codes = e2.view(np.uint8).reshape(*x.shape) & 0xF
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    want = np.concatenate([packed, s8.view(np.uint8)], axis=-1)
    assert np.array_equal(got, want), f"{int((got != want).sum())} bytes differ"
    dec = f.decode(torch.from_numpy(got), 64, s).numpy()
    ref = ((e2.astype(np.float32) * sfd[..., None]).astype(np.float32) * np.float32(s)).reshape(x.shape)
    assert np.array_equal(dec, ref.astype(np.float32))
    assert float(sfd.max()) <= 448 / 6 + 1                        # block scales use at most 448/6 of E4M3


@pytest.mark.parametrize("name,gtype", [("q8_0_kv", "q8_0"), ("q4_0_kv", "q4_0"), ("q5_0_kv", "q5_0")])
def test_ggml_cache_types_are_libggmls_reference(name, gtype):
    f = get_kv_format(name)
    x = _kv(6, dtype=torch.bfloat16).float()
    rows = x.reshape(-1, 64).numpy()
    got = f.encode(x, None).reshape(rows.shape[0], -1).numpy()
    assert np.array_equal(got, G.quantize(rows, gtype)), f"{name} != ggml_quantize_chunk"
    assert np.array_equal(got[7], G.quantize_row_ref(rows[7], gtype))
    dec = f.decode(torch.from_numpy(got), 64).numpy()
    assert np.array_equal(dec, G.dequantize(got, gtype, 64))


def _ties_rows(n=64, seed=7):
    """Rows with amax 127 (d = 1) and many exact .5 values: the two q8_0 rules part there."""
    rng = np.random.default_rng(seed)
    x = (np.round(rng.standard_normal((n, 64)) * 40) / 2).astype(np.float32)
    x[:, 0] = 127.0
    x[:, 32] = -127.0
    return x


def test_q8_0_x86_is_the_cpu_backends_from_float_and_differs_from_the_reference():
    feats = G.cpu_features()
    assert feats["avx"] or feats["avx2"], f"libggml-python's CPU backend is not an AVX build ({feats}): the " \
                                          f"oracle for llama.cpp's x86 q8_0 cache write cannot run here"
    f, ref = get_kv_format("q8_0_kv_x86"), get_kv_format("q8_0_kv")
    for rows in (_ties_rows(), _kv(8).reshape(-1, 64).numpy(), _kv(9, dtype=torch.bfloat16).float().reshape(-1, 64).numpy()):
        got = f.encode(torch.from_numpy(rows), None).numpy()
        assert np.array_equal(got, G.quantize_row_cpu(rows, "q8_0"))
    t = torch.from_numpy(_ties_rows())
    assert not torch.equal(f.encode(t, None), ref.encode(t, None))     # RNE vs roundf on ties
    assert np.array_equal(ref.encode(t, None).numpy(), G.quantize(t.numpy(), "q8_0"))


def test_llama_k_order_is_what_transformers_gguf_loader_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    for d in (8, 64, 128):
        order = gguf_k_order(d).numpy()
        # a GGUF llama K row j holds transformers' element order[j]; the loader's un-permute restores 0..d-1
        back = LlamaTensorProcessor()._reverse_permute_weights(order.reshape(d, 1), 1, 1).reshape(-1)
        assert np.array_equal(back, np.arange(d))
        assert list(order[:4]) == [0, d // 2, 1, d // 2 + 1]
