"""Qwen3.5 dense (``qwen3_5_text``, a hybrid of Gated DeltaNet linear attention and gated full attention)
through prepare / calibrate / convert and the vLLM exports in both flavours, each through the parity gate.

What vLLM's qwen3_5.py does with the checkpoint decides what the student quantizes and how: it fuses
``linear_attn.in_proj_qkv`` and ``in_proj_z`` into one ``in_proj_qkvz`` GEMM (one per-tensor scale, as q/k/v),
``in_proj_b`` and ``in_proj_a`` into ``in_proj_ba`` (per-head gates of num_v_heads rows: kept in the model
dtype, as the engines run them), and keeps the short convolution, A_log, dt_bias and the norms wide.
"""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from test_exporters_helpers import cell_student, cells, qwen3_5_model, qwen3_5_student

from qatfactory.exporters import export, verify
from qatfactory.quantize import QuantConfig, coverage, prepare

CELLS = cells(lambda c: c.kind == "qwen3_5")
LIN = "model.layers.0.linear_attn"


@pytest.mark.parametrize("cell", CELLS)
def test_qwen3_5_export_passes_gate(tmp_path, cell):
    cm = cell_student(cell)
    assert cm.config["model_type"] == "qwen3_5_text"
    out = tmp_path / "e"
    export(cm, out, engine=cell.engine, flavour=cell.flavour)
    v = verify(out, cm)
    assert v.verdict == "PASS", v.table()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    sd = load_file(str(out / "model.safetensors"))
    if cell.fmt == "nvfp4":
        # the fused in_proj_qkvz of vLLM: one per-tensor scale for both shards, checked by the gate too
        checked = {c.tensor for c in v.checks if c.check.startswith("shared.") and c.status == "ok"}
        assert any("in_proj_qkv" in t and "in_proj_z" in t for t in checked), checked
        key = "weight_scale_2" if cell.flavour == "modelopt" else "weight_global_scale"
        assert sd[f"{LIN}.in_proj_qkv.{key}"].float().equal(sd[f"{LIN}.in_proj_z.{key}"].float())
    # kept wide, under their own names: vLLM's in_proj_ba shards, the conv, the decay and step parameters
    for n in ("in_proj_a.weight", "in_proj_b.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight"):
        assert sd[f"{LIN}.{n}"].dtype == cm.dense[f"{LIN}.{n}"].dtype, n
    ignored = cfg["quantization_config"].get("ignore") or cfg["quantization_config"].get("exclude_modules")
    assert f"{LIN}.in_proj_a" in ignored and f"{LIN}.in_proj_b" in ignored


def test_qwen3_5_coverage_names_what_stays_wide():
    model = qwen3_5_model()
    prepare(model, QuantConfig(weight_format="nvfp4"))
    rep = coverage(model)
    rows = {r.name: r for r in rep.rows}
    for proj in ("in_proj_qkv", "in_proj_z", "out_proj"):
        assert rows[f"{LIN}.{proj}.weight"].status == "quantized", proj
    for proj in ("in_proj_a", "in_proj_b"):
        assert rows[f"{LIN}.{proj}.weight"].status == "excluded", proj
    assert rows[f"{LIN}.conv1d.weight"].status == "dense" and "convolution" in rows[f"{LIN}.conv1d.weight"].note
    for n in ("A_log", "dt_bias", "norm.weight"):
        assert rows[f"{LIN}.{n}"].status == "dense"
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert rows[f"model.layers.3.self_attn.{proj}.weight"].status == "quantized"
    assert not rep.errors
    # one per-tensor scale for what vLLM fuses into in_proj_qkvz
    qkv, z = model.model.layers[0].linear_attn.in_proj_qkv, model.model.layers[0].linear_attn.in_proj_z
    cm = qwen3_5_student("nvfp4")
    assert [f"{LIN}.in_proj_qkv", f"{LIN}.in_proj_z"] in cm.fused_groups
    assert cm.packed[f"{LIN}.in_proj_qkv.weight"].global_scale.equal(cm.packed[f"{LIN}.in_proj_z.weight"].global_scale)
    assert qkv is not z


def test_qwen3_5_gguf_is_refused_naming_the_supported_ones(tmp_path):
    with pytest.raises(NotImplementedError, match=r"qwen3_5_text.*supported.*gemma3_text"):
        export(qwen3_5_student("mxfp4"), tmp_path / "g", engine="llama_cpp")
    assert not (tmp_path / "g").exists() or not any((tmp_path / "g").iterdir())


def test_qwen3_5_qad_steps_reach_every_projection_and_still_export(tmp_path):
    """Distillation steps on the fake-quantized student (KL to its frozen bf16 copy): gradients reach every
    quantized projection of both layer kinds and the wide DeltaNet parameters, the loss falls, and the
    trained student still converts, exports and passes the gate."""
    import copy

    import torch
    import torch.nn.functional as F

    from qatfactory.quantize import convert
    torch.manual_seed(0)
    teacher = qwen3_5_model().float().eval()
    student = copy.deepcopy(teacher)
    prepare(student, QuantConfig(weight_format="nvfp4"))
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=2e-4)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(ids).logits, -1)
    losses = []
    for step in range(6):
        s_logp = F.log_softmax(student(ids).logits, -1)
        loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad for n, p in student.named_parameters() if p.requires_grad}
            for n in (f"{LIN}.in_proj_qkv.weight", f"{LIN}.in_proj_z.weight", f"{LIN}.out_proj.weight",
                      f"{LIN}.in_proj_a.weight", f"{LIN}.conv1d.weight", f"{LIN}.A_log", f"{LIN}.dt_bias",
                      "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight"):
                assert grads.get(n) is not None and bool(grads[n].abs().sum() > 0), n
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    student.to(torch.bfloat16)
    cm = convert(student)
    cm.source_dir = qwen3_5_student("nvfp4").source_dir
    export(cm, tmp_path / "e", engine="vllm", flavour="compressed-tensors")
    v = verify(tmp_path / "e", cm)
    assert v.verdict == "PASS", v.table()
