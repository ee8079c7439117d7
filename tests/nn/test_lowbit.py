"""Learnable ParetoQ scales (nn/lowbit.py): forward and gradients equal ParetoQ's released quantizer
(torchao 0.18's copy, the oracle); the learned alpha lives on the engine's fp16 grid, so prepare ->
convert agree with atol=0; calibration, strategies and save/load."""
import warnings

import pytest
import torch
from torch import nn

from qatfactory.formats import get_format
from qatfactory.formats.intgrid import C23
from qatfactory.nn.lowbit import LowBitQuantizer, grad_scale
from qatfactory.quantize import QuantConfig, calibrate, convert, load_student, prepare, save_student

FAMILIES = ["int4_lsq", "int3_lsq", "int2_lsq", "int2_seq", "ternary_seq", "binary_sign", "int4_lsq_g32"]


def _U():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.paretoq.models import utils_quant as U
    return U


def _released(fmt, w, alpha):
    U = _U()
    if fmt.family == "seq2":
        return U.StretchedElasticQuant.apply(w, alpha, 2, False)
    if fmt.family == "ternary":
        return U.StretchedElasticQuant.apply(w, alpha, 0, False)
    bits = 1 if fmt.family == "sign" else {7: 4, 3: 3, 1: 2}[fmt.qp]
    return U.LsqBinaryTernaryExtension.apply(w, alpha, bits, False)


def _case(name, seed=0, rows=16):
    fmt = get_format(name)
    k = 512 if fmt.spec.super_block == 256 else 128
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.04
    q = LowBitQuantizer(name, "learnable", (1, rows, k))
    q.init_state(w.unsqueeze(0), "max")
    with torch.no_grad():               # move alpha off its init and off the grid: the STE rounding is exercised
        q.alpha.mul_(0.6 + 0.5 * torch.rand(q.alpha.shape, generator=g))
    return fmt, q, w, torch.randn(rows, k, generator=g)


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_and_gradients_equal_paretoq_released(name):
    fmt, q, w, gy = _case(name)
    wp = w.clone().requires_grad_(True)
    y = q(wp.unsqueeze(0))[0]
    (y * gy).sum().backward()
    # the oracle runs on the alpha our forward used (rounded onto the fp16 grid); per group = per row of
    # the [rows * groups, group] view, which keeps ParetoQ's N = numel of the whole matrix
    n = fmt.group or w.shape[-1]
    a = fmt.alpha_of_d(fmt.d_of_alpha(q.alpha.detach()))[0].reshape(-1, 1).clone().requires_grad_(True)
    wr = w.reshape(-1, n).clone().requires_grad_(True)
    yr = _released(fmt, wr, a)
    (yr * gy.reshape(-1, n)).sum().backward()
    assert torch.equal(y, yr.reshape(w.shape)), f"{name}: forward differs from ParetoQ's"
    assert torch.equal(wp.grad, wr.grad.reshape(w.shape)), f"{name}: weight gradient (clipped STE) differs"
    assert torch.equal(q.alpha.grad[0].reshape(-1, 1), a.grad), f"{name}: alpha gradient differs from ParetoQ's"
    assert q.alpha.grad.abs().sum() > 0


def test_clean_ternary_gradient_differs_only_in_the_clipped_region():
    fmt, q, w, gy = _case("ternary_seq", seed=1)
    grads = {}
    for rule in ("released", "clean"):
        q.grad_rule = rule
        q.alpha.grad = None
        (q(w.unsqueeze(0))[0] * gy).sum().backward()
        grads[rule] = q.alpha.grad.clone()[0, :, 0]
    a = fmt.alpha_of_d(fmt.d_of_alpha(q.alpha.detach()))[0]
    x = w / a
    out = ((x > 0.99).float() - (x < -0.99).float()) * gy
    gs = grad_scale(fmt, w.numel())
    # released: +-1 outside the clip; clean: +-2/3 (ParetoQ's ternary output level there)
    want = (out * (float(C23) - 1.0) * gs).sum(-1)
    assert torch.allclose(grads["clean"] - grads["released"], want, atol=1e-9)
    assert (want != 0).any()


def test_alpha_rounding_is_straight_through():
    fmt, q, w, gy = _case("int2_seq", seed=2)
    with torch.no_grad():
        q.alpha.add_(1e-7)                   # below the fp16 spacing: same d, same forward
    d0 = fmt.d_of_alpha(q.alpha.detach())
    y0 = q(w.unsqueeze(0))
    with torch.no_grad():
        q.alpha.add_(1e-7)
    assert torch.equal(fmt.d_of_alpha(q.alpha.detach()), d0) and torch.equal(q(w.unsqueeze(0)), y0)
    assert torch.equal(q.scale_bytes(), d0)


@pytest.mark.parametrize("name", ["int4_lsq", "int3_lsq", "int2_seq", "int2_lsq", "ternary_seq"])
def test_mse_calibration_beats_paretoq_init(name):
    """ParetoQ's max-based inits are far from MSE-optimal below 4 bits (shared/reference/paretoq.md 1.7)."""
    w = torch.randn(32, 512) * 0.03
    errs = {}
    for method in ("max", "mse"):
        q = LowBitQuantizer(name, "frozen", (1, 32, 512))
        q.init_state(w.unsqueeze(0), method)
        errs[method] = float(((q(w.unsqueeze(0))[0] - w) ** 2).sum())
    assert errs["mse"] < errs["max"] * (0.9 if name != "int4_lsq" else 0.99), errs
    q = LowBitQuantizer("binary_sign", "frozen", (1, 32, 512))
    q.init_state(w.unsqueeze(0), "mse")          # mean|W| is already the MSE optimum for sign
    assert torch.allclose(q.scales.float()[0, :, 0], w.abs().mean(-1), rtol=2 ** -10)
    with pytest.raises(ValueError, match="four_over_six"):
        q.init_state(w.unsqueeze(0), "four_over_six")


def test_frozen_and_dynamic_use_the_format_with_paretoq_clipped_ste():
    w = (torch.randn(8, 256) * 0.05).requires_grad_(True)
    fmt = get_format("int2_seq")
    for strategy in ("frozen", "dynamic"):
        q = LowBitQuantizer("int2_seq", strategy, (1, 8, 256))
        q.init_state(w.detach().unsqueeze(0), "max")
        y = q(w.unsqueeze(0))[0]
        p = fmt.quantize(w.detach(), **({} if strategy == "dynamic" else {"scales": q.scales[0]}))
        assert torch.equal(y, fmt.dequantize(p))
        w.grad = None
        y.sum().backward()
        assert torch.equal(w.grad, fmt.clip_mask(w.detach(), p).float())
    with pytest.raises(ValueError, match="produces fixed scales"):
        LowBitQuantizer("int2_seq", "dynamic", (1, 8, 256)).init_state(w.detach().unsqueeze(0), "mse")


def _tiny(seed=0, hidden=256, inter=512):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=inter,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True, initializer_range=0.05))


@pytest.mark.parametrize("fmt,strategy", [("int2_seq", "learnable"), ("ternary_seq_tq1", "learnable"),
                                          ("int4_lsq_g128", "frozen"), ("binary_sign", "dynamic")])
def test_prepare_then_convert_agree_exactly(fmt, strategy, tmp_path):
    model = _tiny()
    prepare(model, QuantConfig(weight_format=fmt, scale_strategy=strategy, calib_method="max"))
    if strategy == "learnable":           # one step so that alpha and W are no longer their init
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, 300, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    cm = convert(model)
    ql = model.model.layers[0].mlp.down_proj
    p = cm.packed["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(get_format(p.format).dequantize(p), ql.quantized_weight().detach())
    # the whole model rebuilt from the converted tensors gives the student's logits, bit for bit
    from transformers import LlamaForCausalLM
    ref = LlamaForCausalLM(model.config)
    sd = dict(cm.dense)
    sd.update({k: get_format(v.format).dequantize(v) for k, v in cm.packed.items()})
    ref.load_state_dict(sd, strict=False)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, model(input_ids=ids).logits)
    save_student(model, str(tmp_path / "s"))
    back = load_student(str(tmp_path / "s"))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)
    if strategy == "learnable":
        assert torch.equal(back.model.layers[0].mlp.down_proj.weight_quant.alpha, ql.weight_quant.alpha)


def test_quant_config_grad_rule_and_calibrate_errors():
    with pytest.raises(ValueError, match="lowbit_grad='x'; allowed"):
        QuantConfig(weight_format="int2_seq", lowbit_grad="x")
    model = _tiny()
    prepare(model, QuantConfig(weight_format="ternary_seq", scale_strategy="learnable", lowbit_grad="clean"))
    qs = [m for m in model.modules() if isinstance(m, LowBitQuantizer)]
    assert qs and all(q.grad_rule == "clean" for q in qs)
    with pytest.raises(ValueError, match="four_over_six"):
        calibrate(model, method="four_over_six")
    calibrate(model, method="mse")
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight_quant.alpha, nn.Parameter)
