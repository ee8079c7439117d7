"""Gemma 3 (text, ``gemma3_text``) end to end: prepare / calibrate / convert, vLLM exports in both
flavours, llama.cpp's gemma3 GGUF, each through the parity gate (llama.cpp's own runtime included); the
GGUF against what llama.cpp's own converter writes for the same tiny model; and the refusals where
llama.cpp would run something else than the student.

Students: a tiny random Gemma3ForCausalLM (2 sliding-window layers, window 8, shorter than the gate's
prompts; hidden 64; tied; norm weights away from zero so Gemma's (1 + w) convention shows).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from test_exporters_helpers import cell_student, cells, gemma3_model, gemma3_student, source_dir

from qatfactory.exporters import export, verify

import gguf  # noqa: E402  (an install requirement: missing, these tests fail)

CELLS = cells(lambda c: c.kind == "gemma3")

pytestmark = pytest.mark.llama_cpp  # the GGUF cells run llama.cpp's own runtime (in make test)

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "self_attn.q_norm", "self_attn.k_norm")


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("cell", CELLS)
def test_gemma3_export_passes_gate(tmp_path, cell):
    cm = cell_student(cell)
    assert cm.config["model_type"] == "gemma3_text" and cm.config["tie_word_embeddings"] is True
    out = tmp_path / "e"
    export(cm, out, engine=cell.engine, flavour=cell.flavour)
    v = verify(out, cm)
    assert v.verdict == "PASS", v.table()
    if cell.engine == "llama_cpp":
        lg = {c.check: c for c in v.checks if c.tensor == "logits"}
        assert lg["llama.cpp runtime"].status == "ok", lg
        r = v.logits["llama.cpp"]
        assert not r["not_emulated"] and r["decisive_positions"] > 0
        # the prompts are longer than the window: the sliding layers' masks are exercised
        assert len(r["kl_per_prompt"]) == 4 and int(cm.config["sliding_window"]) < 12
        rd = gguf.GGUFReader(str(out / "model.gguf"))
        assert rd.fields["general.architecture"].contents() == "gemma3"
        assert rd.fields["gemma3.attention.sliding_window"].contents() == 8
        assert rd.fields["gemma3.rope.freq_base"].contents() == 1e6
        assert rd.fields["gemma3.rope.freq_base_swa"].contents() == 1e4
        t = _tensors(out / "model.gguf")
        assert "output.weight" not in t   # tied: llama.cpp reuses token_embd
        for hf, g in (("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
                      ("post_feedforward_layernorm", "post_ffw_norm"), ("input_layernorm", "attn_norm")):
            w = cm.dense[f"model.layers.1.{hf}.weight"]
            assert t[f"blk.1.{g}.weight"].tensor_type == gguf.GGMLQuantizationType.F32
            # stored as 1 + w, the float Gemma's RMSNorm multiplies by
            assert np.array_equal(np.asarray(t[f"blk.1.{g}.weight"].data), (w.float() + 1).numpy())
    else:
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["tie_word_embeddings"] is True
        names = set(load_file(str(out / "model.safetensors")))
        # vLLM's Gemma3ForCausalLM has no lm_head (logits from the embedding): none is written, ModelOpt included
        assert not any(n.startswith("lm_head") for n in names)
        assert "model.layers.0.self_attn.q_norm.weight" in names


def test_gemma3_coverage_names_what_stays_wide():
    from qatfactory.quantize import QuantConfig, coverage, prepare
    model = gemma3_model()
    prepare(model, QuantConfig(weight_format="nvfp4"))
    rows = {r.name: r for r in coverage(model).rows}
    for i in range(2):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj"):
            assert rows[f"model.layers.{i}.{proj}.weight"].status == "quantized"
        for n in NORMS:
            assert rows[f"model.layers.{i}.{n}.weight"].status == "dense"
    assert rows["model.embed_tokens.weight"].status == "dense"
    assert rows["lm_head.weight"].status == "tied"
    assert "pre_feedforward_layernorm" in coverage(model).table()


def test_gemma3_gguf_matches_llama_cpps_converter(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py on the same tiny model: the same tensor names and shapes, the same
    stored norms (1 + w) and embedding, and every gemma3.* key it writes with the same value."""
    from qatfactory.faces import llama_tools as LT
    try:
        R = LT.runtime()
    except LT.ToolUnavailable as e:
        pytest.fail(str(e))
    # vocabulary = the test tokenizer's size: the converter cuts token_embd to the tokenizer's entries
    model = gemma3_model(vocab_size=300)
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    for f in os.listdir(source_dir()):
        shutil.copy(source_dir() / f, hf / f)
    src = R.target_dir() / "src"
    ref = tmp_path / "ref.gguf"
    # the converter names BPE pre-tokenizers by hashing known tokenizers' output; the toy one is unknown
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from conversion.base import TextModel; "
            "TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; import convert_hf_to_gguf as C; "
            "sys.argv = ['convert_hf_to_gguf.py', sys.argv[2], '--outfile', sys.argv[3], '--outtype', 'bf16']; C.main()")
    env = {k: v for k, v in LT.converter_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", code, str(src), str(hf), str(ref)], env=env, cwd=str(src),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]

    from qatfactory.quantize import QuantConfig, convert, prepare
    prepare(model, QuantConfig(weight_format="mxfp4"))
    cm = convert(model)
    cm.source_dir = str(source_dir())
    export(cm, tmp_path / "ours", engine="llama_cpp")
    ours = tmp_path / "ours" / "model.gguf"
    a, b = _tensors(ref), _tensors(ours)
    assert sorted(a) == sorted(b)
    for n in a:
        assert list(a[n].shape) == list(b[n].shape), n
        if n.endswith("norm.weight") or n == "token_embd.weight":   # the tensors both keep wide: same bytes
            assert a[n].tensor_type == b[n].tensor_type, n
            assert np.asarray(a[n].data).tobytes() == np.asarray(b[n].data).tobytes(), n
    ra, rb = gguf.GGUFReader(str(ref)), gguf.GGUFReader(str(ours))
    keys = [k for k in ra.fields if k.startswith("gemma3.")]
    assert {"gemma3.rope.freq_base_swa", "gemma3.attention.sliding_window", "gemma3.attention.key_length"} <= set(keys)
    for k in keys:
        assert k in rb.fields, k
        assert rb.fields[k].contents() == ra.fields[k].contents(), k
    assert set(k for k in rb.fields if k.startswith("gemma3.")) - set(keys) <= {"gemma3.vocab_size",
                                                                                "gemma3.rope.dimension_count"}


def test_gemma3_gguf_refuses_what_llama_cpp_would_run_differently(tmp_path):
    # ModelOpt-numerics NVFP4: llama.cpp's gemma3 graph never multiplies by the .scale tensors
    with pytest.raises(NotImplementedError, match=r"per-tensor scale.*nvfp4_ggml"):
        export(gemma3_student("nvfp4"), tmp_path / "a", engine="llama_cpp")
    assert not (tmp_path / "a" / "model.gguf").exists()
    cm = gemma3_student("mxfp4")
    for over, msg in (({"query_pre_attn_scalar": 32}, r"query_pre_attn_scalar=32.*1/sqrt\(64\)"),
                      ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types"),
                      ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping"),
                      ({"hidden_activation": "gelu"}, r"hidden_activation='gelu'")):
        bad = copy.copy(cm)
        bad.config = dict(cm.config, **over)
        with pytest.raises(NotImplementedError, match=msg):
            export(bad, tmp_path / "b", engine="llama_cpp")


def test_gemma3_gate_fails_norms_stored_as_llama_does(tmp_path, monkeypatch):
    """A Gemma GGUF whose norms hold w (not 1 + w) is what a Llama-minded exporter writes: the gate fails it."""
    from qatfactory.exporters import gguf_families
    cm = gemma3_student("mxfp4")
    monkeypatch.setattr(gguf_families, "norm_shift", lambda mt, name: 0.0)
    export(cm, tmp_path / "e", engine="llama_cpp")
    v = verify(tmp_path / "e", cm, llama_cpp=False)
    assert v.verdict == "FAIL"
    bad = {c.tensor for c in v.checks if c.status == "FAIL" and c.check == "dense"}
    assert "model.layers.0.pre_feedforward_layernorm.weight" in bad and "model.norm.weight" in bad


def test_gemma3_full_attention_layer_with_scaled_rope_passes_gate(tmp_path):
    """Six layers: the sixth is llama.cpp's (and transformers') full-attention layer, with the global theta and
    the x8 linear rope scaling of Gemma 3 4B and up, which llama.cpp applies to the full layers only."""
    from qatfactory.quantize import QuantConfig, convert, prepare
    model = gemma3_model(num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert model.config.layer_types[5] == "full_attention" and model.config.layer_types[4] == "sliding_attention"
    prepare(model, QuantConfig(weight_format="mxfp4"))
    cm = convert(model)
    cm.source_dir = str(source_dir())
    export(cm, tmp_path / "e", engine="llama_cpp")
    rd = gguf.GGUFReader(str(tmp_path / "e" / "model.gguf"))
    assert rd.fields["gemma3.rope.scaling.type"].contents() == "linear"
    assert rd.fields["gemma3.rope.scaling.factor"].contents() == 8.0
    v = verify(tmp_path / "e", cm)
    assert v.verdict == "PASS", v.table()
    assert {c.check for c in v.checks if c.tensor == "logits" and c.status == "ok"} >= {"llama.cpp runtime",
                                                                                      "transformers GGUF loader"}


def test_gemma3_qad_steps_reach_every_projection_and_still_export(tmp_path):
    """Distillation steps on the fake-quantized student (KL to its frozen copy): gradients reach every quantized
    projection and the extra norms, the loss falls, and the trained student still exports to llama.cpp and
    passes the gate with llama.cpp's runtime."""
    import copy

    import torch
    import torch.nn.functional as F

    from qatfactory.quantize import QuantConfig, convert, prepare
    teacher = gemma3_model().float().eval()
    student = copy.deepcopy(teacher)
    prepare(student, QuantConfig(weight_format="mxfp4"))
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=2e-4)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(ids).logits, -1)
    losses = []
    for step in range(6):
        loss = F.kl_div(F.log_softmax(student(ids).logits, -1), t_logp, log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad for n, p in student.named_parameters() if p.requires_grad}
            for n in [f"model.layers.1.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                     [f"model.layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")] + \
                     [f"model.layers.1.{n}.weight" for n in NORMS]:
                assert grads.get(n) is not None and bool(grads[n].abs().sum() > 0), n
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    student.to(torch.bfloat16)
    cm = convert(student)
    cm.source_dir = str(source_dir())
    export(cm, tmp_path / "e", engine="llama_cpp")
    v = verify(tmp_path / "e", cm)
    assert v.verdict == "PASS", v.table()
