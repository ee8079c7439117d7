"""llama.cpp GGUF exports through the parity gate: gguf-py's GGUFReader + gguf.quants.dequantize,
libggml's C dequantizers (libggml-python), transformers' GGUF loader for logits and the
tokenizer, and (opt-in, marker llama_cpp) llama.cpp's own runtime via llama-cpp-python."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from test_exporters_helpers import source_dir, student

from qatfactory.exporters import ExportError, export, verify
from qatfactory.exporters.gguf_tokenizer import tokenizer_parity
from qatfactory.exporters.llama_cpp import packed_to_gguf, permute_rows, unpermute_rows

gguf = pytest.importorskip("gguf")

# (kind, weight format, act format, rules)
CASES = [
    ("llama", "q4_k_m", None, None),                      # Q4_K + Q6_K (llama.cpp's Q4_K_M policy), Q/K permuted
    ("llama", "nvfp4", "nvfp4_act", None),                # ModelOpt NVFP4 -> GGML NVFP4 + .scale/.input_scale
    ("qwen3_moe", "nvfp4", "nvfp4_act", None),            # _exps with per-expert .scale/.input_scale vectors
    ("qwen3", "mxfp4", None, None),                       # OCP MXFP4 repacked losslessly into GGML MXFP4
    ("qwen3_moe", "mxfp4_ggml", None, [{"pattern": "*.self_attn.*", "weight": "q8_0"}]),
    ("qwen3", "nvfp4_ggml", None, [{"pattern": "*.mlp.*", "weight": "q5_0"}]),
    ("qwen2", "mxfp4", None, None),                       # q/k/v biases -> attn_{q,k,v}.bias (F32)
]


def _id(c):
    return f"{c[0]}-{c[1]}" + ("-" + c[3][0]["weight"] if c[3] else "") + ("-w4a4" if c[2] else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_gguf_export_passes_gate(tmp_path, case):
    kind, fmt, act, rules = case
    cm = student(kind, fmt, act, rules=rules)
    out = tmp_path / "g"
    res = export(cm, out, engine="llama_cpp")
    v = verify(out, cm, llama_cpp=False)
    assert v.ok, v.table()
    # llama.cpp's own tokenizer on this file gives the HF tokenizer's ids, BOS/EOS included (gguf_tokenizer.py)
    tp = tokenizer_parity(out / "model.gguf", cm.source_dir)
    assert tp.status == "ok", (tp.detail, tp.mismatches[:3])
    for name in cm.packed:
        assert {"bytes", "weights", "weights (libggml C)"} <= {c.check for c in v.checks if c.tensor == name}
    lg = [c for c in v.checks if c.tensor == "logits"]
    assert lg and all(c.status == "ok" for c in lg)
    if not any(k.endswith(".scale") for k in _tensors(out)):
        # weights decode bit-exactly and transformers' own GGUF loader gives identical logits
        assert v.logits["transformers GGUF loader"]["exact"]

    r = gguf.GGUFReader(str(out / "model.gguf"))
    t = _tensors(out)
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[kind]
    assert _str(r, "general.architecture") == arch
    assert _str(r, "tokenizer.ggml.model") == "gpt2"
    # the test tokenizer is plain GPT-2 byte-level BPE: llama.cpp's "gpt-2" split, whatever the architecture
    # (the family names -- llama-bpe, qwen2, smollm -- are checked against llama.cpp in test_gguf_tokenizer.py)
    assert _str(r, "tokenizer.ggml.pre") == "gpt-2"
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert "tokenizer.ggml.merges" in r.fields and "tokenizer.chat_template" in r.fields
    # norms, routers and every 1-D tensor F32; embeddings stay bf16
    for name, tt in t.items():
        if name.endswith("_norm.weight") or ".ffn_gate_inp." in name or len(tt.shape) == 1:
            assert tt.tensor_type == gguf.GGMLQuantizationType.F32, name
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    if kind == "qwen3_moe":
        assert f"{arch}.expert_feed_forward_length" in r.fields
        ex = t["blk.0.ffn_gate_exps.weight"]
        assert list(ex.shape) == [256, 256, 4]  # ne = {in, out, E}
        if fmt == "nvfp4":
            assert list(t["blk.0.ffn_down_exps.scale"].shape) == [4]
    if fmt == "nvfp4":
        assert t["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.NVFP4
        assert ("blk.0.attn_q.input_scale" in t) == bool(act)
        if act and kind == "qwen3_moe":  # llama.cpp rejects any other shape for _exps
            assert list(t["blk.0.ffn_up_exps.input_scale"].shape) == [4]
    if kind == "qwen2":
        assert t["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    assert json.loads((out / "qatfactory.json").read_text())["architecture"] == arch
    assert "model.gguf" in res.files


def _tensors(out):
    return {x.name: x for x in gguf.GGUFReader(str(out / "model.gguf")).tensors}


def _str(r, key):
    f = r.fields[key]
    return bytes(f.parts[f.data[0]]).decode()


def test_llama_qk_rows_are_permuted(tmp_path):
    cm = student("llama", "q4_k_m", None)
    out = tmp_path / "g"
    export(cm, out, engine="llama_cpp")
    t = _tensors(out)
    for key, gname, heads in (("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", 4),
                              ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", 2)):
        raw = np.asarray(t[gname].data)
        want, _, _ = packed_to_gguf(key, cm.packed[key])
        assert not np.array_equal(raw, want)          # permuted on disk
        assert np.array_equal(unpermute_rows(raw, heads), want)
        hd = want.shape[0] // heads
        assert np.array_equal(raw[1], want[hd // 2])  # row 1 of head 0 = HF row hd/2 (interleaved RoPE)
    # qwen3 keeps NeoX order
    a = np.arange(24).reshape(12, 2)
    assert np.array_equal(unpermute_rows(permute_rows(a, 2), 2), a)


def test_gguf_tokenizer_matches_hf(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    cm = student("qwen3", "mxfp4", None)
    out = tmp_path / "g"
    export(cm, out, engine="llama_cpp")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(source_dir() / "tokenizer.json"))
    g = AutoTokenizer.from_pretrained(str(out), gguf_file="model.gguf")
    text = "the quick brown fox, hello tokens 42"
    assert g.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    r = gguf.GGUFReader(str(out / "model.gguf"))
    f = r.fields["tokenizer.ggml.tokens"]
    toks = [bytes(f.parts[i]).decode() for i in f.data]
    assert len(toks) == 320 and toks[hf.convert_tokens_to_ids("</s>")] == "</s>"
    assert toks[-1].startswith("[PAD")  # vocab rows beyond the tokenizer


def test_gguf_refusals(tmp_path):
    cm = copy.deepcopy(student("qwen3", "mxfp4", None))
    name = "model.layers.0.mlp.down_proj.weight"
    cm.packed[name].scales[0, 0] = 255  # a NaN E8M0 scale: no ggml encoding decodes to it
    with pytest.raises(ExportError, match="decodes to different values.*mxfp4_ggml"):
        export(cm, tmp_path / "g", engine="llama_cpp")
    assert not (tmp_path / "g").exists()
    from qatfactory.formats import get_format
    p = get_format("nvfp4").quantize(torch.randn(8, 48), amax=torch.tensor(4.0))
    with pytest.raises(ExportError, match="multiple of 64"):
        packed_to_gguf("x.weight", p)
    bad = copy.deepcopy(student("qwen3", "mxfp4", None))
    bad.config = dict(bad.config, model_type="gpt2")
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'.*supported"):
        export(bad, tmp_path / "g", engine="llama_cpp")
    act = copy.deepcopy(student("qwen3", "nvfp4_ggml", None, rules=[{"pattern": "*.mlp.*", "weight": "q5_0"}]))
    next(iter(act.packed.values())).format = "nvfp4_act"
    with pytest.raises(NotImplementedError, match="supported: q4_k"):
        export(act, tmp_path / "g", engine="llama_cpp")


def test_gguf_atomic(tmp_path, monkeypatch):
    cm = student("qwen3", "mxfp4", None)

    def boom(self, *a, **k):
        raise OSError("injected failure while writing tensors")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", boom)
    with pytest.raises(OSError, match="injected"):
        export(cm, tmp_path / "g", engine="llama_cpp")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.llama_cpp
@pytest.mark.parametrize("case", [("llama", "q4_k_m", None, None), ("qwen3_moe", "nvfp4", "nvfp4_act", None),
                                  ("qwen3", "mxfp4", None, None)], ids=lambda c: f"{c[0]}-{c[1]}")
def test_llama_cpp_runtime(tmp_path, case):
    """llama.cpp itself loads the file and its logits follow the student's within the noise of its
    Q8 activation quantization (an F32 control of the same weights gave 0.06-0.08 %)."""
    pytest.importorskip("llama_cpp")
    kind, fmt, act, rules = case
    cm = student(kind, fmt, act, rules=rules)
    out = tmp_path / "g"
    export(cm, out, engine="llama_cpp")
    v = verify(out, cm, llama_cpp=True)
    assert v.ok, v.table()
    assert v.logits["llama.cpp"]["max_rel"] < 0.05
