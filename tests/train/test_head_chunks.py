"""No [tokens, vocabulary] logits beyond one loss chunk, in the evaluation and in the loss, when the lm_head is
not a plain linear (a quantized or a biased head runs its own forward): the results equal the unchunked ones,
and a probe of every tensor the ops make sees no more rows of vocabulary width than one chunk."""
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from qatfactory.distill.losses import LiveTeacherOut, LossConfig
from qatfactory.distill.teachers import split_causal_lm
from qatfactory.train.student import StudentLM

V, T, B, HID = 97, 13, 2, 48


def _widest_rows(fn):
    """The most rows (numel / V) of any float tensor with last dim V that an aten op makes while fn runs."""
    seen = [0]

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                # the head's weight [V, HID] (its transposes and gradient too) is not logits
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() >= 2 and o.shape[-1] == V \
                        and o.numel() != V * HID:
                    seen[0] = max(seen[0], o.numel() // V)
            return out

    with Probe():
        r = fn()
    return seen[0], r


def _model(head):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=HID, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    if head == "plain":
        return m
    if head == "biased":
        m.lm_head = nn.Linear(HID, V, bias=True)
    else:
        from qatfactory import quantize as Q
        from qatfactory.quantize import QuantConfig
        Q.prepare(m, QuantConfig.preset("nvfp4_w4a16", quantize_lm_head=True))
        assert type(m.lm_head).__name__ == "QuantLinear"
    return m


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False
    return ids, torch.ones_like(ids), mask


def _teacher(ids):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    t = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=HID, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
    backbone, head = split_causal_lm(t)
    with torch.no_grad():
        return LiveTeacherOut(backbone(input_ids=ids).last_hidden_state, head.weight)


@pytest.mark.parametrize("head", ["plain", "biased", "quantized"])
def test_evaluation_with_a_non_plain_head_is_chunked_and_equal(head):
    m = _model(head)
    ids, attn, mask = _batch()
    t = _teacher(ids)
    rows, res = {}, {}
    for chunk in (5, 1000):
        lm = StudentLM(m, LossConfig(chunk_tokens=chunk)).eval()
        with torch.no_grad():
            rows[chunk], res[chunk] = _widest_rows(lambda: lm(ids, attn, mask, t, metrics=True))
    assert rows[1000] == B * (T - 1)          # unchunked: the probe sees every position's logits at once
    assert rows[5] <= 5                       # chunked: never more than one chunk of rows
    torch.testing.assert_close(res[5], res[1000], rtol=1e-6, atol=1e-9)
    assert res[5][0] == B * (T - 1) - 3 and res[5][1] > 0


@pytest.mark.parametrize("head", ["biased", "quantized"])
@pytest.mark.parametrize("kind", ["forward_kl", "topk_kl"])
def test_loss_with_a_non_plain_head_is_chunked_and_equal(head, kind):
    m = _model(head)
    ids, attn, mask = _batch()
    t = _teacher(ids)
    out = {}
    for chunk in (5, 1000):
        m.zero_grad()
        extra = dict(top_k=7) if kind == "topk_kl" else {}
        lm = StudentLM(m, LossConfig(kind=kind, chunk_tokens=chunk, ce_weight=0.3, **extra))

        def step():
            loss = lm(ids, attn, mask, t)
            loss.backward()
            return loss.detach()

        rows, loss = _widest_rows(step)
        out[chunk] = rows, loss, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    (r_small, a, ga), (r_full, b, gb) = out[5], out[1000]
    assert r_full >= B * (T - 1) and r_small <= 5
    assert a.item() > 0
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert ga.keys() == gb.keys() and "lm_head.weight" in ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_biased_teacher_head_gives_hidden_states_not_logits():
    # the live teacher's outputs: [h, 1] and [W, b] instead of [tokens, V] logits; the loss forms them per chunk
    from qatfactory.distill.teachers import LiveTeacher
    torch.manual_seed(2)
    tm = _model("biased")
    ids, attn, mask = _batch()
    lt = LiveTeacher(tm, torch.float32)
    with torch.no_grad():
        want = tm(input_ids=ids, use_cache=False).logits
        rows, got = _widest_rows(lambda: _enter(lt.outputs(ids, attn)))
    assert rows == 0                                        # no tensor of vocabulary width was made
    assert got.hidden.shape == (B, T, HID + 1) and got.weight.shape == (V, HID + 1)
    torch.testing.assert_close(got.hidden @ got.weight.t(), want, rtol=1e-5, atol=1e-5)


def _enter(cm):
    with cm as t:
        return t
