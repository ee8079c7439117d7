"""Frozen codes, moving scales (Format.code_values / block_multiplier / shift_scales), the numerics of the
scale-only adapters: the decomposition is dequantize bit for bit; a zero offset leaves every byte alone;
a shifted scale is the byte the target's own encoder gives (ml_dtypes for E4M3, libggml's NVFP4 quantizer
for ggml's UE4M3, float64 log2 for E8M0); no shift ever produces a zero or NaN byte."""
import numpy as np
import pytest
import torch

from qatfactory.formats import PackedTensor, get_format
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with

SHIFTABLE = ["nvfp4", "nvfp4_ggml", "mxfp4", "mxfp4_rceil", "mxfp4_even", "mxfp4_ggml"]


@pytest.mark.parametrize("name", SHIFTABLE)
def test_decomposition_is_dequantize_bit_for_bit(name):
    f = get_format(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-4, 1, 16)[:, None]
    x[3, :64] = 0.0                                   # all-zero blocks
    p = f.quantize(x)
    bs = f.spec.block_size
    r = (f.code_values(p).reshape(16, -1, bs) * f.block_multiplier(p)[..., None]).reshape(16, 256)
    d = f.dequantize(p)
    assert torch.equal(r.view(torch.int32), d.view(torch.int32))


@pytest.mark.parametrize("name", SHIFTABLE)
def test_zero_offset_keeps_every_byte(name):
    f = get_format(name)
    s = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    b, c = f.shift_scales(s, torch.zeros(16, 16))
    assert torch.equal(b, s) and not bool(c.any())


def test_nvfp4_shift_is_nvidia_e4m3_rne_satfinite():
    f = get_format("nvfp4")
    s = torch.arange(1, 0x7F, dtype=torch.uint8).repeat(64)        # every positive finite E4M3 byte
    g = torch.Generator().manual_seed(1)
    th = torch.cat([torch.randn(s.numel() // 2, generator=g) * 0.2, torch.randn(s.numel() - s.numel() // 2,
                                                                               generator=g) * 6])
    b, clamped = f.shift_scales(s, th)
    base = s.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = (base * np.exp2(th.numpy().astype(np.float32))).astype(np.float32)
    oracle = np.clip(want, 2.0 ** -9, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(b.numpy(), oracle)
    assert np.array_equal(clamped.numpy(), (want < 2.0 ** -9) | (want > 448.0))
    assert int(b.min()) >= 1 and int(b.max()) <= 0x7E
    # bytes the format cannot scale (zero, NaN, sign bit set) pass through; a NaN offset moves nothing
    odd = torch.tensor([0x00, 0x7F, 0x80, 0xFF, 0x38], dtype=torch.uint8)
    b2, _ = f.shift_scales(odd, torch.tensor([1.0, 1.0, 1.0, 1.0, float("nan")]))
    assert b2.tolist() == odd.tolist()


def test_nvfp4_ggml_shift_is_ggmls_own_ue4m3_encoder():
    import ggml_oracle
    f = get_format("nvfp4_ggml")
    g = torch.Generator().manual_seed(2)
    s = torch.randint(1, 0x7F, (4096,), generator=g, dtype=torch.uint8)
    th = torch.randn(4096, generator=g) * 1.5
    b, _ = f.shift_scales(s, th)
    base = s.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = np.clip((base * np.exp2(th.numpy().astype(np.float32))).astype(np.float32), 2.0 ** -9, 448.0)
    # libggml picks the scale byte as ue4m3(amax / 6): a block whose amax is 6 * want (where that division
    # gives want back exactly) makes libggml's own encoder round `want`
    amax = (want * np.float32(6.0)).astype(np.float32)
    keep = (amax / np.float32(6.0)).astype(np.float32) == want
    assert keep.mean() > 0.5
    blocks = np.zeros((int(keep.sum()), 64), dtype=np.float32)
    blocks[:, 0] = amax[keep]
    raw = ggml_oracle.quantize(blocks, "nvfp4").reshape(-1, 36)
    assert np.array_equal(b.numpy()[keep], raw[:, 0])
    assert int(b.min()) >= 1 and int(b.max()) <= 0x7E


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_ggml"])
def test_mxfp4_shift_is_the_nearest_power_of_two_in_log2(name):
    f = get_format(name)
    s = torch.arange(0, 255, dtype=torch.uint8).repeat(16)
    g = torch.Generator().manual_seed(3)
    th = torch.randn(s.numel(), generator=g) * 4
    th = torch.where((th - th.round()).abs() > 1e-3, th, th + 0.01)       # no exact half-way ties
    b, clamped = f.shift_scales(s, th)
    e = s.numpy().astype(np.float64) - 127 + th.numpy().astype(np.float64)   # log2 of value * 2^theta
    want = np.rint(e) + 127
    assert np.array_equal(b.numpy(), np.clip(want, 0, 254).astype(np.uint8))
    assert np.array_equal(clamped.numpy(), (want < 0) | (want > 254))
    # the shifted scale decodes to value * 2^round(theta) exactly
    p = PackedTensor(name, (1, 32), torch.zeros(1, 16, dtype=torch.uint8), torch.tensor([[100]], dtype=torch.uint8))
    q = PackedTensor(name, (1, 32), p.codes, f.shift_scales(p.scales, torch.tensor([[2.4]]))[0])
    assert float(f.block_multiplier(q)[0, 0]) == float(f.block_multiplier(p)[0, 0]) * 4.0
