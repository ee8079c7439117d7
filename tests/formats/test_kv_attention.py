"""vLLM's FP8 attention on an fp8_e4m3 cache (formats/kv_attention.py), against oracles that share no code
with it:

* the query cast against ml_dtypes' float8_e4m3fn cast (after the clip vLLM's op applies);
* a 2-query x 3-key attention worked by hand (every E4M3 rounding written out below, E4M3: 3 mantissa
  bits, normal from 2^-6, subnormal steps of 2^-9, max 448);
* the kernels' own loop (an online softmax over key tiles in the kernel's order, running max, rescale of
  the accumulator and of the row sum at each step, P cast with ml_dtypes), written here in numpy float32
  from the kernels' description, against the closed form the module computes.
The rule itself is a transcription of the kernels (there is no FP8 attention kernel on a CPU); the GPU
comparison with vLLM is benchmarks/kv_cache.py's vllm_serve.
"""
import math

import numpy as np
import pytest
import torch

from qatfactory.formats.kv_attention import (KV_ATTENTION, attentions_for, default_attention, fp8_attention,
                                             get_kv_attention, query_values)
from optional_imports import needed

ml_dtypes = needed("ml_dtypes")   # the independent low-precision casts these tests compare with

E4M3 = ml_dtypes.float8_e4m3fn


def _e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(E4M3).astype(np.float32)


def test_the_rules_are_registered_with_vllms_backend_names_and_none_is_the_default():
    assert sorted(KV_ATTENTION) == ["fa3", "triton"]
    assert get_kv_attention("fa3").vllm_backend == "FLASH_ATTN" and get_kv_attention("triton").vllm_backend == "TRITON_ATTN"
    # the cache-only emulation by default: measured closer to vLLM's FLASH_ATTN serving than the fa3 rule
    assert [default_attention(f) for f in ("fp8_e4m3", "fp8_e4m3_sglang", "nvfp4_kv", "q8_0_kv", None)] == ["none"] * 5
    assert attentions_for("fp8_e4m3") == ["fa3", "triton"] and attentions_for("nvfp4_kv") == []
    assert get_kv_attention("fa3").tile_n(64) == 128 and get_kv_attention("fa3").tile_n(128) == 192
    assert get_kv_attention("triton").tile_n(64) == 32
    with pytest.raises(ValueError, match="unknown KV attention rule 'fa2'; registered: \\['fa3', 'triton'\\]"):
        get_kv_attention("fa2")


def test_query_cast_is_rne_satfinite_e4m3_of_q_times_the_reciprocal_scale():
    g = torch.Generator().manual_seed(0)
    q = torch.cat([torch.randn(4096, generator=g) * 3, torch.randn(512, generator=g) * 1e-3,
                   torch.tensor([1.0625, 1.1875, 460.0, -500.0, 2.0 ** -10, 1.5 * 2.0 ** -10, 0.0, -0.0])])
    for dt in (torch.bfloat16, torch.float32):
        x = q.to(dt)
        got = query_values(x).numpy()
        assert np.array_equal(got, _e4m3(x.float().numpy()))
        # by hand: ties go to the even mantissa, beyond 448 saturates, 2^-10 is half the smallest subnormal
        assert got[-8:].tolist() == [1.0, 1.25, 448.0, -448.0, 0.0, 2.0 ** -9, 0.0, 0.0]
    # a checkpoint q_scale: fp32(q) * fl32(1/s), as vLLM's static_scaled_fp8_quant (inv = 1/scale; x * inv)
    inv = np.float32(1) / np.float32(0.3)
    assert np.array_equal(query_values(q, 0.3).numpy(), _e4m3(q.numpy().astype(np.float32) * inv))


# the hand-worked case: keys 0..2 with E4M3 values 1, 5.5, 8 on one axis; query 0 sees keys 0-1, query 1 all
Q = torch.tensor([[[[1.0625, 0.0], [1.1, 0.0]]]])              # E4M3: 1.0 (tie, even), 1.125
K8 = torch.tensor([[[[1.0, 0.0], [5.5, 0.0], [8.0, 0.0]]]])
V8 = torch.tensor([[[[4.0], [2.0], [1.0]]]])
KEEP = torch.tensor([[True, True, False], [True, True, True]])
KS, VS, SCALE = 1.0, 0.5, 1.0


def _hand(p8, p):
    """sum(P8 v) / sum(P) * v_scale, with P the unrounded probabilities (the kernels' row sum)."""
    return sum(a * b for a, b in zip(p8, V8.flatten().tolist())) / sum(p) * VS


def test_a_two_by_three_attention_worked_by_hand():
    e = math.exp
    # query 1 (E4M3 1.125): s - max = 1.125 * (k - 8) = -7.875, -2.8125, 0
    d0, d1 = -7.875, -2.8125
    # FA3: P = 256 exp(s - m): 0.0972 -> 0.09375 (step 2^-7), 15.37 -> 15, 256 -> 256
    fa3_1 = _hand([0.09375, 15.0, 256.0], [256 * e(d0), 256 * e(d1), 256.0])
    # Triton: P = exp(s - m): 3.8e-4 -> 0 (below 2^-10), 0.0601 -> 0.05859375 (step 2^-8), 1 -> 1
    tri_1 = _hand([0.0, 0.05859375, 1.0], [e(d0), e(d1), 1.0])
    # query 0 (1.0625 -> 1.0): s - m = -4.5, 0 (key 2 masked). FA3: 2.844 -> 2.75 (step 0.25);
    # Triton: 0.01111 is subnormal -> 6 * 2^-9 = 0.01171875. Unrounded q (1.0625) would give other values.
    fa3_0 = _hand([2.75, 256.0, 0.0], [256 * e(-4.5), 256.0, 0.0])
    tri_0 = _hand([6 * 2.0 ** -9, 1.0, 0.0], [e(-4.5), 1.0, 0.0])
    got = {r: fp8_attention(r, Q, K8, V8, KS, VS, SCALE, KEEP).flatten().tolist() for r in ("fa3", "triton")}
    assert got["fa3"] == pytest.approx([fa3_0, fa3_1], rel=2e-7)
    assert got["triton"] == pytest.approx([tri_0, tri_1], rel=2e-7)
    exact = [(e(-4.5) * 4 + 2) / (1 + e(-4.5)) * VS, (e(d0) * 4 + e(d1) * 2 + 1) / (1 + e(d0) + e(d1)) * VS]
    assert abs(got["triton"][1] - exact[1]) > 1e-3 and abs(got["fa3"][1] - exact[1]) > 1e-4   # P8 is visible


def test_the_running_max_of_the_kernels_tile_order_is_the_reference_of_ps_rounding():
    """One key per tile: FA3 visits the last tile first (here the largest score), so every P is cast against
    the final max as with one tile; Triton visits the first tile first, casts each P = 1 against its own
    running max and rescales in fp32 afterwards: the exact softmax."""
    e = math.exp
    one = {r: fp8_attention(r, Q, K8, V8, KS, VS, SCALE, KEEP).flatten() for r in ("fa3", "triton")}
    per = {r: fp8_attention(r, Q, K8, V8, KS, VS, SCALE, KEEP, tile_n=1).flatten() for r in ("fa3", "triton")}
    assert torch.equal(per["fa3"][1], one["fa3"][1])
    exact = [(e(-4.5) * 4 + 2) / (1 + e(-4.5)) * VS, (e(-7.875) * 4 + e(-2.8125) * 2 + 1) / (1 + e(-7.875) + e(-2.8125)) * VS]
    assert per["triton"].tolist() == pytest.approx(exact, rel=2e-7)
    assert not torch.equal(per["triton"], one["triton"])


def _kernel_loop(rule: str, q, k8, v8, ks, vs, scale, keep, tn):
    """The kernels' loop for one (batch, head) row set, numpy float32: tiles in the kernel's order, running
    max m, accumulator and row sum rescaled by the max change at each step, P cast with ml_dtypes."""
    q8 = _e4m3(q)
    tq, tk = keep.shape
    out = np.zeros((tq, v8.shape[-1]), np.float32)
    tiles = list(range(-(-tk // tn)))
    if rule == "fa3":
        tiles = tiles[::-1]
        c = np.float32(np.float32(np.float32(scale) * np.float32(math.log2(math.e))) * np.float32(np.float32(1.0) * np.float32(ks)))
    else:
        c = np.float32(np.float32(np.float32(scale) * np.float32(1.0)) * np.float32(ks))
    l2e = np.float32(1.4426950408889634)
    for i in range(tq):
        m, L = np.float32(-np.inf), np.float32(0)
        acc = np.zeros(v8.shape[-1], np.float32)
        for t in tiles:
            j = np.arange(t * tn, min(tk, (t + 1) * tn))
            s = (k8[j] @ q8[i]).astype(np.float32)
            s = np.where(keep[i, j], s, np.float32(-np.inf))
            if rule == "triton":
                s = (s * c).astype(np.float32)
            m_new = np.float32(max(m, s.max()))
            if rule == "fa3":
                ms = np.float32(0) if m_new == -np.inf else np.float32(m_new * c - np.float32(8))
                p = np.exp2((s * c - ms).astype(np.float32)).astype(np.float32)
                alpha = np.float32(np.exp2(np.float32((m - m_new) * c))) if m_new > -np.inf else np.float32(0)
            else:
                m_new = m_new if m_new > -np.inf else np.float32(0)
                p = np.exp2(((s - m_new) * l2e).astype(np.float32)).astype(np.float32)
                alpha = np.float32(np.exp2(np.float32((m - m_new) * l2e)))
            p8 = _e4m3(p)
            acc = (acc * alpha + p8 @ v8[j]).astype(np.float32)
            L = np.float32(L * alpha + p.sum(dtype=np.float32))
            m = m_new
        out[i] = acc * (np.float32(1) / L * np.float32(vs)) if rule == "fa3" else acc / L * np.float32(vs)
    return out


@pytest.mark.parametrize("rule", ["fa3", "triton"])
@pytest.mark.parametrize("tn", [8, 32])
def test_the_closed_form_equals_the_kernels_online_loop(rule, tn):
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, T, D = 2, 4, 2, 45, 16
    q = (torch.randn(B, Hq, T, D, generator=g) * 2.5).to(torch.bfloat16)
    k8 = torch.from_numpy(_e4m3(torch.randn(B, Hkv, T, D, generator=g).numpy() * 60))
    v8 = torch.from_numpy(_e4m3(torch.randn(B, Hkv, T, D, generator=g).numpy() * 100))
    ks, vs, scale = 0.0123, 0.0071, D ** -0.5
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    got = fp8_attention(rule, q, k8, v8, ks, vs, scale, keep, tile_n=tn).numpy()
    G = Hq // Hkv
    want = np.stack([np.stack([_kernel_loop(rule, q[b, h].float().numpy(), k8[b, h // G].numpy(), v8[b, h // G].numpy(),
                                            ks, vs, scale, keep.numpy(), tn) for h in range(Hq)]) for b in range(B)])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    # the cast of P is not a no-op: the float softmax of the same FP8 inputs is elsewhere
    s = torch.einsum("bhqd,bhkd->bhqk", query_values(q), k8.repeat_interleave(G, 1)) * (scale * ks)
    flt = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ (v8.repeat_interleave(G, 1) * vs)
    assert np.abs(got - flt.numpy()).max() > 1e-3 * np.abs(want).max()


def test_rows_without_keys_are_zero_and_shapes_are_checked():
    keep = torch.tensor([[False, False, False], [True, True, True]])
    for r in ("fa3", "triton"):
        o = fp8_attention(r, Q, K8, V8, KS, VS, SCALE, keep)
        assert o[0, 0, 0].tolist() == [0.0] and torch.isfinite(o).all()
    with pytest.raises(ValueError, match="do not fit one attention"):
        fp8_attention("fa3", torch.zeros(1, 3, 2, 2), torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 1), 1, 1, 1)
