"""prepare / calibrate / convert / coverage / save-load on tiny random HF models (CPU).

The central check (DESIGN.md rule 3): the prepared model's logits equal, with atol=0, the logits
of a plain transformers model loaded with from_pretrained from the converted tensors'
dequantization (plus the same activation fake quant for W4A4)."""
import json
import os

import numpy as np
import pytest
import torch

from quant_helpers import DT, ids, rebuild, tiny
from qatfactory.formats import get_format
from qatfactory.nn import QuantExperts, QuantLinear
from qatfactory.quantize import (CoverageError, QuantConfig, ModuleRule, calibrate, convert, coverage,
                                 load_student, prepare, register_zero3_external_params, save_student,
                                 search_scales)
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with


def _logits(m, x):
    m.eval()
    with torch.no_grad():
        return m(input_ids=x).logits


def _train_step(m, x, lr=1e-2):
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    grads = {id(p): p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params}
    opt.step()
    opt.zero_grad()
    return loss.item(), grads


# ----------------------------------------------------------------------------- exactness
EXACT_CASES = [
    # model,      preset,        strategy,    calib,            train first
    ("llama", "nvfp4_w4a16", "dynamic", "max", True),
    ("qwen3_moe", "nvfp4_w4a4", "frozen", "mse", True),
    ("qwen3_moe", "nvfp4_w4a16", "learnable", "four_over_six", True),
    ("mixtral", "mxfp4_w4a16", "learnable", "mse", True),
    ("mixtral", "nvfp4_w4a4", "dynamic", "max", False),
    ("qwen2", "mxfp4_w4a4", "frozen", "four_over_six", False),
    ("qwen3", "q4_k", "dynamic", "max", True),
]


@pytest.mark.parametrize("kind,preset,strategy,method,train", EXACT_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in EXACT_CASES])
def test_prepared_forward_equals_rebuilt_from_converted(tmp_path, kind, preset, strategy, method, train):
    size = dict(hidden=256, inter=96) if preset == "q4_k" else {}
    m = tiny(kind, **size)
    x = ids()
    plain = _logits(m, x)
    prepare(m, QuantConfig.preset(preset, scale_strategy=strategy))
    info = calibrate(m, [ids(seed=3), ids(seed=4)], method)
    assert info["method"] == method
    if train:   # scales / weights move; convert must still ship exactly what the forward used
        loss, _ = _train_step(m, x)
        assert np.isfinite(loss)
    a = _logits(m, x)
    cm = convert(m)
    r = rebuild(cm, str(tmp_path / "rebuilt"))
    b = _logits(r, x)
    assert a.dtype == b.dtype == DT
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # and the quantization is not a no-op: the bf16 model gave other logits
    assert not torch.equal(a, plain)
    if preset.endswith("w4a4"):
        assert cm.act_formats and set(cm.act_formats) <= {k[:-len(".weight")] for k in cm.packed}


def test_converted_names_are_the_on_disk_hf_names(tmp_path):
    for kind in ("qwen3_moe", "mixtral"):
        m = tiny(kind)
        m.save_pretrained(str(tmp_path / kind))
        from safetensors import safe_open
        with safe_open(str(tmp_path / kind / "model.safetensors"), "pt") as f:
            disk = set(f.keys())
        prepare(m, QuantConfig.preset("nvfp4_w4a16"))
        cm = convert(m)
        assert set(cm.packed) | set(cm.dense) == disk
        experts = [k for k in cm.packed if ".experts." in k]
        assert len(experts) == 2 * 4 * 3
        if kind == "mixtral":
            assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in cm.packed
            assert "model.layers.0.block_sparse_moe.gate.weight" in cm.dense
        else:
            assert "model.layers.1.mlp.experts.3.up_proj.weight" in cm.packed
        for k, p in cm.packed.items():
            assert len(p.shape) == 2 and p.codes.dtype == torch.uint8


# ----------------------------------------------------------------------------- fused groups
def test_shared_global_scales_qkv_gateup_and_per_expert():
    m = tiny("qwen3_moe")
    with torch.no_grad():     # make k_proj / expert 1's up rows the largest so sharing is visible
        m.model.layers[0].self_attn.k_proj.weight.mul_(5)
        m.model.layers[0].mlp.experts.gate_up_proj[1, 64:].mul_(7)
    prepare(m, QuantConfig.preset("nvfp4_w4a4"))
    calibrate(m, [ids()])
    cm = convert(m)
    L = "model.layers.0"
    attn = [f"{L}.self_attn.{p}_proj" for p in "qkv"]
    g = [cm.packed[n + ".weight"].global_scale for n in attn]
    amax = max(float(m.model.layers[0].self_attn.get_submodule(f"{p}_proj").weight.detach().abs().max()) for p in "qkv")
    assert all(torch.equal(x, g[0]) for x in g)
    assert float(g[0]) == np.float32(amax) / np.float32(2688)
    assert float(cm.packed[f"{L}.self_attn.o_proj.weight"].global_scale) != float(g[0])
    assert attn in cm.fused_groups
    # activation amax: one per fused group
    assert len({float(cm.input_amax[n]) for n in attn}) == 1
    # experts: gate and up of one expert share, experts differ, down has its own
    gs = [cm.packed[f"{L}.mlp.experts.{e}.gate_proj.weight"].global_scale for e in range(4)]
    us = [cm.packed[f"{L}.mlp.experts.{e}.up_proj.weight"].global_scale for e in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(gs, us))
    w = m.model.layers[0].mlp.experts.gate_up_proj.detach()
    for e in range(4):
        assert float(gs[e]) == np.float32(float(w[e].abs().max())) / np.float32(2688)
    assert float(gs[1]) > float(gs[0])
    assert [f"{L}.mlp.experts.1.gate_proj", f"{L}.mlp.experts.1.up_proj"] in cm.fused_groups
    assert len({float(cm.input_amax[f"{L}.mlp.experts.{e}.down_proj"]) for e in range(4)}) == 1


def test_zero3_external_params_registered_for_fused_peers():
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    n = register_zero3_external_params(m)
    at = m.model.layers[0].self_attn
    ext = {id(p) for p in at.q_proj._external_params.values()}
    assert ext == {id(at.k_proj.weight), id(at.v_proj.weight)}
    mlp = m.model.layers[0].mlp
    assert {id(p) for p in mlp.up_proj._external_params.values()} == {id(mlp.gate_proj.weight)}
    assert not hasattr(at.o_proj, "_external_params")
    assert n == 2 * (3 * 2 + 2 * 1)


# ----------------------------------------------------------------------------- calibration
def _block_err(fmt, w, amax, sb):
    kw = {"amax": amax} if fmt.spec.global_scale else {}
    y = fmt.dequantize(fmt.quantize(w, scales=sb, **kw))
    return ((y - w.float()) ** 2).reshape(*sb.shape, -1).sum(-1)


@pytest.mark.parametrize("fname", ["nvfp4", "mxfp4"])
def test_mse_and_four_over_six_block_choices(fname):
    fmt = get_format(fname)
    torch.manual_seed(0)
    w = (torch.randn(1, 64, 128) * torch.rand(1, 64, 1) * 0.05).to(DT)
    w[0, 0, :32] = 0                                                    # all-zero blocks stay valid
    amax = w.float().abs().amax().reshape(1)
    s_max = search_scales(fmt, w, amax, "max")
    assert torch.equal(s_max, fmt.quantize(w, **({"amax": amax} if fmt.spec.global_scale else {})).scales)
    s_mse = search_scales(fmt, w, amax, "mse")
    e_max, e_mse = _block_err(fmt, w, amax, s_max), _block_err(fmt, w, amax, s_mse)
    assert bool((e_mse <= e_max).all()) and bool((e_mse < e_max).any())
    # four_over_six: each block picks the better of "block max -> 6" and "block max -> 4",
    # the candidates computed here independently (ml_dtypes E4M3 / exact powers of two)
    s46 = search_scales(fmt, w, amax, "four_over_six")
    ab = w.float().reshape(1, 64, -1, fmt.spec.block_size).abs().amax(-1).numpy()       # float32
    if fname == "nvfp4":
        g = np.float32(amax.item()) / np.float32(2688)
        c6 = s_max.numpy()
        c4 = np.clip(ab / (np.float32(4) * g), 2 ** -9, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    else:   # float32 quotient, then an exact ceil(log2) in float64
        with np.errstate(divide="ignore"):
            c6 = np.clip(np.ceil(np.log2((ab / np.float32(6)).astype(np.float64))) + 127, 0, 254).astype(np.uint8)
            c4 = np.clip(np.ceil(np.log2((ab / np.float32(4)).astype(np.float64))) + 127, 0, 254).astype(np.uint8)
    zero = ab == 0
    c6 = np.where(zero, s_max.numpy(), c6)
    c4 = np.where(zero, s_max.numpy(), c4)
    got = s46.numpy()
    assert np.all((got == c6) | (got == c4))
    e6 = _block_err(fmt, w, amax, torch.from_numpy(c6)).numpy()
    e4 = _block_err(fmt, w, amax, torch.from_numpy(c4)).numpy()
    np.testing.assert_array_equal(_block_err(fmt, w, amax, s46).numpy(), np.minimum(e6, e4))
    assert np.any(got == c4) and np.any((got == c6) & (c6 != c4))


def test_static_activation_amax_is_the_input_max_over_batches():
    ref = tiny("llama")
    m = tiny("llama")
    batches = [ids(seed=s) for s in (3, 4, 5)]
    seen = []
    h = ref.model.layers[0].input_layernorm.register_forward_hook(lambda mod, a, out: seen.append(out.abs().max()))
    with torch.no_grad():
        for b in batches:
            ref(input_ids=b)
    h.remove()
    prepare(m, QuantConfig.preset("nvfp4_w4a4"))
    with pytest.raises(RuntimeError, match="calibrate"):
        m(input_ids=batches[0])
    calibrate(m, batches)
    q = m.model.layers[0].self_attn.q_proj.input_quant
    assert float(q.amax) == float(torch.stack(seen).max().float())


def test_calibrate_rejects_mse_with_dynamic_scales():
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    with pytest.raises(ValueError, match="scale_strategy"):
        calibrate(m, None, "mse")
    with pytest.raises(ValueError, match="allowed"):
        calibrate(m, None, "percentile")


# ----------------------------------------------------------------------------- training
def test_strategies_train_what_they_should():
    x = ids()
    # frozen: weights move, scale bytes do not
    m = tiny("qwen3_moe")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", scale_strategy="frozen"))
    calibrate(m, None, "mse")
    before = m.model.layers[0].mlp.experts.gate_up_quant.scales.clone()
    w0 = m.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    _, grads = _train_step(m, x, lr=1.0)
    assert torch.equal(before, m.model.layers[0].mlp.experts.gate_up_quant.scales)
    assert not torch.equal(w0, m.model.layers[0].mlp.experts.gate_up_proj)
    # learnable: LSQ scales get gradients and stay on the E4M3 grid in the forward
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", scale_strategy="learnable"))
    wq = m.model.layers[0].self_attn.q_proj.weight_quant
    s, b0 = wq.scale, wq.scale_bytes().clone()
    m.train()
    opt = torch.optim.Adam([s], lr=2e-4)   # steps ~10% of a typical block step (~1e-3)
    m(input_ids=x, labels=x).loss.backward()
    assert s.grad is not None and bool(s.grad.abs().sum() > 0)
    opt.step()
    sb = wq.scale_bytes()
    assert not torch.equal(b0, sb)
    g = np.float32(wq.amax.item()) / np.float32(2688)
    onto = (s.detach().numpy() / g).clip(2 ** -9, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert torch.equal(sb, torch.from_numpy(onto))


def test_learnable_rejects_formats_without_a_byte_scale_grid():
    m = tiny("qwen3", hidden=256, inter=256)
    with pytest.raises(NotImplementedError, match="nvfp4"):
        prepare(m, QuantConfig.preset("q4_k", scale_strategy="learnable"))


def test_lora_is_merged_then_quantized(tmp_path):
    m = tiny("qwen2")
    cfg = QuantConfig.preset("nvfp4_w4a16")
    cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets = 4, 8.0, ["*self_attn.*", "*mlp.down_proj"]
    cfg = QuantConfig.from_dict(cfg.to_dict())
    prepare(m, cfg)
    q = m.model.layers[0].self_attn.q_proj
    assert q.lora is not None and m.model.layers[0].mlp.gate_proj.lora is None
    assert not q.weight.requires_grad and not m.model.embed_tokens.weight.requires_grad
    x = ids()
    _, grads = _train_step(m, x, lr=0.5)   # B starts at 0: A gets no gradient on step one
    _, grads = _train_step(m, x, lr=0.5)
    assert grads[id(q.lora.lora_A)] and grads[id(q.lora.lora_B)]
    # forward == fake_quant(W + s*B@A), not fake_quant(W) + s*x@A^T@B^T
    merged = q.weight.float() + (q.lora.lora_B @ q.lora.lora_A) * (8.0 / 4)
    want = get_format("nvfp4").fake_quantize(merged.detach(), amax=q.group_amax()[0]).to(DT)
    assert torch.equal(q.quantized_weight().detach(), want)
    a = _logits(m, x)
    cm = convert(m)
    torch.testing.assert_close(a, _logits(rebuild(cm, str(tmp_path / "r")), x), atol=0, rtol=0)
    assert not any("lora" in k for k in list(cm.packed) + list(cm.dense))


# ----------------------------------------------------------------------------- coverage
def test_coverage_counts_and_bits():
    m = tiny("qwen3_moe")
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    rep = coverage(m)
    t = rep.totals
    H, I, E = 64, 64, 4
    per_layer_q = (64 * H + 32 * H * 2 + H * 64) + E * (2 * I * H + H * I)
    assert t["quantized_params"] == 2 * per_layer_q
    assert t["params"] == sum(p.numel() for p in m.parameters())
    assert t["by_format"] == {"nvfp4": 2 * per_layer_q}
    assert sorted(t["excluded"]) == ["lm_head.weight", "model.layers.0.mlp.gate.weight",
                                     "model.layers.1.mlp.gate.weight"]
    qbits = sum(r.bits for r in rep.rows if r.status == "quantized")
    assert qbits == 2 * per_layer_q * 4.5 + 32 * 2 * (4 + 2 * E)     # 4.5 bpw + one fp32 per scale group
    assert "nvfp4" in rep.table() and "total" in rep.table()


def test_coverage_refuses_silently_skipped_experts():
    m = tiny("qwen3_moe")
    with pytest.raises(CoverageError, match=r"experts\.gate_up_proj.*left out without being excluded"):
        prepare(m, QuantConfig.preset("nvfp4_w4a16", targets=["*self_attn*"]))
    m = tiny("qwen3_moe")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", targets=["*self_attn*"], exclude=["*mlp*"]))
    st = {r.name: r.status for r in coverage(m).rows}
    assert st["model.layers.0.mlp.experts.down_proj"] == "excluded"
    assert st["model.layers.0.self_attn.q_proj.weight"] == "quantized"


def test_q4_k_policy_types_in_the_prepared_model():
    m = tiny("qwen3", hidden=256, inter=96)
    prepare(m, QuantConfig.preset("q4_k"))
    fm = {n: q.weight_format for n, q in m.named_modules() if isinstance(q, QuantLinear)}
    assert fm["lm_head"] == "q6_k"
    assert fm["model.layers.0.self_attn.v_proj"] == "q4_k" and fm["model.layers.1.self_attn.v_proj"] == "q6_k"
    assert fm["model.layers.0.mlp.down_proj"] == "q5_0"    # 96 % 256: llama-quantize's fallback
    assert fm["model.layers.1.mlp.down_proj"] == "q8_0"    # q6_k's fallback
    assert fm["model.layers.0.mlp.gate_proj"] == "q4_k"


# ----------------------------------------------------------------------------- state
def test_state_dict_round_trip_resumes_exactly():
    a = tiny("qwen3_moe", seed=0)
    cfg = QuantConfig.preset("nvfp4_w4a4", scale_strategy="learnable")
    prepare(a, cfg)
    calibrate(a, [ids(seed=7)], "mse")
    _train_step(a, ids(), lr=5.0)
    sd = a.state_dict()
    assert any(k.endswith("weight_quant.scale") for k in sd)
    assert any(k.endswith("input_quant.amax") for k in sd) and any(k.endswith("gate_up_quant.amax") for k in sd)
    b = tiny("qwen3_moe", seed=1)
    prepare(b, cfg)
    b.load_state_dict(sd)
    x = ids(seed=9)
    torch.testing.assert_close(_logits(a, x), _logits(b, x), atol=0, rtol=0)


def test_save_and_load_student(tmp_path):
    m = tiny("mixtral")
    prepare(m, QuantConfig.preset("nvfp4_w4a4", scale_strategy="frozen"))
    calibrate(m, [ids(seed=2)], "four_over_six")
    out = tmp_path / "student"
    save_student(m, str(out))
    save_student(m, str(out))           # over an existing dir: replaced atomically
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "qatfactory_quant.json"]
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
    meta = json.loads((out / "qatfactory_quant.json").read_text())
    assert meta["quant_config"]["act_format"] == "nvfp4_act"
    r = load_student(str(out))
    assert isinstance(r.model.layers[0].mlp.experts, QuantExperts)
    x = ids(seed=9)
    torch.testing.assert_close(_logits(m, x), _logits(r, x), atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="save_student"):
        load_student(str(tmp_path))


# ----------------------------------------------------------------------------- bad configs
def test_bad_configs_name_field_value_and_allowed():
    m = tiny("llama")
    with pytest.raises(ValueError, match=r"weight_format='nvfp5'.*allowed.*'nvfp4'"):
        prepare(m, QuantConfig(weight_format="nvfp5"))
    with pytest.raises(ValueError, match=r"act_format='nvfp4'.*weight-only"):
        prepare(m, QuantConfig(weight_format="nvfp4", act_format="nvfp4"))
    with pytest.raises(ValueError, match=r"rules\[0\]\.pattern='\*attn_qkv\*' matches no"):
        prepare(m, QuantConfig(rules=[ModuleRule(pattern="*attn_qkv*", weight="mxfp4")]))
    with pytest.raises(ValueError, match=r"targets: pattern 're:.*\\.c_attn' matches no"):
        prepare(m, QuantConfig(targets=[r"re:.*\.c_attn"]))
    with pytest.raises(ValueError, match=r"scale_strategy='lsq'.*allowed.*learnable"):
        QuantConfig(scale_strategy="lsq")
    with pytest.raises(ValueError, match=r"lora\.dropout"):
        QuantConfig(lora={"rank": 4, "dropout": 0.1})
    with pytest.raises(ValueError, match=r"unknown recipe 'int4'.*nvfp4_w4a16"):
        QuantConfig.preset("int4")
    # a last dim that is not a multiple of the block: names the module, format and block
    m = tiny("llama", hidden=48, inter=96)
    with pytest.raises(ValueError, match=r"self_attn\.q_proj: mxfp4: last dimension K=48.*block size 32"):
        prepare(m, QuantConfig.preset("mxfp4_w4a16"))
    # the failed prepare left the model as it was (q_proj failed after nothing was swapped; the
    # experts case below fails in coverage, after every swap)
    assert not any(isinstance(x, QuantLinear) for x in m.modules())
    m = tiny("qwen3_moe")
    keys = set(m.state_dict())
    with pytest.raises(CoverageError):
        prepare(m, QuantConfig.preset("nvfp4_w4a16", scale_strategy="frozen", targets=["*experts"]))
    assert set(m.state_dict()) == keys and not hasattr(m, "_qf_config")
    assert type(m.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert not any(isinstance(x, QuantLinear) for x in m.modules())
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))     # and can still be prepared
    # rules: first match wins, act "none" gives W4A16 for the match
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a4", rules=[ModuleRule("*.o_proj", act="none"),
                                                       ModuleRule("*proj", weight="mxfp4", act="none")]))
    at = m.model.layers[0].self_attn
    assert at.o_proj.weight_format == "nvfp4" and at.o_proj.input_quant is None
    assert at.q_proj.weight_format == "mxfp4" and m.model.layers[0].mlp.up_proj.weight_format == "mxfp4"


def test_fused_members_must_share_a_format():
    m = tiny("llama")
    with pytest.raises(ValueError, match="q_proj/k_proj/v_proj are fused"):
        prepare(m, QuantConfig.preset("nvfp4_w4a16", rules=[ModuleRule("*.k_proj", weight="mxfp4")]))


def test_hydra_structured_config():
    from omegaconf import OmegaConf
    c = OmegaConf.structured(QuantConfig.preset("mxfp4_w4a4"))
    c.lora.rank = 8
    c.rules.append(ModuleRule(pattern="*.down_proj", weight="nvfp4"))
    o = OmegaConf.to_object(c)
    assert isinstance(o, QuantConfig) and o.lora.rank == 8 and o.rules[0].weight == "nvfp4"
    assert QuantConfig.from_dict(o.to_dict()) == o
    m = tiny("llama")
    prepare(m, c)                        # a Hydra node is accepted as it is
    assert m._qf_config == o and m.model.layers[0].mlp.down_proj.weight_format == "nvfp4"
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bits'\]"):
        QuantConfig.from_dict({"bits": 4})


def _weight_formats():
    from qatfactory.formats import list_formats
    return [f for f in list_formats() if get_format(f).spec.role != "activation"]


@pytest.mark.parametrize("fname", _weight_formats())
def test_every_registered_weight_format_converts_exactly(tmp_path, fname):
    from qatfactory.nn.fake_quant import scale_grid
    fmt = get_format(fname)
    hidden = 256 if max(fmt.spec.super_block, fmt.spec.block_size) > 64 else 64
    strategy = "frozen" if scale_grid(fmt) else "dynamic"
    m = tiny("qwen3", hidden=hidden, inter=hidden, layers=1)
    prepare(m, QuantConfig(weight_format=fname, scale_strategy=strategy))
    calibrate(m, None, "mse" if strategy == "frozen" else "max")
    x = ids()
    a = _logits(m, x)
    cm = convert(m)
    assert cm.formats_used() == [fname]
    torch.testing.assert_close(a, _logits(rebuild(cm, str(tmp_path / "r")), x), atol=0, rtol=0)


def test_tied_lm_head_stays_with_the_embeddings(tmp_path):
    m = tiny("llama", tie_word_embeddings=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    prepare(m, QuantConfig.preset("nvfp4_w4a16", quantize_lm_head=True))
    st = {r.name: (r.status, r.note) for r in coverage(m).rows}
    assert st["lm_head.weight"] == ("tied", "same tensor as model.embed_tokens.weight; counted there")
    assert coverage(m).totals["params"] == sum(p.numel() for p in m.parameters())
    cm = convert(m)
    assert "lm_head.weight" not in cm.packed and "lm_head.weight" not in cm.dense
    assert "model.embed_tokens.weight" in cm.dense
    x = ids()
    torch.testing.assert_close(_logits(m, x), _logits(rebuild(cm, str(tmp_path / "r")), x), atol=0, rtol=0)


def test_ggml_calibration_collects_an_imatrix_that_quantize_uses():
    ref = tiny("qwen3", hidden=256, inter=96)
    m = tiny("qwen3", hidden=256, inter=96)
    batches = [ids(seed=s) for s in (3, 4)]
    xs = []
    h = ref.model.layers[0].input_layernorm.register_forward_hook(lambda mod, a, out: xs.append(out))
    with torch.no_grad():
        for b in batches:
            ref(input_ids=b)
    h.remove()
    # the embedding kept wide, so the plain reference model sees the same layer-0 inputs
    prepare(m, QuantConfig.preset("q4_k", quantize_embeddings=False))
    q = m.model.layers[0].self_attn.q_proj
    before = q.pack().codes.clone()
    info = calibrate(m, batches)
    assert info["imatrix"] == sum(isinstance(x, QuantLinear) for x in m.modules())
    x = torch.cat([t.reshape(-1, 256) for t in xs]).double()
    want = (x * x).mean(0).float()
    torch.testing.assert_close(q.weight_quant.imatrix, want, rtol=1e-6, atol=0)
    p = q.pack()
    fmt = get_format("q4_k")
    assert np.array_equal(fmt.to_bytes(p), fmt.to_bytes(fmt.quantize(q.weight.detach(), imatrix=want)))
    assert not torch.equal(p.codes, before)
