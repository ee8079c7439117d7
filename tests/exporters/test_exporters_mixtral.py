"""Mixtral-style MoE (transformers MixtralForCausalLM) through every exporter and the parity gate.

On disk Mixtral keeps the pre-fusion names ``block_sparse_moe.experts.E.{w1,w3,w2}`` (w1 = gate,
w3 = up, w2 = down) and the router ``block_sparse_moe.gate``, although transformers 5 holds the
experts fused in memory (``mlp.experts.gate_up_proj``). In GGUF it is architecture ``llama`` with
stacked ``ffn_*_exps`` tensors, ``llama.expert_count``/``expert_used_count`` and llama.cpp's Q/K
row permutation. The students are tiny random Mixtrals run through the real quantize.prepare /
calibrate / convert; what proves each export is third-party code named in verify's rows, plus
transformers' own GGUF un-permutation below.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from test_exporters_helpers import MIXTRAL, cell_student, cells, mixtral_student

from qatfactory.exporters import export, verify
from qatfactory.formats import get_format

import gguf  # noqa: E402  (an install requirement: missing, these tests fail)

H, INTER, LAYERS, EXPERTS, TOPK, VOCAB, HEADS, KV_HEADS = (MIXTRAL[k] for k in (
    "H", "INTER", "LAYERS", "EXPERTS", "TOPK", "VOCAB", "HEADS", "KV_HEADS"))


def mixtral(fmt: str, act=None, rules=(), preset=None, exclude=()):
    return mixtral_student(fmt, act, rules=rules, preset=preset, exclude=exclude)


def _expert(layer: int, e: int, proj: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}"


def _router(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.gate"


# ------------------------------------------------------------------------------ safetensors
ST_CELLS = cells(lambda c: c.kind == "mixtral" and c.engine != "llama_cpp")


@pytest.mark.parametrize("cell", ST_CELLS)
def test_mixtral_safetensors_gate(tmp_path, cell):
    engine, flavour, fmt, act, excl = cell.engine, cell.flavour, cell.fmt, cell.act, cell.exclude
    cm = cell_student(cell)
    out = tmp_path / "e"
    res = export(cm, out, engine=engine, flavour=flavour)
    v = verify(out, cm)
    assert v.verdict == "PASS", v.table()
    for name in cm.packed:
        m = name[: -len(".weight")]
        assert {c.check for c in v.checks if c.tensor == m and c.status == "ok"} >= {"bytes", "weights"}, m
    assert [c for c in v.checks if c.tensor == "logits" and c.status == "ok"]

    sd = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    assert cfg["num_local_experts"] == EXPERTS and cfg["num_experts_per_tok"] == TOPK
    qc = cfg["quantization_config"]
    packed_suffix = "weight" if flavour == "modelopt" else "weight_packed"
    # per-expert on-disk names (no fused 3-D experts, no in-memory mlp.experts names)
    assert not any(".mlp." in k or "gate_up_proj" in k for k in sd), [k for k in sd if ".mlp." in k][:3]
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for proj, shape in (("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))):
                t = sd[f"{_expert(layer, e, proj)}.{packed_suffix}"]
                assert t.dtype == torch.uint8 and tuple(t.shape) == (shape[0], shape[1] // 2)
        # the router: bf16, excluded by name, no quantization tensors
        r = _router(layer)
        assert sd[r + ".weight"].dtype == torch.bfloat16 and tuple(sd[r + ".weight"].shape) == (EXPERTS, H)
        assert torch.equal(sd[r + ".weight"], cm.dense[r + ".weight"])
        assert not [k for k in sd if k.startswith(r + ".") and k != r + ".weight"]
        assert r in qc["ignore"]
        if excl:  # attention left in bf16 and listed, so SGLang sees MXFP4 only on the experts
            assert f"model.layers.{layer}.self_attn.q_proj" in qc["ignore"]
            assert sd[f"model.layers.{layer}.self_attn.q_proj.weight"].dtype == torch.bfloat16
    if flavour == "modelopt":
        hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == ("NVFP4" if act else "W4A16_NVFP4")
        assert all(_router(i) in hq["exclude_modules"] for i in range(LAYERS))
    else:
        assert qc["format"] == {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}[fmt]

    # one per-tensor scale per expert gate/up (vLLM fuses w1/w3 into w13 with one scale)
    gs = ".weight_scale_2" if flavour == "modelopt" else ".weight_global_scale"
    ins = ".input_scale" if flavour == "modelopt" else ".input_global_scale"
    if fmt == "nvfp4":
        for layer in range(LAYERS):
            w1 = [sd[_expert(layer, e, "w1") + gs] for e in range(EXPERTS)]
            w3 = [sd[_expert(layer, e, "w3") + gs] for e in range(EXPERTS)]
            for a, b in zip(w1, w3):
                assert a.dtype == torch.float32 and torch.equal(a, b)
            assert len({float(x) for x in w1}) > 1, "experts should not share one gate/up scale across experts"
            if act:  # one activation scale for every expert's w1/w3 and one for every w2
                assert len({float(sd[_expert(layer, e, p) + ins]) for e in range(EXPERTS) for p in ("w1", "w3")}) == 1
                assert len({float(sd[_expert(layer, e, "w2") + ins]) for e in range(EXPERTS)}) == 1
            else:
                assert not [k for k in sd if k.endswith(ins)]
    else:
        assert not [k for k in sd if k.endswith((".weight_global_scale", ".weight_scale_2"))]
    rows = {c.check for c in v.checks if c.tensor.startswith("w1,w3 @")}
    if fmt == "nvfp4":  # the gate also checked the shared scale on disk, per expert
        assert gs in {r[len("shared"):] for r in rows}
        assert sum(c.tensor.startswith("w1,w3 @") for c in v.checks) >= LAYERS * EXPERTS
    assert res.record["model_type"] == "mixtral"
    assert sum(len(g) == 2 and g[0].endswith(".w1") for g in res.record["fused_groups"]) == LAYERS * EXPERTS


# ------------------------------------------------------------------------------ GGUF
def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0]


# expected GGML type of the stacked experts per layer (gate, up, down), by the cell's weight format
EXP_TYPES = {
    # llama.cpp's Q4_K_M: ffn_down wants Q6_K where use_more_bits(layer, 2) (layer 1 of 2), Q4_K
    # elsewhere; its rows of INTER=64 hold no 256-block, so llama.cpp's fallbacks Q8_0 / Q5_0
    "q4_k_m": [("Q4_K", "Q4_K", "Q5_0"), ("Q4_K", "Q4_K", "Q8_0")],
    "mxfp4_ggml": [("MXFP4",) * 3] * LAYERS,
    "nvfp4": [("NVFP4",) * 3] * LAYERS,
}
GGUF_CELLS = cells(lambda c: c.kind == "mixtral" and c.engine == "llama_cpp")


@pytest.mark.parametrize("cell", GGUF_CELLS)
def test_mixtral_gguf_gate(tmp_path, cell):
    exp_types = EXP_TYPES[cell.fmt]
    kw = {"preset": cell.preset}
    cm = cell_student(cell)
    out = tmp_path / "g"
    res = export(cm, out, engine="llama_cpp")
    v = verify(out, cm)  # includes llama.cpp's own runtime (llama arch + _exps)
    assert v.verdict == "PASS", v.table()
    for name in cm.packed:
        assert {c.check for c in v.checks if c.tensor == name and c.status == "ok"} >= \
            {"bytes", "weights", "weights (libggml C)"}, name
    assert {c.check for c in v.checks if c.tensor == "logits" and c.status == "ok"} >= {"llama.cpp runtime"}

    path = out / "model.gguf"
    r = gguf.GGUFReader(str(path))
    t = _tensors(path)
    assert _field(r, "general.architecture") == "llama" and res.record["qk_permuted"]
    assert _field(r, "llama.expert_count") == EXPERTS and _field(r, "llama.expert_used_count") == TOPK
    # llama.cpp sizes the llama-arch expert tensors with feed_forward_length
    assert _field(r, "llama.feed_forward_length") == INTER and _field(r, "llama.block_count") == LAYERS
    assert _field(r, "llama.rope.freq_base") == cm.config["rope_parameters"]["rope_theta"] == 1e6  # Mixtral's
    assert not [n for n in t if ".ffn_gate.weight" in n or ".ffn_up.weight" in n or ".ffn_down.weight" in n]
    for layer in range(LAYERS):
        b = f"blk.{layer}."
        for proj, ne, want in (("gate", [H, INTER, EXPERTS], exp_types[layer][0]),
                               ("up", [H, INTER, EXPERTS], exp_types[layer][1]),
                               ("down", [INTER, H, EXPERTS], exp_types[layer][2])):
            x = t[f"{b}ffn_{proj}_exps.weight"]
            assert list(x.shape) == ne and x.tensor_type.name == want, (proj, list(x.shape), x.tensor_type.name)
        # router: F32 [n_embd, n_expert], the student's bf16 values widened exactly
        gi = t[b + "ffn_gate_inp.weight"]
        assert gi.tensor_type == gguf.GGMLQuantizationType.F32 and list(gi.shape) == [H, EXPERTS]
        want_r = cm.dense[_router(layer) + ".weight"].float().numpy()
        assert np.array_equal(np.asarray(gi.data).reshape(EXPERTS, H), want_r)
        if exp_types[layer][0] == "NVFP4":  # per-expert S vectors; gate/up share theirs expert by expert
            sg, su = (np.asarray(t[f"{b}ffn_{p}_exps.scale"].data).reshape(-1) for p in ("gate", "up"))
            assert sg.shape == (EXPERTS,) and np.array_equal(sg.view(np.int32), su.view(np.int32))
            assert len(set(sg.tolist())) > 1
            for e in range(EXPERTS):
                p1 = cm.packed[_expert(layer, e, "w1") + ".weight"]
                assert np.float32(sg[e]) == np.float32(float(p1.global_scale))
            for p in ("gate", "up", "down"):
                assert list(t[f"{b}ffn_{p}_exps.input_scale"].shape) == [EXPERTS]
    # Q/K rows in llama.cpp's interleaved-RoPE order: undo with transformers' own GGUF
    # un-permutation (independent of ours) and get the student's weights back
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    proc = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    for layer in range(LAYERS):
        for proj, g in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            key = f"model.layers.{layer}.self_attn.{proj}.weight"
            x = t[f"blk.{layer}.{g}.weight"]
            dq = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
            got = proc.process(dq, x.name).weights
            p = cm.packed[key]
            want = get_format(p.format).dequantize(p).float().numpy()
            if f"blk.{layer}.{g}.scale" in t:
                got = got * np.asarray(t[f"blk.{layer}.{g}.scale"].data).reshape(())
                np.testing.assert_allclose(got, want, rtol=2 ** -23, atol=0)
            else:
                assert np.array_equal(got, want), key
            assert not np.array_equal(dq, want)  # really permuted on disk
    if kw.get("preset"):  # the rest of Q4_K_M: attn_v bumped to Q6_K in layer 1, lm_head Q6_K
        assert [t[f"blk.{i}.attn_v.weight"].tensor_type.name for i in range(LAYERS)] == ["Q4_K", "Q6_K"]
        assert t["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
        assert t["output.weight"].tensor_type.name == "Q6_K"
    else:
        assert t["output.weight"].tensor_type.name == "BF16"


def test_mixtral_refusals(tmp_path):
    import copy

    from test_exporters_helpers import source_dir

    from qatfactory.exporters import ExportError
    # SGLang has no dense compressed-tensors MXFP4 scheme: quantized attention is refused
    with pytest.raises(ExportError, match="SGLang.*only for MoE experts"):
        export(mixtral("mxfp4"), tmp_path / "x", engine="sglang", flavour="compressed-tensors")
    # a tokenizer with more ids than the model's vocab_size (300 > 128): llama.cpp would reject
    # token_embd's shape, so the exporter says so instead of writing an unloadable file
    cm = copy.copy(mixtral("nvfp4", "nvfp4_act"))
    cm.source_dir = str(source_dir())
    with pytest.raises(ExportError, match="ids up to 299 but the model's vocab_size is 128"):
        export(cm, tmp_path / "x", engine="llama_cpp")
    assert not (tmp_path / "x").exists()
