"""Exports of the ParetoQ low-bit grids through the parity gate, every registered grid:

* GGUF (Q4_0, Q3_K, Q2_K, TQ2_0, TQ1_0): gguf-py and libggml decode the student's exact weights,
  transformers' GGUF loader gives bit-identical logits, and llama.cpp's own runtime (llama-cpp-python,
  in a subprocess) loads the file and evaluates it;
* compressed-tensors int4 ``pack-quantized`` W4A16 (per channel, per group): compressed-tensors' own
  unpacking and decompressor give the student's weights exactly, transformers loads it with identical logits.
Students are trained for one step first, so weights and learned scales are not their init."""
from __future__ import annotations

import json

import pytest
import torch

from test_exporters_helpers import VOCAB, source_dir, tiny_config

from qatfactory.exporters import ExportError, export, verify
from qatfactory.formats import get_format, list_formats
from qatfactory.formats.intgrid import IntGrid

GRIDS = [n for n in list_formats() if isinstance(get_format(n), IntGrid)]
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# two layers x seven linears + lm_head: every grid once per file, two files
GGUF_SETS = [
    ["int2_seq", "ternary_seq", "binary_sign", "int3_lsq", "int4_lsq", "ternary_seq_tq1", "binary_sign_tq1",
     "int2_lsq", "int4_lsq_g32", "int4_lsq_g128", "int4_lsq_bf16", "int4_lsq_g128_bf16", "int3_lsq_q4_0",
     "int2_seq_q4_0", "int2_lsq_q4_0"],
    ["ternary_seq_q4_0", "binary_sign_q4_0"] + ["int2_seq"] * 13,
]


def lowbit_student(formats, dtype=torch.float32, seed=0, strategy="learnable"):
    """A 2-layer Llama whose 14 linears and lm_head get formats[0..14] (QuantConfig rules), one AdamW step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qatfactory.quantize import ModuleRule, QuantConfig, convert, prepare
    torch.manual_seed(seed)
    cfg = tiny_config("llama")
    cfg["num_hidden_layers"] = 2
    mt = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
    names = [f"model.layers.{i}.{'self_attn' if l.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{l}"
             for i in range(2) for l in LINEARS] + ["lm_head"]
    rules = [ModuleRule(pattern=n, weight=f) for n, f in zip(names, formats)]
    prepare(model, QuantConfig(weight_format=formats[0], rules=rules, scale_strategy=strategy,
                               quantize_lm_head=len(formats) > 14))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.to(dtype)                # the step in float32 (an fp16 AdamW step underflows), then the model dtype
    model.config.dtype = dtype
    cm = convert(model)
    cm.source_dir = str(source_dir())
    return cm


@pytest.mark.parametrize("formats", GGUF_SETS, ids=["all-grids", "q4_0-variants"])
def test_gguf_every_grid_passes_the_gate_and_runs_in_llama_cpp(tmp_path, formats):
    import gguf
    cm = lowbit_student(formats)
    assert sorted({p.format for p in cm.packed.values()}) == sorted(set(formats))
    out = tmp_path / "g"
    export(cm, out, engine="llama_cpp")
    v = verify(out, cm, llama_cpp=True)          # llama.cpp's runtime is required: a check that cannot run fails
    assert v.ok, v.table()
    for name in cm.packed:
        st = {c.check: c.status for c in v.checks if c.tensor == name}
        assert st == {"bytes": "ok", "weights (libggml C)": "ok", "weights": "ok"}, (name, st)
    assert v.logits["transformers GGUF loader"]["exact"]
    assert v.logits["llama.cpp"]["max_rel"] < 0.05
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out / "model.gguf")).tensors}
    want = {"Q4_0", "Q3_K", "Q2_K", "TQ2_0", "TQ1_0"} if formats is GGUF_SETS[0] else {"Q4_0", "Q2_K"}
    assert want <= set(types.values())
    assert types["blk.0.attn_q.weight"] == get_format(formats[0]).layout.upper().replace("_K", "_K")


@pytest.mark.parametrize("fmt,dtype", [("int4_lsq", torch.float32), ("int4_lsq_g128", torch.float32),
                                       ("int4_lsq_g32", torch.float16), ("int4_lsq_bf16", torch.bfloat16),
                                       ("int4_lsq_g128_bf16", torch.bfloat16)])
def test_compressed_tensors_int4_passes_the_gate(tmp_path, fmt, dtype):
    cm = lowbit_student([fmt] * 14, dtype=dtype)
    out = tmp_path / "ct"
    export(cm, out, engine="vllm", flavour="compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "pack-quantized" and w["type"] == "int" and w["num_bits"] == 4
    g = get_format(fmt).group
    assert (w["strategy"], w["group_size"]) == (("group", g) if g else ("channel", None))
    v = verify(out, cm)
    assert v.ok, v.table()
    for name in cm.packed:
        det = {c.check: c.detail for c in v.checks if c.tensor == name.rsplit(".", 1)[0]}
        assert det["weights"].startswith("exact"), det
    assert v.logits[next(iter(v.logits))]["exact"]


def test_int4_refusals(tmp_path):
    # scales a bf16 model cannot hold exactly (vLLM loads weight_scale in the model dtype) are refused: a
    # float32 student's fp16 scales with its dense tensors in bf16 (a bf16 model whose alpha stayed float32)
    cm = lowbit_student(["int4_lsq"] * 14)
    cm.dense = {k: v.to(torch.bfloat16) for k, v in cm.dense.items()}
    with pytest.raises(ExportError, match="not exact in the model dtype bfloat16.*int4_lsq_bf16"):
        export(cm, tmp_path / "x", engine="vllm", flavour="compressed-tensors")
    with pytest.raises(ExportError, match="ModelOpt container written here holds NVFP4 only"):
        export(cm, tmp_path / "x", engine="vllm", flavour="modelopt")
    mixed = lowbit_student(["int4_lsq"] * 7 + ["int4_lsq_g128"] * 7)
    with pytest.raises(ExportError, match="different scale groupings"):
        export(mixed, tmp_path / "x", engine="vllm", flavour="compressed-tensors")
    # the other grids are GGUF-only: vLLM refuses them by name
    ggml_only = lowbit_student(["int2_seq"] * 14)
    with pytest.raises(ExportError, match="llama.cpp/ggml format"):
        export(ggml_only, tmp_path / "x", engine="vllm", flavour="compressed-tensors")
    assert not (tmp_path / "x").exists()


def test_every_grid_is_covered_by_the_export_tests():
    assert set(GRIDS) == set(GGUF_SETS[0]) | set(GGUF_SETS[1])
