"""quant.kquant_refresh_every: the k-quant scale search every K optimizer steps.

Oracles: libggml-python 0.20.2 (``ggml_quantize_chunk``: llama.cpp's own quantizer, imatrix path) for
the scales a search keeps, gguf 0.19 ``gguf.quants.dequantize`` for the decode of bytes assembled from
those scales and codes re-rounded here in numpy (the record layout through the formats' numpy
pack/unpack, which tests/formats check against libggml byte for byte). The training forward under
test goes through the torch emulator; none of it computes an oracle value."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

import ggml_oracle
from quant_helpers import ids, tiny
from qatfactory.formats import get_format
from qatfactory.formats import q4_k as F4
from qatfactory.formats import q5_0 as F5
from qatfactory.formats import q6_k as F6
from qatfactory.nn import QuantLinear, kquant_refresh, step_cache
from qatfactory.quantize import QuantConfig, calibrate, prepare

GT = gguf.GGMLQuantizationType
GGUF_TYPE = {"q4_k": GT.Q4_K, "q6_k": GT.Q6_K, "q5_0": GT.Q5_0}
f32 = np.float32


def _engine(w: np.ndarray, fmt: str, im: np.ndarray) -> np.ndarray:
    """llama.cpp's quantization of w (rows) with the importance matrix: the GGUF bytes."""
    return ggml_oracle.quantize(w, fmt, im)


def _decode(b: np.ndarray, fmt: str, shape) -> np.ndarray:
    return gguf.quants.dequantize(b, GGUF_TYPE[fmt]).reshape(shape)


def _requantized_bytes(fmt: str, w: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Bytes with the scales of ``kept`` (engine bytes of earlier weights) and each weight of ``w`` coded
    under them by the type's element rule, written here from the rules:
    q4_k q = clamp(rint((x + dmin*lm) / (d*ls)), 0, 15), 0 where d*ls == 0;
    q6_k q = clamp(rint(x / (d*sc)), -32, 31) + 32, 32 where d*sc == 0;
    q5_0 q = clamp(trunc(x * (1/d) + 16.5), 0, 31) (llama.cpp's reference rule), 1/d = 0 where d == 0."""
    R, K = w.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmt == "q4_k":
            _, ls, lm, d, dmin = F4._unpack_np(kept, K)
            dj = (np.repeat(d, 8, axis=1) * ls.astype(f32)).astype(f32)[..., None]
            mj = (np.repeat(dmin, 8, axis=1) * lm.astype(f32)).astype(f32)[..., None]
            v = ((w.reshape(R, K // 32, 32) + mj).astype(f32) / dj).astype(f32)
            q = np.where(dj != 0, np.clip(np.rint(v), 0, 15), 0).astype(np.uint8).reshape(R, K)
            return F4._pack_np(q, ls, lm, d, dmin)
        if fmt == "q6_k":
            blk = kept.reshape(-1, F6.BLOCK_BYTES)
            _, sc, d = F6._unpack_np(blk)
            ds = (d.astype(f32)[:, None] * sc.astype(f32)).astype(f32)[..., None]       # [B, 16, 1]
            v = (w.reshape(-1, 16, 16) / ds).astype(f32)
            q = np.where(ds != 0, np.clip(np.rint(v), -32, 31) + 32, 32).astype(np.uint8).reshape(-1, 256)
            return F6._pack_np(q, sc, d).reshape(R, -1)
        blk = kept.reshape(-1, F5.BLOCK_BYTES)
        _, d = F5._unpack_np(blk)
        df = d.astype(f32)
        inv = np.where(df != 0, (f32(1) / df).astype(f32), f32(0)).astype(f32)[:, None]
        v = ((w.reshape(-1, 32) * inv).astype(f32) + f32(16.5)).astype(f32)
        q = np.clip(np.trunc(v), 0, 31).astype(np.uint8)
        return F5._pack_np(q, d).reshape(R, -1)


def _linear(fmt: str, R: int, K: int, every: int, seed: int = 0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, R, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        lin.weight[:, :7] *= 6.0                     # a few wide columns: sub-blocks of different spans
    q = QuantLinear(lin, fmt)
    im = torch.linspace(0.25, 3.0, K) ** 2
    q.weight_quant.imatrix.copy_(im)
    assert kquant_refresh.attach(q.weight_quant, every) is True
    return q, im.numpy()


def _fq(q, step):
    """The fake-quantized weight one training step's forward uses (float32)."""
    with kquant_refresh.training_step(q, step):
        return q.quantized_weight().detach().numpy()


def _assert_bits(a, b, what):
    a = np.ascontiguousarray(a, dtype=f32)
    b = np.ascontiguousarray(b, dtype=f32)
    bad = np.nonzero(a.view(np.uint32).reshape(-1) != b.view(np.uint32).reshape(-1))[0]
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} values differ, first at {bad[0]}: {a.reshape(-1)[bad[0]]!r} " \
                          f"vs {b.reshape(-1)[bad[0]]!r}"


@pytest.mark.parametrize("fmt,K", [("q4_k", 512), ("q6_k", 512), ("q5_0", 96)])
def test_between_refreshes_the_forward_is_the_kept_engine_scales_with_new_codes(fmt, K):
    R = 48
    q, im = _linear(fmt, R, K, every=4)
    w = q.weight
    rng = np.random.default_rng(7)
    kept = None
    for step in range(6):
        W = w.detach().numpy().copy()
        got = _fq(q, step)
        fresh = _decode(_engine(W, fmt, im), fmt, (R, K))
        if step % 4 == 0:
            # a refresh: exactly the engine's quantization of the current weights
            _assert_bits(got, fresh, f"{fmt} step {step} (refresh)")
            kept = _engine(W, fmt, im)
            assert int(q.weight_quant.kq_step) == step
        else:
            want = _decode(_requantized_bytes(fmt, W, kept), fmt, (R, K))
            _assert_bits(got, want, f"{fmt} step {step} (kept scales)")
            # and it is not what a search of these weights gives: the scales really are the kept ones
            assert not np.array_equal(got, fresh), f"{fmt} step {step}: equals a fresh search"
            assert int(q.weight_quant.kq_step) == 4 * (step // 4)
        # an evaluation between the steps sees the full search of the current weights
        with torch.no_grad():
            _assert_bits(q.quantized_weight().numpy(), fresh, f"{fmt} step {step}: outside a training step")
        with torch.no_grad():                        # what an optimizer step does: every weight moves
            w.add_(torch.from_numpy(rng.normal(0, 0.004, W.shape).astype(f32)))


def _grads_and_logits(m, x, step=None):
    m.zero_grad(set_to_none=True)
    m.train()
    ctx = kquant_refresh.training_step(m, step) if step is not None else _null()
    with ctx:
        out = m(input_ids=x, labels=x)
        out.loss.backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("tie", [True, False])
def test_k1_and_every_refresh_step_are_bit_identical_to_the_per_forward_search(tie):
    """K = 1 adds nothing (same state dict, same bits); K = 4 on a refresh step runs the same search:
    logits and every gradient bit for bit as the model prepared without the setting (q4_k, q6_k and
    q5_0 with an imatrix all occur: hidden 256, MLP 320)."""
    models = {}
    for name, kw in (("default", {}), ("k1", {"kquant_refresh_every": 1}), ("k4", {"kquant_refresh_every": 4})):
        m = tiny("llama", hidden=256, inter=320, tie_word_embeddings=tie)
        prepare(m, QuantConfig.preset("q4_k", **kw))
        calibrate(m, [ids(seed=3)])
        models[name] = m
    fmts = {m.weight_format for m in models["default"].modules() if isinstance(m, QuantLinear)}
    assert {"q4_k", "q6_k", "q5_0"} <= fmts, fmts
    assert set(models["k1"].state_dict()) == set(models["default"].state_dict())
    assert any(k.endswith("weight_quant.kq_step") for k in models["k4"].state_dict())
    x = ids()
    with step_cache.enabled():
        ref = _grads_and_logits(models["default"], x)
        for name, step in (("k1", 0), ("k1", 5), ("k4", 0), ("k4", 8)):
            kquant_refresh.reset_stats()
            got = _grads_and_logits(models[name], x, step)
            assert torch.equal(got[0], ref[0]), (name, step)
            assert set(got[1]) == set(ref[1])
            for n in ref[1]:
                assert torch.equal(got[1][n], ref[1][n]), (name, step, n)
            st = kquant_refresh.stats()
            sites = sum(1 for mod in models[name].modules() if isinstance(mod, QuantLinear)
                        and mod.weight_quant.fmt.searches_scales(mod.weight_quant._imatrix() is not None))
            assert st["kept"] == 0 and st["searches"] == (0 if name == "k1" else sites) and sites >= 12, (name, st)


def test_kept_scales_are_per_tensor_state_in_the_state_dict_and_survive_a_reload():
    q, im = _linear("q4_k", 16, 256, every=4)
    _fq(q, 0)
    with torch.no_grad():
        q.weight.add_(0.01)
    a = _fq(q, 1)
    sd = {k: v.clone() for k, v in q.state_dict().items()}
    assert sd["weight_quant.kq_d"].dtype == torch.int16 and int(sd["weight_quant.kq_step"]) == 0
    # a fresh module with other kept state, loaded from the state dict: the same forward in the block
    r, _ = _linear("q4_k", 16, 256, every=4, seed=1)
    _fq(r, 0)
    r.load_state_dict(sd)
    assert np.array_equal(_fq(r, 1), a)
    # K = 1 quantizers have no such state; a wrong K is refused
    with pytest.raises(ValueError, match="kquant_refresh_every"):
        QuantConfig(kquant_refresh_every=0)
    with pytest.raises(ValueError, match="kquant_refresh_every"):
        QuantConfig(kquant_refresh_every=2.5)
    assert kquant_refresh.attach(QuantLinear(nn.Linear(64, 8), "q8_0").weight_quant, 4) is False   # no search


def test_q4_k_kept_scale_hook_checks_its_arguments():
    F = get_format("q4_k")
    x = torch.randn(4, 256)
    p = F.quantize(x)
    kw = F.scale_kwargs(p)
    assert torch.equal(F.dequantize(F.quantize(x, **kw)), F.dequantize(p))   # same weights: the search's values
    with pytest.raises(ValueError, match="together"):
        F.quantize(x, scales=kw["scales"])
    with pytest.raises(ValueError, match="not both"):
        F.quantize(x, imatrix=torch.ones(256), **kw)
    with pytest.raises(ValueError, match="6-bit"):
        F.quantize(x, scales=kw["scales"] | 64, d=kw["d"], dmin=kw["dmin"])
    with pytest.raises(ValueError, match="float16"):
        F.quantize(x, scales=kw["scales"], d=kw["d"].float(), dmin=kw["dmin"])
    with pytest.raises(ValueError, match="uint8 of shape"):
        F.quantize(x, scales=kw["scales"][:2], d=kw["d"], dmin=kw["dmin"])


def test_fused_experts_keep_their_scales_per_expert_row():
    """Fused 3-D experts ([E, R, K], no imatrix: one row per expert row) follow the same rule; the whole
    model trains through it (forward and backward inside the step)."""
    from qatfactory.nn import QuantExperts
    m = tiny("qwen3_moe", hidden=256, inter=512, dtype="float32")
    m.float()
    prepare(m, QuantConfig(weight_format="q4_k", kquant_refresh_every=4))
    mod = next(x for x in m.modules() if isinstance(x, QuantExperts))
    q = mod.gate_up_quant
    assert q.shape3[0] == 4 and q.kq_scales.shape[:2] == q.shape3[:2]
    x = ids()
    kept = None
    for step in range(3):
        W = mod.gate_up_proj.detach().numpy().reshape(-1, 256).copy()
        with kquant_refresh.training_step(m, step):
            got = q(mod.gate_up_proj, None).detach().numpy().reshape(W.shape)
            m.train()
            m(input_ids=x, labels=x).loss.backward()
        if step == 0:
            kept = _engine(W, "q4_k", None)
            _assert_bits(got, _decode(kept, "q4_k", W.shape), "experts, refresh")
        else:
            _assert_bits(got, _decode(_requantized_bytes("q4_k", W, kept), "q4_k", W.shape), f"experts step {step}")
        assert mod.gate_up_proj.grad is not None
        with torch.no_grad():
            mod.gate_up_proj.add_(0.02 * torch.randn_like(mod.gate_up_proj))
            mod.gate_up_proj.grad = None
