"""Rollouts: the batched KV-cache sampler against transformers' own generate and logits processors,
and the weights it samples from against an independent decode of what convert() ships: the frozen
NVFP4/MXFP4 base is bit-identical to the export's dequantized bytes (ml_dtypes decode), and the
side adapter saved as a PEFT directory reproduces the student's logits when peft loads it onto
that base (transformers' loader, peft's LoRA: no qatfactory code on the reference side)."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qatfactory.train.rl.rollout import SamplingConfig, generate, top_p_filter
from qatfactory.nn import adapter as A
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with


def _tiny(seed=0, init=0.3, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=256, eos_token_id=257,
                      pad_token_id=258, initializer_range=init, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype).eval()


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def test_greedy_batch_equals_transformers_generate_and_cache_equals_full_forward():
    m = _tiny()
    r = generate(m, PROMPTS, 257, 258, SamplingConfig(max_new_tokens=10, temperature=0), repeat=2)
    assert r.tokens.shape[0] == 6 and [row for row in r.prompt_ids[::2]] == PROMPTS
    for i, p in enumerate(PROMPTS):
        g = m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=10,
                       do_sample=False, eos_token_id=257, pad_token_id=258)
        want = g[0, len(p):].tolist()
        for row in (2 * i, 2 * i + 1):           # group-major copies
            assert r.tokens[row, :r.lengths[row]].tolist() == want
        # the sampler's log-probs (incremental, cached, left-padded batch) = one full forward
        full = torch.tensor([p + want])
        with torch.no_grad():
            lsm = torch.log_softmax(m(full).logits.float(), -1)[0, len(p) - 1:-1]
        ref = lsm.gather(-1, torch.tensor(want)[:, None]).squeeze(-1)
        assert torch.allclose(r.logprobs[2 * i, :len(want)], ref, atol=2e-5)
        ent = -(lsm.exp() * lsm).sum(-1)
        assert torch.allclose(r.entropy[2 * i, :len(want)], ent, atol=2e-5)
    for i in range(6):                  # finished exactly when EOS came; else truncated at 10 tokens
        row = r.tokens[i, :r.lengths[i]].tolist()
        assert bool(r.finished[i]) == (row[-1] == 257) and (r.finished[i] or len(row) == 10)
    assert r.finished.any() and not r.finished.all()


def test_top_p_matches_transformers_warper():
    from transformers.generation.logits_process import TopPLogitsWarper
    g = torch.Generator().manual_seed(0)
    for p in (0.3, 0.7, 0.95):
        z = torch.randn(16, 259, generator=g) * 3
        ours = torch.isfinite(top_p_filter(z, p))
        theirs = torch.isfinite(TopPLogitsWarper(p)(None, z.clone()))
        assert torch.equal(ours, theirs), p
    assert torch.equal(top_p_filter(z, 1.0), z)


def test_sampling_is_seeded_and_ends_at_eos_or_stop():
    m = _tiny(init=0.02)            # near-uniform: EOS and every byte are likely enough
    cfg = SamplingConfig(max_new_tokens=40, temperature=1.0, top_p=0.9)
    a = generate(m, PROMPTS, 257, 258, cfg, torch.Generator().manual_seed(3), repeat=4)
    b = generate(m, PROMPTS, 257, 258, cfg, torch.Generator().manual_seed(3), repeat=4)
    c = generate(m, PROMPTS, 257, 258, cfg, torch.Generator().manual_seed(4), repeat=4)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    for i in range(a.tokens.shape[0]):
        row = a.tokens[i, :a.lengths[i]].tolist()
        assert (257 in row) == bool(a.finished[i])
        if a.finished[i]:
            assert row.index(257) == len(row) - 1      # ends at (and keeps) the first EOS
        assert (a.tokens[i, a.lengths[i]:] == 258).all()
    from qatfactory.train.data import ByteTokenizer
    tok = ByteTokenizer()
    s = generate(m, PROMPTS, 257, 258, SamplingConfig(max_new_tokens=40, temperature=1.0, stop=["a", "e", "o"]),
                 torch.Generator().manual_seed(3), repeat=4, tokenizer=tok)
    for i, t in enumerate(s.texts):
        hits = [t.find(x) for x in "aeo" if x in t]
        if hits:
            assert s.finished[i] and min(hits) == len(t) - 1, t     # stopped on the first stop string
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        generate(m, PROMPTS, 257, 258, SamplingConfig(stop=["x"]))


# ----------------------------------------------------------------------------- serving weights
def _decode_nvfp4(p) -> np.ndarray:
    codes = p.codes.numpy()
    c = np.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1).astype(np.uint8)
    e2m1 = c.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s8 = p.scales.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    sf = (s8 * np.float32(p.global_scale.numpy())).astype(np.float32)     # fl(s8 * g), then x code
    return (e2m1.reshape(*s8.shape, 16) * sf[..., None]).reshape(e2m1.shape)


def _decode_mxfp4(p) -> np.ndarray:
    codes = p.codes.numpy()
    c = np.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1).astype(np.uint8)
    e2m1 = c.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = p.scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return (e2m1.reshape(*s.shape, 32) * s[..., None]).reshape(e2m1.shape)


def _student(fmt: str, adapters: bool = True):
    from qatfactory import quantize as Q
    m = _tiny(init=0.05)
    Q.prepare(m, Q.QuantConfig.preset(fmt))
    if adapters:
        A.attach(m, 4, 8.0, ["*_proj"])
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for ad in A.adapters(m).values():
                ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.05)
    return m


@pytest.mark.parametrize("fmt,decode", [("nvfp4_w4a16", _decode_nvfp4), ("mxfp4_w4a16", _decode_mxfp4)])
def test_frozen_base_is_bit_identical_to_the_converted_bytes(fmt, decode):
    from qatfactory import quantize as Q
    m = _student(fmt)
    cm = Q.convert(m)
    with A.serving_weights(m) as frozen:
        assert sorted(frozen) == sorted(k[:-len(".weight")] for k in cm.packed)
        for name, w in frozen.items():
            ref = decode(cm.packed[name + ".weight"])
            assert w.dtype == torch.float32 and np.array_equal(w.numpy(), ref), name
    # the context ends: QuantLinear forwards through its own fake quant again
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_peft_loads_the_adapter_onto_the_decoded_base_and_reproduces_the_student(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from qatfactory import quantize as Q
    m = _student("nvfp4_w4a16")
    cm = Q.convert(m)
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    state = {k: v.contiguous() for k, v in cm.dense.items()}
    state.update({k: torch.from_numpy(_decode_nvfp4(p)) for k, p in cm.packed.items()})
    save_file(state, str(base_dir / "model.safetensors"), metadata={"format": "pt"})
    (base_dir / "config.json").write_text(json.dumps(cm.config))
    A.save_peft_adapter(m, str(tmp_path / "adapter"), base_model=str(base_dir))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["target_modules"] == sorted(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    ref_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), A.serving_weights(m):
        ours = m(ids).logits
        with A.adapters_disabled(m):
            ours_base = m(ids).logits
        theirs = ref_model(ids).logits
        with ref_model.disable_adapter():
            theirs_base = ref_model(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    assert torch.equal(ours_base, theirs_base)                 # the frozen base, bit for bit
    assert (ours - ours_base).abs().max() > 1e-3                # the adapters do something
    # an existing directory that is not an adapter is never replaced
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "x.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not written by qatfactory"):
        A.save_peft_adapter(m, str(tmp_path / "keep"))
    assert (tmp_path / "keep" / "x.txt").read_text() == "mine"
    # nor is somebody else's PEFT adapter (adapter_config.json without our record), extra files and all
    theirs_dir = tmp_path / "their_adapter"
    theirs_dir.mkdir()
    (theirs_dir / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (theirs_dir / "README.md").write_text("trained elsewhere")
    with pytest.raises(FileExistsError, match="not written by qatfactory.*Nothing was changed"):
        A.save_peft_adapter(m, str(theirs_dir))
    assert sorted(p.name for p in theirs_dir.iterdir()) == ["README.md", "adapter_config.json"]
    # ours carries its record, and is replaced by the next save
    rec = json.loads((tmp_path / "adapter" / "qatfactory_adapter.json").read_text())["qatfactory_adapter"]
    assert rec["r"] == 4 and rec["base_model"] == str(base_dir)
    A.save_peft_adapter(m, str(tmp_path / "adapter"))
    assert PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                                     str(tmp_path / "adapter")) is not None


def test_merge_into_quant_ships_q_of_w_plus_delta():
    from qatfactory import quantize as Q
    m = _student("nvfp4_w4a16")
    base = Q.convert(m)
    names = A.merge_into_quant(m)
    assert len(names) == 14 and not A.adapters(m)
    merged = Q.convert(m)
    fmt = Q.QuantConfig.preset("nvfp4_w4a16").weight_format
    from qatfactory.formats import get_format
    k = "model.layers.0.self_attn.q_proj.weight"
    mod = dict(m.named_modules())["model.layers.0.self_attn.q_proj"]
    # what convert packs now is the exact quantizer applied to W + s*B@A (the QA-LoRA path)
    assert torch.equal(get_format(fmt).dequantize(merged.packed[k]), mod.quantized_weight().detach().float())
    assert not torch.equal(merged.packed[k].codes, base.packed[k].codes)
    with pytest.raises(ValueError, match="already has a merged LoRA"):
        A.attach(m, 4, 8.0, ["*q_proj"])


@pytest.mark.parametrize("rank,alpha", [(16, 16.0), (4, 8.0)])
def test_side_adapter_output_and_gradients_are_the_lora_formula_bit_for_bit(rank, alpha):
    """base(x) + (x A^T B^T) * alpha/rank, as peft computes it; at alpha = rank the hook skips the multiply by
    1.0 (one launch fewer per linear on host-bound decode steps): the bits must not change."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 24, bias=False)
    holder = torch.nn.Sequential(lin)
    A.attach(holder, rank, alpha, ["0"])
    ad = lin.adapter
    with torch.no_grad():
        ad.lora_B.normal_()
    x = torch.randn(5, 32, requires_grad=True)
    got = holder(x)
    x2 = x.detach().clone().requires_grad_(True)
    F = torch.nn.functional
    ref = F.linear(x2, lin.weight) + F.linear(F.linear(x2, ad.lora_A), ad.lora_B) * (alpha / rank)
    assert torch.equal(got, ref)
    g = torch.randn_like(got)
    ga = torch.autograd.grad(got, [x, ad.lora_A, ad.lora_B], g)
    gb = torch.autograd.grad(ref, [x2, ad.lora_A, ad.lora_B], g)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_adapter_save_is_a_swap_a_kill_cannot_lose_and_a_link_is_refused(tmp_path):
    m = _student("nvfp4_w4a16")
    out = tmp_path / "adapter"
    A.save_peft_adapter(m, str(out))
    first = (out / "adapter_model.safetensors").read_bytes()
    # a replace cut between its two renames: only the moved-aside copy is left; the next save restores it,
    # then replaces it, and leaves nothing beside it
    os.rename(out, tmp_path / ".adapter.old-abcd1234")
    A.save_peft_adapter(m, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert (out / "adapter_model.safetensors").read_bytes() == first
    # a symbolic link at the target is never replaced (it would act on whatever it points at)
    real = tmp_path / "real"
    real.mkdir()
    (real / "adapter_config.json").write_text("{}")
    (real / "qatfactory_adapter.json").write_text('{"qatfactory_adapter": {}}')
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(FileExistsError, match="symbolic link"):
        A.save_peft_adapter(m, str(tmp_path / "link"))
    assert (real / "adapter_config.json").read_text() == "{}"
