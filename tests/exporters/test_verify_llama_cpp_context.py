"""llama.cpp's runtime row opens the model with the context its probe prompts need, not the model's
trained context (n_ctx=0: a tiny Mistral claiming 131072 positions wanted 24 GiB), and a runtime
that cannot allocate what it needs on this machine makes the row INCOMPLETE: it says nothing about
the file, so it is never a FAIL."""
from __future__ import annotations

import importlib

import pytest
import torch

from qatfactory.exporters import export, verify

pytestmark = pytest.mark.llama_cpp
rt = importlib.import_module("qatfactory.exporters.verify.llama_cpp_runtime")


def _long_context_export(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.quantize import QuantConfig, convert, prepare
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                      max_position_embeddings=131072)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
    prepare(m, QuantConfig(weight_format="q8_0"))
    cm = convert(m)
    export(cm, tmp_path / "g", engine="llama_cpp")
    return cm, tmp_path / "g"


def test_runtime_opens_the_prompts_context_not_the_trained_one(tmp_path):
    cm, out = _long_context_export(tmp_path)
    v = verify(out, cm)
    row = next(c for c in v.checks if c.check == "llama.cpp runtime")
    assert row.status == "ok", v.table()
    assert v.logits["llama.cpp"]["n_ctx"] <= 256, v.logits["llama.cpp"]   # llama.cpp pads to 256
    assert v.verdict == "PASS", v.table()


def test_runtime_that_cannot_allocate_is_incomplete_not_fail(tmp_path, monkeypatch):
    cm, out = _long_context_export(tmp_path)
    monkeypatch.setattr(rt, "context_for", lambda prompts: 1 << 31)   # a KV cache no machine here holds
    v = verify(out, cm)
    row = next(c for c in v.checks if c.check == "llama.cpp runtime")
    assert row.status == "INCOMPLETE" and "could not allocate" in row.detail, v.table()
    assert v.verdict == "INCOMPLETE" and not v.failures, v.table()
