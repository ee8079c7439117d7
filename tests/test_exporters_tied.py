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
import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from qatfactory.exporters import ExportError, export, verify

gguf = pytest.importorskip("gguf")

VOCAB = 128


@functools.lru_cache(maxsize=None)
def tied_student(kind: str, fmt: str, act=None, preset=None, tie: bool = True, wide: bool = False):
    """Tiny random Llama/Qwen3 (hidden 128, 2 layers) with tied embeddings, prepared/calibrated/
    converted with the real quantize API (cached: read-only)."""
    import transformers as T

    from qatfactory.quantize import QuantConfig, calibrate, convert, prepare

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie)
    if kind == "llama":
        model = T.LlamaForCausalLM._from_config(T.LlamaConfig(**common), dtype=torch.bfloat16)
    else:
        model = T.Qwen3ForCausalLM._from_config(T.Qwen3Config(head_dim=64, **common), dtype=torch.bfloat16)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
    qc = QuantConfig.preset(preset, **({"quantize_embeddings": False} if wide else {})) if preset \
        else QuantConfig(weight_format=fmt, act_format=act)
    prepare(model, qc)
    if act:
        calibrate(model, [torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))])
    return convert(model)


# (engine, flavour, kind, student args)
CASES = [
    ("vllm", "modelopt", "llama", dict(fmt="nvfp4", act="nvfp4_act")),
    ("sglang", "compressed-tensors", "llama", dict(fmt="nvfp4", act="nvfp4_act")),
    ("llama_cpp", "gguf", "llama", dict(fmt="nvfp4", act="nvfp4_act")),
    ("llama_cpp", "gguf", "llama", dict(fmt="q4_k_m", preset="q4_k")),       # token_embd Q8_0, head = token_embd
    ("llama_cpp", "gguf", "llama", dict(fmt="q4_k_m", preset="q4_k", wide=True)),   # the user keeps it wide
    ("sglang", "modelopt", "qwen3", dict(fmt="nvfp4")),
    ("vllm", "compressed-tensors", "qwen3", dict(fmt="mxfp4")),
    ("llama_cpp", "gguf", "qwen3", dict(fmt="mxfp4")),
    ("llama_cpp", "gguf", "qwen3", dict(fmt="q4_k_m", preset="q4_k")),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[2]}-{c[0]}-{c[1]}-{c[3]['fmt']}" + ("-wide" if c[3].get("wide") else "")
                                             for c in CASES])
def test_tied_export_passes_gate(tmp_path, case):
    engine, flavour, kind, kw = case
    cm = tied_student(kind, **kw)
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
    v = verify(out, cm, llama_cpp=False)
    assert v.ok, v.table()
    assert [c for c in v.checks if c.tensor == "logits" and c.status == "ok"]
    lm = [(c.check, c.status) for c in v.checks if c.tensor == "lm_head"]
    assert lm[0] == ("tied embeddings", "ok")
    assert lm[1:] == ([] if engine == "llama_cpp" else [("excluded (model dtype)", "ok")])
    assert res.record["tied_embeddings"] is True
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
        assert cfg["tie_word_embeddings"] is True
        assert not [k for k in sd if k.startswith("lm_head")]
        assert torch.equal(sd["model.embed_tokens.weight"], cm.dense["model.embed_tokens.weight"])
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
        v = verify(tmp_path / d, cm, logits=False)
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
    assert verify(tmp_path / "dg", dup, logits=False).ok

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
    v = verify(tmp_path / "d", base, logits=False)
    assert [(c.tensor, c.check) for c in v.failures] == [("lm_head", "tied embeddings")]


def test_tied_student_through_the_cli(tmp_path, capsys):
    """save_student -> `qatfactory export --verify` (load_student -> convert -> export -> gate)."""
    import transformers as T

    from qatfactory.cli_export import main
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
    ct = pytest.importorskip("compressed_tensors.quantization")
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
