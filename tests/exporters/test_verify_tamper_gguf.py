"""Tampering the parity gate must catch in GGUF exports (llama.cpp): FAIL (or INCOMPLETE when a
required library is hidden), never PASS, with rows naming what is wrong. Edits go through gguf-py
(a writable memory map for in-place byte/metadata edits, its writer to drop or add tensors)."""
from __future__ import annotations

import os
import shutil

import gguf  # noqa: E402  (an install requirement: missing, these tests fail)
import numpy as np
import pytest
from tamper_helpers import edit_json, exported, gguf_rw, hide, rewrite_gguf, rows

from qatfactory.exporters import verify

NV = "llama_cpp-gguf-llama-nvfp4-w4a4"       # NVFP4 + .scale/.input_scale, Q/K permuted
QK = "llama_cpp-gguf-llama-q4_k_m-w4a16"     # Q4_K/Q6_K blocks as trained, Q/K permuted
MX = "llama_cpp-gguf-qwen3-mxfp4-w4a16"      # OCP MXFP4 repacked, no permutation
DOWN = "model.layers.0.mlp.down_proj.weight"

pytestmark = pytest.mark.llama_cpp  # runs llama.cpp's own runtime (in make test)


def _fail(v, *want):
    assert v.verdict == "FAIL" and not v.ok, v.table()
    got = rows(v, "FAIL")
    for w in want:
        assert w in got, f"expected a FAIL row {w}; got {sorted(got)}\n{v.table()}"
    return got


def _g(out):
    return out / "model.gguf"


def test_dropped_input_scales_and_edited_record(tmp_path):
    cm, out = exported(tmp_path, NV)
    r = gguf.GGUFReader(str(_g(out)))
    rewrite_gguf(_g(out), drop=[t.name for t in r.tensors if t.name.endswith(".input_scale")])
    edit_json(out / "qatfactory.json", lambda x: x.update(mode="w4a16", activation_formats=[]))
    v = verify(out, cm)
    got = _fail(v, ("qatfactory.json", "record == student"))
    for name in cm.packed:
        assert (name, "bytes") in got
    assert "input_scale missing (the student is W4A4)" in v.table()


@pytest.mark.parametrize("cell_id,gname", [(NV, "blk.0.ffn_down.weight"), (QK, "blk.0.ffn_down.weight"),
                                           (MX, "blk.0.ffn_down.weight"), (QK, "blk.0.attn_q.weight")])
def test_flipped_code_byte(tmp_path, cell_id, gname):
    cm, out = exported(tmp_path, cell_id)
    r = gguf_rw(_g(out))
    t = next(t for t in r.tensors if t.name == gname)
    t.data[1, -3] ^= 0x10            # a code byte (the tail of a block holds codes in every type)
    del r
    name = "model.layers.0." + ("mlp.down_proj.weight" if "ffn_down" in gname else "self_attn.q_proj.weight")
    _fail(verify(out, cm), (name, "bytes"), (name, "weights"))


@pytest.mark.parametrize("cell_id", [NV, QK, MX])
def test_swapped_scale_bytes(tmp_path, cell_id):
    """Two scale bytes of one block swapped (NVFP4: two UE4M3 sub-block scales; MXFP4: the E8M0
    bytes of two blocks; Q4_K: the fp16 d and dmin)."""
    cm, out = exported(tmp_path, cell_id)
    r = gguf_rw(_g(out))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight")
    row = t.data[2]
    if t.tensor_type.name == "NVFP4":
        i, j = 0, next(k for k in range(1, 4) if row[k] != row[0])
    elif t.tensor_type.name == "MXFP4":
        i, j = 0, next(17 * k for k in range(1, row.size // 17) if row[17 * k] != row[0])
    else:  # Q4_K/Q6_K: d (bytes 0-1) vs dmin (2-3) for Q4_K; Q6_K: its fp16 d is at the end
        i, j = (0, 2) if t.tensor_type.name == "Q4_K" else (row.size - 2, row.size - 1)
    row[i], row[j] = row[j].copy(), row[i].copy()
    del r
    _fail(verify(out, cm), (DOWN, "bytes"), (DOWN, "weights"))


def test_nvfp4_per_tensor_scale_edited(tmp_path):
    cm, out = exported(tmp_path, NV)
    r = gguf_rw(_g(out))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.scale")
    t.data[0] *= 2
    del r
    _fail(verify(out, cm), (DOWN, "bytes"), (DOWN, "weights"))


@pytest.mark.parametrize("cell_id", [NV, QK])
def test_skipped_qk_permutation(tmp_path, monkeypatch, cell_id):
    """Both permute functions replaced with the identity: the file has HF row order, which
    llama.cpp's interleaved RoPE reads wrongly. transformers' un-permutation exposes it."""
    import qatfactory.exporters.llama_cpp as L
    monkeypatch.setattr(L, "permute_rows", lambda a, n: a)
    monkeypatch.setattr(L, "unpermute_rows", lambda a, n: a)
    cm, out = exported(tmp_path, cell_id)
    v = verify(out, cm)
    got = _fail(v, ("model.layers.0.self_attn.q_proj.weight", "bytes"),
                ("model.layers.0.self_attn.k_proj.weight", "bytes"))
    assert ("model.layers.0.self_attn.v_proj.weight", "bytes") not in got


def test_permutation_on_a_neox_architecture(tmp_path, monkeypatch):
    """qwen3 uses NeoX RoPE in llama.cpp: q/k rows permuted anyway are wrong."""
    import qatfactory.exporters.llama_cpp as L
    monkeypatch.setitem(L.ARCHS, "qwen3", ("qwen3", True, "qwen2"))
    cm, out = exported(tmp_path, MX)
    _fail(verify(out, cm), ("model.layers.0.self_attn.q_proj.weight", "bytes"))


@pytest.mark.parametrize("drop", ["blk.0.ffn_norm.weight", "blk.0.attn_q.scale", "blk.0.ffn_down.weight",
                                  "output.weight"])
def test_removed_tensor(tmp_path, drop):
    cm, out = exported(tmp_path, NV)
    rewrite_gguf(_g(out), drop=[drop])
    v = verify(out, cm)
    assert v.verdict == "FAIL", v.table()
    assert drop in v.table() and "Traceback" not in v.table()


def test_extra_tensor(tmp_path):
    cm, out = exported(tmp_path, MX)
    rewrite_gguf(_g(out), extra={"blk.0.attn_smuggled.weight": np.zeros((4, 4))})
    v = verify(out, cm)
    _fail(v, ("tensors", "none extra"))
    assert "attn_smuggled" in v.table()


def test_wrong_tensor_type(tmp_path):
    """NVFP4 bytes declared as Q4_0 (18 bytes per 32 either way, so the file stays well-formed)."""
    cm, out = exported(tmp_path, "llama_cpp-gguf-qwen3-nvfp4_ggml+q5_0-w4a16")
    rewrite_gguf(_g(out), retype={"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_0})
    v = verify(out, cm)
    _fail(v, ("model.layers.0.self_attn.q_proj.weight", "bytes"))
    assert "is Q4_0" in v.table()


# ------------------------------------------------------------------------------ metadata values
@pytest.mark.parametrize("key,value", [("rope.freq_base", 500000.0), ("attention.layer_norm_rms_epsilon", 1e-5),
                                       ("attention.head_count_kv", 4), ("context_length", 64),
                                       ("block_count", 2), ("embedding_length", 128)])
def test_edited_metadata_value(tmp_path, key, value):
    cm, out = exported(tmp_path, QK)
    r = gguf_rw(_g(out))
    f = r.fields[f"llama.{key}"]
    f.parts[f.data[0]][0] = value
    del r
    v = verify(out, cm)
    got = _fail(v, ("metadata", "hyperparameters == student"))
    assert f"llama.{key}" in v.table()
    if key in ("rope.freq_base", "attention.layer_norm_rms_epsilon", "attention.head_count_kv"):
        assert ("metadata", "transformers GGUF config == student") in got
    if key == "rope.freq_base":
        # llama.cpp's own run of the file sees it too: the tipping bound (its largest of five tipped
        # forwards) is far below a gross error's KL
        assert ("logits", "llama.cpp runtime") in got, v.table()


def test_removed_metadata_key(tmp_path):
    """head_count_kv removed: llama.cpp then uses head_count (4); the student has 2."""
    cm, out = exported(tmp_path, QK)
    rewrite_gguf(_g(out), drop_kv=["llama.attention.head_count_kv"])
    v = verify(out, cm)
    _fail(v, ("metadata", "hyperparameters == student"))
    assert "llama.cpp uses 4, the student 2" in v.table()


# ------------------------------------------------------------------------------ NaN
def test_nan_in_a_norm(tmp_path):
    cm, out = exported(tmp_path, MX)
    r = gguf_rw(_g(out))
    next(t for t in r.tensors if t.name == "blk.0.ffn_norm.weight").data[3] = np.nan
    del r
    v = verify(out, cm)
    _fail(v, ("model.layers.0.post_attention_layernorm.weight", "dense"))
    assert "NaN" in v.table()


def test_nan_scale(tmp_path):
    cm, out = exported(tmp_path, NV)
    r = gguf_rw(_g(out))
    next(t for t in r.tensors if t.name == "blk.0.ffn_down.scale").data[0] = np.nan
    del r
    _fail(verify(out, cm), (DOWN, "bytes"), (DOWN, "weights"))


def test_all_nan_dense(tmp_path):
    import copy

    import torch
    cm, out = exported(tmp_path, MX)
    bad = copy.deepcopy(cm)
    for k, t in bad.dense.items():
        bad.dense[k] = torch.full_like(t, float("nan"))
    r = gguf_rw(_g(out))
    for t in r.tensors:
        if t.tensor_type.name == "F32":
            t.data[...] = np.nan
    del r
    v = verify(out, bad)
    assert v.verdict == "FAIL" and ("model.norm.weight", "dense") in rows(v, "FAIL"), v.table()


# ------------------------------------------------------------------------------ files
def test_record_gguf_file_is_never_followed(tmp_path):
    """qatfactory.json pointing at a good file outside the export while model.gguf inside is
    corrupted: the gate reads model.gguf (and says the record is wrong)."""
    cm, out = exported(tmp_path, QK)
    good = tmp_path / "good"
    shutil.copytree(out, good)
    r = gguf_rw(_g(out))
    next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight").data[0, -1] ^= 0x44
    del r
    edit_json(out / "qatfactory.json", lambda x: x.update(gguf_file="../good/model.gguf"))
    v = verify(out, cm)
    _fail(v, ("model.layers.0.mlp.up_proj.weight", "bytes"), ("qatfactory.json", "record == student"))


def test_gguf_symlink_leaving_the_export(tmp_path):
    cm, out = exported(tmp_path, QK)
    shutil.move(str(_g(out)), str(tmp_path / "x.gguf"))
    os.symlink(tmp_path / "x.gguf", _g(out))
    v = verify(out, cm)
    _fail(v, ("model.gguf", "found"))
    assert "outside the export directory" in v.table()


def test_two_gguf_files_without_model_gguf(tmp_path):
    cm, out = exported(tmp_path, QK)
    shutil.copy(_g(out), out / "b.gguf")
    os.replace(_g(out), out / "a.gguf")
    _fail(verify(out, cm), ("model.gguf", "found"))
    os.remove(out / "b.gguf")  # the only *.gguf is found by that name
    edit_json(out / "qatfactory.json", lambda x: x.update(gguf_file="a.gguf"))
    assert verify(out, cm).verdict == "PASS"


def test_truncated_gguf(tmp_path):
    cm, out = exported(tmp_path, MX)
    p = _g(out)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    v = verify(out, cm)
    assert v.verdict == "FAIL" and "Traceback" not in v.table(), v.table()


# ------------------------------------------------------------------------------ libraries hidden
@pytest.mark.parametrize("module,install", [("libggml", "pip install libggml-python"),
                                            ("llama_cpp", "pip install llama-cpp-python (or: python "
                                                          "scripts/llama_cpp_runtime.py ensure)")])
def test_hidden_library_is_incomplete(tmp_path, monkeypatch, module, install):
    cm, out = exported(tmp_path, NV)
    hide(monkeypatch, module)
    v = verify(out, cm)
    assert v.verdict == "INCOMPLETE" and not v.ok, v.table()
    assert v.to_install() == [install]
    assert f"to complete the gate: {install}" in v.table()


def test_hidden_gguf_is_incomplete(tmp_path, monkeypatch):
    cm, out = exported(tmp_path, MX)
    hide(monkeypatch, "gguf")
    v = verify(out, cm)
    assert v.verdict == "INCOMPLETE" and v.to_install() == ["pip install gguf"], v.table()


def test_opting_out_of_llama_cpp_is_incomplete(tmp_path):
    cm, out = exported(tmp_path, MX)
    v = verify(out, cm, llama_cpp=False)
    assert v.verdict == "INCOMPLETE" and not v.failures
    # both llama.cpp rows are not run: its runtime's logits and its tokenizer on the file
    assert sorted((c.tensor, c.check) for c in v.incomplete) == [
        ("logits", "llama.cpp runtime"), ("tokenizer", "llama.cpp tokenization == transformers")]
    assert all("opted out" in c.detail for c in v.incomplete)


def test_llama_cpp_that_cannot_run_the_file_is_a_fail(tmp_path, monkeypatch):
    """A runner that dies (as llama.cpp's AMX path did here) is no pass."""
    import importlib
    rt = importlib.import_module("qatfactory.exporters.verify.llama_cpp_runtime")
    monkeypatch.setattr(rt, "_RUNNER", "import os; os.kill(os.getpid(), 11)")
    cm, out = exported(tmp_path, MX)
    v = verify(out, cm)
    _fail(v, ("logits", "llama.cpp runtime"))
    assert "signal 11" in v.table()


def test_wrong_engine_in_record(tmp_path):
    cm, out = exported(tmp_path, MX)
    edit_json(out / "qatfactory.json", lambda x: x.update(engine="vllm"))
    _fail(verify(out, cm), ("qatfactory.json", "engine"))
    edit_json(out / "qatfactory.json", lambda x: x.update(engine="tgi"))
    _fail(verify(out, cm), ("qatfactory.json", "engine"))
