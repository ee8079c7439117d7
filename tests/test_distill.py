"""Chunked distillation losses against the naive full-logits computation (values and gradients),
and cached (top-k) teachers against live ones."""
import math

import pytest
import torch

from qatfactory.distill.losses import (LiveTeacherOut, LossConfig, TopKTeacherOut, lm_loss, lm_metrics,
                                       naive_lm_loss)

N, H, V = 37, 16, 50


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    th = torch.randn(N, H, generator=g, dtype=dtype)
    tw = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    mask = torch.rand(N, generator=g) > 0.3
    return h, w, th, tw, labels, mask


CASES = [
    dict(kind="forward_kl"),
    dict(kind="forward_kl", temperature=2.0, ce_weight=0.3),
    dict(kind="reverse_kl", temperature=0.7),
    dict(kind="jsd", beta=0.3),
    dict(kind="ce"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_chunked_equals_naive_values_and_grads(case):
    h, w, th, tw, labels, mask = _inputs()
    teacher = LiveTeacherOut(th, tw)
    cfg = LossConfig(chunk_tokens=8, **case)   # 37 tokens: 4 full chunks and a ragged one
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    a = lm_loss(h1, w1, labels, mask, teacher, cfg)
    b = naive_lm_loss(h2, w2, labels, mask, teacher, cfg)
    (a * 1.7).backward()
    (b * 1.7).backward()
    assert a.item() > 0
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)


def test_masked_tokens_do_not_count_and_empty_mask_is_zero():
    h, w, th, tw, labels, mask = _inputs(1)
    t = LiveTeacherOut(th, tw)
    cfg = LossConfig(chunk_tokens=5)
    # changing the hidden state of a masked token changes nothing
    h2 = h.clone()
    h2[~mask] += 3.0
    assert lm_loss(h, w, labels, mask, t, cfg).item() == pytest.approx(lm_loss(h2, w, labels, mask, t, cfg).item(),
                                                                         rel=1e-12)
    z = lm_loss(h.requires_grad_(), w, labels, torch.zeros(N, dtype=torch.bool), t, cfg)
    z.backward()
    assert z.item() == 0.0 and not torch.isnan(h.grad).any() and h.grad.abs().sum() == 0


def test_kl_of_identical_models_is_zero_and_bf16_works():
    h, w, *_ = _inputs(2, dtype=torch.bfloat16)
    cfg = LossConfig(chunk_tokens=16)
    hh = h.clone().requires_grad_()
    loss = lm_loss(hh, w, teacher=LiveTeacherOut(h, w), cfg=cfg)
    loss.backward()
    assert abs(loss.item()) < 1e-5 and hh.grad.dtype == torch.bfloat16
    assert hh.grad.abs().max().item() < 1e-3


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_covering_vocab_equals_live(kind):
    h, w, th, tw, labels, mask = _inputs(3)
    zt = (th @ tw.t()).float()
    lp = torch.log_softmax(zt, -1)
    vals, idx = lp.topk(V, dim=-1)          # k = V: every index, sorted, as the cache stores them
    cfg = LossConfig(kind=kind, temperature=1.5, chunk_tokens=7)
    live = lm_loss(h.requires_grad_(), w, labels, mask, LiveTeacherOut(th, tw), cfg)
    (gl,) = torch.autograd.grad(live, h)
    cached = lm_loss(h, w, labels, mask, TopKTeacherOut(vals, idx.int()), cfg)
    (gc,) = torch.autograd.grad(cached, h)
    torch.testing.assert_close(cached.double(), live.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gc, gl, rtol=1e-4, atol=1e-6)


def test_topk_renormalisation_rule():
    # k < V: teacher renormalised over S, student full-vocab log-softmax for forward KL
    h, w, th, tw, _, _ = _inputs(4)
    k = 5
    lp = torch.log_softmax((th @ tw.t()).float(), -1)
    vals, idx = lp.topk(k, dim=-1)
    cfg = LossConfig(kind="forward_kl", chunk_tokens=10)
    got = lm_loss(h, w, teacher=TopKTeacherOut(vals, idx), cfg=cfg)
    p = torch.softmax(vals, -1)
    logq = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, idx)
    want = (p * (p.log() - logq)).sum(-1).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_metrics():
    h, w, th, tw, labels, mask = _inputs(5)
    m = lm_metrics(h, w, labels, mask, LiveTeacherOut(th, tw), chunk_tokens=6)
    keep = mask & (labels != -100)
    zs, zt = (h @ w.t()).float()[keep], (th @ tw.t()).float()[keep]
    assert m["tokens"] == keep.sum().item()
    ce = torch.nn.functional.cross_entropy(zs, labels[keep], reduction="sum")
    kl = torch.nn.functional.kl_div(torch.log_softmax(zs, -1), torch.log_softmax(zt, -1), log_target=True,
                                    reduction="sum")
    assert m["ce_sum"] == pytest.approx(ce.item(), rel=1e-6)
    assert m["kl_sum"] == pytest.approx(kl.item(), rel=1e-6)
    assert m["agree_sum"] == (zs.argmax(-1) == zt.argmax(-1)).sum().item()
    m2 = lm_metrics(h, w, labels, mask, LiveTeacherOut(h, w))
    assert m2["agree_sum"] == m2["tokens"] and abs(m2["kl_sum"]) < 1e-9 and math.isfinite(m2["ce_sum"])


def test_bad_config_and_shapes_raise():
    with pytest.raises(ValueError, match="kind='kl'.*forward_kl"):
        LossConfig(kind="kl")
    with pytest.raises(ValueError, match="beta"):
        LossConfig(kind="jsd", beta=1.0)
    h, w, *_ = _inputs()
    with pytest.raises(ValueError, match="needs a teacher"):
        lm_loss(h, w, cfg=LossConfig())
    with pytest.raises(ValueError, match="hidden size"):
        lm_loss(h, w[:, :3], cfg=LossConfig(kind="ce"), labels=torch.zeros(N, dtype=torch.long))


def test_bf16_chunked_matches_naive_within_bf16_rounding():
    h, w, th, tw, labels, mask = _inputs(6, dtype=torch.bfloat16)
    cfg = LossConfig(chunk_tokens=8, ce_weight=0.5)
    t = LiveTeacherOut(th, tw)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    a = lm_loss(h1, w1, labels, mask, t, cfg)
    b = naive_lm_loss(h2, w2, labels, mask, t, cfg)
    a.backward()
    b.backward()
    assert w1.grad.dtype == torch.bfloat16 and h1.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for g1, g2 in ((h1.grad, h2.grad), (w1.grad, w2.grad)):   # bf16 rounding: 1% of the gradient's scale
        torch.testing.assert_close(g1.float(), g2.float(), rtol=0, atol=1e-2 * g2.float().abs().max().item())
