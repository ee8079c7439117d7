"""Live top-k KL (method.loss.kind=topk_kl): the chunked loss against a direct formula written here (values
and gradients), the full forward KL when k covers the vocabulary, a numerical gradient check, and the
settings it refuses in one line."""
import pytest
import torch

from qatfactory.distill.losses import LiveTeacherOut, LossConfig, lm_loss

N, H, V = 37, 16, 50


def _inputs(seed=0, n=N, hdim=H, vocab=V):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hdim, generator=g, dtype=torch.float64) * 0.7
    th = torch.randn(n, hdim, generator=g, dtype=torch.float64)
    tw = torch.randn(vocab, hdim, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[3] = -100
    mask = torch.rand(n, generator=g) > 0.3
    return h, w, th, tw, labels, mask


def _direct(h, w, th, tw, labels, mask, k, tau=1.0, ce_weight=0.0):
    """The k + 1 bins written out: p, q over the whole vocabulary, the tail as 1 - the top-k sum."""
    p = torch.softmax(th @ tw.t() / tau, -1)
    q = torch.softmax(h @ w.t() / tau, -1)
    top = p.topk(k, -1).indices
    ps, qs = p.gather(-1, top), q.gather(-1, top)
    pt, qt = 1 - ps.sum(-1), 1 - qs.sum(-1)
    tail = pt > 1e-12                 # k = V: no tail (where's other branch kept finite for autograd)
    pt, qt = torch.where(tail, pt, torch.ones_like(pt)), torch.where(tail, qt, torch.ones_like(qt))
    kl = (ps * (ps / qs).log()).sum(-1) + torch.where(tail, pt * (pt / qt).log(), torch.zeros_like(pt))
    per = tau * tau * kl
    if ce_weight:
        nll = -torch.log_softmax(h @ w.t(), -1).gather(-1, labels.clamp_min(0)[:, None])[:, 0]
        per = per + ce_weight * torch.where(labels == -100, torch.zeros_like(nll), nll)
    m = mask.double()
    return (per * m).sum() / m.sum()


def _grads(fn, h, w):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(hh, ww)
    (loss * 1.3).backward()
    return loss.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("case", [dict(k=5), dict(k=1), dict(k=17, temperature=2.0, ce_weight=0.4),
                                  dict(k=8, fused=False, temperature=0.7)],
                         ids=lambda c: "-".join(f"{a}={b}" for a, b in c.items()))
def test_chunked_topk_kl_equals_the_direct_formula(case):
    h, w, th, tw, labels, mask = _inputs()
    k = case.pop("k")
    cfg = LossConfig(kind="topk_kl", top_k=k, chunk_tokens=8, **case)      # 37 tokens: 5 chunks, one ragged
    teacher = LiveTeacherOut(th, tw)
    a = _grads(lambda hh, ww: lm_loss(hh, ww, labels, mask, teacher, cfg), h, w)
    b = _grads(lambda hh, ww: _direct(hh, ww, th, tw, labels, mask, k, cfg.temperature, cfg.ce_weight), h, w)
    assert a[0].item() > 0.01
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_topk_kl_differs_from_the_cached_renormalised_rule_and_from_full_kl():
    # the tail bucket is part of the loss: with k < V it is neither the full KL nor the KL over S alone
    h, w, th, tw, labels, mask = _inputs(1)
    t = LiveTeacherOut(th, tw)
    topk = lm_loss(h, w, labels, mask, t, LossConfig(kind="topk_kl", top_k=4)).item()
    full = lm_loss(h, w, labels, mask, t, LossConfig(kind="forward_kl")).item()
    assert 0 < topk < full                      # merging bins never raises a KL (log-sum inequality)


@pytest.mark.parametrize("fused", [True, False])
def test_k_equal_to_the_vocabulary_is_the_full_forward_kl(fused):
    h, w, th, tw, labels, mask = _inputs(2)
    t = LiveTeacherOut(th, tw)
    for tau in (1.0, 1.6):
        a = _grads(lambda hh, ww: lm_loss(hh, ww, labels, mask, t, LossConfig(kind="topk_kl", top_k=V, chunk_tokens=6,
                                                                              temperature=tau, fused=fused)), h, w)
        b = _grads(lambda hh, ww: lm_loss(hh, ww, labels, mask, t, LossConfig(kind="forward_kl", chunk_tokens=6,
                                                                              temperature=tau)), h, w)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("case", [dict(vc=7, k=5), dict(vc=1, k=3, temperature=1.7, ce_weight=0.3),
                                  dict(vc=16, k=V), dict(vc=16, k=40, ce_weight=0.5), dict(vc=49, k=1)],
                         ids=lambda c: "-".join(f"{a}={b}" for a, b in c.items()))
def test_vocab_sliced_topk_kl_equals_unsliced(case):
    # vocab_chunk < V: the top-k merged across slices, the tails outside it, the gradient slice by slice
    h, w, th, tw, labels, mask = _inputs(6)
    vc, k = case.pop("vc"), case.pop("k")
    t = LiveTeacherOut(th, tw)
    a = _grads(lambda hh, ww: lm_loss(hh, ww, labels, mask, t, LossConfig(kind="topk_kl", top_k=k, chunk_tokens=8,
                                                                          vocab_chunk=vc, **case)), h, w)
    b = _grads(lambda hh, ww: _direct(hh, ww, th, tw, labels, mask, k, case.get("temperature", 1.0),
                                      case.get("ce_weight", 0.0)), h, w)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_vocab_sliced_topk_kl_holds_no_wider_logits():
    from test_distill import _logit_widths
    h, w, th, tw, labels, mask = _inputs(7)

    def step(vc):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        cfg = LossConfig(kind="topk_kl", top_k=3, ce_weight=0.5, chunk_tokens=N, vocab_chunk=vc)
        return lambda: lm_loss(hh, ww, labels, mask, LiveTeacherOut(th, tw), cfg).backward()

    assert V in _logit_widths(step(None))
    # no tensor wider than the slice (the top-k merge holds 2 k = 6 columns)
    assert max(_logit_widths(step(8))) <= 8
    got = lm_loss(h, w, labels, mask, LiveTeacherOut(th, tw), LossConfig(kind="topk_kl", top_k=6, vocab_chunk=8))
    want = lm_loss(h, w, labels, mask, LiveTeacherOut(th, tw), LossConfig(kind="topk_kl", top_k=6))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_numerical_gradient_check():
    h, w, th, tw, labels, mask = _inputs(3, n=7, hdim=4, vocab=11)
    t = LiveTeacherOut(th, tw)
    cfg = LossConfig(kind="topk_kl", top_k=3, chunk_tokens=3, temperature=1.3, ce_weight=0.2)
    assert torch.autograd.gradcheck(lambda hh, ww: lm_loss(hh, ww, labels, mask, t, cfg),
                                    (h.clone().requires_grad_(), w.clone().requires_grad_()))


def test_bf16_student_and_teacher_run_in_float32_chunks():
    h, w, th, tw, labels, mask = (x.bfloat16() if x.is_floating_point() else x for x in _inputs(4))
    hh = h.clone().requires_grad_()
    loss = lm_loss(hh, w, labels, mask, LiveTeacherOut(th, tw), LossConfig(kind="topk_kl", top_k=9, chunk_tokens=8))
    loss.backward()
    want = _direct(h.double(), w.double(), th.double(), tw.double(), labels, mask, 9)
    assert loss.dtype == torch.float32 and hh.grad.dtype == torch.bfloat16
    assert abs(loss.item() - want.item()) < 2e-2 * want.item()


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match=r"LossConfig.top_k=None with kind='topk_kl'; allowed: an int from 1"):
        LossConfig(kind="topk_kl")
    for bad in (0, -4, True):
        with pytest.raises(ValueError, match=r"LossConfig.top_k=.* with kind='topk_kl'; allowed"):
            LossConfig(kind="topk_kl", top_k=bad)
    with pytest.raises(ValueError, match=r"LossConfig.top_k=64 with kind='forward_kl'; allowed: null"):
        LossConfig(kind="forward_kl", top_k=64)
    h, w, th, tw, labels, mask = _inputs(5)
    with pytest.raises(ValueError, match=r"method.loss.top_k=51 with a vocabulary of 50 tokens; allowed: 1..50"):
        lm_loss(h, w, labels, mask, LiveTeacherOut(th, tw), LossConfig(kind="topk_kl", top_k=51))


@pytest.mark.parametrize("over,text", [
    (["method.loss.top_k=0"], "LossConfig.top_k=0 with kind='topk_kl'; allowed: an int from 1 to the vocabulary"),
    (["method.loss.top_k=300"], "method.loss.top_k=300 with a vocabulary of 259 tokens; allowed: 1..259"),
    (["method.loss.top_k=8", "method=qad_cached"], "method.loss.kind='topk_kl' with a cached teacher; allowed: "
                                                   "method.teacher=live"),
])
def test_bad_top_k_settings_are_one_line_usage_errors(capsys, tmp_path, over, text):
    from qatfactory import exitcodes as X
    from qatfactory.faces import cli
    run = tmp_path / "run"
    capsys.readouterr()
    rc = cli.main(["train", "train=cpu_tiny", "model.tiny.vocab_size=259", "method.loss.kind=topk_kl",
                   "method.loss.vocab_chunk=null", *over, f"run_dir={run}"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("qatfactory train")]
    assert rc == X.USAGE and len(lines) == 1 and text in lines[0], err[-800:]
    assert "Traceback" not in err and not run.exists()


def test_compose_accepts_topk_kl():
    from qatfactory.train.config import compose
    cfg = compose(["method.loss.kind=topk_kl", "method.loss.top_k=16", "method.loss.vocab_chunk=null"])
    assert cfg.method.loss.top_k == 16 and cfg.method.loss.needs_teacher



def test_the_trainer_with_k_equal_to_the_vocabulary_steps_as_forward_kl(tmp_path):
    # the trainer end to end with a teacher that differs (another seed): each step's loss of topk_kl at k = V is
    # the forward KL's, and it learns
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.faces.ship import train_and_ship
    from qatfactory.train.config import compose
    tdir = tmp_path / "teacher"
    torch.manual_seed(123)
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(tdir)
    base = ["train=cpu_tiny", "data.synthetic=16", "data.seq_len=32", "data.eval_samples=4", "train.max_steps=3",
            "train.lr=1e-3", "train.eval_every=0", "train.save_student=false", "train.save_final=false",
            "method=qad", "format=bf16", f"method.teacher_path={tdir}", "method.loss.chunk_tokens=24"]
    out = {}
    for name, over in (("full", []), ("topk", ["method.loss.kind=topk_kl", "method.loss.top_k=259",
                                               "method.loss.vocab_chunk=null"])):
        s = train_and_ship(compose(base + over + [f"run_dir={tmp_path / name}"]))
        s.pop("engine").destroy()
        recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = ({r["step"]: r["loss"] for r in recs if "loss" in r}, s)
    (full, _), (topk, s) = out["full"], out["topk"]
    assert sorted(topk) == [1, 2, 3] and topk[3] < topk[1]
    for k in full:
        assert topk[k] == pytest.approx(full[k], rel=1e-5), (k, topk, full)
    assert s["eval_last"]["eval/kl"] < s["eval_first"]["eval/kl"]
