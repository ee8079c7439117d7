"""AQN: noise lands on the norms that feed q/k/v and gate/up (found by role, per architecture; the
test checks the feeding by capturing the projections' inputs), nowhere else; it is gone before the
loss forward; the schedule's values in both indexings; seeded draws, per step or per forward."""
import math

import pytest
import torch
from torch import nn

from qatfactory.nn import noise as N


def _tiny(arch: str, dtype=torch.float32):
    import transformers as T
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1)
    cfg, cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM),
                "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}[arch]
    if arch in ("qwen3", "gemma3_text"):
        kw["head_dim"] = 16
    torch.manual_seed(0)
    m = cls(cfg(**kw)).to(dtype)
    with torch.no_grad():      # gains away from their init (1 or 0) so a wrong gain model shows
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape) * 0.3)
    return m.eval()


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"]
MLP_NORM = {"gemma3_text": "pre_feedforward_layernorm"}


@pytest.mark.parametrize("arch", ARCHS)
def test_noise_on_the_norms_feeding_qkv_and_gate_up_only(arch):
    m = _tiny(arch)
    targets = N.find_norms(m)
    mlp = MLP_NORM.get(arch, "post_attention_layernorm")
    assert [t.name for t in targets] == [f"model.layers.{i}.{a}.weight" for i in range(2)
                                         for a in ("input_layernorm", mlp)]
    offset = 1.0 if arch.startswith("gemma") else 0.0
    assert {t.offset for t in targets} == {offset}

    # the role is a fact of the forward: the chosen norm's output is exactly what q/k/v (gate/up) read
    seen = {}
    hooks = []
    owner = {id(mod.weight): mod for mod in m.modules() if isinstance(getattr(mod, "weight", None), nn.Parameter)}
    for i, layer in enumerate(m.model.layers):
        # the modules AQN picked (not the names this test expects)
        picked = [owner[id(t.param)] for t in targets if t.name.startswith(f"model.layers.{i}.")]
        for nm, mod in zip(("attn_norm", "mlp_norm"), picked):
            hooks.append(mod.register_forward_hook(lambda _m, a, o, k=(i, nm): seen.__setitem__(k, o)))
        for proj in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(layer.self_attn, proj).register_forward_hook(
                lambda _m, a, o, k=(i, proj): seen.__setitem__(k, a[0])))
        for proj in ("gate_proj", "up_proj"):
            hooks.append(getattr(layer.mlp, proj).register_forward_hook(
                lambda _m, a, o, k=(i, proj): seen.__setitem__(k, a[0])))
    ids = torch.randint(0, 64, (2, 7))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    aqn = N.AQN(m, total_steps=10, sigma_start=0.05, sigma_end=0.01, stages=5, seed=1)
    with torch.no_grad(), aqn.rollout(step=4) as info:     # stage 2
        noisy = {n: p.detach().clone() for n, p in m.named_parameters()}
        m(ids)
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(seen[(i, proj)], seen[(i, "attn_norm")])
        for proj in ("gate_proj", "up_proj"):
            assert torch.equal(seen[(i, proj)], seen[(i, "mlp_norm")])
    for h in hooks:
        h.remove()
    changed = {n for n in before if not torch.equal(before[n], noisy[n])}
    assert changed == {t.name for t in targets}
    assert info["sigma"] == pytest.approx(N.stage_sigma(2, 0.05, 0.01, 5, "code")) and info["stage"] == 2
    # multiplicative per-channel noise on the projections' inputs: (offset + w + z) / (offset + w)
    layer0 = m.model.layers[0].input_layernorm
    x = torch.randn(3, 32)
    with torch.no_grad():
        clean = layer0(x)
        with aqn.rollout(step=4):
            noisy_out = layer0(x)
    w0 = before["model.layers.0.input_layernorm.weight"]
    z0 = noisy["model.layers.0.input_layernorm.weight"] - w0
    assert torch.allclose(noisy_out / clean, ((offset + w0 + z0) / (offset + w0)).expand(3, -1), rtol=1e-4, atol=1e-5)
    assert info["sigma_over_gain_max"] == pytest.approx(
        float((info["sigma"] / torch.cat([(offset + before[t.name]).abs() for t in targets])).max()), rel=1e-6)
    # noise removed exactly: the same tensors as before, the same logits as a never-noised forward
    for t in targets:
        assert torch.equal(t.param.detach(), before[t.name])
    with torch.no_grad():
        ref = m(ids).logits
        with aqn.rollout(step=0):          # stage 0: nothing added
            z = m(ids).logits
    assert torch.equal(ref, z)


def test_schedule_values_code_and_paper_indexing():
    code = [N.stage_sigma(k, 1e-2, 5e-4, 10, "code") for k in range(10)]
    # the released code's example (methods.md 2.4): 0, 1e-2, 6.88e-3, ..., 7.27e-4, 5.00e-4
    assert code[0] == 0.0 and code[1] == pytest.approx(1e-2) and code[9] == pytest.approx(5e-4, rel=1e-12)
    assert [round(v, 6) for v in code[1:]] == pytest.approx(
        [1.0e-2, 6.88e-3, 4.73e-3, 3.25e-3, 2.24e-3, 1.54e-3, 1.06e-3, 7.27e-4, 5.0e-4], rel=3e-3)
    paper = [N.stage_sigma(k, 1e-2, 5e-4, 10, "paper") for k in range(10)]
    assert paper[1] == pytest.approx(1e-2) and paper[9] == pytest.approx(1e-2 * 0.05 ** (8 / 9), rel=1e-12)
    assert paper[9] > 5e-4                 # the paper's Eq. 8 never reaches sigma_end
    # stages: 600 steps, K = 10 -> 60 steps each; the last step stays in the last stage
    assert [N.stage_of(s, 600, 10) for s in (0, 59, 60, 119, 120, 599, 600, 10**6)] == [0, 0, 1, 1, 2, 9, 9, 9]
    assert N.sigma_at(60, 600, 1e-2, 5e-4, 10) == pytest.approx(1e-2)
    with pytest.raises(ValueError, match="indexing='linear'"):
        N.stage_sigma(1, 1e-2, 5e-4, 10, "linear")


def test_seeded_per_step_and_per_forward_resampling():
    m = _tiny("llama")
    name = "model.layers.1.post_attention_layernorm.weight"
    p = dict(m.named_parameters())[name]
    w = p.detach().clone()

    def noise_of(aqn, step):
        with aqn.rollout(step):
            return p.detach() - w

    a1 = N.AQN(m, 10, 0.05, 0.01, 5, seed=7)
    a2 = N.AQN(m, 10, 0.05, 0.01, 5, seed=7)
    assert torch.equal(noise_of(a1, 4), noise_of(a2, 4))
    assert not torch.equal(noise_of(a1, 4), noise_of(a1, 5))
    assert not torch.equal(noise_of(a1, 4), noise_of(N.AQN(m, 10, 0.05, 0.01, 5, seed=8), 4))
    # per forward: every forward pass draws again
    af = N.AQN(m, 10, 0.05, 0.01, 5, seed=7, resample="forward")
    ids = torch.randint(0, 64, (1, 5))
    draws = []
    with torch.no_grad(), af.rollout(4) as info:
        for _ in range(3):
            m(ids)
            draws.append(p.detach() - w)
    assert info["draws"] == 3.0
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert torch.equal(p.detach(), w)


def test_bf16_rounds_small_sigma_away_and_sigma_eff_says_so():
    m32 = _tiny("llama")
    m16 = _tiny("llama", torch.bfloat16)
    for m, lo, hi in ((m32, 0.9, 1.1), (m16, 0.0, 0.7)):
        a = N.AQN(m, 10, 5e-4, 1e-4, 5, seed=0)
        with a.rollout(3) as info:
            pass
        # fp32 carries the draw; bf16 (spacing 2^-8..2^-7 near the gains) loses most of it
        assert lo * info["sigma"] <= info["sigma_eff"] <= hi * info["sigma"], info


def test_unknown_architecture_and_final_norm():
    from transformers import GPT2Config, GPT2LMHeadModel
    g = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' has no norm-role mapping; supported: \['gemma3'"):
        N.find_norms(g)
    m = _tiny("qwen3")
    ts = N.find_norms(m, include_final=True)
    assert ts[-1].name == "model.norm.weight" and ts[-1].role == "final"
    # qwen3's q_norm / k_norm are never targets (they normalise heads, not projection inputs)
    assert not any("q_norm" in t.name or "k_norm" in t.name for t in ts)
