"""Tampering the parity gate must catch, for each safetensors flavour (vLLM/SGLang ModelOpt NVFP4,
compressed-tensors NVFP4, compressed-tensors MXFP4): every edit below gives FAIL (or INCOMPLETE when a
required library is hidden), never PASS, and the rows name what is wrong. The exports are real
matrix cells; the edits are what a hostile or careless user could do to the files.
(GGUF: tests/exporters/test_verify_tamper_gguf.py.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tamper_helpers import edit_json, edit_tensors, exported, hide, rows

from qatfactory.exporters import verify

MO = "vllm-modelopt-llama-nvfp4-w4a4"
CTN = "vllm-compressed-tensors-llama-nvfp4-w4a4"
CTM = "vllm-compressed-tensors-qwen3-mxfp4-w4a16"
CTM_A4 = "vllm-compressed-tensors-qwen3_moe-mxfp4_rceil-w4a4"
FLAVOURS = [MO, CTN, CTM]
M = "model.layers.0.mlp.down_proj"


def _packed_key(cell_id):
    return ".weight" if "modelopt" in cell_id else ".weight_packed"


def _fail(v, *want):
    assert v.verdict == "FAIL" and not v.ok, v.table()
    got = rows(v, "FAIL")
    for w in want:
        assert w in got, f"expected a FAIL row {w}; got {sorted(got)}\n{v.table()}"
    return got


# ------------------------------------------------------------------ a W4A4 student passed off as W4A16
def test_w4a4_student_exported_as_w4a16_fails(tmp_path):
    """input_scale tensors dropped, quant_algo and qatfactory.json edited to say W4A16: the student
    (W4A4) is the truth, so every module's missing input scale is named."""
    cm, out = exported(tmp_path, MO)
    edit_tensors(out, lambda sd: [sd.pop(k) for k in [k for k in sd if k.endswith(".input_scale")]])
    edit_json(out / "qatfactory.json", lambda r: r.update(mode="w4a16", activation_formats=[]))
    edit_json(out / "hf_quant_config.json", lambda h: h["quantization"].update(quant_algo="W4A16_NVFP4"))

    def cfg(c):
        c["quantization_config"].update(quant_algo="W4A16_NVFP4")
        c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    edit_json(out / "config.json", cfg)
    v = verify(out, cm)
    got = _fail(v, ("qatfactory.json", "record == student"), ("hf_quant_config.json", "config == student"),
                ("config.json", "quantization_config == student"), ("tensors", "none missing"))
    for name in cm.packed:
        assert (name[: -len(".weight")], "bytes") in got
    assert "input_scale missing (the student is W4A4)" in v.table()


@pytest.mark.parametrize("cell_id", [CTN, CTM_A4])
def test_ct_w4a4_as_w4a16_fails(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)
    if "nvfp4" in cell_id:
        edit_tensors(out, lambda sd: [sd.pop(k) for k in [k for k in sd if k.endswith(".input_global_scale")]])
    edit_json(out / "config.json", lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        input_activations=None))
    edit_json(out / "qatfactory.json", lambda r: r.update(mode="w4a16"))
    v = verify(out, cm)
    _fail(v, ("config.json", "quantization_config == student"), ("qatfactory.json", "record == student"))


# ------------------------------------------------------------------------------ bytes
@pytest.mark.parametrize("cell_id", FLAVOURS)
def test_flipped_code_byte(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)
    key = M + _packed_key(cell_id)

    def flip(sd):
        sd[key][3, 5] ^= 0x10
    edit_tensors(out, flip)
    _fail(verify(out, cm), (M, "bytes"), (M, "weights"))


@pytest.mark.parametrize("cell_id", FLAVOURS)
def test_swapped_scale_bytes(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)

    def swap(sd):
        s = sd[M + ".weight_scale"].view(torch.uint8)
        flat = s.reshape(-1)
        j = int((flat != flat[0]).nonzero()[0])  # two different bytes
        a, b = flat[0].clone(), flat[j].clone()
        flat[0], flat[j] = b, a
        sd[M + ".weight_scale"] = s.view(sd[M + ".weight_scale"].dtype)
    edit_tensors(out, swap)
    _fail(verify(out, cm), (M, "bytes"), (M, "weights"))


@pytest.mark.parametrize("cell_id", FLAVOURS)
def test_changed_group_size(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)
    if "modelopt" in cell_id:
        edit_json(out / "hf_quant_config.json", lambda h: h["quantization"].update(group_size=32))
        edit_json(out / "config.json", lambda c: c["quantization_config"].update(group_size=32))
        _fail(verify(out, cm), ("hf_quant_config.json", "config == student"),
              ("config.json", "quantization_config == student"))
    else:
        edit_json(out / "config.json", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"]
                  .update(group_size=64))
        _fail(verify(out, cm), ("config.json", "quantization_config == student"))


# ------------------------------------------------------------------------------ tensors missing / extra
@pytest.mark.parametrize("cell_id,suffix", [(MO, ".weight_scale_2"), (MO, ".weight"), (CTN, ".weight_packed"),
                                            (CTN, ".weight_global_scale"), (CTM, ".weight_scale"),
                                            (CTM, "@model.norm.weight")])
def test_removed_tensor_is_named_not_a_traceback(tmp_path, cell_id, suffix):
    cm, out = exported(tmp_path, cell_id)
    key = suffix[1:] if suffix.startswith("@") else M + suffix
    edit_tensors(out, lambda sd: sd.pop(key))
    v = verify(out, cm)
    got = _fail(v, ("tensors", "none missing"))
    assert key in v.table() and "Traceback" not in v.table()
    if not suffix.startswith("@"):
        assert (M, "bytes") in got


@pytest.mark.parametrize("cell_id", FLAVOURS)
def test_extra_tensor(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)
    edit_tensors(out, lambda sd: sd.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    v = verify(out, cm)
    _fail(v, ("tensors", "none extra"))
    assert "extra_proj" in v.table()


def test_extra_tensor_in_a_shard_the_index_does_not_map(tmp_path):
    cm, out = exported(tmp_path, CTN, max_shard_bytes=400_000)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    edit_tensors(out, lambda sd: sd.update({"smuggled": torch.ones(2)}), fname=shard)
    v = verify(out, cm)
    _fail(v, ("tensors", "readable"))
    assert "smuggled" in v.table()


# ------------------------------------------------------------------------------ third-party libraries hidden
def test_hidden_modelopt_is_incomplete(tmp_path, monkeypatch):
    cm, out = exported(tmp_path, MO)
    hide(monkeypatch, "modelopt")
    v = verify(out, cm)
    assert v.verdict == "INCOMPLETE" and not v.ok, v.table()
    assert "pip install nvidia-modelopt" in v.table() and v.to_install() == ["pip install nvidia-modelopt"]


@pytest.mark.parametrize("cell_id", [CTN, CTM])
def test_hidden_compressed_tensors_is_incomplete(tmp_path, monkeypatch, cell_id):
    cm, out = exported(tmp_path, cell_id)
    hide(monkeypatch, "compressed_tensors")
    v = verify(out, cm)
    assert v.verdict == "INCOMPLETE", v.table()
    assert "pip install compressed-tensors" in v.to_install()


def test_hidden_compressed_tensors_and_garbled_config_never_pass(tmp_path, monkeypatch):
    """The failure guarded against: with compressed-tensors missing every check turned into 'skip'."""
    cm, out = exported(tmp_path, CTN)
    edit_json(out / "config.json", lambda c: c["quantization_config"].update(
        format="garbage", config_groups={"group_0": {"weights": "nonsense"}}))
    hide(monkeypatch, "compressed_tensors")
    v = verify(out, cm)
    assert v.verdict in ("INCOMPLETE", "FAIL") and not v.ok, v.table()
    assert not any(c.status == "skip" for c in v.checks)
    monkeypatch.undo()
    _fail(verify(out, cm), ("config.json", "quantization_config == student"))


def test_hidden_transformers_logits_is_incomplete(tmp_path, monkeypatch):
    cm, out = exported(tmp_path, MO)
    import importlib
    common = importlib.import_module("qatfactory.exporters.verify.common")

    def no_transformers(*a, **k):
        from qatfactory.exporters.verify.result import Missing
        raise Missing("transformers")
    monkeypatch.setattr(common, "need", lambda m: no_transformers() if m.startswith("transformers") else
                        importlib.import_module(m))
    v = verify(out, cm)
    assert v.verdict == "INCOMPLETE", v.table()


# ------------------------------------------------------------------------------ config values
@pytest.mark.parametrize("cell_id", FLAVOURS)
@pytest.mark.parametrize("key,value", [("rms_norm_eps", 1e-5), ("rope_theta", 500000.0), ("hidden_act", "gelu"),
                                       ("num_key_value_heads", 4), ("max_position_embeddings", 64),
                                       ("tie_word_embeddings", True), ("vocab_size", 300)])
def test_edited_config_value(tmp_path, cell_id, key, value):
    cm, out = exported(tmp_path, cell_id)

    def ed(c):
        if key == "rope_theta":
            c["rope_parameters"] = dict(c["rope_parameters"], rope_theta=value)
        else:
            c[key] = value
    edit_json(out / "config.json", ed)
    v = verify(out, cm)
    got = _fail(v, ("config.json", "model config == student"))
    if key in ("rms_norm_eps", "rope_theta", "hidden_act"):
        # and the logits of a model built from the exported config differ too
        assert ("logits", next(c.check for c in v.checks if c.tensor == "logits")) in got


def test_unknown_config_key_and_architecture(tmp_path):
    cm, out = exported(tmp_path, CTM)
    edit_json(out / "config.json", lambda c: c.update(architectures=["MistralForCausalLM"], sliding_window_x=8))
    v = verify(out, cm)
    _fail(v, ("config.json", "model config == student"))
    assert "sliding_window_x" in v.table() and "architectures" in v.table()


def test_ignore_list_quantizes_a_different_set(tmp_path):
    """lm_head dropped from ignore: compressed-tensors would now quantize it (it is bf16 on disk)."""
    cm, out = exported(tmp_path, CTN)
    edit_json(out / "config.json", lambda c: c["quantization_config"].update(ignore=[]))
    _fail(verify(out, cm), ("config.json", "quantization_config == student"),
          ("modules", "quantized set (compressed-tensors)"))
    cm, out = exported(tmp_path, MO, name="m")
    edit_json(out / "config.json", lambda c: c["quantization_config"].update(ignore=[], exclude_modules=[]))
    _fail(verify(out, cm), ("modules", "quantized set (exclude_modules)"))


# ------------------------------------------------------------------------------ NaN / Inf
@pytest.mark.parametrize("cell_id", FLAVOURS)
def test_nan_in_a_dense_tensor(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)

    def nan(sd):
        sd["model.norm.weight"][7] = float("nan")
    edit_tensors(out, nan)
    v = verify(out, cm)
    _fail(v, ("model.norm.weight", "dense"))
    assert "NaN" in v.table()


@pytest.mark.parametrize("cell_id", FLAVOURS)
def test_nan_block_scale(tmp_path, cell_id):
    cm, out = exported(tmp_path, cell_id)

    def nan(sd):
        s = sd[M + ".weight_scale"]
        b = s.view(torch.uint8).clone()
        b.reshape(-1)[0] = 0x7F if s.dtype == torch.float8_e4m3fn else 0xFF
        sd[M + ".weight_scale"] = b.view(s.dtype)
    edit_tensors(out, nan)
    v = verify(out, cm)
    _fail(v, (M, "bytes"))
    assert "NaN block scales" in v.table()


def test_all_nan_model_is_not_bit_identical(tmp_path):
    """Every dense tensor NaN and the student the same: the old gate called that bit-identical."""
    import copy
    cm, out = exported(tmp_path, MO)
    bad = copy.deepcopy(cm)
    for k, t in bad.dense.items():
        bad.dense[k] = torch.full_like(t, float("nan"))
    edit_tensors(out, lambda sd: [sd.__setitem__(k, torch.full_like(sd[k], float("nan"))) for k in bad.dense])
    v = verify(out, bad)
    assert v.verdict == "FAIL" and ("model.norm.weight", "dense") in rows(v, "FAIL"), v.table()


# ------------------------------------------------------------------------------ rows outside the prompt
@pytest.mark.parametrize("logits", [True, False])
def test_embedding_row_outside_the_prompt(tmp_path, logits):
    """The 12-token prompt never reads row 299 of an untied embedding; the bytes check does."""
    cm, out = exported(tmp_path, CTM)
    from qatfactory.exporters.verify import default_prompt
    assert 299 not in default_prompt(cm.config["vocab_size"])

    def ed(sd):
        sd["model.embed_tokens.weight"][299] += 1
        sd["lm_head.weight"][301] += 1
    edit_tensors(out, ed)
    v = verify(out, cm, logits=logits)
    _fail(v, ("model.embed_tokens.weight", "dense"), ("lm_head.weight", "dense"))


def test_dense_dtype_change(tmp_path):
    cm, out = exported(tmp_path, CTM)
    edit_tensors(out, lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].float()}))
    _fail(verify(out, cm), ("model.norm.weight", "dense"))


# ------------------------------------------------------------------------------ paths that leave the export
def test_index_weight_map_leaving_the_export_is_not_read(tmp_path):
    """A shard moved out of the directory and the index pointed at it (../): the content is the
    correct one, so reading it would pass; the gate must refuse the path instead."""
    cm, out = exported(tmp_path, CTN, max_shard_bytes=400_000)
    idx_p = out / "model.safetensors.index.json"
    idx = json.loads(idx_p.read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    os.replace(out / shard, tmp_path / shard)
    idx["weight_map"] = {k: ("../" + v if v == shard else v) for k, v in idx["weight_map"].items()}
    idx_p.write_text(json.dumps(idx))
    v = verify(out, cm)
    _fail(v, ("tensors", "readable"))
    assert "not a plain file name" in v.table()


def test_shard_symlink_leaving_the_export(tmp_path):
    cm, out = exported(tmp_path, MO)
    shutil.move(str(out / "model.safetensors"), str(tmp_path / "elsewhere.safetensors"))
    os.symlink(tmp_path / "elsewhere.safetensors", out / "model.safetensors")
    v = verify(out, cm)
    _fail(v, ("tensors", "readable"))
    assert "outside the export directory" in v.table()


def test_config_symlink_leaving_the_export(tmp_path):
    cm, out = exported(tmp_path, CTM)
    shutil.move(str(out / "config.json"), str(tmp_path / "config.json"))
    os.symlink(tmp_path / "config.json", out / "config.json")
    _fail(verify(out, cm), ("config.json", "readable"))


def test_garbled_record_and_config(tmp_path):
    cm, out = exported(tmp_path, MO)
    (out / "qatfactory.json").write_text("{not json")
    v = verify(out, cm)
    _fail(v, ("qatfactory.json", "readable"))
    cm, out = exported(tmp_path, CTN, name="b")
    (out / "config.json").write_text("[1, 2")
    v = verify(out, cm)
    _fail(v, ("config.json", "readable"))
    assert "Traceback" not in v.table()


def test_truncated_shard_is_a_fail_not_a_traceback(tmp_path):
    cm, out = exported(tmp_path, CTM)
    p = out / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    v = verify(out, cm)
    _fail(v, ("tensors", "readable"))
    assert "not a readable safetensors file" in v.table()


def test_sglang_dense_mxfp4_is_a_fail(tmp_path):
    """An SGLang-labelled record on a dense-MXFP4 export: SGLang cannot load it."""
    cm, out = exported(tmp_path, CTM)
    edit_json(out / "qatfactory.json", lambda r: r.update(engine="sglang"))
    _fail(verify(out, cm), ("student", "SGLang scheme"))


def test_wrong_student(tmp_path):
    """The export of one student checked against another one (same shapes, other weights)."""
    from test_exporters_helpers import make_student
    cm, out = exported(tmp_path, CTM)
    other = make_student("qwen3", "mxfp4", seed=1)
    v = verify(out, other)
    assert v.verdict == "FAIL" and sum(c.check == "bytes" and c.status == "FAIL" for c in v.checks) == len(cm.packed)


def test_tokenizer_files_are_the_students(tmp_path):
    """The engine tokenizes with the export's tokenizer.json: it must be the base model's, byte for byte."""
    cm, out = exported(tmp_path, CTM)
    assert ("source files", "== student's source_dir") in rows(verify(out, cm), "ok")
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["model"]["vocab"]["the"] = 7
    (out / "tokenizer.json").write_text(json.dumps(tj))
    _fail(verify(out, cm), ("source files", "== student's source_dir"))
    cm, out = exported(tmp_path, CTM, name="b")
    (out / "chat_template.jinja").unlink()
    (out / "special_tokens_map.json").write_text("{}")
    v = verify(out, cm)
    _fail(v, ("source files", "== student's source_dir"))
    assert "chat_template.jinja missing" in v.table() and "special_tokens_map.json is not in" in v.table()


def test_tokenizer_files_without_a_source_dir_are_incomplete(tmp_path):
    """A student that names no base directory cannot vouch for the tokenizer the export ships."""
    import copy
    cm, out = exported(tmp_path, CTM)
    blind = copy.copy(cm)
    blind.source_dir = None
    v = verify(out, blind)
    assert v.verdict == "INCOMPLETE" and ("source files", "== student's source_dir") in rows(v, "INCOMPLETE")
    assert "--source-dir" in v.table()
