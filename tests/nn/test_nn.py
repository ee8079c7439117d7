"""Unit tests of qatfactory.nn (quantizers, LSQ, QuantExperts) and formats.policy."""
import numpy as np
import pytest
import torch

from qatfactory.formats import get_format
from qatfactory.formats.policy import ggml_policy, tensor_role, use_more_bits
from qatfactory.nn import ActQuantizer, QuantExperts, WeightQuantizer, decode_grid, encode_grid
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with


# ----------------------------------------------------------------------------- policy
def test_use_more_bits_matches_llama_cpp_integer_rule():
    # i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, C integer division
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(2) if use_more_bits(i, 2)] == [1]
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]


@pytest.mark.parametrize("name,shape,n_exp,want", [
    ("model.layers.1.self_attn.v_proj.weight", (256, 1024), 0, "q4_k"),
    ("model.layers.3.self_attn.v_proj.weight", (256, 1024), 0, "q6_k"),
    ("model.layers.3.self_attn.k_proj.weight", (256, 1024), 0, "q4_k"),
    ("model.layers.3.self_attn.k_proj.weight", (256, 1024), 8, "q8_0"),
    ("model.layers.1.self_attn.v_proj.weight", (256, 1024), 8, "q8_0"),
    ("model.layers.1.self_attn.o_proj.weight", (1024, 1024), 8, "q5_k"),
    ("model.layers.6.mlp.down_proj.weight", (1024, 2816), 0, "q6_k"),     # 2816 = 11 * 256
    ("model.layers.2.mlp.down_proj.weight", (1024, 2816), 0, "q4_k"),
    ("model.layers.7.mlp.experts.5.down_proj.weight", (1024, 512), 4, "q6_k"),
    ("model.layers.7.block_sparse_moe.experts.0.w2.weight", (1024, 512), 4, "q6_k"),
    ("model.layers.7.block_sparse_moe.experts.0.w1.weight", (512, 1024), 4, "q4_k"),
    ("model.layers.0.mlp.gate_proj.weight", (4864, 896), 0, "q5_0"),      # Qwen2.5-0.5B: 896 % 256 != 0
    ("model.layers.0.mlp.down_proj.weight", (896, 4864), 0, "q6_k"),
    ("model.layers.1.mlp.down_proj.weight", (896, 4864), 0, "q4_k"),
    ("model.layers.0.self_attn.v_proj.weight", (128, 896), 0, "q8_0"),    # q6_k -> q8_0 fallback
    ("model.layers.1.mlp.up_proj.weight", (64, 48), 0, "f16"),            # not even % 32
    ("lm_head.weight", (151936, 1024), 0, "q6_k"),
    ("lm_head.weight", (151936, 896), 0, "q8_0"),
    ("model.layers.0.self_attn.qkv_proj.weight", (3072, 1024), 0, "q5_k"),
    ("model.embed_tokens.weight", (151936, 1024), 0, "q4_k"),     # untied: the base type
    ("model.embed_tokens.weight", (49152, 576), 0, "q5_0"),       # untied, 576 % 256: q4_k's fallback
    ("model.layers.0.mlp.gate.weight", (64, 1024), 64, None),
    ("model.layers.0.input_layernorm.weight", (1024,), 0, None),
])
def test_ggml_policy_q4_k_m(name, shape, n_exp, want):
    assert ggml_policy(name, shape, n_layers=8, n_experts=n_exp) == want


@pytest.mark.parametrize("shape,want", [((49152, 576), "q8_0"), ((151936, 1024), "q6_k"), ((100, 48), "f16")])
def test_ggml_policy_tied_token_embd_takes_the_output_type(shape, want):
    # llama-quantize: no output.weight in the file -> token_embd gets the output tensor's rule
    assert ggml_policy("model.embed_tokens.weight", shape, n_layers=30, tied=True) == want
    assert ggml_policy("lm_head.weight", shape, n_layers=30) == want


def test_policy_roles_and_errors():
    assert tensor_role("model.layers.0.mlp.experts.gate_up_proj") == "ffn_gate"
    assert tensor_role("model.layers.0.mlp.experts.down_proj") == "ffn_down"
    with pytest.raises(ValueError, match="base='q3_k'.*allowed.*q4_k"):
        ggml_policy("lm_head.weight", (8, 256), 2, base="q3_k")


# ----------------------------------------------------------------------------- scale grids
def test_encode_grid_e4m3_matches_ml_dtypes_and_never_emits_zero():
    s = torch.cat([torch.rand(4096) * 500, torch.tensor([0.0, 1e-9, 2.0 ** -9, 448.0, 1e6])])
    got = encode_grid(s, "e4m3").numpy()
    want = np.clip(s.numpy(), 2 ** -9, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    assert got.min() >= 1
    np.testing.assert_array_equal(decode_grid(torch.from_numpy(got), "e4m3").numpy(),
                                  want.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_encode_grid_e8m0_is_the_nearest_power_of_two_in_log2():
    s = torch.tensor([1.0, 1.4, 1.5, 3.0, 0.3, 2.0 ** -130, 2.0 ** 120])
    got = encode_grid(s, "e8m0").tolist()
    assert got == [127, 127, 128, 129, 125, 0, 247]
    assert decode_grid(torch.tensor([127, 130], dtype=torch.uint8), "e8m0").tolist() == [1.0, 8.0]


# ----------------------------------------------------------------------------- quantizers
def test_lsq_gradients_follow_the_lsq_rule():
    torch.manual_seed(0)
    w = (torch.randn(1, 4, 32) * 0.1).requires_grad_(True)
    q = WeightQuantizer("nvfp4", "learnable", (1, 4, 32))
    amax = w.detach().abs().amax().reshape(1)
    q.set_state(amax, get_format("nvfp4").quantize(w.detach(), amax=amax).scales.reshape(1, 4, 2))
    with torch.no_grad():
        q.scale.mul_(0.5)      # half-size steps: the block maxima saturate at 6 now
    y = q(w)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    # independent reference: E4M3 via ml_dtypes, E2M1 values from the dequantized output
    g = np.float32(amax.item()) / np.float32(2688)
    s8 = (q.scale.detach().numpy() / g).clip(2 ** -9, 448).astype(ml_dtypes.float8_e4m3fn)
    d = s8.astype(np.float32) * g                                      # [1, 4, 2]
    wb = w.detach().numpy().reshape(1, 4, 2, 16)
    v = wb / d[..., None]
    qv = y.detach().numpy().reshape(1, 4, 2, 16) / d[..., None]
    inside = np.abs(v) <= 6
    assert (~inside).any() and inside.any()
    assert set(np.abs(qv[~inside]).round(6).tolist()) == {6.0}
    np.testing.assert_array_equal(w.grad.numpy().reshape(1, 4, 2, 16), gy.numpy().reshape(1, 4, 2, 16) * inside)
    gb = gy.numpy().reshape(1, 4, 2, 16)
    want = (gb * (qv - np.where(inside, v, 0))).sum(-1) / np.sqrt(16 * 6)
    np.testing.assert_allclose(q.scale.grad.numpy(), want, rtol=1e-5, atol=1e-9)


def test_frozen_quantizer_uses_its_bytes_and_dynamic_follows_amax():
    torch.manual_seed(1)
    w = torch.randn(1, 8, 64)
    fmt = get_format("nvfp4")
    f = WeightQuantizer("nvfp4", "frozen", (1, 8, 64))
    sb = torch.full((1, 8, 4), 0x30, dtype=torch.uint8)
    f.set_state(torch.tensor([2.0]), sb)
    torch.testing.assert_close(f(w), fmt.dequantize(fmt.quantize(w, amax=torch.tensor([2.0]), scales=sb)),
                               atol=0, rtol=0)
    assert torch.equal(f.pack(w, 0, 2, 5).scales, sb[0, 2:5])
    d = WeightQuantizer("nvfp4", "dynamic", (1, 8, 64))
    assert not list(d.buffers())
    torch.testing.assert_close(d(w, torch.tensor([9.0])), fmt.fake_quantize(w, amax=torch.tensor([9.0])),
                               atol=0, rtol=0)


def test_act_quantizer_calibrates_then_quantizes():
    a = ActQuantizer("nvfp4_act")
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="calibrate"):
        a(x)
    a.calibrating = True
    assert a(x) is x and a(2 * x) is not None
    a.calibrating = False
    assert float(a.amax) == float((2 * x).abs().max())
    y = a(x)
    assert y.dtype == x.dtype and torch.equal(y, get_format("nvfp4_act").fake_quantize(x, amax=a.amax))
    m = ActQuantizer("mxfp4_rceil")
    assert not m.static and torch.equal(m(x), get_format("mxfp4_rceil").fake_quantize(x))


def test_quant_experts_shadow_is_removed_and_grads_reach_the_3d_params():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    from qatfactory.nn import make_quant_experts
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    ex = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.05)
        ex.down_proj.normal_(0, 0.05)
    names = [n for n, _ in ex.named_parameters()]
    make_quant_experts(ex)
    ex._qf_setup("mxfp4", "mxfp4", "dynamic", None, None, "identity", "experts")
    assert isinstance(ex, QuantExperts) and isinstance(ex, Qwen3MoeExperts)
    h = torch.randn(5, 64)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]])
    wts = torch.rand(5, 2)
    out = ex(h, idx, wts)
    assert "gate_up_proj" not in ex.__dict__ and isinstance(ex.gate_up_proj, torch.nn.Parameter)
    assert [n for n, _ in ex.named_parameters()] == names
    out.sum().backward()
    assert ex.gate_up_proj.grad is not None and ex.down_proj.grad.abs().sum() > 0
    # the forward used the fake-quantized experts: equal to the plain class on dequantized weights
    ref = Qwen3MoeExperts(cfg)
    fmt = get_format("mxfp4")
    with torch.no_grad():
        ref.gate_up_proj.copy_(fmt.fake_quantize(ex.gate_up_proj))
        ref.down_proj.copy_(fmt.fake_quantize(ex.down_proj))
        torch.testing.assert_close(out, ref(h, idx, wts), atol=0, rtol=0)


def test_w4a4_experts_need_an_implementation_that_exposes_the_down_input():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    from qatfactory.nn.experts import check_supported
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4)
    ex = Qwen3MoeExperts(cfg)
    cfg._experts_implementation = "eager"
    with pytest.raises(ValueError, match="experts_implementation='eager'.*grouped_mm"):
        check_supported(ex, "model.layers.0.mlp.experts", w4a4=True)
    check_supported(ex, "model.layers.0.mlp.experts", w4a4=False)
    ex.is_transposed = True
    with pytest.raises(NotImplementedError, match="is_transposed=True"):
        check_supported(ex, "model.layers.0.mlp.experts", w4a4=False)


def test_group_amax_is_cached_only_inside_the_trainer_epoch():
    """q/k/v share one amax: equal to max|W| over the group; inside step_cache.enabled() it is kept
    until weights_changed() or an in-place write to a member (version counter); a write through
    ``.data`` is not seen until weights_changed(); outside, a weight change shows at once."""
    from qatfactory.nn import step_cache
    from qatfactory.quantize import QuantConfig, prepare
    from tests.quant_helpers import tiny
    model = tiny("llama")
    prepare(model, QuantConfig.preset("nvfp4_w4a16"))
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert len(q._group) == 3
    want = max(float(m.weight.detach().abs().max()) for m in (q, k, v))
    assert float(q.group_amax()) == want and float(v.group_amax()) == want
    with torch.no_grad():
        k.weight[0, 0] = 2 * want
    assert float(q.group_amax()) == 2 * want          # no cache outside the trainer
    with step_cache.enabled():
        a = q.group_amax()
        assert v.group_amax() is a and k.group_amax() is a      # same epoch: one computation per group
        with torch.no_grad():
            k.weight[0, 0] = 4 * want                           # in place: the version counter moves
        assert float(v.group_amax()) == 4 * want
        b = q.group_amax()
        k.weight.data[0, 0] = 8 * want                          # .data has a counter of its own
        assert v.group_amax() is b and float(b) == 4 * want
        step_cache.weights_changed()
        assert float(v.group_amax()) == 8 * want
    with torch.no_grad():
        k.weight[0, 0] = float("nan")
    assert torch.isnan(q.group_amax()).all()        # NaN is not hidden by the reduction


def test_act_quantizer_checks_amax_once_and_again_after_a_load():
    a = ActQuantizer("nvfp4_act")
    x = torch.randn(3, 32)
    a.amax.fill_(1.0)
    a(x)
    assert a._amax_ok
    a.load_state_dict({"amax": torch.tensor(0.0)})
    with pytest.raises(RuntimeError, match="calibrate"):
        a(x)


@pytest.mark.parametrize("wfmt,afmt,ste", [("nvfp4", None, "identity"), ("mxfp4", "mxfp4", "identity"),
                                           ("nvfp4", "nvfp4_act", "identity"), ("mxfp4", None, "clipped"),
                                           ("q4_k", None, "identity")])
def test_quant_linear_backward_recomputes_instead_of_saving_fq_copies(wfmt, afmt, ste):
    """The training path saves x and W only (no fake-quantized copies) and gives the same output and
    gradients as F.linear on the fake-quantized tensors with the quantizers' own STE."""
    from qatfactory.nn import QuantLinear
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, bias=True)
    m = QuantLinear(lin, wfmt, "dynamic", act_format=afmt, ste=ste)
    assert not m.recompute_in_backward()      # auto: only where the CUDA kernels make a recompute cheap
    m.recompute_fq = True
    if afmt == "nvfp4_act":
        m.input_quant.amax.fill_(2.0)
    x = (torch.randn(3, 5, 256) * 1.5).requires_grad_()
    gy = torch.randn(3, 5, 64)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    # nothing weight- or activation-sized is saved except x and W themselves
    big = [t for t in saved if t.numel() > 64]
    assert all(t is x or t is m.weight for t in big), [tuple(t.shape) for t in big]
    gx, gw, gb = torch.autograd.grad(y, [x, m.weight, m.bias], gy)
    x2 = x.detach().requires_grad_()
    y2 = torch.nn.functional.linear(m._quant_input(x2), m.quantized_weight(), m.bias)
    gx2, gw2, gb2 = torch.autograd.grad(y2, [x2, m.weight, m.bias], gy)
    for a, b in ((y, y2), (gx, gx2), (gw, gw2), (gb, gb2)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if ste == "clipped":
        assert (gw == 0).any()       # MX FLOOR saturates some block maxima; the mask reached W's gradient
