"""vLLM / SGLang safetensors exports (ModelOpt and compressed-tensors flavours) through the parity
gate, config fields the engines require, shared fused scales, refusals and atomic writes.

Students are tiny random Llama / Qwen3 / Qwen3-MoE models run through the real
quantize.prepare/calibrate/convert; the third-party code that proves each export is named in
verify's rows (compressed-tensors compressors and transformers' CompressedTensorsConfig loader,
a transcription of vLLM's ModelOpt NVFP4 dequantize rule)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from test_exporters_helpers import cell_student, cells, source_dir, student

from qatfactory.exporters import ExportError, export, verify
from qatfactory.exporters import base as ex_base

# this file's cells of the supported matrix (qatfactory/exporters/matrix.py): safetensors, dense and MoE
CELLS = cells(lambda c: c.engine in ("vllm", "sglang") and c.kind in ("llama", "qwen2", "qwen3", "qwen3_moe"))


@pytest.mark.parametrize("cell", CELLS)
def test_export_passes_gate(tmp_path, cell):
    engine, flavour, kind, fmt, act = cell.engine, cell.flavour, cell.kind, cell.fmt, cell.act
    cm = cell_student(cell)
    out = tmp_path / "export"
    res = export(cm, out, engine=engine, flavour=flavour)
    v = verify(out, cm)
    assert v.verdict == "PASS" and v.ok, v.table()
    checks = {(c.tensor, c.check) for c in v.checks if c.status == "ok"}
    for name in cm.packed:  # every packed tensor went through bytes and the engine library's decode
        m = name[: -len(".weight")]
        assert (m, "bytes") in checks and (m, "weights") in checks
        if flavour == "modelopt":
            assert (m, "weights (vLLM rule)") in checks
    srcs = {c.source for c in v.checks if c.check == "weights"}
    from qatfactory.exporters.verify.safetensors import layout_of
    lay = layout_of(fmt)
    ct_name = {"nvfp4": "NVFP4PackedCompressor", "mxfp4": "MXFP4PackedCompressor",
               "int4": "PackedQuantizationCompressor"}[lay]          # int4: the ParetoQ 4-bit LSQ grid
    assert srcs == ({"nvidia-modelopt NVFP4QTensor.dequantize"} if flavour == "modelopt" else
                    {f"compressed_tensors {ct_name}.decompress"}), srcs
    assert [c for c in v.checks if c.tensor == "logits" and c.status == "ok" and "bit-identical" in c.detail]
    assert ("config.json", "model config == student") in checks and ("tensors", "none extra") in checks
    assert any(c.tensor == "modules" and c.status == "ok" for c in v.checks)
    assert any("GPU" in n for n in v.notes)  # says where the engine itself runs

    # container facts the engines rely on
    files = set(res.files)
    assert {"config.json", "qatfactory.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "chat_template.jinja"} <= files
    sd = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["architectures"] and cfg["torch_dtype"] == "bfloat16"
    for m in res.record["exclude_modules"]:
        assert sd[m + ".weight"].dtype == torch.bfloat16
    assert "lm_head" in res.record["exclude_modules"]
    if kind == "qwen3_moe":
        routers = [m for m in res.record["exclude_modules"] if m.endswith(".mlp.gate")]
        assert len(routers) == 1
        suffix = "weight" if flavour == "modelopt" else "weight_packed"
        assert "model.layers.0.mlp.experts.3.down_proj." + suffix in sd
    if flavour == "modelopt":
        hq = json.loads((out / "hf_quant_config.json").read_text())
        q = hq["quantization"]
        # vLLM: "NVFP4 quantization requires the following fields in hf_quant_config.json"
        assert {"group_size", "kv_cache_quant_algo", "exclude_modules"} <= set(q)
        assert q["group_size"] == 16 and hq["producer"]["name"] == "modelopt"
        assert q["quant_algo"] == ("NVFP4" if act else "W4A16_NVFP4") == qc["quant_algo"]
        assert qc["quant_method"] == "modelopt" and qc["ignore"] == q["exclude_modules"]
        assert {"group_size", "kv_cache_quant_algo", "exclude_modules"} <= set(qc)
        any_m = next(iter(cm.packed))[: -len(".weight")]
        assert sd[any_m + ".weight"].dtype == torch.uint8
        assert sd[any_m + ".weight_scale"].dtype == torch.float8_e4m3fn
        assert sd[any_m + ".weight_scale_2"].dtype == torch.float32 and sd[any_m + ".weight_scale_2"].ndim == 0
        assert (any_m + ".input_scale" in sd) == bool(act)
    else:
        assert qc["quant_method"] == "compressed-tensors"
        assert qc["format"] == {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized",
                                "int4": "pack-quantized"}[lay]
        g = qc["config_groups"]["group_0"]
        assert (g["input_activations"] is not None) == bool(act)
    rec = json.loads((out / "qatfactory.json").read_text())
    assert rec["engine"] == engine and rec["weight_formats"] == [fmt]
    assert rec["numerics"][fmt]["block_size"] in ((16, 32) if lay != "int4" else (0, 32, 128))
    assert rec["numerics"][fmt]["engine"]


def test_fused_groups_share_scales_on_disk(tmp_path):
    cm = student("qwen3_moe", "nvfp4", None)
    out = tmp_path / "e"
    export(cm, out, engine="vllm", flavour="modelopt")
    sd = load_file(str(out / "model.safetensors"))
    for layer in (0,):
        a = f"model.layers.{layer}.self_attn."
        s = [sd[a + p + ".weight_scale_2"] for p in ("q_proj", "k_proj", "v_proj")]
        assert s[0] == s[1] == s[2]
        assert not torch.equal(s[0], sd[a + "o_proj.weight_scale_2"])  # not shared beyond the group
        for e in range(4):
            x = f"model.layers.{layer}.mlp.experts.{e}."
            assert sd[x + "gate_proj.weight_scale_2"] == sd[x + "up_proj.weight_scale_2"]


def test_unshared_fused_scale_is_refused(tmp_path):
    cm = copy.deepcopy(student("llama", "nvfp4", None))
    k = "model.layers.0.self_attn.k_proj.weight"
    cm.packed[k].global_scale = cm.packed[k].global_scale * 2
    with pytest.raises(ExportError, match=r"different per-tensor weight scales.*share"):
        export(cm, tmp_path / "e", engine="vllm", flavour="compressed-tensors")
    assert not (tmp_path / "e").exists()
    cm2 = copy.deepcopy(student("llama", "nvfp4", "nvfp4_act"))
    cm2.input_amax["model.layers.0.mlp.up_proj"] = cm2.input_amax["model.layers.0.mlp.up_proj"] + 1
    with pytest.raises(ExportError, match="different activation amax"):
        export(cm2, tmp_path / "e", engine="sglang", flavour="modelopt")


def test_refusals_say_why(tmp_path):
    mx = student("qwen3", "mxfp4", None)
    with pytest.raises(ExportError, match="ModelOpt.*no MXFP4.*compressed-tensors"):
        export(mx, tmp_path / "a", engine="vllm", flavour="modelopt")
    with pytest.raises(ExportError, match="SGLang.*only for MoE experts"):
        export(mx, tmp_path / "a", engine="sglang", flavour="compressed-tensors")
    q4 = student("llama", "q4_k_m", None)
    with pytest.raises(ExportError, match="llama.cpp/ggml format.*engine='llama_cpp'"):
        export(q4, tmp_path / "a", engine="vllm", flavour="compressed-tensors")
    cm = copy.deepcopy(mx)
    from qatfactory.formats import get_format
    for n, p in cm.packed.items():  # same tensors relabelled as the ggml engine variant
        p.format = "mxfp4_ggml"
    with pytest.raises(ExportError, match="mxfp4_ggml.*GGUF"):
        export(cm, tmp_path / "a", engine="vllm", flavour="compressed-tensors")
    cm = copy.deepcopy(student("llama", "nvfp4", None))
    w = next(iter(cm.packed))
    cm.packed[w].format = "nvfp4_act"  # an activation-only format is no weight layout
    with pytest.raises(NotImplementedError, match="supported: NVFP4"):
        export(cm, tmp_path / "a", engine="vllm", flavour="modelopt")
    with pytest.raises(ValueError, match="flavour='gptq'.*allowed"):
        export(mx, tmp_path / "a", engine="vllm", flavour="gptq")
    with pytest.raises(ValueError, match="engine='tgi'.*allowed"):
        export(mx, tmp_path / "a", engine="tgi")
    assert not (tmp_path / "a").exists()
    assert get_format("mxfp4_ggml").spec.ggml_type == 39


def test_atomic_write_and_force(tmp_path, monkeypatch):
    cm = student("llama", "nvfp4", None)
    out = tmp_path / "e"
    calls = {"n": 0}
    real = ex_base.write_json

    def boom(path, obj):  # dies after the weights are written, before config.json
        calls["n"] += 1
        raise RuntimeError("disk full (injected)")

    monkeypatch.setattr("qatfactory.exporters.vllm.write_json", boom)
    with pytest.raises(RuntimeError, match="injected"):
        export(cm, out, engine="vllm", flavour="modelopt")
    assert calls["n"] == 1 and not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind either
    monkeypatch.setattr("qatfactory.exporters.vllm.write_json", real)

    export(cm, out, engine="vllm", flavour="modelopt")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="force"):
        export(cm, out, engine="vllm", flavour="compressed-tensors")
    assert (out / "model.safetensors").read_bytes() == before and (out / "hf_quant_config.json").exists()
    # a failing forced export leaves the previous one intact
    monkeypatch.setattr("qatfactory.exporters.vllm.write_json", boom)
    with pytest.raises(RuntimeError):
        export(cm, out, engine="vllm", flavour="compressed-tensors", force=True)
    assert (out / "hf_quant_config.json").exists()
    monkeypatch.setattr("qatfactory.exporters.vllm.write_json", real)
    export(cm, out, engine="vllm", flavour="compressed-tensors", force=True)
    assert not (out / "hf_quant_config.json").exists()
    assert json.loads((out / "qatfactory.json").read_text())["flavour"] == "compressed-tensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_sharded_index(tmp_path):
    cm = student("llama", "nvfp4", None)
    out = tmp_path / "e"
    res = export(cm, out, engine="vllm", flavour="compressed-tensors", max_shard_bytes=400_000)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(shards) <= set(res.files) and not (out / "model.safetensors").exists()
    names = set()
    for s in shards:
        names |= set(load_file(str(out / s)))
    assert names == set(idx["weight_map"])
    v = verify(out, cm)
    assert v.verdict == "PASS", v.table()
    # opting out of the logits can never give PASS
    v = verify(out, cm, logits=False)
    assert v.verdict == "INCOMPLETE" and not v.ok and not v.failures
    assert [(c.tensor, c.check) for c in v.incomplete] == [("logits", "transformers")]
    assert "opted out" in v.incomplete[0].detail and "verdict: INCOMPLETE" in v.table()


def test_gate_catches_a_flipped_byte(tmp_path):
    from safetensors.torch import save_file
    cm = student("llama", "nvfp4", None)
    out = tmp_path / "e"
    export(cm, out, engine="vllm", flavour="modelopt")
    sd = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = sd[name].clone()
    sd[name][3, 5] ^= 0x10  # one code nibble
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    v = verify(out, cm)
    bad = {(c.tensor, c.check) for c in v.failures}
    assert not v.ok
    assert ("model.layers.0.mlp.down_proj", "bytes") in bad and ("model.layers.0.mlp.down_proj", "weights") in bad
    assert "verdict: FAIL" in v.table()
    assert source_dir().is_dir()


def test_gate_catches_a_missing_config_key(tmp_path):
    cm = student("llama", "nvfp4", None)
    out = tmp_path / "e"
    export(cm, out, engine="sglang", flavour="modelopt")
    assert verify(out, cm).ok
    hq = json.loads((out / "hf_quant_config.json").read_text())
    del hq["quantization"]["kv_cache_quant_algo"]  # vLLM raises on exactly this
    (out / "hf_quant_config.json").write_text(json.dumps(hq))
    v = verify(out, cm)
    # the config check and the KV-cache check (verify/kv.py) both see it
    fails = {(c.tensor, c.check): c for c in v.failures}
    assert set(fails) == {("hf_quant_config.json", "config == student"), ("kv cache", "config == student")}
    assert all("kv_cache_quant_algo" in c.detail for c in fails.values()), [c.detail for c in fails.values()]


def test_sglang_export_warns_when_hoppers_marlin_has_no_tile():
    # SmolLM2-135M's shapes (hidden 576, 9/3 heads of 64, MLP 1536): SGLang fuses q/k/v into K=576 x N=960, which
    # no FP4 Marlin tile fits (measured: the H200 run of 2026-12-03 stopped there), nor o_proj's 576 x 576;
    # gate/up (576 x 3072) and down (1536 x 576) fit. A hidden size of 768 fits everywhere.
    from types import SimpleNamespace

    from qatfactory.exporters import sglang as sg
    from qatfactory.formats import PackedTensor

    def model(h, q, kv, mlp):
        e = torch.empty(0, dtype=torch.uint8)
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                  "gate_proj": (mlp, h), "up_proj": (mlp, h), "down_proj": (h, mlp)}
        blk = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
        return SimpleNamespace(packed={f"model.layers.0.{blk.get(k, 'mlp')}.{k}.weight": PackedTensor("nvfp4", s, e)
                                       for k, s in shapes.items()})
    assert sg.marlin_misfits(model(576, 576, 192, 1536)) == [
        ("model.layers.0.self_attn.o_proj", 576, 576), ("model.layers.0.self_attn.qkv_proj", 576, 960)]
    assert sg.marlin_misfits(model(768, 768, 192, 2048)) == []
    assert not sg.marlin_fits(576, 960) and sg.marlin_fits(768, 1152) and sg.marlin_fits(1536, 576)
    # the exporter's check says so (a warning: the checkpoint is valid), and the tiny students, whose shapes fit,
    # export without it
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert sg.warn_marlin_misfits(model(576, 576, 192, 1536), "modelopt")
        sg.SGLangExporter().check(student("llama", "nvfp4", None), "modelopt")
    said = [str(x.message) for x in w if "Marlin" in str(x.message)]
    assert len(said) == 1 and "2 NVFP4 linears" in said[0] and "K=576, N=576" in said[0], said
