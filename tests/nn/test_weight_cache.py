"""The per-step weight cache (nn/weight_cache.py): training with fq(W) kept for the optimizer
step gives, bit for bit, the losses, gradients and evaluation logits of the per-forward path, across
optimizer steps with gradient accumulation, for NVFP4 / MXFP4 / Q4_K_M, W4A16 and W4A4, dense and MoE,
both autograd paths (F.linear on the emulator, the recompute-in-backward path of the CUDA kernels) and
both fills (one per tensor, batched over concatenated rows). Every weight is quantized exactly once per
step (the counters), and a weight changed by any torch path (optimizer, load_state_dict, an edit under
no_grad, a quantizer buffer) is seen at once."""
import contextlib
import json
from pathlib import Path

import pytest
import torch

from qatfactory.nn import step_cache, weight_cache
from qatfactory.quantize import QuantConfig, calibrate, prepare
from tests.quant_helpers import ids, tiny


# Q4_K needs rows of 256; one layer keeps its emulator fast
Q4K_SIZE = dict(hidden=256, inter=96, layers=1)


@pytest.fixture(autouse=True)
def _batching():
    yield
    weight_cache.set_batching(None)


def _model(kind, preset, calib=True, model_kw=None, **kw):
    m = tiny(kind, **(Q4K_SIZE if preset == "q4_k" else {}), **(model_kw or {}))
    prepare(m, QuantConfig.preset(preset, **kw))
    # calibration batches give W4A4 its activation amax and Q4_K its importance matrix (per-tensor
    # fills then); without them a Q4_K model has none and joins the batched fills
    calibrate(m, [ids(seed=99)] if calib else None)
    return m


def _all_sites(m):
    from qatfactory.nn import QuantExpertsMixin, QuantLinear
    out = []
    for mod in m.modules():
        if isinstance(mod, QuantLinear):
            out.append(mod._wc_site())
        elif isinstance(mod, QuantExpertsMixin):
            out += list(mod._wc_sites())
    return [s for s in out if s.eligible()]


def _sites(m):
    return len(_all_sites(m))


def _train(m, cached: bool, steps: int, accum: int, recompute):
    """Optimizer steps of `accum` micro-batches each, then an eval forward: everything recorded."""
    for mod in m.modules():
        if hasattr(mod, "recompute_fq"):
            mod.recompute_fq = recompute
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    dev = next(m.parameters()).device
    rec = []
    with step_cache.enabled(weights=True) if cached else contextlib.nullcontext():
        for st in range(steps):
            for mb in range(accum):
                x = ids(seed=10 * st + mb).to(dev)
                out = m(input_ids=x, labels=x)
                (out.loss / accum).backward()
                rec.append(("loss", st, mb, out.loss.detach()))
            rec += [("grad", st, n, p.grad.clone()) for n, p in m.named_parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                rec.append(("eval", st, 0, m(input_ids=ids(seed=7).to(dev)).logits))
    return rec


CASES = [("llama", "nvfp4_w4a16", {}), ("llama", "mxfp4_w4a16", {}), ("llama", "nvfp4_w4a4", {}),
         ("llama", "mxfp4_w4a4", {}), ("llama", "q4_k", {}), ("llama", "q4_k", {"calib": False}),
         ("llama", "nvfp4_w4a16", {"scale_strategy": "frozen"}), ("llama", "mxfp4_w4a16", {"ste": "clipped"}),
         ("qwen3_moe", "nvfp4_w4a16", {}), ("qwen3_moe", "nvfp4_w4a4", {}), ("qwen3_moe", "mxfp4_w4a4", {}),
         ("qwen3_moe", "mxfp4_w4a16", {"ste": "clipped"})]
# (recompute_fq, batching): the emulator's F.linear path with batched fills and the CUDA path's
# recompute-in-backward (forced on the CPU) with one fill per tensor, for every case; recompute with
# batched fills for NVFP4 (the fills do not depend on the autograd path); Q4_K without imatrix batched
PATHS = {"flinear-batched": (None, "always"), "recompute-per-tensor": (True, "never"),
         "recompute-batched": (True, "always")}


def _params():
    out = []
    for kind, preset, kw in CASES:
        name = f"{kind}-{preset}" + "".join(f"-{v}" for v in kw.values())
        paths = ["flinear-batched", "recompute-per-tensor"]
        if preset in ("nvfp4_w4a16", "nvfp4_w4a4") and not kw:
            paths.append("recompute-batched")
        if kw.get("calib") is False:
            paths = ["flinear-batched"]
        out += [pytest.param(kind, preset, kw, *PATHS[p], id=f"{name}-{p}") for p in paths]
    return out


@pytest.mark.parametrize("kind,preset,kw,recompute,batch", _params())
def test_cached_training_is_bit_identical_to_the_per_forward_path(kind, preset, kw, recompute, batch, monkeypatch):
    kw = dict(kw)
    calib = kw.pop("calib", True)
    weight_cache.set_batching(batch)
    monkeypatch.setattr(weight_cache, "CHUNK_ELEMS", 1 << 14)    # several chunks per batched fill
    steps, accum = (2, 2) if preset == "q4_k" else (3, 2)
    a, b = _model(kind, preset, calib, **kw), _model(kind, preset, calib, **kw)
    n_sites = _sites(a)
    assert n_sites >= 7
    weight_cache.reset_stats()
    got = _train(a, True, steps, accum, recompute)
    st = weight_cache.stats()
    want = _train(b, False, steps, accum, recompute)
    assert [r[:3] for r in got] == [r[:3] for r in want]
    for g, w in zip(got, want):
        assert g[3].dtype == w[3].dtype and torch.equal(g[3], w[3]), g[:3]
    # each weight quantized once per optimizer step (epochs: steps + the eval after the last), never per
    # micro-batch, backward or eval forward, and the kept copy used by all of them
    assert st["fills"] == n_sites * (steps + 1), st
    assert st["hits"] >= n_sites * steps * (accum - 1), st
    buckets = {}
    for s in _all_sites(a):
        buckets.setdefault(s.batch_key(), []).append(s)
    together = sum(len(v) for k, v in buckets.items() if k is not None and len(v) > 1)
    if batch == "always" and not (preset == "q4_k" and calib) and kw.get("scale_strategy") != "frozen":
        # from the second epoch on, one batched fill per (format, K) bucket of two or more sites, in
        # several chunks
        assert together >= n_sites // 2
        assert st["batched_sites"] == together * steps and st["batched_launches"] > 2 * steps, st
    else:
        assert together == 0 and st["batched_sites"] == 0


def _logits(m):
    with torch.no_grad():
        return m(input_ids=ids(seed=3)).logits


@pytest.mark.parametrize("kind,preset", [("llama", "nvfp4_w4a16"), ("qwen3_moe", "nvfp4_w4a4"),
                                         ("llama", "q4_k")])
def test_the_cache_sees_every_weight_change(kind, preset):
    """Edits under no_grad (a fused-group member: its siblings' shared amax moves too; a 3-D expert
    tensor), load_state_dict, a quantizer buffer, an optimizer step: the next forward equals a model
    that never cached. A write through .data is the one path the version counters miss; then
    weights_changed() is the contract."""
    weight_cache.set_batching("always")
    a, b = _model(kind, preset), _model(kind, preset)
    other_sd = {k: v.clone() for k, v in tiny(kind, seed=5, **(Q4K_SIZE if preset == "q4_k" else {}))
                .state_dict().items()}
    n_sites = _sites(a)
    layer = lambda m: m.model.layers[0]       # noqa: E731
    edits = [
        ("k_proj", 3 if preset.startswith("nvfp4") else 1,
         lambda m: layer(m).self_attn.k_proj.weight.mul_(1.7)),
        ("load_state_dict", n_sites, lambda m: m.load_state_dict(other_sd, strict=False)),
    ]
    if kind == "qwen3_moe":
        edits.append(("experts", 1, lambda m: layer(m).mlp.experts.down_proj[1].mul_(-2.0)))
    if preset == "q4_k":
        edits.append(("imatrix", 1, lambda m: layer(m).mlp.up_proj.weight_quant.imatrix.mul_(3.0)))
    with step_cache.enabled(weights=True):
        weight_cache.reset_stats()
        got = [_logits(a)]
        assert weight_cache.stats()["fills"] == n_sites
        for name, n_fills, edit in edits:
            before = weight_cache.stats()["fills"]
            with torch.no_grad():
                edit(a)
            got.append(_logits(a))
            assert weight_cache.stats()["fills"] - before == n_fills, name
        before = weight_cache.stats()["fills"]
        got.append(_logits(a))
        assert weight_cache.stats()["fills"] == before       # nothing changed: all kept
        # an optimizer step (its version counters and the optimizer hook both say so)
        a(input_ids=ids(seed=4), labels=ids(seed=4)).loss.backward()
        opt = torch.optim.SGD(a.parameters(), lr=0.5)
        opt.step()
        got.append(_logits(a))
        # .data: not seen until weights_changed()
        p = layer(a).mlp.down_proj.weight if kind == "llama" else layer(a).mlp.experts.gate_up_proj
        stale = _logits(a)
        p.data.mul_(0.5)
        assert torch.equal(_logits(a), stale)
        step_cache.weights_changed()
        got.append(_logits(a))
    want = [_logits(b)]
    for name, _, edit in edits:
        with torch.no_grad():
            edit(b)
        want.append(_logits(b))
    want.append(_logits(b))
    b(input_ids=ids(seed=4), labels=ids(seed=4)).loss.backward()
    torch.optim.SGD(b.parameters(), lr=0.5).step()
    want.append(_logits(b))
    pb = layer(b).mlp.down_proj.weight if kind == "llama" else layer(b).mlp.experts.gate_up_proj
    pb.data.mul_(0.5)
    want.append(_logits(b))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), i
    assert not torch.equal(want[1], want[0]) and not torch.equal(want[-1], want[-2])   # the edits mattered


def test_what_is_not_cached_and_the_switches(monkeypatch):
    m = _model("llama", "nvfp4_w4a16")
    q = m.model.layers[0].self_attn.q_proj
    s = weight_cache.site(q, "weight", "weight_quant")
    assert weight_cache.lookup(s) is None                           # outside the trainer: never
    with step_cache.enabled(weights=False):
        assert weight_cache.lookup(s) is None
    with step_cache.enabled(weights=False):
        assert not step_cache.weights_cached() and weight_cache.lookup(s) is None
    with step_cache.enabled():                                      # the default keeps them
        e = weight_cache.lookup(s)
        assert e is not None and torch.equal(e.wq, q.quantized_weight().detach())
        assert weight_cache.lookup(s) is e
        q.quant_enabled = False                                     # quant_start's full-precision phase
        assert weight_cache.lookup(s) is None
        q.quant_enabled = True
    assert s.entry is None                                          # leaving the block frees every entry
    with pytest.raises(ValueError, match="allowed"):
        weight_cache.set_batching("sometimes")
    # learnable scales train through the quantizer, LoRA merges first: the per-forward path runs
    for cfg in (dict(scale_strategy="learnable"), dict(lora=dict(rank=4))):
        mm = tiny("llama")
        prepare(mm, QuantConfig.preset("nvfp4_w4a16", **cfg))
        with step_cache.enabled(weights=True):
            weight_cache.reset_stats()
            mm(input_ids=ids(), labels=ids()).loss.backward()
            assert weight_cache.stats()["fills"] == 0


def _trainer_run(tmp_path, name, cache, monkeypatch, *over):
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    weight_cache.reset_stats()
    served = {True: 0, False: 0}          # kept entries handed to a forward: experts / linears
    lookup = weight_cache.lookup

    def counted(site):
        e = lookup(site)
        served[site.experts] += e is not None
        return e
    monkeypatch.setattr(weight_cache, "lookup", counted)
    cfg = compose(["train=cpu_tiny", "data.synthetic=16", "data.seq_len=32", "data.eval_samples=2",
                   "train.eval_every=2", "train.max_steps=3", "train.lr=1e-2", "train.grad_accum=2",
                   "method=qad", "format=nvfp4_w4a4", "model.tiny.initializer_range=0.3",
                   f"train.weight_cache={'true' if cache else 'false'}", f"run_dir={tmp_path / name}", *over])
    s = run(cfg)
    s.pop("engine").destroy()
    recs = [json.loads(line) for line in (Path(tmp_path / name) / "metrics.jsonl").read_text().splitlines()]
    return recs, dict(weight_cache.stats(), experts_served=served[True], linears_served=served[False]), \
        s["student"].model


@pytest.mark.parametrize("model,precision", [("tiny_llama", "fp32"), ("tiny_llama", "bf16"),
                                             ("tiny_qwen3_moe", "fp32"), ("tiny_qwen3_moe", "bf16")])
def test_trainer_with_grad_accumulation_is_bit_identical(tmp_path, monkeypatch, model, precision):
    """The trainer (DeepSpeed; bf16: its BF16 optimizer writes the weights through .data, which only the
    trainer's weights_changed() at the accumulation boundary reports) with the cache on and off, on the
    random Llama and the random Qwen3-MoE (fused 3-D experts, W4A4 through grouped_mm): the same losses
    and evaluations, bit for bit, the same trained weights after three AdamW steps (so the same gradients
    went in), and every weight, the expert tensors included, quantized once per epoch of the cache."""
    over = [f"model={model}", f"train.precision={precision}",
            f"model.dtype={'float32' if precision == 'fp32' else 'bfloat16'}"]
    on, st, m_on = _trainer_run(tmp_path, "on", True, monkeypatch, *over)
    off, st_off, m_off = _trainer_run(tmp_path, "off", False, monkeypatch, *over)
    timing = ("step_ms", "tokens_per_s", "mem_gb")
    assert [{k: v for k, v in r.items() if k not in timing} for r in on] == \
        [{k: v for k, v in r.items() if k not in timing} for r in off]
    assert len([r for r in on if "loss" in r]) == 3 and len([r for r in on if "eval/kl" in r]) == 3
    assert st_off["fills"] == 0 and st["fills"] > 0 and st["hits"] > st["fills"]
    sd_on, sd_off = m_on.state_dict(), m_off.state_dict()
    assert sd_on.keys() == sd_off.keys()
    for k in sd_on:
        assert torch.equal(sd_on[k], sd_off[k]), k
    sites = _all_sites(m_on)
    n_exp = sum(s.experts for s in sites)
    assert n_exp == (4 if model == "tiny_qwen3_moe" else 0)        # gate_up and down of both layers
    assert st["fills"] % len(sites) == 0, (st, len(sites))           # whole epochs: experts filled with the rest
    # the MoE forwards read the experts from the cache: per training forward (3 steps x 2 micro-batches)
    # each expert site at least once, besides the evaluations; the per-forward path never
    assert st["experts_served"] >= 6 * n_exp and st["linears_served"] > 0
    assert st_off["experts_served"] == st_off["linears_served"] == 0
