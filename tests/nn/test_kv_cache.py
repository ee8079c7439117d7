"""The KV cache in the loop (nn/kv_cache.py + QuantConfig.kv_format): K after RoPE and V fake-quantized
with the engine's write rule in every supported architecture, calibrated, trained through, converted.

The reference never touches qatfactory.nn: tests/quant_helpers.kv_reference fake-quantizes the
K that transformers' apply_rotary_pos_emb returns and v_proj's output, on a plain model rebuilt from
convert()'s tensors, through the format API with the converted scales."""
import sys

import numpy as np
import pytest
import torch

from quant_helpers import DT, ids, kv_reference, rebuild, tiny
from qatfactory.nn import kv_cache as KV
from qatfactory.quantize import QuantConfig, calibrate, convert, load_student, prepare, save_student

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def _logits(m, x):
    m.eval()
    with torch.no_grad():
        return m(input_ids=x).logits


def _scales(cm):
    return {n: (d["k_scale"], d["v_scale"]) for n, d in cm.kv_cache["layers"].items()} if \
        cm.kv_cache["layers"] and next(iter(cm.kv_cache["layers"].values())) else None


def _train_step(m, x, lr=1e-2):
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    kgrad = {n: p.grad.abs().sum().item() for n, p in m.named_parameters() if "k_proj" in n and p.grad is not None}
    opt.step()
    opt.zero_grad()
    return loss.item(), kgrad


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
def test_the_attention_wrapper_alone_changes_no_bit(inner):
    m = tiny("qwen3")
    m.config._attn_implementation = inner
    x = ids()
    a = _logits(m, x)
    KV.attach(m, "fp8_e4m3")
    assert m.config._attn_implementation == f"qatfactory_kv_{inner}"
    for _, q in KV.kv_quantizers(m):
        q.calibrating = "pass"
    assert torch.equal(_logits(m, x), a)
    KV.detach(m)
    assert m.config._attn_implementation == inner and not KV.kv_quantizers(m)
    assert "_attn_implementation" not in m.config.to_dict() and "_attn_implementation_internal" not in m.config.to_dict()


EXACT = [
    # arch,       weights preset, kv format,         strategy, kv calib, train  (the first fp8_e4m3 row also trains
    # with kv_attention=fa3, vLLM's FP8 attention arithmetic on top of the cache, the others with the default,
    # none: the cache write only; see also tests/nn/test_nn_kv_attention.py)
    ("llama", "nvfp4_w4a16", "fp8_e4m3", "frozen", "max", True),
    ("qwen2", "nvfp4_w4a4", "fp8_e4m3", "frozen", "mse", True),
    ("qwen3", "nvfp4_w4a4", "nvfp4_kv", "frozen", "max", True),
    ("qwen3_moe", "nvfp4_w4a16", "fp8_e4m3_sglang", "frozen", "max", False),
    ("mixtral", "mxfp4_w4a16", "nvfp4_kv", "frozen", "mse", True),
    ("llama", "q4_k", "q8_0_kv_x86", "frozen", "max", True),
    ("mixtral", "nvfp4_w4a16", "q4_0_kv", "frozen", "max", False),
    ("qwen3", "q4_k", "q5_0_kv", "frozen", "max", False),
    ("qwen3", "q4_k", "q8_0_kv", "frozen", "max", True),
]


@pytest.mark.parametrize("kind,preset,kv,strategy,kcal,train", EXACT, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[4]}" for c in EXACT])
def test_prepared_with_kv_equals_rebuilt_from_converted(tmp_path, kind, preset, kv, strategy, kcal, train):
    size = dict(hidden=256, inter=96) if preset == "q4_k" else {}
    m = tiny(kind, **size)
    x = ids()
    want_att = "fa3" if (kind, kv) == ("llama", "fp8_e4m3") else "none"
    extra = {"kv_attention": "fa3"} if want_att == "fa3" else {}
    prepare(m, QuantConfig.preset(preset, kv_format=kv, kv_scale_strategy=strategy, kv_calib_method=kcal, **extra))
    calibrate(m, [ids(seed=3), ids(seed=4)])
    if train:   # QAD/QAT with the quantized cache on: gradients reach k_proj through the STE
        loss, kgrad = _train_step(m, x)
        assert np.isfinite(loss) and kgrad and all(g > 0 for g in kgrad.values())
    a = _logits(m, x)
    cm = convert(m)
    assert cm.kv_cache["format"] == kv and len(cm.kv_cache["layers"]) == m.config.num_hidden_layers
    r = rebuild(cm, str(tmp_path / "r"))
    no_kv = _logits(r, x)
    att = cm.kv_cache["attention"]
    assert att == want_att
    with kv_reference(r, kv, _scales(cm), attention=None if att == "none" else att):
        b = _logits(r, x)
    assert a.dtype == b.dtype == DT
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, no_kv)             # the cache quantization is not a no-op


def test_llama_k_is_quantized_in_llama_cpps_element_order(tmp_path):
    """q8_0 blocks of 32 over a 64-wide head: on llama the student quantizes K in GGUF's permuted order
    (the reference builds it from transformers' GGUF un-permutation); transformers' order would give
    other logits. qwen3 (NeoX RoPE in llama.cpp too) keeps transformers' order."""
    m = tiny("llama", hidden=128, num_attention_heads=2)        # head_dim 64
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="q8_0_kv"))
    assert all(q.permute_k for _, q in KV.kv_quantizers(m))
    x = ids()
    a = _logits(m, x)
    r = rebuild(convert(m), str(tmp_path / "r"))
    with kv_reference(r, "q8_0_kv"):
        assert torch.equal(a, _logits(r, x))
    with kv_reference(r, "q8_0_kv", gguf_order=False):
        assert not torch.equal(a, _logits(r, x))
    q3 = tiny("qwen3", hidden=128, num_attention_heads=2)
    prepare(q3, QuantConfig.preset("nvfp4_w4a16", kv_format="q8_0_kv"))
    assert not any(q.permute_k for _, q in KV.kv_quantizers(q3))


def test_calibration_max_is_the_largest_k_after_rope_and_mse_is_no_worse():
    m = tiny("qwen3")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3", kv_calib_method="max"))
    batches = [ids(seed=3), ids(seed=4, seq=20)]
    # independent capture: what apply_rotary_pos_emb returns and what v_proj outputs, per layer
    modeling = sys.modules[type(m.model.layers[0].self_attn).__module__]
    seen, cur = {}, {}
    base = modeling.apply_rotary_pos_emb

    rows = {}

    def rope(q, k, *a, **kw):
        q2, k2 = base(q, k, *a, **kw)
        seen.setdefault(cur["n"], [0.0, 0.0])[0] = max(seen.get(cur["n"], [0.0, 0.0])[0], float(k2.abs().max()))
        rows.setdefault(cur["n"], []).append(k2.detach().float().reshape(-1, k2.shape[-1]))
        return q2, k2
    hooks = []
    for i, layer in enumerate(m.model.layers):
        n = f"model.layers.{i}.self_attn"
        hooks.append(layer.self_attn.register_forward_pre_hook(lambda mod, a, n=n: cur.__setitem__("n", n)))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(
            lambda mod, a, out, n=n: seen.setdefault(n, [0.0, 0.0]).__setitem__(1, max(seen[n][1], float(out.abs().max())))))
    modeling.apply_rotary_pos_emb = rope
    try:
        info = calibrate(m, batches)
    finally:
        modeling.apply_rotary_pos_emb = base
        for h in hooks:
            h.remove()
    assert info["kv_cache"]["layers"] == 2 and info["kv_cache"]["method"] == "max"
    for n, q in KV.kv_quantizers(m):
        assert float(q.k_amax) == seen[n][0] and float(q.v_amax) == seen[n][1]
    # mse picks, per layer and tensor, the candidate 2^(-i/8) * max with the least squared error over every
    # calibration K row (few rows here: none thinned away), computed here with the format API
    before = {n: (float(q.k_amax), float(q.v_amax)) for n, q in KV.kv_quantizers(m)}
    m._qf_config.kv_calib_method = "mse"
    info = calibrate(m, batches)
    from qatfactory.formats.kv import get_kv_format
    f = get_kv_format("fp8_e4m3")
    for n, q in KV.kv_quantizers(m):
        kr = torch.cat(rows[n][:2])            # the max pass above saw both batches once
        errs = []
        for i in range(KV.MSE_STEPS):
            a_ = torch.tensor(before[n][0] * 2.0 ** (-i / 8), dtype=torch.float32)
            errs.append((float(((f.values(kr, f.scale(a_)) - kr) ** 2).sum()), float(a_)))
        assert float(q.k_amax) == min(errs)[1]
    after = {n: (float(q.k_amax), float(q.v_amax)) for n, q in KV.kv_quantizers(m)}
    for n in before:
        for b, a in zip(before[n], after[n]):
            assert a <= b and any(abs(a - b * 2.0 ** (-i / 8)) <= 1e-6 * b for i in range(KV.MSE_STEPS))
    assert info["kv_cache"]["method"] == "mse" and torch.isfinite(_logits(m, ids(seed=9))).all()


def test_dynamic_scales_follow_each_batch_and_must_be_frozen_before_convert(tmp_path):
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3", kv_scale_strategy="dynamic"))
    calibrate(m, [ids(seed=3)])
    small, big = ids(seed=5), ids(seed=6, seq=30)
    _logits(m, big)
    _logits(m, small)
    q = KV.kv_quantizers(m)[0][1]
    run_max = float(q.k_amax)
    assert run_max > 0
    with pytest.raises(ValueError, match="dynamic KV-cache scales.*freeze_kv_scales"):
        convert(m)
    assert KV.freeze_kv_scales(m) == 2 and m._qf_config.kv_scale_strategy == "frozen"
    assert float(q.k_amax) == run_max
    x = ids()
    a = _logits(m, x)
    cm = convert(m)
    r = rebuild(cm, str(tmp_path / "r"))
    with kv_reference(r, "fp8_e4m3", _scales(cm), attention=cm.kv_cache["attention"]):
        torch.testing.assert_close(a, _logits(r, x), atol=0, rtol=0)


def test_save_load_student_keeps_the_kv_state(tmp_path):
    m = tiny("qwen2")
    prepare(m, QuantConfig.preset("nvfp4_w4a4", kv_format="nvfp4_kv"))
    calibrate(m, [ids(seed=3)])
    save_student(m, str(tmp_path / "s"))
    m2 = load_student(str(tmp_path / "s"))
    x = ids()
    assert torch.equal(_logits(m, x), _logits(m2, x))
    assert [float(q.k_amax) for _, q in KV.kv_quantizers(m2)] == [float(q.k_amax) for _, q in KV.kv_quantizers(m)]


def test_bad_kv_configs_are_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match="kv_format='fp9' is not a KV-cache format; allowed: .*fp8_e4m3"):
        QuantConfig(kv_format="fp9").validate()
    with pytest.raises(ValueError, match="kv_scale_strategy='learnable'; allowed"):
        QuantConfig(kv_format="fp8_e4m3", kv_scale_strategy="learnable")
    with pytest.raises(ValueError, match="kv_calib_method='four_over_six'; allowed"):
        QuantConfig(kv_format="fp8_e4m3", kv_calib_method="four_over_six")
    m = tiny("llama")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3"))
    with pytest.raises(RuntimeError, match="needs a calibrated K scale.*calibrate"):
        _logits(m, ids())
    with pytest.raises(ValueError, match="one K and one V scale per layer, calibrated on batches="):
        calibrate(m, None)
    m = tiny("llama", hidden=80, num_attention_heads=2)           # head_dim 40: no 16/32 blocks
    with pytest.raises(ValueError, match="head_dim=40 is not a multiple of the block size 32"):
        prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="q8_0_kv"))
    assert m.config._attn_implementation == "sdpa" and not KV.kv_quantizers(m)    # prepare undone
    from transformers import GPT2Config, GPT2LMHeadModel
    g = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="model_type 'gpt2' is not supported.*supported: "):
        KV.attach(g, "fp8_e4m3")


def test_generation_with_the_cache_reads_the_same_quantized_k_and_v():
    """Cached decoding re-quantizes the stored (unquantized) rows with the same static scale: the greedy
    tokens equal a full recompute of the prefix at every step."""
    m = tiny("qwen3")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3"))
    calibrate(m, [ids(seed=3)])
    m.eval()
    x = ids(batch=1, seq=6)
    with torch.no_grad():
        out = m.generate(x, max_new_tokens=6, do_sample=False, use_cache=True)
        seq = x
        for _ in range(6):
            nxt = m(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_sglangs_nan_on_overflow_is_a_clear_error_not_a_silent_nan():
    m = tiny("qwen3")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3_sglang"))
    calibrate(m, [ids(seed=3)])
    for _, q in KV.kv_quantizers(m):
        q.k_amax.mul_(0.25)              # a scale 4x too small: |K/s| beyond 464 somewhere
    with pytest.raises(RuntimeError, match="K exceeds the largest value its scale can store.*NaN, in serving as here"):
        _logits(m, ids())
    for _, q in KV.kv_quantizers(m):
        q.fmt_name = "fp8_e4m3"          # vLLM's rule saturates instead
    assert torch.isfinite(_logits(m, ids())).all()


@pytest.mark.parametrize("over,want", [
    (["format=nvfp4_w4a16_kvfp8"], ("nvfp4", None, "fp8_e4m3")),
    (["format=nvfp4_w4a4_kvfp8", "method=qad"], ("nvfp4", "nvfp4_act", "fp8_e4m3")),
    (["format=nvfp4_w4a4_kvnvfp4"], ("nvfp4", "nvfp4_act", "nvfp4_kv")),
    (["format=q4_k_kvq8_0"], ("q4_k_m", None, "q8_0_kv_x86")),
    (["format=mxfp4_w4a4", "quant.kv_format=fp8_e4m3", "quant.kv_calib_method=mse"], ("mxfp4", "mxfp4_rceil", "fp8_e4m3")),
])
def test_recipes_combine_weight_activation_and_kv_formats(over, want):
    from qatfactory.train.config import compose
    q = compose(over).quant
    assert (q.weight_format, q.act_format, q.kv_format) == want


def test_a_kv_format_on_a_bf16_run_is_refused():
    from qatfactory.train.config import compose
    with pytest.raises(ValueError, match="quant.kv_format='fp8_e4m3' with format=bf16"):
        compose(["format=bf16", "quant.kv_format=fp8_e4m3"])


def test_docs_kv_table_matches_the_registry():
    import re
    from pathlib import Path
    from qatfactory.formats.kv import markdown_table
    text = (Path(__file__).resolve().parents[2] / "docs" / "kv-cache.md").read_text()
    m = re.search(r"<!-- kv-formats-table -->\n(.*?)\n<!-- /kv-formats-table -->", text, re.S)
    assert m and m.group(1).strip() == markdown_table().strip()
