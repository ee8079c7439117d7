"""The low-bit grids (formats/intgrid.py) against code that is not ours:

* ParetoQ's own quantizer as released (torchao 0.18 ``prototype/paretoq/models/utils_quant.py``, a copy
  of facebookresearch/ParetoQ): its forward on our alpha equals our fake-quant weights, ties and quirks
  included (sign of zero aside: ParetoQ's round can give -0.0 where our integer code gives +0.0);
* the engine's decoders: gguf-py ``gguf.quants.dequantize`` and libggml's C ``dequantize_row_*`` read
  our bytes as exactly the student's values, for every registered grid and layout;
* libggml's and gguf-py's own TQ1_0 / TQ2_0 encoders produce our bytes on the student's weights.
"""
import numpy as np
import pytest
import torch

import ggml_oracle as G
from qatfactory.formats import get_format, list_formats
from qatfactory.formats.intgrid import C23, EPS, IntGrid

GRIDS = [n for n in list_formats() if isinstance(get_format(n), IntGrid)]
GGUF_T = {"q4_0": "Q4_0", "q3_k": "Q3_K", "q2_k": "Q2_K", "tq2_0": "TQ2_0", "tq1_0": "TQ1_0"}


def _paretoq():
    with _quiet():
        from torchao.prototype.paretoq.models import utils_quant as U
    return U


class _quiet:
    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *a):
        return self._w.__exit__(*a)


def paretoq_forward(fmt: IntGrid, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """ParetoQ's QuantizeLinear weight path for this grid: w [R, n], alpha [R, 1]."""
    U = _paretoq()
    if fmt.family == "seq2":
        return U.StretchedElasticQuant.apply(w, alpha, 2, False)
    if fmt.family == "ternary":
        return U.StretchedElasticQuant.apply(w, alpha, 0, False)
    bits = 1 if fmt.family == "sign" else {7: 4, 3: 3, 1: 2}[fmt.qp]
    return U.LsqBinaryTernaryExtension.apply(w, alpha, bits, False)


def _weights(fmt, rows=12, seed=0):
    k = 512 if fmt.spec.super_block == 256 else 256
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.03
    w[1] = torch.distributions.StudentT(2.0).sample((k,)) * 0.01
    w[2, ::3] = 0.0
    w[3] = w[3].abs()
    return w


def _rowwise(fmt, w, d):
    """(w, alpha) reshaped so that one row = one scale group, for ParetoQ's per-row quantizer."""
    n = fmt.group or w.shape[-1]
    return w.reshape(-1, n), fmt.alpha_of_d(d).reshape(-1, 1)


@pytest.mark.parametrize("name", GRIDS)
def test_forward_equals_paretoq_released_quantizer(name):
    fmt = get_format(name)
    w = _weights(fmt)
    for d in (None, fmt.d_of_alpha(torch.rand(w.shape[0], fmt.n_groups(w.shape[-1])) * 0.02 + 1e-4)):
        p = fmt.quantize(w, scales=d)
        ours = fmt.dequantize(p)
        wr, a = _rowwise(fmt, w, p.scales)
        ref = paretoq_forward(fmt, wr, a).reshape(w.shape)
        assert torch.equal(ours, ref), f"{name}: {int((ours != ref).sum())} weights differ from ParetoQ's forward"


@pytest.mark.parametrize("name", ["int4_lsq", "int3_lsq", "int2_lsq", "int2_seq", "ternary_seq", "binary_sign"])
def test_ties_and_quirks_match_paretoq(name):
    """x = W / alpha on every decision boundary of the grid (and next to it), plus the clip region."""
    fmt = get_format(name)
    d = torch.tensor([[0.0625]], dtype=torch.float16)          # a power of two: x = W / alpha exactly
    alpha = float(fmt.alpha_of_d(d))
    xs = [0.0, -0.0, 1e-9, -1e-9, 0.5, -0.5, 1 / 3, -1 / 3, 0.99, -0.99, 0.995, -0.995, 1.0, -1.0, 1.25, -1.25,
          2.5, -2.5, 3.5, -3.5, 6.5, -7.5, 7.5, -8.5, 9.0, -9.0]
    xs += [v + s for v in (0.5, 1.5, -0.5, -1.5) for s in (1e-7, -1e-7)]
    k = max(64, fmt.spec.super_block)
    x = torch.tensor(xs, dtype=torch.float32)
    w = torch.zeros(1, k)
    w[0, :len(xs)] = x * alpha
    p = fmt.quantize(w, scales=d)
    ours = fmt.dequantize(p)
    ref = paretoq_forward(fmt, w, torch.tensor([[alpha]]))
    assert torch.equal(ours, ref), [(xs[i], float(ours[0, i]), float(ref[0, i]))
                                    for i in range(len(xs)) if ours[0, i] != ref[0, i]]
    code = p.codes[0, :len(xs)].tolist()
    at = dict(zip(xs, code))
    if fmt.family == "seq2":
        # codes are levels in units of alpha/4: the documented asymmetry of half-to-even ties (x = 0 and
        # +1/2 -> +1/4, -1/2 -> -3/4, tiny negatives -> +1/4) and the clip at 0.99 (the paper's literal
        # formula would put |x| = 1 on an extra level 5/4)
        assert at[0.0] == 1 and at[0.5] == 1 and at[-0.5] == -3 and at[-1e-9] == 1 and at[1e-9] == 1
        assert at[1.0] == 3 and at[-1.0] == -3 and set(code) == {-3, -1, 1, 3}
    if fmt.family == "ternary":
        assert set(code) == {-1, 0, 1}
        assert at[1 / 3] == 0 and at[-1 / 3] == 0             # 1.5 * fl(1/3) rounds to 0.5: ties to 0
        assert at[1.0] == 1 and at[-2.5] == -1
        assert float(ours[0, xs.index(1.0)]) == float(torch.tensor(float(C23)) * alpha)   # ParetoQ's 2/3 level
    if fmt.family == "lsq":
        assert at[0.5] == 0 and at[-0.5] == 0 and at[2.5] == min(2, fmt.qp) and at[-2.5] == max(-2, fmt.qn)
        assert max(code) == fmt.qp and min(code) == fmt.qn
    if fmt.family == "sign":
        assert at[0.0] == 0 and at[1e-9] == 1 and at[-1e-9] == -1 and set(code) == {-1, 0, 1}


@pytest.mark.parametrize("name", GRIDS)
def test_gguf_bytes_decode_to_the_student_weights(name):
    import gguf
    fmt = get_format(name)
    w = _weights(fmt, seed=3)
    p = fmt.quantize(w)
    want = fmt.dequantize(p).numpy()
    raw = fmt.to_bytes(p)
    t = gguf.GGMLQuantizationType[GGUF_T[fmt.layout]]
    assert int(t) == fmt.spec.ggml_type
    assert raw.shape == (w.shape[0], w.shape[1] // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1])
    got = gguf.quants.dequantize(raw, t).reshape(w.shape)
    assert np.array_equal(got, want), f"{name}: gguf-py decodes {int((got != want).sum())} weights differently"
    c = G.dequantize(raw, fmt.layout, w.shape[1])
    assert np.array_equal(c, want), f"{name}: libggml decodes {int((c != want).sum())} weights differently"
    q = fmt.from_bytes(raw, w.shape[1])
    assert torch.equal(q.codes, p.codes) and torch.equal(q.scales, p.scales)


@pytest.mark.parametrize("name", [n for n in GRIDS if get_format(n).layout in ("tq1_0", "tq2_0")])
def test_tq_bytes_equal_the_engines_own_encoder(name):
    """ggml's quantize_row_tq*_ref (and gguf-py's quantize) take d = amax of each 256-block and round
    x / d: on the student's weights (values 0, +-d) they must write exactly our bytes."""
    import gguf
    fmt = get_format(name)
    w = _weights(fmt, seed=4)
    p = fmt.quantize(w)
    y = fmt.dequantize(p).numpy().reshape(-1, 256)
    ours = fmt.to_bytes(p).reshape(y.shape[0], -1)
    live = np.abs(y).max(-1) > 0          # an all-zero block gets d = 0 from ggml (we keep the row's d)
    assert live.sum() >= y.shape[0] - 2
    ref = np.stack([G.quantize_row_ref(y[i], fmt.layout) for i in range(y.shape[0])])
    assert np.array_equal(ref[live], ours[live])
    gq = gguf.quants.quantize(y, gguf.GGMLQuantizationType[GGUF_T[fmt.layout]])
    assert np.array_equal(gq[live], ours[live])


@pytest.mark.parametrize("name", GRIDS)
def test_training_values_equal_dequantize_of_quantize_bit_for_bit(name):
    """fake_values (the training forward: float codes, no int8 round trip, no scale checks) gives the bits
    of dequantize(quantize(x, scales=d)), signed zeros included (a zero code is +0 there), on random rows,
    heavy tails, exact zeros, and every tie / clip edge of the grid with its tiny negative neighbours."""
    fmt = get_format(name)
    w = _weights(fmt)
    k = w.shape[-1]
    d = torch.tensor([[0.0625]], dtype=torch.float16).expand(1, fmt.n_groups(k))
    alpha = float(fmt.alpha_of_d(d)[0, 0])
    xs = [0.0, -0.0, 1e-9, -1e-9, -1e-30, 0.5, -0.5, -0.49, 1 / 3, -1 / 3, -0.3, 0.99, -0.99, 0.995, -0.995,
          1.0, -1.0, 1.25, -1.25, 2.5, -2.5, 3.5, -3.5, 6.5, -7.5, 7.5, -8.5, 9.0, -9.0]
    edge = torch.zeros(1, k)
    edge[0, :len(xs)] = torch.tensor(xs) * alpha
    for x, dd in ((w, None), (w, fmt.d_of_alpha(torch.rand(w.shape[0], fmt.n_groups(k)) * 0.02 + 1e-4)),
                  (edge, d)):
        p = fmt.quantize(x, scales=dd)
        ref = fmt.dequantize(p)
        xg = fmt._grouped(x, k)
        got = fmt.fake_values(xg, fmt.alpha_of_d(p.scales), p.scales).reshape(x.shape)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), \
            f"{name}: {int((got.view(torch.int32) != ref.view(torch.int32)).sum())} values differ in their bits"


def test_ternary_scale_grid_is_reachable_for_every_fp16():
    """ParetoQ's ternary weight is fl(fl(1/1.5) * alpha): for every positive finite fp16 d the alpha we use,
    fl(d / C), gives back exactly d, so TQ's d * q equals ParetoQ's value."""
    fmt = get_format("ternary_seq")
    d = torch.arange(1, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    a = fmt.alpha_of_d(d)
    assert torch.equal(torch.tensor(float(C23)) * a, d.float())
    dn = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)
    assert np.array_equal(fmt.alpha_of_d_np(dn), a.numpy())


@pytest.mark.parametrize("name", ["int4_lsq", "int2_seq", "ternary_seq", "binary_sign"])
def test_alpha_rounding_floor_and_range(name):
    fmt = get_format(name)
    a = torch.tensor([0.0, -1.0, float("nan"), 1e-7, float(EPS), 1e-5 * 1.001, 0.0123, 3e5, float("inf")])
    d = fmt.d_of_alpha(a)
    assert d.dtype == torch.float16 and bool(torch.isfinite(d).all())
    alpha = fmt.alpha_of_d(d)
    assert bool((alpha > float(EPS)).all()), "ParetoQ replaces alpha <= 1e-5 by 1e-5: the grid must stay above"
    assert np.array_equal(fmt.d_of_alpha_np(a.numpy()).view(np.uint16), d.numpy().view(np.uint16))
    assert float(alpha[6]) == pytest.approx(0.0123, rel=2 ** -10)
    # the rounding is to nearest on the grid: no other fp16 d gives an alpha closer to the request
    t = torch.tensor([0.0123])
    dd = fmt.d_of_alpha(t)
    for step in (-1, 1):
        nb = (dd.view(torch.int16) + step).view(torch.float16)
        assert (fmt.alpha_of_d(nb) - t).abs() >= (fmt.alpha_of_d(dd) - t).abs()


def test_init_rules_are_paretoq_s():
    """ParetoQ's train.py: mean|W| (1 bit), max|W| (SEQ), max|W| / (2^(b-1) - 1) (LSQ)."""
    w = torch.randn(6, 256) * 0.05
    amax, mean = w.abs().amax(-1), w.abs().mean(-1)
    for name, want in (("int4_lsq", amax / 7), ("int3_lsq", amax / 3), ("int2_seq", amax), ("ternary_seq", amax),
                       ("binary_sign", mean)):
        fmt = get_format(name)
        got = fmt.alpha_of_d(fmt.quantize(w).scales)[:, 0]
        assert torch.allclose(got, want, rtol=2 ** -10), name


def test_per_group_scales():
    fmt = get_format("int4_lsq_g128")
    w = torch.randn(4, 512) * 0.02
    w[:, 128:256] *= 10
    p = fmt.quantize(w)
    assert p.scales.shape == (4, 4)
    assert (p.scales[:, 1].float() > 5 * p.scales[:, 0].float()).all()
    with pytest.raises(ValueError, match="multiple of the scale group 128"):
        fmt.quantize(torch.randn(2, 96))


def test_from_bytes_refuses_blocks_the_grid_does_not_write():
    import gguf
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    # a general Q3_K tensor (llama-quantize's output) has per-16 scales: not a per-row int3_lsq tensor
    q3 = G.quantize(x, "q3_k")
    with pytest.raises(ValueError, match="sub-block scales other than 1"):
        get_format("int3_lsq").from_bytes(q3, 256)
    with pytest.raises(ValueError, match="not of this grid"):
        get_format("int2_seq").from_bytes(G.quantize(x, "q2_k"), 256)
    # per-row formats: every block of a row must carry the row's one scale
    q4 = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="different scales"):
        get_format("int4_lsq").from_bytes(q4, 256)
    assert get_format("int4_lsq_g32").from_bytes(q4, 256).scales.shape == (2, 8)
    # TQ2_0 code 3 decodes to 2d, outside the ternary grid
    t = get_format("ternary_seq")
    raw = t.to_bytes(t.quantize(torch.from_numpy(x)))
    raw[0, 0] |= 3
    with pytest.raises(ValueError, match="code 3"):
        t.from_bytes(raw, 256)


def test_bad_scales_and_inputs_are_refused():
    fmt = get_format("int2_seq")
    w = torch.randn(2, 256)
    with pytest.raises(ValueError, match="shape"):
        fmt.quantize(w, scales=torch.ones(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="not fp16"):
        fmt.quantize(w, scales=torch.full((2, 1), 0.1000001))
    with pytest.raises(ValueError, match="floor"):
        fmt.quantize(w, scales=torch.zeros(2, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="NaN"):
        fmt.quantize(torch.full((2, 256), float("nan")))
    with pytest.raises(ValueError, match="int2_seq_q4_0"):
        fmt.quantize(torch.randn(2, 576))                  # SmolLM2's hidden size: the fallback is named
    assert get_format("int2_seq_q4_0").quantize(torch.randn(2, 576)).shape == (2, 576)
