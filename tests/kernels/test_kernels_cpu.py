"""CPU-side checks of qatfactory.kernels: the emulator fallback (one log line, identical
results and gradients), argument checks, the LSQ rule, and an nvcc compile check of csrc/."""
from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from qatfactory import kernels as K
from qatfactory.formats import get_format
from qatfactory.kernels import loader

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _x(k=256, rows=4, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * 0.05).to(dtype)


@pytest.fixture
def fresh_log():
    K._warned.clear()
    yield
    K._warned.clear()


def test_fallback_logs_one_line_and_equals_emulator(caplog, fresh_log):
    x = _x()
    with caplog.at_level(logging.WARNING, logger="qatfactory.kernels"):
        for fmt in K.kernel_formats():
            y = K.fake_quantize(x, fmt)
            want = get_format(fmt).fake_quantize(x)
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), fmt
            y2 = K.fake_quantize(x, fmt)          # a second call logs nothing more
            assert torch.equal(y2.view(torch.int16), want.view(torch.int16)), fmt
    lines = [r for r in caplog.records if r.name == "qatfactory.kernels"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "torch emulator" in msg and ("CUDA" in msg or "cuda" in msg)


def test_kernel_formats_cover_the_training_formats():
    names = set(K.kernel_formats())
    for want in ("nvfp4", "nvfp4_act", "mxfp4", "mxfp4_rceil", "mxfp4_even", "mxfp4_ggml", "q4_k", "q5_0", "q6_k"):
        assert want in names, f"{want} has no kernel entry; kernel_formats() = {sorted(names)}"


def test_fp4_kernel_params_come_from_the_spec():
    for fmt in ("nvfp4", "mxfp4", "mxfp4_ggml"):
        block, rule, tie, negz = K._fp4_params(fmt)
        spec = get_format(fmt).spec
        assert block == spec.block_size
        assert tie == (0 if spec.tie_rule == "rne" else 1)
    # six distinct scale rules, one per spec.scale_rule
    assert len({K._fp4_params(f)[1] for f in ("nvfp4", "nvfp4_act", "mxfp4", "mxfp4_rceil",
                                               "mxfp4_even", "mxfp4_ggml")}) == 6


@pytest.mark.parametrize("ste", ["identity", "clipped"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "q4_k"])
def test_fallback_gradients_equal_format_fake_quantize(fmt, ste, fresh_log):
    x = _x(seed=1).float()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    a = x.clone().requires_grad_(True)
    K.fake_quantize(a, fmt, ste=ste).backward(g)
    b = x.clone().requires_grad_(True)
    get_format(fmt).fake_quantize(b, ste=ste).backward(g)
    assert torch.equal(a.grad, b.grad)


def test_why_not_names_the_reason():
    x = _x()
    r = K.why_not(x, "nvfp4")
    assert r is not None
    ok, reason = loader.probe()
    if not ok:
        assert r == reason
    else:
        assert "not a CUDA tensor" in r


def test_why_not_format_without_kernel(monkeypatch):
    monkeypatch.setattr(loader, "probe", lambda: (True, ""))
    x = _x()
    assert "not a CUDA tensor" in K.why_not(x, "nvfp4")
    meta = torch.empty(4, 256, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert "no kernel" in K.why_not(meta, "nvfp4_ggml")
    assert "emulator only" in K.why_not(meta, "nvfp4", scales=torch.ones(4, 16, dtype=torch.uint8))
    assert "emulator" in K.why_not(meta, "q4_k", ste="clipped")
    assert K.why_not(meta, "nvfp4", amax=1.0) is None


def test_bad_ste_and_shape_errors():
    x = _x(k=48)
    with pytest.raises(ValueError, match="ste='straight'.*allowed"):
        K.fake_quantize(_x(), "nvfp4", ste="straight")
    with pytest.raises(ValueError, match="q4_k.*K=48.*256"):
        K.fake_quantize(x, "q4_k")
    with pytest.raises(ValueError, match="unknown format"):
        K.fake_quantize(_x(), "nvfp5")


def test_lsq_torch_rule_gradients():
    """dL/ds of the LSQ rule: the definition, summed per block, checked element by element."""
    x = torch.tensor([[0.30, -0.10, 2.00, 0.05] * 4], dtype=torch.float32)     # one block of 16
    s = torch.tensor([[0.1]], requires_grad=True)
    xr = x.clone().requires_grad_(True)
    y = K.lsq_fake_quantize(xr, s, 16, grad_scale=0.25)
    g = torch.ones_like(x)
    y.backward(g)
    v = x / 0.1
    q = torch.tensor([3.0, -1.0, 6.0, 0.5] * 4)      # e2m1 RNE of v = 3, -1, 20 (saturates), 0.5
    assert torch.equal(y.detach(), (q * 0.1).reshape(1, 16))
    inside = v.abs() <= 6
    assert torch.equal(xr.grad, inside.float())
    term = torch.where(inside, q - v, 6.0 * torch.sign(v))
    torch.testing.assert_close(s.grad, (term.sum() * 0.25).reshape(1, 1))


def test_lsq_rejects_mismatched_scale():
    with pytest.raises(ValueError, match="scale of shape"):
        K.lsq_fake_quantize(_x(k=64).float(), torch.ones(4, 3), 16)


def test_quantize_fallback_equals_emulator(fresh_log):
    x = _x(k=512)
    for fmt in ("nvfp4", "mxfp4_ggml", "q6_k"):
        b = K.quantize_bytes(x, fmt)
        f = get_format(fmt)
        assert (b == f.to_bytes(f.quantize(x))).all()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("src", ["fp4_qdq.cu", "kquant_qdq.cu"])
def test_sources_compile_with_nvcc(src, tmp_path):
    r = subprocess.run(["nvcc", "-arch=sm_90", "--fmad=false", "-std=c++17", "-DQF_NVCC_CHECK", "-I", str(CSRC),
                        "-c", str(CSRC / src), "-o", str(tmp_path / "k.o")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr.lower(), r.stderr[-3000:]
