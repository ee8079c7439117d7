"""Our Q4_K_M export against llama.cpp's own ``llama-quantize ... Q4_K_M`` on the demo model's shapes.

A random 2-layer model with SmolLM2-135M's widths (hidden 576, MLP 1536, 9 query / 3 KV heads of 64,
vocabulary 49152, the real SmolLM2 tokenizer), tied as SmolLM2 and untied, saved in bf16. llama.cpp's
path: its own convert_hf_to_gguf.py (--outtype bf16), then llama-quantize Q4_K_M (no importance
matrix). Ours: the same directory loaded with transformers, prepare(q4_k preset) with dynamic scales
and no calibration, convert, export. Both quantizers see the same numbers: llama-quantize upcasts
the BF16 tensors to F32 before quantizing, ours quantizes the bf16 weights in float32.

Asserted: every tensor has the same name, shape and ggml type; every tensor's bytes are identical
(q/k rows included: the converter permutes bf16 rows before quantizing, we permute quantized rows,
and the blocks never cross a row); the tensor data sections have the same size, so the files differ
only by their metadata (general.* keys the converter writes from the model card, tokenizer keys).
This is the third-party run that confirms formats/policy.py, the Q4_K_M transcription.
"""
from __future__ import annotations

import numpy as np
import pytest

from qatfactory.faces import llama_tools as LT
from smollm2_shapes import smollm2_dir, export_ours, require_llama_cpp

gguf = pytest.importorskip("gguf")


def _data_start(r) -> int:
    return min(int(t.data_offset) for t in r.tensors)


def _same_tensors(theirs, ours):
    """Same names, shapes, types and bytes; equal data sections. Returns {name: type}."""
    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    types = {n: (ta[n].tensor_type.name, tb[n].tensor_type.name) for n in ta}
    assert not {n: v for n, v in types.items() if v[0] != v[1]}
    for n in ta:
        assert list(ta[n].shape) == list(tb[n].shape), n
        x, y = np.asarray(ta[n].data), np.asarray(tb[n].data)
        assert x.tobytes() == y.tobytes(), f"{n} ({types[n][0]}): bytes differ"
    # same tensor data; the files differ by their metadata only
    size_a, size_b = theirs.stat().st_size, ours.stat().st_size
    assert size_a - _data_start(a) == size_b - _data_start(b)
    assert abs(size_a - size_b) == abs(_data_start(a) - _data_start(b)) < 64 * 1024
    return {n: v[0] for n, v in types.items()}


@pytest.fixture(scope="module")
def tied_bf16(tmp_path_factory):
    require_llama_cpp()
    d = tmp_path_factory.mktemp("smollm2_shapes")
    hf = smollm2_dir(d / "hf", True)
    return hf, LT.convert_hf(hf, d / "bf16.gguf", "bf16")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_q4_k_m_export_equals_llama_quantize(tmp_path, tie, tied_bf16):
    if tie:
        hf, bf16 = tied_bf16
    else:
        hf = smollm2_dir(tmp_path / "hf", tie)
        bf16 = LT.convert_hf(hf, tmp_path / "bf16.gguf", "bf16")
    theirs = tmp_path / "q4_k_m.gguf"
    LT.quantize(bf16, theirs, "Q4_K_M")
    types = _same_tensors(theirs, export_ours(hf, tmp_path / "ours"))
    # the choices themselves, as llama-quant.cpp makes them for these widths
    want_embd = "Q8_0" if tie else "Q5_0"          # tied: the output rule, 576 % 256 -> Q8_0; untied: Q4_K -> Q5_0
    assert types["token_embd.weight"] == want_embd
    assert ("output.weight" in types) == (not tie) and (tie or types["output.weight"] == "Q8_0")
    assert types["blk.1.attn_v.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "Q5_0"


@pytest.mark.parametrize("fmt,ggml", [("mxfp4_ggml", "mxfp4"), ("nvfp4_ggml", "nvfp4")])
def test_fp4_gguf_export_equals_llama_quantize_overrides(tmp_path, fmt, ggml, tied_bf16):
    """llama-quantize takes NVFP4 (and MXFP4 for a dense model) only as per-tensor overrides over a
    base type: every linear ``--tensor-type ...=nvfp4`` over Q8_0 (token_embd Q8_0). The recipe that
    matches it: every linear in the ggml format, the embedding (and the tied head) q8_0."""
    from qatfactory.quantize import QuantConfig
    hf, bf16 = tied_bf16
    theirs = tmp_path / f"{ggml}.gguf"
    LT.quantize(bf16, theirs, "Q8_0", tensor_types=[f"attn_(q|k|v|output)={ggml}", f"ffn_(gate|up|down)={ggml}"])
    qc = QuantConfig.preset(f"{ggml}_gguf")
    assert qc.weight_format == fmt
    types = _same_tensors(theirs, export_ours(hf, tmp_path / "ours", qc))
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == ggml.upper()
