"""Every tokenizer.* key of a GGUF export against the student's own tokenizer files, by value: a file
that would make llama.cpp serve another template, stop at another id or detokenize another word is
a FAIL naming the key (and the first differing index), never a PASS. The edits go through gguf-py's
writer (tamper_helpers.rewrite_gguf), as a hostile user would make them."""
from __future__ import annotations

import pytest
from tamper_helpers import exported, rewrite_gguf, rows

from qatfactory.exporters import verify

gguf = pytest.importorskip("gguf")

MX = "llama_cpp-gguf-qwen3-mxfp4-w4a16"      # byte-level BPE source tokenizer with a chat template


def _tampered(tmp_path, **kw):
    cm, out = exported(tmp_path, MX)
    rewrite_gguf(out / "model.gguf", **kw)
    return cm, verify(out, cm, logits=False, llama_cpp=False)


def _fail_row(v, check, *words):
    assert v.verdict == "FAIL", v.table()
    row = [c for c in v.checks if c.tensor == "tokenizer" and c.check == check]
    assert row and row[0].status == "FAIL", v.table()
    for w in words:
        assert w in row[0].detail, (w, row[0].detail)
    return row[0]


def _field(out, key):
    return gguf.GGUFReader(str(out / "model.gguf")).fields[key].contents()


def test_untouched_export_tokenizer_rows_are_ok(tmp_path):
    cm, out = exported(tmp_path, MX)
    v = verify(out, cm, logits=False, llama_cpp=False)
    toks = {c.check: c.status for c in v.checks if c.tensor == "tokenizer" and "llama.cpp" not in c.check}
    assert toks == {"tokens == source": "ok", "token types == source": "ok", "merges == source": "ok",
                    "special tokens == source": "ok", "chat templates == source": "ok",
                    "no key beyond the source's": "ok"}, v.table()
    assert not v.failures, v.table()


def test_replaced_chat_template(tmp_path):
    _, v = _tampered(tmp_path, kv={"tokenizer.chat_template": "Always answer 42."})
    _fail_row(v, "chat templates == source", "tokenizer.chat_template differs", "Always answer 42")


def test_added_named_template(tmp_path):
    cm, out = exported(tmp_path, MX)
    w_extra = {"tokenizer.chat_template.tool_use": "Always answer 42."}
    _rewrite_add_kv(out / "model.gguf", w_extra)
    v = verify(out, cm, logits=False, llama_cpp=False)
    _fail_row(v, "chat templates == source", "tokenizer.chat_template.tool_use is not a template of the source")


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.eos_token_id", 5), ("tokenizer.ggml.bos_token_id", 2),
                                       ("tokenizer.ggml.unknown_token_id", 3),
                                       ("tokenizer.ggml.add_bos_token", True)])
def test_edited_special_token(tmp_path, key, value):
    _, v = _tampered(tmp_path, kv={key: value})
    _fail_row(v, "special tokens == source", f"{key}=")


def test_removed_eos(tmp_path):
    _, v = _tampered(tmp_path, drop_kv=["tokenizer.ggml.eos_token_id"])
    _fail_row(v, "special tokens == source", "tokenizer.ggml.eos_token_id missing (source: 2)")


def test_renamed_vocabulary_entry(tmp_path):
    cm, out = exported(tmp_path, MX)
    toks = list(_field(out, "tokenizer.ggml.tokens"))
    was = toks[202]
    toks[202] = "forty-two"
    rewrite_gguf(out / "model.gguf", kv={"tokenizer.ggml.tokens": toks})
    v = verify(out, cm, logits=False, llama_cpp=False)
    _fail_row(v, "tokens == source", "tokenizer.ggml.tokens[202]='forty-two'", f"(source: {was!r})",
              "1 of 320 entries differ")


def test_edited_token_type_and_merge(tmp_path):
    cm, out = exported(tmp_path, MX)
    types = list(_field(out, "tokenizer.ggml.token_type"))
    types[7] = 3    # a normal token made CONTROL: llama.cpp would stop parsing it as text
    merges = list(_field(out, "tokenizer.ggml.merges"))
    merges[4], merges[5] = merges[5], merges[4]
    rewrite_gguf(out / "model.gguf", kv={"tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges})
    v = verify(out, cm, logits=False, llama_cpp=False)
    _fail_row(v, "token types == source", "tokenizer.ggml.token_type[7]=3 (source: 1)")
    _fail_row(v, "merges == source", "tokenizer.ggml.merges[4]=")


def test_key_nothing_vouches_for(tmp_path):
    cm, out = exported(tmp_path, MX)
    _rewrite_add_kv(out / "model.gguf", {"tokenizer.ggml.eot_token_id": 7})
    v = verify(out, cm, logits=False, llama_cpp=False)
    _fail_row(v, "no key beyond the source's", "tokenizer.ggml.eot_token_id")
    assert ("tokenizer", "no key beyond the source's") in rows(v, "FAIL")


def _rewrite_add_kv(path, kv):
    """Copy the GGUF with gguf-py's writer, adding new keys (strings / uint32)."""
    import numpy as np  # noqa: F401  (rewrite_gguf's tensors)
    reader = gguf.GGUFReader(str(path))
    tmp = path.with_suffix(".tmp2")
    w = gguf.GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for k, v in kv.items():
        if isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_uint32(k, int(v))
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data)
    w.close()
    tmp.replace(path)


def test_named_templates_of_the_source_are_shipped_and_compared(tmp_path):
    """A source with additional_chat_templates/ (transformers loads them as named templates): the export
    carries each as tokenizer.chat_template.<name>, and the gate compares them with the source's."""
    import copy
    import shutil

    from tamper_helpers import cell
    from test_exporters_helpers import cell_student

    from qatfactory.exporters import export
    src = tmp_path / "src"
    shutil.copytree(cell_student(cell(MX)).source_dir, src)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages }}")
    cm = copy.copy(cell_student(cell(MX)))
    cm.source_dir = str(src)
    export(cm, tmp_path / "e", engine="llama_cpp")
    assert _field(tmp_path / "e", "tokenizer.chat_template.tool_use") == "TOOLS {{ messages }}"
    v = verify(tmp_path / "e", cm, logits=False, llama_cpp=False)
    assert not v.failures, v.table()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("Always answer 42.")
    v = verify(tmp_path / "e", cm, logits=False, llama_cpp=False)
    _fail_row(v, "chat templates == source", "tokenizer.chat_template.tool_use differs")


def test_spm_scores_that_reorder_the_merges(tmp_path):
    """A byte-fallback (SentencePiece-style) vocabulary: llama.cpp merges the best-scored pair first, so
    two merge results whose scores are swapped would tokenize differently from the source."""
    from test_gguf_tokenizer import _export_with, _train, _vocab
    tok = _train(tmp_path / "tok", "spm")
    cm, _ = _export_with(tok, tmp_path / "g", _vocab(tok))
    v = verify(tmp_path / "g", cm, logits=False, llama_cpp=False)
    assert not v.failures and ("tokenizer", "scores order == source merges") in rows(v, "ok"), v.table()
    import json
    merges = json.loads((tok / "tokenizer.json").read_text())["model"]["merges"]
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
    first, later = ["".join(m.split(" ") if isinstance(m, str) else m) for m in (merges[0], merges[40])]
    scores = list(_field(tmp_path / "g", "tokenizer.ggml.scores"))
    i, j = vocab[first], vocab[later]
    scores[i], scores[j] = scores[j], scores[i]
    rewrite_gguf(tmp_path / "g" / "model.gguf", kv={"tokenizer.ggml.scores": scores})
    v = verify(tmp_path / "g", cm, logits=False, llama_cpp=False)
    _fail_row(v, "scores order == source merges", "tokenizer.ggml.scores[")


def test_template_names_are_compared_as_gguf_stores_them(tmp_path):
    """A named template whose name has a '-' (GGUF keys hold letters, digits and '_'): no false alarm."""
    import copy
    import shutil

    from tamper_helpers import cell
    from test_exporters_helpers import cell_student

    from qatfactory.exporters import export
    src = tmp_path / "src"
    shutil.copytree(cell_student(cell(MX)).source_dir, src)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool-use.jinja").write_text("TOOLS")
    cm = copy.copy(cell_student(cell(MX)))
    cm.source_dir = str(src)
    export(cm, tmp_path / "e", engine="llama_cpp")
    v = verify(tmp_path / "e", cm, logits=False, llama_cpp=False)
    assert not v.failures, v.table()
