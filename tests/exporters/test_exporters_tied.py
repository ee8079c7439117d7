"""Tied embeddings (lm_head IS embed_tokens, as in SmolLM2 and Qwen3-0.6B) through every exporter
and the parity gate.

Engines build a tied lm_head from the embedding: vLLM's loaders skip ``lm_head.weight`` when
``tie_word_embeddings`` is set, llama.cpp reuses ``token_embd`` when ``output.weight`` is absent
(and transformers' GGUF loader infers the tie from exactly that absence). So a tied export writes
the embedding once and no lm_head; an untied one must write its lm_head. Students are tiny random
Llama / Qwen3 models through the real quantize.prepare / calibrate / convert.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from test_exporters_helpers import TIED_VOCAB as VOCAB, cell_student, cells, tied_student

from qatfactory.exporters import ExportError, export, verify

import gguf  # noqa: E402  (an install requirement: missing, these tests fail)



CELLS = cells(lambda c: c.kind.endswith("_tied"))   # Gemma 3 (tied too) has its own file


@pytest.mark.parametrize("cell", CELLS)
def test_tied_export_passes_gate(tmp_path, cell):
    engine, flavour, kind = cell.engine, cell.flavour, cell.kind[: -len("_tied")]
    kw = {"fmt": cell.fmt, **({"preset": cell.preset} if cell.preset else {})}
    cm = cell_student(cell)
    _check_tied_export(tmp_path, engine, flavour, kind, kw, cm)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_q4_k_m_embedding_kept_wide_when_asked(tmp_path, kind):
    """quantize_embeddings=False: the user keeps token_embd (and the tied head) in the model dtype."""
    kw = {"fmt": "q4_k_m", "preset": "q4_k", "wide": True}
    cm = tied_student(kind, **kw)
    _check_tied_export(tmp_path, "llama_cpp", "gguf", kind, kw, cm)


def _check_tied_export(tmp_path, engine, flavour, kind, kw, cm):
    # convert hands over the embedding once and no lm_head, even where the recipe quantizes lm_head
    assert cm.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in cm.dense and "lm_head.weight" not in cm.packed
    # the q4_k preset stores the tied table as llama-quantize does (Q8_0: 128 % 256 != 0), unless asked not to
    quant_emb = kw.get("preset") == "q4_k" and not kw.get("wide")
    if quant_emb:
        assert cm.packed["model.embed_tokens.weight"].format == "q8_0"
    else:
        assert cm.dense["model.embed_tokens.weight"].dtype == torch.bfloat16
    out = tmp_path / "e"
    res = export(cm, out, engine=engine, flavour=flavour)
    v = verify(out, cm)
    assert v.verdict == "PASS", v.table()
    assert [c for c in v.checks if c.tensor == "logits" and c.status == "ok"]
    lm = [(c.check, c.status) for c in v.checks if c.tensor == "lm_head"]
    modelopt = flavour == "modelopt"
    assert lm[0] == ("tied embeddings (shipped untied)" if modelopt else "tied embeddings", "ok")
    assert len(lm) == 1
    assert res.record["tied_embeddings"] is (not modelopt)
    assert res.record.get("untied_lm_head_copy", False) is modelopt
    if engine == "llama_cpp":
        t = {x.name: x for x in gguf.GGUFReader(str(out / "model.gguf")).tensors}
        assert "output.weight" not in t  # llama.cpp reuses token_embd
        emb = t["token_embd.weight"]
        want = gguf.GGMLQuantizationType.Q8_0 if quant_emb else gguf.GGMLQuantizationType.BF16
        assert emb.tensor_type == want and list(emb.shape) == [128, VOCAB]
        if "preset" not in kw and kind == "qwen3":
            # no separate lm_head: transformers' own GGUF loader ties (exact logits when nothing has .scale)
            assert v.logits["transformers GGUF loader"]["exact"]
    else:
        sd = load_file(str(out / "model.safetensors"))
        cfg = json.loads((out / "config.json").read_text())
        assert torch.equal(sd["model.embed_tokens.weight"], cm.dense["model.embed_tokens.weight"])
        if modelopt:
            # vLLM 0.24 refuses a tied ModelOpt checkpoint (its ModelOpt config hands ParallelLMHead a linear
            # method, whose tie_weights raises NotImplementedError; seen on the H200, benchmarks/gpu/engines.py):
            # the export ships lm_head untied, as the embedding's own bytes
            assert cfg["tie_word_embeddings"] is False
            assert [k for k in sd if k.startswith("lm_head")] == ["lm_head.weight"]
            assert torch.equal(sd["lm_head.weight"].view(torch.int16),
                               cm.dense["model.embed_tokens.weight"].view(torch.int16))
        else:
            assert cfg["tie_word_embeddings"] is True
            assert not [k for k in sd if k.startswith("lm_head")]
        # not written, but listed as unquantized (llm-compressor / ModelOpt do the same): config-driven
        # loaders such as transformers 5.17's CompressedTensorsConfig otherwise quantize the module
        ignore = cfg["quantization_config"]["ignore"]
        assert res.record["exclude_modules"] == ignore == ["lm_head"]
        if flavour == "modelopt":
            hq = json.loads((out / "hf_quant_config.json").read_text())
            assert hq["quantization"]["exclude_modules"] == ["lm_head"]


def test_untied_control_writes_lm_head(tmp_path):
    """The same tiny model untied: lm_head ships (bf16 for vLLM, output.weight for llama.cpp)."""
    cm = tied_student("qwen3", "nvfp4", tie=False)
    assert "lm_head.weight" in cm.dense
    export(cm, tmp_path / "s", engine="vllm", flavour="modelopt")
    export(cm, tmp_path / "g", engine="llama_cpp")
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "s" / "config.json").read_text())["tie_word_embeddings"] is False
    assert "output.weight" in {x.name for x in gguf.GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors}
    for d in ("s", "g"):
        v = verify(tmp_path / d, cm)
        assert v.ok, v.table()
        assert ("untied lm_head", "ok") in [(c.check, c.status) for c in v.checks if c.tensor == "lm_head"]


def test_tied_lm_head_contradictions_are_refused(tmp_path):
    base = tied_student("llama", "nvfp4")
    emb = base.dense["model.embed_tokens.weight"]
    # an explicit duplicate of the embedding (e.g. a state dict with both keys) is written once
    dup = copy.deepcopy(base)
    dup.dense["lm_head.weight"] = emb.clone()
    export(dup, tmp_path / "d", engine="vllm", flavour="compressed-tensors")
    export(dup, tmp_path / "dg", engine="llama_cpp")
    assert "lm_head.weight" not in load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "output.weight" not in {x.name for x in gguf.GGUFReader(str(tmp_path / "dg" / "model.gguf")).tensors}
    assert verify(tmp_path / "dg", dup).ok

    # a tied config with a different lm_head: the engine would use the embedding instead
    diff = copy.deepcopy(dup)
    diff.dense["lm_head.weight"][0, 0] += 1
    for engine in ("vllm", "sglang", "llama_cpp"):
        with pytest.raises(ExportError, match="tie_word_embeddings is true but lm_head.weight differs"):
            export(diff, tmp_path / "x", engine=engine)
    # a tied config with a quantized lm_head: engines skip it and serve the bf16 embedding
    qlm = copy.deepcopy(base)
    from qatfactory.formats import get_format
    qlm.packed["lm_head.weight"] = get_format("nvfp4").quantize(emb.float())
    with pytest.raises(ExportError, match="lm_head.weight is quantized"):
        export(qlm, tmp_path / "x", engine="vllm", flavour="modelopt")
    # an untied config without any lm_head: llama.cpp would silently fall back to token_embd
    untied = copy.deepcopy(base)
    untied.config = dict(untied.config, tie_word_embeddings=False)
    with pytest.raises(ExportError, match="tie_word_embeddings is false but .* no lm_head.weight"):
        export(untied, tmp_path / "x", engine="llama_cpp")
    assert not (tmp_path / "x").exists()

    # the gate notices an export that contradicts the tie
    from safetensors.torch import save_file
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    sd["lm_head.weight"] = emb.clone()
    save_file(sd, str(tmp_path / "d" / "model.safetensors"), metadata={"format": "pt"})
    v = verify(tmp_path / "d", base)
    assert ("lm_head", "tied embeddings") in [(c.tensor, c.check) for c in v.failures]
    assert ("tensors", "none extra") in [(c.tensor, c.check) for c in v.failures]  # lm_head.weight is extra


def test_tied_student_through_the_cli(tmp_path, capsys):
    """save_student -> `qatfactory export --verify` (load_student -> convert -> export -> gate)."""
    import transformers as T

    from qatfactory.faces.export import main
    from qatfactory.quantize import QuantConfig, prepare, save_student

    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM._from_config(
        T.Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True),
        dtype=torch.bfloat16)
    prepare(model, QuantConfig(weight_format="nvfp4"))
    save_student(model, str(tmp_path / "student"))
    for engine, flavour in (("sglang", "compressed-tensors"), ("llama_cpp", "gguf")):
        capsys.readouterr()
        assert main(["export", str(tmp_path / "student"), "--engine", engine, "--flavour", flavour,
                     "--out", str(tmp_path / engine), "--verify"]) == 0
        text = capsys.readouterr().out
        assert "verdict: PASS" in text and "tied embeddings" in text
    assert "output.weight" not in {x.name for x in gguf.GGUFReader(str(tmp_path / "llama_cpp" / "model.gguf")).tensors}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_compressed_tensors_config_leaves_tied_lm_head_unquantized(tmp_path, fmt):
    """compressed-tensors itself (the library transformers and llm-compressor use to build a
    quantized module tree from config.json) must not take the tied lm_head for a quantized Linear:
    transformers 5.17 did, dropped its weight and failed to tie it (seen on the H200 pipeline run)."""
    import compressed_tensors.quantization as ct  # an install requirement
    import transformers as T
    cm = tied_student("llama", fmt)
    export(cm, tmp_path / "e", engine="vllm", flavour="compressed-tensors")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    qcfg = ct.QuantizationConfig.model_validate(cfg["quantization_config"])
    skeleton = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(tmp_path / "e"))
    ct.apply_quantization_config(skeleton, qcfg, show_progress=False)
    quantized = {n for n, m in skeleton.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    assert "lm_head" not in quantized
    assert quantized == {n[:-len(".weight")] for n in cm.packed}


def test_modelopt_untied_copy_must_be_the_embedding(tmp_path):
    """The ModelOpt flavour ships a tied student's head as a copy of the embedding (vLLM cannot tie it):
    a copy that differs in one element is a FAIL, not a silent change of the logits."""
    from safetensors.torch import save_file
    cm = tied_student("llama", "nvfp4")
    out = tmp_path / "m"
    export(cm, out, engine="vllm", flavour="modelopt")
    assert not verify(out, cm, logits=False).failures     # INCOMPLETE (no logits), nothing wrong
    sd = load_file(str(out / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    sd["lm_head.weight"][3, 5] += 1
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    v = verify(out, cm, logits=False)
    assert ("lm_head", "tied embeddings (shipped untied)") in [(c.tensor, c.check) for c in v.failures]
