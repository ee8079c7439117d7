"""A new format through the registry alone: a test adds a toy format and exports it, nothing else
changed. Each toy is defined here, in the test, as a format file would define it: one FormatSpec
(its rules and the engine layouts it declares) and one ``register(...)`` call. Nothing in exporters/ or
kernels/ names it; a tiny model is prepared and converted with it by the real quantize API, exported, and
the gate (the engines' own libraries and runtimes) must PASS.

* ``toy_int4_g64``: the ParetoQ 4-bit LSQ grid with one scale per 64 elements (a block rule no shipped
  format has), on bf16's grid: compressed-tensors int4 pack-quantized group 64 (vLLM) and Q4_0 (llama.cpp).
* ``toy_mxfp4_w``: OCP MXFP4 with the EVEN scale rule as a weight-only format: compressed-tensors
  mxfp4-pack-quantized, and GGML MXFP4 blocks repacked from its pairs codec.
* ``toy_mxfp4_nolayout``: the same numerics declaring no engine layout: every exporter refuses it by name.
"""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from test_exporters_helpers import make_student, source_dir

from qatfactory import kernels
from qatfactory.exporters import ExportError, export, verify
from qatfactory.formats import FormatSpec, get_format, list_formats, register, unregister
from qatfactory.formats.intgrid import IntGrid
from qatfactory.formats.layouts import (Codec, GGMLType, GGUFLayout, LlamaFileType, NibbleOrder, SafetensorsLayout,
                                        ScaleRule, TieRule)
from qatfactory.formats.mxfp4 import MXFP4Format

REPO = Path(__file__).resolve().parents[2]

TOY_INT4 = FormatSpec(
    name="toy_int4_g64", engine="test toy: ParetoQ 4-bit LSQ grid, one scale per 64 elements, in llama.cpp Q4_0",
    element="int4", block_size=64, super_block=32, bytes_per_block=18, scale_codec="fp16",
    scale_rule="learned alpha per 64 elements (init max|W| / 7, floor 1e-5); d = bf16(alpha)",
    tie_rule="half_even (torch.round)", global_scale=None,
    nibble_order="q4_0: byte j = (code[j]+8) | (code[j+16]+8) << 4, d fp16 per 32",
    oracle="the gate: gguf-py, libggml, compressed-tensors, llama.cpp", role="weight",
    gguf=GGUFLayout(GGMLType.Q4_0, file_type=LlamaFileType.MOSTLY_Q4_0),
    safetensors=SafetensorsLayout(Codec.INT4_FP16, ct_format="pack-quantized", group_size=64, strategy="group",
                                  scale_dtype=None, type="int"))

TOY_MX = FormatSpec(
    name="toy_mxfp4_w", engine="test toy: OCP MXFP4, EVEN scale rule, weights only", element="e2m1",
    block_size=32, super_block=32, bytes_per_block=17, scale_codec="e8m0", scale_rule=ScaleRule.MX_EVEN,
    tie_rule=TieRule.RNE, global_scale=None, nibble_order=NibbleOrder.PAIRS, oracle="the gate", role="weight",
    gguf=GGUFLayout(GGMLType.MXFP4, Codec.E2M1_E8M0, LlamaFileType.MOSTLY_MXFP4_MOE),
    safetensors=SafetensorsLayout(Codec.E2M1_E8M0, ct_format="mxfp4-pack-quantized", group_size=32,
                                  strategy="group", scale_dtype="uint8"))

TOY_NONE = dataclasses.replace(TOY_MX, name="toy_mxfp4_nolayout", gguf=None, safetensors=None)
TOYS = [TOY_INT4.name, TOY_MX.name, TOY_NONE.name]


@pytest.fixture(scope="module", autouse=True)
def toys():
    register(IntGrid(TOY_INT4, "lsq", -8, 7, "q4_0", group=64, grid="bf16"))   # the one registry call
    register(MXFP4Format(TOY_MX))
    register(MXFP4Format(TOY_NONE))
    yield
    for name in TOYS:
        unregister(name)
    assert not set(TOYS) & set(list_formats())


@pytest.mark.llama_cpp
@pytest.mark.parametrize("engine,flavour", [("vllm", "compressed-tensors"), ("llama_cpp", "gguf")])
@pytest.mark.parametrize("fmt", [TOY_INT4.name, TOY_MX.name])
def test_toy_format_exports_and_passes_the_gate(tmp_path, fmt, engine, flavour):
    cm = make_student("llama", fmt, source_dir())
    assert {p.format for p in cm.packed.values()} == {fmt} and len(cm.packed) == 7
    out = tmp_path / "e"
    res = export(cm, out, engine=engine, flavour=flavour)
    v = verify(out, cm)   # llama.cpp's runtime included for GGUF
    assert v.verdict == "PASS", v.table()
    for name in cm.packed:
        m = name[: -len(".weight")] if engine != "llama_cpp" else name
        assert {"bytes", "weights"} <= {c.check for c in v.checks if c.tensor == m and c.status == "ok"}, name
    lay = get_format(fmt).spec.gguf if engine == "llama_cpp" else get_format(fmt).spec.safetensors
    if engine == "llama_cpp":
        assert res.record["ggml_types"] == {lay.ggml_type.name: 7}
        assert any(c.tensor == "logits" and c.check == "llama.cpp runtime" and c.status == "ok" for c in v.checks)
    else:
        assert res.record["layout"] == lay.codec.value
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["format"] == lay.ct_format
        assert qc["config_groups"]["group_0"]["weights"]["group_size"] == (64 if fmt == TOY_INT4.name else 32)


def test_the_kernels_pick_a_toy_up_by_its_rule():
    # the E2M1 kernel is chosen by the spec's typed rules, not by a name: the MX toy has one, the int grid none
    assert TOY_MX.name in kernels.kernel_formats() and TOY_INT4.name not in kernels.kernel_formats()
    assert kernels._fp4_params(TOY_MX.name) == kernels._fp4_params("mxfp4_even")


def test_a_format_without_a_layout_is_refused_by_name(tmp_path):
    cm = make_student("llama", TOY_NONE.name, source_dir())
    for engine, flavour, container in (("vllm", "compressed-tensors", "safetensors"), ("sglang", "modelopt",
                                                                                       "safetensors"),
                                       ("llama_cpp", "gguf", "gguf")):
        with pytest.raises(ExportError, match=rf"{engine} exporter: format '{TOY_NONE.name}' .*declares no "
                                              rf"{container} layout"):
            export(cm, tmp_path / engine, engine=engine, flavour=flavour)
        assert not (tmp_path / engine).exists()


def _string_keys(tree):
    """String constants that code compares against, uses as dict keys or subscripts with."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for side in [n.left] + n.comparators:
                for c in ast.walk(side):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        yield n.lineno, c.value
        elif isinstance(n, ast.Dict):
            for k in n.keys:
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    yield n.lineno, k.value
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            yield n.lineno, n.slice.value


def test_no_exporter_or_kernel_branches_on_a_format_name():
    """exporters/ and kernels/ key on codec families and typed rules: no comparison, dict key or subscript
    there is a registered format's name (the toys' included). The KV-cache modules are left out: their keys
    are KV-cache algorithm names of a separate registry (formats/kv.py)."""
    names = set(list_formats())
    assert set(TOYS) <= names
    files = sorted((REPO / "exporters").rglob("*.py")) + sorted((REPO / "qatfactory" / "kernels").rglob("*.py"))
    hits = [f"{p.relative_to(REPO)}:{line} {v!r}" for p in files if p.name != "kv.py"
            for line, v in _string_keys(ast.parse(p.read_text())) if v in names]
    assert not hits, hits
    assert len(files) > 10
