"""DESIGN rule 2, for every registered format at once: numpy reference == torch emulator, bit for bit,
dequantize agrees, fake_quantize == dequantize(quantize) in the input dtype, shape errors name the fallback.
A new format registered tomorrow is checked here without writing a line. (Each format's own test file
compares against its independent oracle; this one guards the contract the rest of the package relies on.)"""
import numpy as np
import pytest
import torch

from qatfactory.formats import get_format, list_formats

FORMATS = list_formats()
_ELEMENT_BITS = {"e2m1": None, "uint4": 4, "int5": 5, "int6": 6, "int8": 8,
                 # the ParetoQ grids (intgrid.py), by the step their init gives a row of max M: LSQ max/Qp
                 # (4 bits: M/7 ~ M/8; 3 bits: M/3; 2 bits: M), 2-bit SEQ M/2, ternary 2M/3, sign ~M
                 "int4": 4, "int3": 1 + np.log2(3), "int2": 1, "int2_seq": 2, "ternary": 1 + np.log2(1.5),
                 "binary": 1}


def _data(fmt, seed=0):
    k = max(256, fmt.spec.super_block)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, k, generator=g) * 0.05
    x[1] = torch.distributions.StudentT(2.0).sample((k,)) * 0.02  # heavy tail
    x[2] = 0.0                                                     # zero row
    x[3] = x[3].abs()                                              # all positive
    x[4] *= 1e-6                                                   # tiny
    x[5] *= 1e3                                                    # huge
    return x


def _first_diff(a: np.ndarray, b: np.ndarray) -> str:
    bad = np.argwhere(a != b)
    r, c = bad[0][:-1], bad[0][-1]
    return f"first difference at row {tuple(r)} byte {c}: reference {a[tuple(bad[0])]:#04x} vs emulator {b[tuple(bad[0])]:#04x} ({len(bad)} bytes differ)"


@pytest.mark.parametrize("name", FORMATS)
def test_reference_equals_emulator(name):
    f = get_format(name)
    x = _data(f)
    ref = f.quantize_ref(x.numpy())
    p = f.quantize(x)
    emu = f.to_bytes(p)
    assert ref.dtype == np.uint8 and emu.dtype == np.uint8
    assert ref.shape == emu.shape
    assert np.array_equal(ref, emu), f"{name}: " + _first_diff(ref, emu)
    assert p.shape == tuple(x.shape)


@pytest.mark.parametrize("name", FORMATS)
def test_bytes_round_trip_and_dequantize(name):
    f = get_format(name)
    x = _data(f, seed=1)
    p = f.quantize(x)
    y = f.dequantize(p)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.isfinite(y).all(), f"{name}: dequantize produced non-finite values on finite input"
    kw = {"global_scale": p.global_scale} if p.global_scale is not None else {}
    q = f.from_bytes(f.to_bytes(p), x.shape[-1], **kw)
    assert torch.equal(f.dequantize(q), y), f"{name}: from_bytes(to_bytes(p)) decodes differently"
    # the error a format of this element width must stay under (an all-zero or garbage decode fails):
    # a b-bit integer grid scaled to each block's max M has a step of about M / 2^(b-1) and an rms
    # error of step/sqrt(12); E2M1 has one mantissa bit, a relative error up to 1/4 per element
    # (measured 0.08-0.20 on these rows). Bound: twice that prediction, from the row's own block maxima
    # ParetoQ's grids keep alpha >= 1e-5 (its forward's floor), and 2-bit SEQ has no zero level: a zero
    # row decodes to +alpha/4 there (scale_floor is that least alpha; 0 for every other format)
    floor = getattr(f, "scale_floor", 0.0)
    assert (y[2].abs() <= floor).all(), f"{name}: a zero row must decode to zeros"
    for r in (0, 1, 3, 5, 6, 7):          # not the zero row (2) nor the 1e-6 row (4, below some formats' range)
        rel = float((y[r] - x[r]).norm() / x[r].norm())
        bits = _ELEMENT_BITS[f.spec.element]
        if bits is None:
            bound = 0.25
        else:
            m = x[r].reshape(-1, f.spec.block_size or x.shape[-1]).abs().amax(-1)   # block_size 0: per row
            bound = 2 * float(m.pow(2).mean().sqrt() / x[r].pow(2).mean().sqrt()) / (2 ** (bits - 1) * 12 ** 0.5)
        assert rel < bound, f"{name}: row {r} decodes with relative rms error {rel:.3f} >= {bound:.3f}"
        if f.spec.element == "e2m1":  # a sign bit per element: never flipped (grids with an offset can)
            assert torch.equal(torch.sign(y[r])[y[r] != 0], torch.sign(x[r])[y[r] != 0]), f"{name}: sign flipped"
    # the tiny row may underflow (fp16 scales, a per-tensor scale set by the 1e3 row) but never grow
    assert (y[4].abs() <= x[4].abs() * 2 + 1e-12 + floor).all()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_contract(name, dtype):
    f = get_format(name)
    x = _data(f, seed=2).to(dtype).requires_grad_(True)
    y = f.fake_quantize(x)
    assert y.dtype == dtype
    expect = f.dequantize(f.quantize(x.detach())).to(dtype)
    assert torch.equal(y.detach(), expect)
    y.float().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)), f"{name}: identity STE must pass the gradient unchanged"


@pytest.mark.parametrize("name", FORMATS)
def test_bad_last_dim_names_format_block_and_fallback(name):
    f = get_format(name)
    k = f.spec.super_block + f.spec.block_size // 2 if f.spec.block_size > 1 else 3
    with pytest.raises(ValueError) as e:
        f.quantize(torch.randn(2, k))
    msg = str(e.value)
    assert name in msg and str(f.spec.super_block) in msg


@pytest.mark.parametrize("name", FORMATS)
def test_spec_is_complete(name):
    s = get_format(name).spec
    for fld in ("engine", "element", "scale_codec", "scale_rule", "tie_rule", "nibble_order", "oracle"):
        assert getattr(s, fld), f"{name}: spec field {fld} is empty"
    # block_size 0: one scale per row; a scale group may also span whole engine blocks (int4_lsq_g128)
    assert s.block_size == 0 or s.super_block % s.block_size == 0 or s.block_size % s.super_block == 0
    assert s.bytes_per_block > 0
    assert 1.6 <= s.bits_per_weight <= 8.5      # TQ1_0 (1.6875) .. Q8_0
