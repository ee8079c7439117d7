"""readers/ (qatfactory.readers) takes what it matches in a container from the format spec, the tables the
exporters write with: a toy change of a spec table (a tensor suffix, the read-as format, a GGUF type's block
format) is what the reader follows, and the reader's sources spell none of the spec's names, dtypes or
block sizes themselves."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_exporters_helpers import student

from qatfactory import readers as R
from qatfactory.exitcodes import CorruptFileError
from qatfactory.exporters import export
from qatfactory.formats import REGISTRY, get_format
from qatfactory.formats import layouts as L

READERS = Path(__file__).resolve().parents[1] / "readers"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    out = {}
    for k, fmt, eng, fl in (("ct_nvfp4", "nvfp4", "vllm", "compressed-tensors"),
                            ("ct_mxfp4", "mxfp4", "vllm", "compressed-tensors"),
                            ("gguf_mxfp4", "mxfp4_ggml", "llama_cpp", None)):
        export(student("llama", fmt), root / k, engine=eng, flavour=fl)
        out[k] = root / k
    return out


def _same(a, b):
    assert set(a.packed) == set(b.packed) and a.layout == b.layout and a.base_format == b.base_format
    for n, p in a.packed.items():
        q = b.packed[n]
        assert torch.equal(p.codes, q.codes) and torch.equal(p.scales, q.scales)
        assert (p.global_scale is None) == (q.global_scale is None)
        assert p.global_scale is None or torch.equal(p.global_scale.view(torch.int32), q.global_scale.view(torch.int32))


def test_the_reader_follows_the_tensor_names_of_the_spec(bases, tmp_path, monkeypatch):
    """Renamed code and per-tensor-scale tensors read back only once the spec's table names them."""
    ref = R.read_native(bases["ct_nvfp4"])
    d = tmp_path / "renamed"
    d.mkdir()
    for f in bases["ct_nvfp4"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(d / "model.safetensors"))
    names = L.FLAVOUR_TENSORS[L.COMPRESSED_TENSORS]
    toy = dataclasses.replace(names, codes=".weight_codes", global_scale=".weight_g")
    ren = {names.codes: toy.codes, names.global_scale: toy.global_scale}
    sd = {next((k[: -len(a)] + b for a, b in ren.items() if k.endswith(a)), k): v for k, v in sd.items()}
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CorruptFileError, match=f"without .*{names.codes}"):
        R.read_native(d)                                  # today's table: the codes are not where it says
    monkeypatch.setitem(L.FLAVOUR_TENSORS, L.COMPRESSED_TENSORS, toy)
    _same(R.read_native(d), ref)


def test_the_reader_follows_the_read_as_format_and_the_block_format_of_the_spec(bases, monkeypatch):
    """Which registered format a codec family reads back as, and which format decodes a GGUF type's blocks,
    are the spec's: a toy choice (mxfp4_even for E2M1_E8M0, a copy of mxfp4_ggml's blocks) is what comes back."""
    ck = R.read_native(bases["ct_mxfp4"])
    assert ck.base_format == L.CODEC_READ_AS[L.Codec.E2M1_E8M0] and ck.layout == L.Codec.E2M1_E8M0.value
    monkeypatch.setitem(L.CODEC_READ_AS, L.Codec.E2M1_E8M0, "mxfp4_even")
    ck2 = R.read_native(bases["ct_mxfp4"])
    assert ck2.base_format == "mxfp4_even" and {p.format for p in ck2.packed.values()} == {"mxfp4_even"}
    assert all(torch.equal(p.codes, ck.packed[n].codes) for n, p in ck2.packed.items())
    monkeypatch.undo()

    g = R.read_native(bases["gguf_mxfp4"])
    assert g.base_format == "mxfp4_ggml"
    blocks = get_format("mxfp4_ggml")
    toy = type(blocks)(dataclasses.replace(blocks.spec, name="toy_mxfp4_blocks"))
    # mxfp4_ggml's spec no longer declares the MXFP4 blocks as its bytes; the toy format's does
    monkeypatch.setitem(REGISTRY, "mxfp4_ggml", type(blocks)(dataclasses.replace(blocks.spec, gguf=None)))
    monkeypatch.setitem(REGISTRY, toy.name, toy)
    g2 = R.read_native(bases["gguf_mxfp4"])
    assert g2.base_format == "toy_mxfp4_blocks" and g2.layout == g.layout
    assert all(torch.equal(p.codes, g.packed[n].codes) and torch.equal(p.scales, g.packed[n].scales)
               for n, p in g2.packed.items())


def _spec_facts():
    """Every string and block size of the spec that a reader matches in a container."""
    strs = {L.MODELOPT, L.COMPRESSED_TENSORS, L.GGUF_FLAVOUR, L.CT_MIXED_FORMAT, L.MODELOPT_CONFIG_FILE,
            L.GGUF_GLOBAL_SCALE, L.GGUF_INPUT_SCALE, *L.GGUF_DENSE_TYPES.values(),
            *(t.name for t in L.GGUF_DENSE_TYPES), *(c.value for c in L.CODEC_READ_AS)}
    for t in L.FLAVOUR_TENSORS.values():
        strs |= {t.codes, t.block_scales, t.global_scale, t.input_scale}
    sizes = set()
    for name in L.CODEC_READ_AS.values():
        spec = get_format(name).spec
        st, gg = spec.safetensors, spec.gguf
        strs |= {name, st.ct_format, st.scale_dtype, *(st.modelopt_algo or ()), gg.ggml_type.name,
                 R.layouts.blocks_format(gg.ggml_type)}
        sizes.add(spec.block_size)
    # ".weight" is also the HF parameter name of every linear (<module>.weight), which the readers spell;
    # ModelOpt's code tensor happens to carry that very name
    strs.discard(".weight")
    return strs, sizes


def test_the_reader_sources_spell_no_fact_of_the_spec():
    strs, sizes = _spec_facts()
    assert {"nvfp4", "mxfp4", ".weight_scale", ".weight_packed", "float8_e4m3fn", "NVFP4"} <= strs and \
        {16, 32} <= sizes                                     # the scan looks for what it should
    files = sorted(READERS.glob("*.py"))
    assert files
    bad = []
    for f in files:
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Constant) and not isinstance(n.value, bool) and \
                    ((isinstance(n.value, str) and n.value in strs) or (isinstance(n.value, int) and n.value in sizes)):
                bad.append(f"{f.name}:{n.lineno}: {n.value!r}")
            if isinstance(n, ast.Attribute) and n.attr in ("float8_e4m3fn", "uint8_e8m0"):
                bad.append(f"{f.name}:{n.lineno}: torch.{n.attr}")
    assert not bad, "spec facts spelled in readers/ (read them from formats/layouts.py):\n" + "\n".join(bad)
