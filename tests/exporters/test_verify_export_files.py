"""Every file in a vLLM / SGLang export is one the gate compared: a weight file neither the index nor
the exporter names (a loader reading every *.safetensors in the folder would load it), a chat template
or tokenizer file the student's source does not have, anything an engine or transformers could read
that the exporter did not write -- each a FAIL naming the file. A model card stays harmless."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
from tamper_helpers import cell, exported, rows

from qatfactory.exporters import export, verify

CTM = "vllm-compressed-tensors-qwen3-mxfp4-w4a16"
MO = "vllm-modelopt-llama-nvfp4-w4a4"


def _files_fail(v, *words):
    assert v.verdict == "FAIL", v.table()
    row = next(c for c in v.checks if (c.tensor, c.check) == ("files", "none unexpected"))
    assert row.status == "FAIL", v.table()
    for w in words:
        assert w in row.detail, (w, row.detail)


@pytest.mark.parametrize("cell_id", [CTM, MO])
def test_override_shard_beside_model_safetensors(tmp_path, cell_id):
    from safetensors.torch import load_file, save_file
    cm, out = exported(tmp_path, cell_id)
    sd = load_file(str(out / "model.safetensors"))
    save_file({"model.norm.weight": torch.zeros_like(sd["model.norm.weight"])}, str(out / "model-override.safetensors"),
              metadata={"format": "pt"})
    v = verify(out, cm, logits=False)
    _files_fail(v, "model-override.safetensors (a weight file neither the index nor the exporter names")


def test_shard_the_index_does_not_name(tmp_path):
    from test_exporters_helpers import cell_student
    cm = cell_student(cell(CTM))
    out = tmp_path / "e"
    export(cm, out, engine="vllm", flavour="compressed-tensors", max_shard_bytes=200_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    assert verify(out, cm).verdict == "PASS"
    shutil.copy(out / shards[0], out / "model.safetensors")
    shutil.copy(out / shards[-1], out / "model-00099-of-00099.safetensors")
    v = verify(out, cm, logits=False)
    _files_fail(v, "model.safetensors (a weight file", "model-00099-of-00099.safetensors")


def test_added_chat_template_and_unknown_files(tmp_path):
    cm, out = exported(tmp_path, CTM)
    (out / "README.md").write_text("# a model card: no engine reads it")
    assert verify(out, cm).verdict == "PASS"
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text("Always answer 42.")
    (out / "tokenization_custom.py").write_text("raise SystemExit")
    v = verify(out, cm, logits=False)
    assert ("source files", "== student's source_dir") in rows(v, "FAIL"), v.table()
    assert "additional_chat_templates/tool_use.jinja is not in the student's source_dir" in v.table()
    _files_fail(v, "tokenization_custom.py")
    assert "README.md" not in next(c.detail for c in v.checks if c.tensor == "files")


def test_named_templates_of_the_source_are_shipped_and_compared(tmp_path):
    from test_exporters_helpers import cell_student
    src = tmp_path / "src"
    base = cell_student(cell(CTM))
    shutil.copytree(base.source_dir, src)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages }}")
    cm = copy.copy(base)
    cm.source_dir = str(src)
    export(cm, tmp_path / "e", engine="vllm", flavour="compressed-tensors")
    assert (tmp_path / "e" / "additional_chat_templates" / "tool_use.jinja").read_text() == "TOOLS {{ messages }}"
    assert verify(tmp_path / "e", cm).verdict == "PASS"
    (tmp_path / "e" / "additional_chat_templates" / "tool_use.jinja").write_text("Always answer 42.")
    v = verify(tmp_path / "e", cm, logits=False)
    assert "additional_chat_templates/tool_use.jinja differs" in v.table(), v.table()


def test_a_hub_download_or_clone_bookkeeping_is_not_a_file_an_engine_reads(tmp_path):
    cm, out = exported(tmp_path, CTM)
    (out / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (out / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("abc\n")
    (out / ".git" / "lfs").mkdir(parents=True)
    (out / ".git" / "lfs" / "blob.safetensors").write_bytes(b"x")
    assert verify(out, cm).verdict == "PASS"
