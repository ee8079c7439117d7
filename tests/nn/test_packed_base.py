"""nn/packed_base.py: the frozen base held as codes + scales gives the same forward and backward, bit for bit,
as the base frozen at its dequantized weights (nn/adapter.serving_weights), holds a fraction of its bytes, and
hands the weights back unchanged."""
from __future__ import annotations

import pytest
import torch

from qatfactory import quantize as Q
from qatfactory.nn import adapter as A
from qatfactory.nn.packed_base import packed_base


def _student(fmt: str, tied: bool, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # k-quants and the low-bit GGUF grids have 256-element super-blocks: rows of 256
    hidden = 256 if fmt in ("q4_k", "paretoq_2bit") else 64
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                      tie_word_embeddings=tied)
    m = LlamaForCausalLM(cfg).to(dtype)
    Q.prepare(m, Q.QuantConfig.preset(fmt))
    Q.calibrate(m, [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))], "max")
    for p in m.parameters():
        p.requires_grad_(False)
    A.attach(m, 4, 8.0, ["*_proj"])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for ad in A.adapters(m).values():
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.05)
    return m


def _pass(m, ctx):
    """Logits, d(loss)/d(input embeddings) and every adapter gradient under one frozen-base context."""
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    for p in m.parameters():
        p.grad = None
    with ctx:
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = m(inputs_embeds=emb).logits
        loss = logits.float().log_softmax(-1)[..., :7].square().mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return logits.detach(), emb.grad, grads


@pytest.mark.parametrize("fmt", ["nvfp4_w4a16", "nvfp4_w4a4", "mxfp4_w4a16", "q4_k", "paretoq_2bit"])
def test_packed_base_forward_and_backward_equal_the_dequantized_base(fmt):
    tied = fmt != "q4_k"
    m = _student(fmt, tied)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ref = _pass(m, A.serving_weights(m))
    with packed_base(m) as rep:
        pass
    got = _pass(m, packed_base(m))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert ref[2].keys() == got[2].keys() and len(ref[2]) == 2 * 14    # A and B of 7 adapters x 2 layers
    for n in ref[2]:
        assert torch.equal(ref[2][n], got[2][n]), n
    # the weights come back as they were, and the model forwards through its own fake quant again
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    # every quantized linear (the 14 of the two layers, and the head where the recipe quantizes it) is held
    # as its packed bytes, a fraction of fp32
    from qatfactory.nn.linear import QuantLinear
    assert len(rep) == sum(isinstance(x, QuantLinear) for x in m.modules()) >= 14
    packed, wide = sum(r["packed_bytes"] for r in rep.values()), sum(r["weight_bytes"] for r in rep.values())
    assert packed < wide / 5, (packed, wide)          # < 6.4 bits a weight (Q4_K_M's Q6_K tensors included)


def test_the_weights_leave_the_device_while_packed_and_a_tied_table_stays():
    m = _student("nvfp4_w4a16", tied=True)
    if not torch.cuda.is_available():
        # on a CPU the weights have nowhere to go: they stay, and nothing is copied
        ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
        with packed_base(m):
            assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
        return
    m.cuda()
    with packed_base(m):
        q = m.model.layers[0].self_attn.q_proj.weight
        assert q.device.type == "cpu"
        assert m.model.embed_tokens.weight.device.type == "cuda"      # shared with the tied head
    assert q.device.type == "cuda"


def test_refusals_name_the_module():
    m = _student("nvfp4_w4a16", tied=True)
    m.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight trains"):
        with packed_base(m):
            pass
    m.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    with A.serving_weights(m):
        with pytest.raises(RuntimeError, match="already frozen"):
            with packed_base(m):
                pass
