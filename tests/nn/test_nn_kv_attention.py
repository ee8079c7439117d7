"""vLLM's FP8 attention in the student (nn/kv_attention.py, QuantConfig.kv_attention): the forward value is
formats/kv_attention.py's rule on the cache's E4M3 values (recovered here with torch's own float8 cast),
the gradient is straight-through (the gradient of sdpa on the rounded query, key and value), the default
is vLLM's default backend on Hopper (FLASH_ATTN = fa3), and the choice survives save/load and convert.
The prepared == rebuilt-from-export checks with the rule on are in test_kv_cache.py / test_kv_export.py."""
import pytest
import torch
import torch.nn.functional as F

from quant_helpers import ids, tiny
from qatfactory.formats.kv_attention import fp8_attention
from qatfactory.nn import kv_cache as KV
from qatfactory.nn.kv_attention import attend
from qatfactory.quantize import QuantConfig, calibrate, convert, load_student, prepare, save_student


def _logits(m, x):
    m.eval()
    with torch.no_grad():
        return m(input_ids=x).logits


def _e4m3(x):
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def test_the_default_is_vllms_hopper_backend_and_other_choices_are_checked(tmp_path):
    for kv, want in (("fp8_e4m3", "none"), ("fp8_e4m3_sglang", "none"), ("nvfp4_kv", "none"), ("q8_0_kv", "none")):
        cfg = QuantConfig.preset("nvfp4_w4a16", kv_format=kv)
        assert cfg.kv_attention == "auto" and cfg.resolved_kv_attention() == want
    with pytest.raises(ValueError, match="kv_attention='triton' does not run on the KV-cache format 'nvfp4_kv'; "
                                         "allowed: \\['none'\\]"):
        QuantConfig(kv_format="nvfp4_kv", kv_attention="triton").validate()
    with pytest.raises(ValueError, match="kv_attention='fa3' without a kv_format"):
        QuantConfig(kv_attention="fa3").validate()
    with pytest.raises(ValueError, match="kv_attention='fa2'; allowed"):
        QuantConfig(kv_format="fp8_e4m3", kv_attention="fa2")
    m = tiny("qwen3")
    cfg = QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3", kv_attention="fa3")
    prepare(m, cfg)
    assert cfg.kv_attention == "fa3" and {q.attention for _, q in KV.kv_quantizers(m)} == {"fa3"}
    calibrate(m, [ids(seed=3)])
    save_student(m, str(tmp_path / "s"))
    m2 = load_student(str(tmp_path / "s"))
    assert m2._qf_config.kv_attention == "fa3" and torch.equal(_logits(m, ids()), _logits(m2, ids()))
    assert KV.set_attention(m2, "triton") == 2 and m2._qf_config.kv_attention == "triton"
    assert convert(m2).kv_cache["attention"] == "triton"
    with pytest.raises(ValueError, match="unknown KV attention rule 'fa2'; registered: \\['fa3', 'triton'\\]"):
        KV.set_attention(m2, "fa2")
    KV.set_attention(m2, "none")
    assert not torch.equal(_logits(m, ids()), _logits(m2, ids()))    # the rule changes the student's output
    m3 = tiny("qwen3")
    m3.config._attn_implementation = "flex_attention"
    with pytest.raises(NotImplementedError, match="wraps \\['sdpa', 'eager'\\] attention; the model uses 'flex_attention'"):
        KV.attach(m3, "fp8_e4m3", attention="fa3")


def test_sdpa_and_eager_masks_give_the_same_emulated_logits():
    x = ids()
    out = []
    for inner in ("sdpa", "eager"):
        m = tiny("llama")
        m.config._attn_implementation = inner
        prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3", kv_attention="triton"))
        calibrate(m, [ids(seed=3)])
        out.append(_logits(m, x))
    torch.testing.assert_close(out[0], out[1], atol=0, rtol=0)


def test_forward_is_the_rule_and_the_gradient_is_straight_through():
    torch.manual_seed(0)
    B, H, T, D = 2, 2, 40, 16
    kvq = KV.KVCacheQuantizer("fp8_e4m3", "frozen", D, False, "t", "fa3")
    q0, k0, v0 = (torch.randn(B, H, T, D) * s for s in (2.0, 3.0, 1.5))
    kvq.k_amax.fill_(float(k0.abs().max()))
    kvq.v_amax.fill_(float(v0.abs().max()) * 0.9)       # a little saturation in V
    ks, vs = kvq.scales()
    mod = torch.nn.Module()
    mod.is_causal = True
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    out, _ = attend(mod, kvq, "sdpa", sdpa_attention_forward, q, k, v, None, scaling=D ** -0.5, dropout=0.0)
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    want = fp8_attention("fa3", q0, _e4m3(k0 / ks), _e4m3(v0 / vs), ks, vs, D ** -0.5, keep).transpose(1, 2)
    assert torch.equal(out, want)
    g = torch.randn_like(out)
    out.backward(g)
    # the reference gradient: sdpa on the values the engine reads, identity through each rounding
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q0, k0, v0))
    qr = q2 + (_e4m3(q2) - q2).detach()
    kr = k2 + (_e4m3(k2 / ks) * ks - k2).detach()
    vr = v2 + (_e4m3(v2 / vs) * vs - v2).detach()
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=D ** -0.5).transpose(1, 2)
    ref.backward(g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert a.grad.abs().sum() > 0
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="attention dropout 0.1 in training"):
        attend(mod, kvq, "sdpa", sdpa_attention_forward, q, k, v, None, scaling=D ** -0.5, dropout=0.1)


def test_training_with_the_fp8_attention_moves_the_student_and_keeps_it_finite():
    m = tiny("qwen2")
    prepare(m, QuantConfig.preset("nvfp4_w4a16", kv_format="fp8_e4m3", kv_attention="triton"))
    calibrate(m, [ids(seed=3)])
    x = ids(seq=40)
    m.train()
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert torch.isfinite(loss) and any("q_proj" in n and g.abs().sum() > 0 for n, g in grads.items())
    assert all(torch.isfinite(g).all() for g in grads.values())
