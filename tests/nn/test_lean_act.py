"""nn/lean_act.py (the live-QAD memory peak): the norms and the MLP product recompute in the backward
what they no longer keep; the forward and every gradient are bit-identical to Hugging Face's modules, and
what autograd keeps per layer shrinks by the amounts the module docstring states."""
import copy

import pytest
import torch

from qatfactory.nn import lean_act

H, I, L = 64, 176, 2


def _llama(dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def _grads(m, ids):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=ids).logits
    (out.float().square().mean() + out.float()[..., 3].sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("fmt", [None, "nvfp4_w4a4"])
def test_lean_modules_give_the_same_bits(fmt):
    ref = _llama()
    if fmt is not None:
        from qatfactory import quantize as Q
        from qatfactory.train.config import compose
        ref = Q.prepare(ref, compose([f"format={fmt}"]).quant) or ref
        ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
        Q.calibrate(ref, [{"input_ids": ids}], "max")
    lean = copy.deepcopy(ref)
    n = lean_act.register(lean)
    assert n == {"norms": 2 * L + 1, "mlps": L}
    assert lean_act.register(lean) == {"norms": 0, "mlps": 0}          # idempotent
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    o0, g0 = _grads(ref, ids)
    o1, g1 = _grads(lean, ids)
    assert torch.equal(_bits(o0), _bits(o1))
    bad = [k for k in g0 if not torch.equal(_bits(g0[k]), _bits(g1[k]))]
    assert not bad, bad
    lean_act.unregister(lean)
    assert not any(getattr(m, lean_act._LEAN, False) for m in lean.modules())


def _saved_bytes(m, ids):
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.model(input_ids=ids)
    return sum(seen.values())


def test_lean_modules_keep_less_for_the_backward():
    """Per token and layer: 2 norms x (4H + 2H - 2H) + 2I bytes fewer kept (bf16 model); the final norm
    4H more. Counted from what autograd saves (unique storages, parameters aside)."""
    ref = _llama()
    lean = copy.deepcopy(ref)
    lean_act.register(lean)
    B, T = 2, 16
    ids = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(3))
    saved = _saved_bytes(ref, ids) - _saved_bytes(lean, ids)
    per_token = saved / (B * T)
    want = L * (2 * (4 * H + 2 * H - 2 * H) + 2 * I) + (4 * H + 2 * H - 2 * H)
    # each norm also drops its fp32 1/rms (4 bytes per token)
    assert per_token == want + (2 * L + 1) * 4, (per_token, want)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "grad_ckpt"])
def test_trainer_with_lean_act_trains_the_same_bits(tmp_path, ckpt):
    """train.lean_act through the trainer (QAD NVFP4 W4A16, live teacher, bf16 DeepSpeed; also inside
    gradient checkpointing, a checkpoint within a checkpoint): the same losses and weights bit for bit
    after 3 steps."""
    import json

    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    out = {}
    for name, over in (("ref", []), ("lean", ["train.lean_act=true"])):
        cfg = compose(["train=cpu_tiny", "train.precision=bf16", "model.dtype=bfloat16", "data.synthetic=12",
                       "data.seq_len=32", "data.eval_samples=2", "train.eval_every=0", "train.max_steps=3",
                       "train.lr=1e-2", "method=qad", "format=nvfp4_w4a16", f"train.grad_ckpt={str(ckpt).lower()}",
                       f"run_dir={tmp_path / name}", *over])
        s = run(cfg)
        eng = s.pop("engine")
        w = {k: _bits(v.detach().clone()) for k, v in eng.module.lm.state_dict().items()}
        eng.destroy()
        recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = (w, [r["loss"] for r in recs if "loss" in r])
    (w0, l0), (w1, l1) = out["ref"], out["lean"]
    assert l0 == l1 and len(l0) == 3
    assert [k for k in w0 if not torch.equal(w0[k], w1[k])] == []


def test_lean_act_refuses_zero3():
    from qatfactory.exitcodes import UsageError
    from qatfactory.train.config import compose
    with pytest.raises(UsageError, match="lean_act=true with train.zero_stage=3"):
        compose(["train.lean_act=true", "train.zero_stage=3"])
