"""CUDA kernels (csrc/) == torch emulator == numpy reference, bit for bit (run on the H200).

Every comparison is on the raw bits (int views), so -0.0 vs +0.0 and NaN payloads count.
Outputs are poisoned (NaN / 0xFF) before each launch, so an element the kernel never writes
cannot pass. ggml formats are also checked against libggml (tests/ggml_oracle.py), the
independent oracle; E2M1 formats against the numpy references the format modules carry,
which their own tests pin to ModelOpt / torchao / triton_kernels / gguf.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from qatfactory import kernels as K  # noqa: E402
from qatfactory.formats import get_format  # noqa: E402
from qatfactory.kernels import loader  # noqa: E402

ok, why = loader.probe()
if not ok:
    pytest.skip(f"CUDA kernels unavailable: {why}", allow_module_level=True)

DEV = torch.device("cuda")
FP4 = [n for n in ("nvfp4", "nvfp4_act", "mxfp4", "mxfp4_rceil", "mxfp4_even", "mxfp4_ggml")
       if n in K.kernel_formats()]
GGML = [n for n in ("q4_k", "q6_k", "q5_0") if n in K.kernel_formats()]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NVFP4 = [n for n in ("nvfp4", "nvfp4_act") if n in FP4]
# NVFP4 runs one of three kernels (QF_NVFP4_KERNEL): every NVFP4 test runs on each; the other
# formats have one kernel ("-")
VERSIONS = K.NVFP4_KERNELS


def _with_versions(fmts):
    return [pytest.param(f, v, id=f"{f}-{v}") for f in fmts for v in (VERSIONS if f in NVFP4 else ("-",))]


@pytest.fixture
def use_kernel(monkeypatch):
    def set_version(version: str) -> None:
        if version != "-":
            monkeypatch.setenv("QF_NVFP4_KERNEL", version)
    return set_version
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(autouse=True)
def _poison():
    K.POISON_OUTPUTS = True
    yield
    K.POISON_OUTPUTS = False


# ----------------------------------------------------------------------------- data
def _adversarial_rows(k: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of K whose blocks hit the edge cases: E2M1 ties, zero / tiny / subnormal blocks,
    block maxima one ulp around powers of two, signed zeros, wide dynamic range."""
    rows = []
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float64)
    nblk = k // block

    def fill(fn):
        r = torch.empty(nblk, block, dtype=torch.float64)
        for b in range(nblk):
            r[b] = fn(b)
        rows.append(r.reshape(-1))

    def tie_block(b):
        e = float(2.0 ** ((b % 17) - 8))
        v = ties[torch.randint(0, 8, (block,), generator=gen)] * e
        v[0] = 6.0 * e
        s = torch.where(torch.rand(block, generator=gen) < 0.5, -1.0, 1.0).double()
        return v * s

    fill(tie_block)
    fill(lambda b: torch.zeros(block, dtype=torch.float64) if b % 2 == 0 else
         torch.randn(block, generator=gen, dtype=torch.float64) * 1e-3)
    fill(lambda b: torch.randn(block, generator=gen, dtype=torch.float64) * float(2.0 ** (-(b % 40) - 100)))

    def pow2_edge(b):
        k2 = (b % 24) - 12
        base = np.float32(2.0 ** k2)
        m = [np.nextafter(base, np.float32(np.inf)), base, np.nextafter(base, np.float32(0))][b % 3]
        v = torch.rand(block, generator=gen, dtype=torch.float64) * float(m)
        v[b % block] = float(m) * (1 if b % 2 else -1)
        return v

    fill(pow2_edge)

    def signed_zero(b):
        v = torch.randn(block, generator=gen, dtype=torch.float64) * 1e-9
        v[:4] = torch.tensor([0.0, -0.0, 1.0, -1.0], dtype=torch.float64)
        return v

    fill(signed_zero)
    fill(lambda b: torch.randn(block, generator=gen, dtype=torch.float64) * float(10.0 ** ((b % 10) - 7)))
    return torch.stack(rows)


def _inputs(fmt: str, dtype: torch.dtype, three_d: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = 512
    block = get_format(fmt).spec.block_size
    rnd = torch.randn(10, k, generator=gen, dtype=torch.float64) * 0.02
    adv = _adversarial_rows(k, block, gen)
    x = torch.cat([rnd, adv])
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)      # stay finite: the emulators refuse Inf
    x = x.to(dtype)
    if three_d:
        x = torch.randn(3, 8, k, generator=gen).to(dtype) * torch.tensor([1.0, 1e-3, 30.0]).view(3, 1, 1).to(dtype)
    return x


# ----------------------------------------------------------------------------- comparisons
def _assert_bits(got: torch.Tensor, want: torch.Tensor, block: int, what: str) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype in INT_VIEW:
        gb, wb = got.view(INT_VIEW[got.dtype]), want.view(INT_VIEW[want.dtype])
    else:
        gb, wb = got, want
    diff = (gb != wb).reshape(-1)
    n = int(diff.sum())
    if n:
        i = int(diff.nonzero()[0])
        kdim = got.shape[-1]
        row, col = divmod(i, kdim)
        width = 8 if got.dtype == torch.float32 else 4
        g = int(gb.reshape(-1)[i]) & ((1 << (4 * width)) - 1) if got.dtype in INT_VIEW else int(gb.reshape(-1)[i])
        w = int(wb.reshape(-1)[i]) & ((1 << (4 * width)) - 1) if got.dtype in INT_VIEW else int(wb.reshape(-1)[i])
        pytest.fail(f"{what}: {n} of {diff.numel()} elements differ; first at row {row}, block {col // block} "
                    f"(element {col}): kernel bits 0x{g:0{width}X} ({got.reshape(-1)[i].item()!r}) vs "
                    f"reference 0x{w:0{width}X} ({want.reshape(-1)[i].item()!r})")


def _ref_fake_quant(fmt: str, x: torch.Tensor, **kw) -> torch.Tensor:
    """numpy reference bytes -> numpy decode -> x.dtype (the ground truth of the format)."""
    f = get_format(fmt)
    x32 = x.float().cpu().numpy()
    b = f.quantize_ref(x32, **kw)
    k = x.shape[-1]
    if fmt.startswith("nvfp4"):
        amax = kw.get("amax")
        g = f.global_scale_ref(x32, amax) if fmt == "nvfp4" else f.global_scale_ref(x32, amax)
        y = f.dequantize_ref(b, k, global_scale=g)
    else:
        y = f.dequantize_ref(b, k)
    return torch.from_numpy(np.ascontiguousarray(y)).to(x.dtype)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt,kver", _with_versions(FP4 + GGML))
def test_fake_quant_kernel_equals_emulator_and_reference(fmt, kver, dtype, use_kernel):
    use_kernel(kver)
    x = _inputs(fmt, dtype)
    block = get_format(fmt).spec.block_size
    got = K.fake_quantize(x.to(DEV), fmt)
    # the numpy reference (the engine's op order) first: a failure here is the kernel's; one
    # only against the emulator below is the emulator's (e.g. q5_0 on an all -0.0 block,
    # where ggml keeps max = +0 and stores d = -0.0)
    _assert_bits(got, _ref_fake_quant(fmt, x), block, f"{fmt} {dtype} kernel vs numpy reference")
    emu = get_format(fmt).fake_quantize(x)           # CPU emulator
    _assert_bits(got, emu, block, f"{fmt} {dtype} kernel vs CPU emulator")


@pytest.mark.parametrize("fmt,kver", _with_versions(FP4 + GGML))
def test_fake_quant_3d_experts(fmt, kver, use_kernel):
    use_kernel(kver)
    x = _inputs(fmt, torch.bfloat16, three_d=True, seed=1)
    block = get_format(fmt).spec.block_size
    kw = {}
    if fmt == "nvfp4":
        kw["amax"] = x.float().abs().amax(dim=(1, 2))        # one global scale per expert
    got = K.fake_quantize(x.to(DEV), fmt, **{k: v.to(DEV) for k, v in kw.items()})
    emu = get_format(fmt).fake_quantize(x, **kw)
    _assert_bits(got, emu, block, f"{fmt} [E, N, K] kernel vs CPU emulator")


@pytest.mark.parametrize("fmt,kver", _with_versions(NVFP4))
def test_supplied_amax(fmt, kver, use_kernel):
    use_kernel(kver)
    x = _inputs(fmt, torch.bfloat16, seed=2)
    amax = torch.tensor(float(x.float().abs().max()) * 0.37)     # smaller than the data: clipping
    got = K.fake_quantize(x.to(DEV), fmt, amax=amax.to(DEV))
    emu = get_format(fmt).fake_quantize(x, amax=amax)
    _assert_bits(got, emu, 16, f"{fmt} amax= kernel vs CPU emulator")
    _assert_bits(got, _ref_fake_quant(fmt, x, amax=amax.numpy()), 16, f"{fmt} amax= kernel vs numpy ref")


@pytest.mark.parametrize("fmt,kver", _with_versions(NVFP4))
def test_all_zero_tensor_is_finite(fmt, kver, use_kernel):
    use_kernel(kver)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    got = K.fake_quantize(x.to(DEV), fmt)
    _assert_bits(got, get_format(fmt).fake_quantize(x), 16, f"{fmt} zeros")
    p = K.quantize(x.to(DEV), fmt)
    assert torch.isfinite(p.global_scale).all() and not (p.scales == 0xFF).any()


# ----------------------------------------------------------------------------- NVFP4 kernels: tails, groups
# (x shape, amax shape or None for a scalar): block counts that are not a multiple of the warp
# (32) or of the CTA (256 threads), one block, and group amaxes that split a warp's blocks
_ODD_SHAPES = [((1, 16), None), ((3, 48), None), ((5, 16 * 37), (5,)), ((3, 16 * 700), None),
               ((3, 5, 80), (3,)), ((3, 5, 80), (3, 5)), ((2, 9, 16 * 33), (2,))]


def _odd_input(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.02
    flat = x.reshape(-1, 16)
    # a spread of block magnitudes (one amax for all of them: tiny blocks, blocks at the top)
    flat *= torch.pow(10.0, torch.randint(-6, 3, (flat.shape[0], 1), generator=gen).double())
    flat[::7] = 0.0                                     # all-zero blocks
    flat[3::11, :4] = torch.tensor([0.0, -0.0, 0.25, -0.75], dtype=torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt,kver", _with_versions(NVFP4))
def test_nvfp4_odd_block_counts_and_group_amax(fmt, kver, dtype, use_kernel):
    """Block counts off the warp / CTA grid and per-row / per-expert amax, against the CPU
    emulator (forward, codes + scales, clipped-STE gradient) with poisoned outputs."""
    use_kernel(kver)
    f = get_format(fmt)
    for i, (shape, ashape) in enumerate(_ODD_SHAPES):
        if fmt == "nvfp4_act" and ashape is not None:
            continue                                    # nvfp4_act: one static scalar amax
        x = _odd_input(shape, dtype, seed=20 + i)
        kw = {}
        if ashape is not None:
            dims = tuple(range(len(ashape), x.ndim))
            kw["amax"] = x.float().abs().amax(dim=dims) * 0.8          # some clipping too
        dkw = {k: v.to(DEV) for k, v in kw.items()}
        what = f"{fmt} {kver} {dtype} {shape} amax {ashape}"
        _assert_bits(K.fake_quantize(x.to(DEV), fmt, **dkw), f.fake_quantize(x, **kw), 16, f"{what} forward")
        p, e = K.quantize(x.to(DEV), fmt, **dkw), f.quantize(x, **kw)
        assert torch.equal(p.codes.cpu(), e.codes), f"{what}: codes differ from the emulator"
        assert torch.equal(p.scales.cpu(), e.scales), f"{what}: scales differ from the emulator"
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(30 + i)).to(dtype)
        xc, xe = x.detach().to(DEV).requires_grad_(True), x.detach().clone().requires_grad_(True)
        K.fake_quantize(xc, fmt, ste="clipped", **dkw).backward(g.to(DEV))
        f.fake_quantize(xe, ste="clipped", **kw).backward(g)
        _assert_bits(xc.grad, xe.grad, 16, f"{what} clipped-STE gradient")


def _version_inputs(dtype: torch.dtype):
    """2-D [R, 208] (13 blocks per row, 273 blocks in all: one full CTA and a partial warp) with
    adversarial rows, NaN, +-Inf and signed zeros; 3-D [3, 5, 208] experts."""
    gen = torch.Generator().manual_seed(40)
    k = 16 * 13
    x = torch.cat([torch.randn(15, k, generator=gen, dtype=torch.float64) * 0.02, _adversarial_rows(k, 16, gen)])
    x = x[:21]
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    x = x.to(dtype)
    x[1, 5] = float("nan")
    x[2, 17] = float("inf")
    x[3, 40] = float("-inf")
    x[4, 60:64] = torch.tensor([0.0, -0.0, float("nan"), -1.0]).to(dtype)
    x3 = (torch.randn(3, 5, k, generator=gen) * torch.tensor([1.0, 1e-3, 30.0]).view(3, 1, 1)).to(dtype)
    return x, x3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", NVFP4)
def test_nvfp4_kernel_versions_agree_bitwise(fmt, dtype, monkeypatch):
    """v2 (nvfp4_qdq16) and v2x (its lane-exchange layout) give the old kernel's (v1) bits for
    every mode -- 1 y, 2 codes + scales, 3 both, 4 clipped-STE dx -- on the same inputs,
    including NaN / Inf elements and amax values the emulator refuses (0, subnormal, NaN)."""
    x, x3 = _version_inputs(dtype)
    finite = float(x.float().nan_to_num(0.0, 0.0, 0.0).abs().max())
    rows = x.shape[0]
    cases = [("scalar amax", x, torch.tensor(finite)),
             ("amax 0 (guard)", x, torch.tensor(0.0)),
             ("subnormal amax (guard)", x, torch.tensor(1e-40)),
             ("amax just above the guard", x, torch.tensor(2688.0 * 2.0 ** -126 * 1.5)),
             ("clipping amax", x, torch.tensor(finite * 0.01)),
             ("per-row amax with a NaN and a 0", x,
              torch.cat([torch.tensor([float("nan"), 0.0]), torch.rand(rows - 2) * 3.0])),
             ("per-expert amax", x3, x3.float().abs().amax(dim=(1, 2))),
             ("per-expert-row amax", x3, x3.float().abs().amax(dim=2))]
    for what, xx, amax in cases:
        xd, ad = xx.to(DEV), amax.to(device=DEV, dtype=torch.float32)
        g = torch.randn(xx.shape, generator=torch.Generator().manual_seed(41)).to(dtype).to(DEV)
        # blocks with finite inputs and a finite group amax: the kernel writes no NaN there, so
        # a NaN (the poison) in y means an element no kernel wrote
        blocks_ok = torch.isfinite(xx.float()).reshape(*xx.shape[:-1], -1, 16).all(-1)
        a_ok = torch.isfinite(amax).reshape(*amax.shape, *([1] * (xx.ndim - amax.ndim)))
        ok = (blocks_ok & a_ok).repeat_interleave(16, dim=-1)
        for mode in (1, 2, 3, 4):
            outs = {}
            for ver in VERSIONS:
                monkeypatch.setenv("QF_NVFP4_KERNEL", ver)
                y, codes, scales = K._launch_fp4(xd, fmt, ad, mode, g=g if mode == 4 else None)
                torch.cuda.synchronize()
                outs[ver] = (y, codes, scales)
                label = f"{fmt} {dtype} {what} mode {mode} {ver}"
                if y is not None:
                    assert not torch.isnan(y.float().cpu()[ok]).any(), f"{label}: an element of y was not written"
                if scales is not None:
                    assert not (scales == 0xFF).any(), f"{label}: a scale byte was not written"
            y1, c1, s1 = outs["v1"]
            for ver in [v for v in VERSIONS if v != "v1"]:
                y2, c2, s2 = outs[ver]
                label = f"{fmt} {dtype} {what} mode {mode}: {ver} vs v1"
                if mode & 5:
                    _assert_bits(y2, y1, 16, label + (" (dx)" if mode == 4 else " (y)"))
                else:
                    assert y1 is None and y2 is None
                if mode & 2:
                    _assert_bits(c2, c1, 8, label + " (codes)")
                    _assert_bits(s2, s1, 1, label + " (scales)")


# ----------------------------------------------------------------------------- quantize-only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt,kver", _with_versions(FP4 + GGML))
def test_quantize_bytes_equal_emulator_and_reference(fmt, kver, dtype, use_kernel):
    use_kernel(kver)
    f = get_format(fmt)
    x = _inputs(fmt, dtype, seed=3)
    got = K.quantize_bytes(x.to(DEV), fmt)
    got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
    want = f.to_bytes(f.quantize(x))
    ref = f.quantize_ref(x.float().numpy())
    for name, w in (("numpy reference", ref), ("emulator", want)):
        if not np.array_equal(got, w):
            r, c = np.argwhere(got != w)[0]
            pytest.fail(f"{fmt} {dtype}: kernel bytes differ from the {name} at row {r}, byte {c}: "
                        f"0x{got[r, c]:02X} vs 0x{w[r, c]:02X} ({int((got != w).sum())} bytes differ)")


@pytest.mark.parametrize("fmt", GGML + [f for f in ("mxfp4_ggml",) if f in FP4])
def test_ggml_bytes_equal_libggml(fmt):
    ggml_oracle = pytest.importorskip("ggml_oracle")
    x = _inputs(fmt, torch.float32, seed=4)
    if get_format(fmt).spec.super_block == 256:
        x = x[:, : (x.shape[-1] // 256) * 256]
    got = K.quantize_bytes(x.to(DEV), fmt)
    got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
    want = ggml_oracle.quantize(x.numpy(), fmt.replace("mxfp4_ggml", "mxfp4"))
    assert got.shape == want.shape
    if not np.array_equal(got, want):
        r, c = np.argwhere(got != want)[0]
        pytest.fail(f"{fmt}: kernel bytes differ from libggml ({ggml_oracle.version()}) at row {r}, byte {c}: "
                    f"0x{got[r, c]:02X} vs 0x{want[r, c]:02X}")


@pytest.mark.parametrize("fmt,kver", _with_versions(FP4))
def test_quantize_packed_tensor_fields(fmt, kver, use_kernel):
    use_kernel(kver)
    x = _inputs(fmt, torch.bfloat16, seed=5)
    p = K.quantize(x.to(DEV), fmt)
    e = get_format(fmt).quantize(x)
    assert p.codes.is_cuda and p.scales.is_cuda
    assert torch.equal(p.codes.cpu(), e.codes) and torch.equal(p.scales.cpu(), e.scales)
    if e.global_scale is not None:
        assert p.global_scale.cpu().view(torch.int32).equal(e.global_scale.float().view(torch.int32))


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize("ste", ["identity", "clipped"])
@pytest.mark.parametrize("fmt,kver", _with_versions(FP4))
def test_backward_matches_emulator(fmt, kver, ste, use_kernel):
    use_kernel(kver)
    x = _inputs(fmt, torch.bfloat16, seed=6)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    xc = x.to(DEV).requires_grad_(True)
    K.fake_quantize(xc, fmt, ste=ste).backward(g.to(DEV))
    xe = x.clone().requires_grad_(True)
    get_format(fmt).fake_quantize(xe, ste=ste).backward(g)
    _assert_bits(xc.grad, xe.grad, get_format(fmt).spec.block_size, f"{fmt} {ste} STE gradient")


@pytest.mark.parametrize("fmt", GGML)
def test_ggml_identity_backward(fmt):
    x = _inputs(fmt, torch.float32, seed=8).to(DEV).requires_grad_(True)
    g = torch.randn_like(x)
    K.fake_quantize(x, fmt).backward(g)
    assert torch.equal(x.grad, g)


def test_lsq_kernel_equals_torch_rule():
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(32, 256, generator=gen) * 0.1).to(torch.bfloat16)
    s = (torch.rand(32, 16, generator=gen) * 0.02 + 0.005)
    g = torch.randn(32, 256, generator=gen).to(torch.bfloat16)
    xc, sc = x.to(DEV).requires_grad_(True), s.to(DEV).requires_grad_(True)
    y = K.lsq_fake_quantize(xc, sc, 16, grad_scale=0.5)
    y.backward(g.to(DEV))
    xr, sr = x.clone().requires_grad_(True), s.clone().requires_grad_(True)
    yr = K._LSQTorch.apply(xr, sr, 16, 0.5)
    yr.backward(g)
    _assert_bits(y, yr, 16, "LSQ forward")
    _assert_bits(xc.grad, xr.grad, 16, "LSQ dx")
    # ds is a per-block sum whose order differs (shuffle tree vs torch.sum): close, not bitwise
    torch.testing.assert_close(sc.grad.cpu(), sr.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- NaN / Inf
@pytest.mark.parametrize("fmt,kver", _with_versions([f for f in ("mxfp4", "mxfp4_rceil", "mxfp4_even", "nvfp4")
                                                      if f in FP4]))
def test_nan_block_is_poisoned_not_spread(fmt, kver, use_kernel):
    """The emulators refuse NaN (no engine defines the result); the kernel does not sync to
    check, so it must at least keep the damage inside the block: that block NaN (scale byte
    0xFF / 0x7F), the other blocks as the emulator computes them on the clean tensor."""
    use_kernel(kver)
    block = get_format(fmt).spec.block_size
    x = _inputs(fmt, torch.float32, seed=10)[:8]
    amax = torch.tensor(float(x.abs().max()))
    kw = {"amax": amax} if fmt == "nvfp4" else {}
    clean = get_format(fmt).fake_quantize(x, **kw)
    xn = x.clone()
    xn[2, 3] = float("nan")
    got = K.fake_quantize(xn.to(DEV), fmt, **{k: v.to(DEV) for k, v in kw.items()}).cpu()
    assert torch.isnan(got[2, :block]).all()
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[2, :block] = False
    _assert_bits(got[keep].reshape(1, -1), clean[keep].reshape(1, -1), block, f"{fmt} blocks next to a NaN")


# ----------------------------------------------------------------------------- compile / graphs
@pytest.mark.parametrize("fmt,kver", _with_versions([f for f in ("nvfp4", "mxfp4", "q4_k") if f in FP4 + GGML]))
def test_torch_compile_and_cuda_graph(fmt, kver, use_kernel):
    use_kernel(kver)
    x = _inputs(fmt, torch.bfloat16, seed=11).to(DEV)
    eager = K.fake_quantize(x, fmt)

    def fn(t):
        return K.fake_quantize(t, fmt) * 1.0

    comp = torch.compile(fn, fullgraph=False)(x)
    _assert_bits(comp, eager, 16, f"{fmt} torch.compile vs eager")
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(static_x)   # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    _assert_bits(out, K.fake_quantize(x * 2, fmt), 16, f"{fmt} CUDA graph replay")


# ----------------------------------------------------------------------------- emulator on CUDA
@pytest.mark.parametrize("fmt", FP4 + GGML)
def test_emulator_on_cuda_equals_cpu(fmt):
    """Not a kernel test: the torch emulator run on CUDA must give the CPU bits too (torch's
    CUDA kernels divide by a Python scalar through a reciprocal, for instance)."""
    x = _inputs(fmt, torch.bfloat16, seed=12)
    f = get_format(fmt)
    _assert_bits(f.fake_quantize(x.to(DEV)), f.fake_quantize(x), f.spec.block_size, f"{fmt} emulator CUDA vs CPU")
