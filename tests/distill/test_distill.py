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


# ------------------------------------------------------------------ vocabulary slices (vocab_chunk)
VOCAB_CASES = CASES + [
    dict(kind="reverse_kl", temperature=1.3, ce_weight=0.2),
    dict(kind="jsd", beta=0.8, temperature=1.7, ce_weight=1.0),
    dict(kind="forward_kl", kd_weight=0.0, ce_weight=0.5),
]


def _teachers(th, tw, k=7):
    lp = torch.log_softmax(th @ tw.t(), -1)
    vals, idx = lp.topk(k, dim=-1)
    return {"live": LiveTeacherOut(th, tw), "topk": TopKTeacherOut(vals, idx),
            "logits": LiveTeacherOut(th @ tw.t(), None)}


def _run(fn, h, w, labels, mask, teacher, cfg, student_logits=False):
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h1 @ w1.t(), None, labels, mask, teacher, cfg) if student_logits \
        else fn(h1, w1, labels, mask, teacher, cfg)
    (loss * 1.7).backward()
    return loss, h1.grad, w1.grad


@pytest.mark.parametrize("case,teacher", [(c, t) for c in VOCAB_CASES for t in ("live", "topk", "logits")
                                          if c["kind"] != "ce" or t == "live"],
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_vocab_chunked_equals_naive_float64(case, teacher):
    h, w, th, tw, labels, mask = _inputs(7)
    t = _teachers(th, tw)[teacher]
    # a ragged 7 (50 = 7 * 7 + 1), one slice short of the vocabulary, the student's logits given directly
    for vc, student_logits in ((7, False), (49, False), (7, True)):
        cfg = LossConfig(chunk_tokens=8, vocab_chunk=vc, **case)
        want = _run(naive_lm_loss, h, w, labels, mask, t, cfg, student_logits)
        got = _run(lm_loss, h, w, labels, mask, t, cfg, student_logits)
        assert got[0].dtype == torch.float64 and got[0].item() > 0
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_vocab_chunk_of_one_column(kind):
    h, w, th, tw, labels, mask = _inputs(11)
    for teacher in ("live", "topk"):
        cfg = LossConfig(kind=kind, chunk_tokens=16, vocab_chunk=1, temperature=0.8, ce_weight=0.4)
        t = _teachers(th, tw)[teacher]
        for a, b in zip(_run(lm_loss, h, w, labels, mask, t, cfg), _run(naive_lm_loss, h, w, labels, mask, t, cfg)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_vocab_chunked_bf16_matches_naive_within_bf16_rounding(kind):
    h, w, th, tw, labels, mask = _inputs(6, dtype=torch.bfloat16)
    cfg = LossConfig(kind=kind, chunk_tokens=8, ce_weight=0.5, temperature=1.5, vocab_chunk=16)
    t = LiveTeacherOut(th, tw)
    a, ah, aw = _run(lm_loss, h, w, labels, mask, t, cfg)
    b, bh, bw = _run(naive_lm_loss, h, w, labels, mask, t, cfg)
    assert aw.dtype == torch.bfloat16 and ah.dtype == torch.bfloat16 and a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for g1, g2 in ((ah, bh), (aw, bw)):
        torch.testing.assert_close(g1.float(), g2.float(), rtol=0, atol=1e-2 * g2.float().abs().max().item())


def _logit_widths(fn, rows=N, hidden=H):
    """Widths of the 2-D float tensors with one row per token that any aten op creates while fn runs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = set()

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() == 2 and o.shape[0] == rows:
                    seen.add(o.shape[1])
            return out

    with Probe():
        fn()
    return seen - {hidden}       # hidden states and dL/dh are [rows, hidden]


@pytest.mark.parametrize("teacher", ["live", "topk"])
def test_vocab_chunk_bounds_the_logits_held(teacher):
    # one token chunk of all 37 tokens, so every [tokens, columns] tensor of the loss has N rows
    h, w, th, tw, labels, mask = _inputs(8)
    t = _teachers(th, tw)[teacher]

    def step(vc):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        cfg = LossConfig(kind="jsd" if teacher == "live" else "forward_kl", ce_weight=0.5, chunk_tokens=N,
                         vocab_chunk=vc)
        return lambda: lm_loss(hh, ww, labels, mask, t, cfg).backward()

    assert V in _logit_widths(step(None))        # the probe sees the full-vocabulary logits
    assert max(_logit_widths(step(8))) <= 8      # sliced: never wider than 8 columns (top-k: k = 7)


def test_vocab_chunk_at_or_above_vocab_is_the_unsliced_path_and_bad_values_raise():
    h, w, th, tw, labels, mask = _inputs(9)
    t = LiveTeacherOut(th, tw)
    base = _run(lm_loss, h, w, labels, mask, t, LossConfig(chunk_tokens=8, kind="reverse_kl"))
    for vc in (V, 10 * V):
        same = _run(lm_loss, h, w, labels, mask, t, LossConfig(chunk_tokens=8, kind="reverse_kl", vocab_chunk=vc))
        for a, b in zip(same, base):
            assert torch.equal(a, b)
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match=r"LossConfig.vocab_chunk=.*allowed: null .* or an int >= 1"):
            LossConfig(vocab_chunk=bad)
    with pytest.raises(ValueError, match=r"top-k teacher indices span \[0, 50\]; allowed: 0..49"):
        idx = torch.zeros(N, 3, dtype=torch.long)
        idx[0, 0] = V
        lm_loss(h, w, teacher=TopKTeacherOut(torch.zeros(N, 3), idx), cfg=LossConfig(vocab_chunk=8))
    with pytest.raises(ValueError, match="teacher vocabulary 49 != student vocabulary 50"):
        lm_loss(h, w, teacher=LiveTeacherOut(th, tw[:-1]), cfg=LossConfig(vocab_chunk=8))


@pytest.mark.parametrize("teacher", ["live", "topk", "logits", None])
def test_metrics_vocab_chunked_equal_unsliced(teacher):
    h, w, th, tw, labels, mask = _inputs(10)
    t = None if teacher is None else _teachers(th, tw)[teacher]
    want = lm_metrics(h, w, labels, mask, t, chunk_tokens=6)
    got = lm_metrics(h, w, labels, mask, t, chunk_tokens=6, vocab_chunk=7)
    assert got["tokens"] == want["tokens"] and got["agree_sum"] == want["agree_sum"]
    assert got["ce_sum"] == pytest.approx(want["ce_sum"], abs=1e-10)
    assert got["kl_sum"] == pytest.approx(want["kl_sum"], abs=1e-10)
    if teacher != "live":
        return
    # ties: all-zero logits put every argmax on index 0 in both paths
    z = torch.zeros_like(h)
    tie = lm_metrics(z, w, labels, mask, LiveTeacherOut(z, tw), chunk_tokens=6, vocab_chunk=7)
    assert tie["agree_sum"] == tie["tokens"] > 0


def test_qad_recipe_sets_vocab_chunk():
    from qatfactory.train.config import compose
    assert compose(["method=qad"]).method.loss.vocab_chunk == 32768
    assert compose(["method=qad", "method.loss.vocab_chunk=null"]).method.loss.vocab_chunk is None
    with pytest.raises(Exception, match=r"vocab_chunk=0"):
        compose(["method=qad", "method.loss.vocab_chunk=0"])


def test_trainer_student_module_honours_vocab_chunk():
    # the module the trainer wraps (tied head: dL/dW reaches the embedding too), fp32, a teacher that differs
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.distill.teachers import split_causal_lm
    from qatfactory.train.student import StudentLM
    conf = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(LlamaConfig(**conf)), LlamaForCausalLM(LlamaConfig(**conf))
    ids = torch.randint(0, 259, (2, 12))
    attn = torch.ones_like(ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :3] = False                                 # a prompt that does not count
    with torch.no_grad():
        backbone, head = split_causal_lm(teacher)
        t = LiveTeacherOut(backbone(input_ids=ids).last_hidden_state, head.weight)
    out, widths = [], []
    for vc in (None, 64):
        student.zero_grad()
        lm = StudentLM(student, LossConfig(kind="jsd", temperature=2.0, ce_weight=0.3, chunk_tokens=5,
                                           vocab_chunk=vc))
        res = {}

        def step():
            res["loss"] = lm(ids, attn, mask, t)
            res["loss"].backward()

        widths.append(_logit_widths(step, rows=5, hidden=32))   # 5-token loss chunks
        out.append((res["loss"].detach(), {n: p.grad.clone() for n, p in student.named_parameters()}))
    assert 259 in widths[0] and max(widths[1]) <= 64         # the trainer's loss really slices the vocabulary
    (a, ga), (b, gb) = out
    assert a.item() > 0
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-6, msg=n)
