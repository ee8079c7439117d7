"""The engine layouts every registered format declares (FormatSpec.gguf / .safetensors, formats/layouts.py),
checked against the engines' own libraries: the ggml type's block geometry and decode are gguf-py's, the
compressed-tensors names are compressed-tensors' enums, the ModelOpt algorithms nvidia-modelopt's. A format
registered tomorrow is checked here without writing a line; a wrong declaration fails before any export."""
import dataclasses

import gguf
import numpy as np
import pytest
import torch

from qatfactory.formats import get_format, list_formats
from qatfactory.formats.layouts import (Codec, GGMLType, GGUFLayout, LlamaFileType, NibbleOrder, SafetensorsLayout,
                                        ScaleRule, TieRule)

FORMATS = list_formats()


def _x(fmt, seed=0):
    k = max(256, fmt.spec.super_block, getattr(fmt, "group", 0) or 0)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, k, generator=g) * 0.05


def _quantize(f, x):
    kw = {"amax": x.abs().amax()} if f.spec.global_scale is not None else {}
    return f.quantize(x, **kw)


@pytest.mark.parametrize("name", [n for n in FORMATS if get_format(n).spec.gguf is not None])
def test_gguf_layout_is_what_gguf_py_decodes(name):
    """The declared ggml type holds the format's tensors: gguf-py's block geometry, and gguf-py's decode of
    the bytes the export writes equals the format's own dequantize (times the per-tensor scale)."""
    f = get_format(name)
    lay = f.spec.gguf
    assert isinstance(lay.ggml_type, GGMLType) and lay.file_type is not None
    blk, nbytes = gguf.GGML_QUANT_SIZES[lay.ggml_type]
    x = _x(f)
    p = _quantize(f, x)
    if lay.codec is Codec.GGML_BLOCKS:
        assert (f.spec.super_block, f.spec.bytes_per_block) == (blk, nbytes), name
        assert f.spec.ggml_type == int(lay.ggml_type)
        raw = np.ascontiguousarray(f.to_bytes(p)).reshape(x.shape[0], -1)
    else:
        from qatfactory.exporters.llama_cpp import packed_to_gguf   # the repack of the pairs codecs
        assert f.spec.ggml_type is None   # its own bytes are no GGUF blocks
        raw = packed_to_gguf("x.weight", p)[0]
    assert raw.shape[-1] == x.shape[-1] // blk * nbytes
    got = gguf.quants.dequantize(raw, lay.ggml_type).reshape(x.shape)
    want = f.dequantize(p).numpy()
    if p.global_scale is not None:   # shipped as the F32 <name>.scale, multiplied after the matmul
        got = got * np.float32(p.global_scale)
        np.testing.assert_allclose(got, want, rtol=2 ** -22, atol=0)
    else:
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("name", FORMATS)
def test_declared_codec_matches_the_packed_tensor(name):
    """Each codec family's promise about the PackedTensor, checked on the format's own output."""
    f = get_format(name)
    s = f.spec
    codecs = {lay.codec for lay in (s.gguf, s.safetensors) if lay is not None}
    x = _x(f)
    p = _quantize(f, x)
    rows, k = x.shape
    for c in codecs - {Codec.GGML_BLOCKS}:
        if c in (Codec.E2M1_E4M3_FP32, Codec.E2M1_E8M0):
            block = 16 if c is Codec.E2M1_E4M3_FP32 else 32
            assert s.element == "e2m1" and s.nibble_order is NibbleOrder.PAIRS and s.block_size == block
            assert p.codes.dtype == torch.uint8 and tuple(p.codes.shape) == (rows, k // 2)
            assert p.scales.dtype == torch.uint8 and tuple(p.scales.shape) == (rows, k // block)
            assert (p.global_scale is not None) == (c is Codec.E2M1_E4M3_FP32)
            assert s.scale_codec == ("e4m3" if c is Codec.E2M1_E4M3_FP32 else "e8m0")
        else:
            assert c is Codec.INT4_FP16
            assert p.codes.dtype == torch.int8 and tuple(p.codes.shape) == (rows, k)
            assert int(p.codes.min()) >= -8 and int(p.codes.max()) <= 7
            g = getattr(f, "group", 0)
            assert p.scales.dtype == torch.float16 and tuple(p.scales.shape) == (rows, k // g if g else 1)


@pytest.mark.parametrize("name", [n for n in FORMATS if get_format(n).spec.safetensors is not None])
def test_safetensors_layout_names_are_the_containers_own(name):
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType
    from modelopt.torch.export import model_config as mc

    f = get_format(name)
    lay = f.spec.safetensors
    CompressionFormat(lay.ct_format)
    QuantizationStrategy(lay.strategy)
    QuantizationType(lay.type)
    assert lay.scale_dtype is None or isinstance(getattr(torch, lay.scale_dtype), torch.dtype)
    if lay.codec is Codec.INT4_FP16:
        assert lay.group_size == (f.group or None) and lay.scale_dtype is None   # the model's dtype, as vLLM loads
    else:
        assert lay.group_size == f.spec.block_size
    if lay.modelopt_algo is not None:
        known = {v for k, v in vars(mc).items() if k.startswith("QUANTIZATION_") and isinstance(v, str)}
        assert {a.lower() for a in lay.modelopt_algo} <= known, (lay.modelopt_algo, sorted(known))


def test_rules_the_code_dispatches_on_are_typed():
    for name in FORMATS:
        s = get_format(name).spec
        if s.element == "e2m1":   # mxfp4.py and the kernels key on these
            assert isinstance(s.scale_rule, ScaleRule) and isinstance(s.tie_rule, TieRule), name
            assert isinstance(s.nibble_order, NibbleOrder), name
    # a spec spelling a known rule in words gets the member (the prose lives in one place, the enum)
    base = get_format("mxfp4").spec
    s = dataclasses.replace(base, scale_rule="ceil(log2(amax / 6))", tie_rule="rne", nibble_order="split_halves")
    assert s.scale_rule is ScaleRule.MX_RCEIL and s.tie_rule is TieRule.RNE
    assert s.nibble_order is NibbleOrder.SPLIT_HALVES
    assert s.as_dict()["scale_rule"] == "ceil(log2(amax / 6))"   # the record keeps the words


def test_layout_records_refuse_untyped_values():
    with pytest.raises(TypeError, match="GGMLQuantizationType"):
        GGUFLayout(39)
    with pytest.raises(TypeError, match="LlamaFileType"):
        GGUFLayout(GGMLType.MXFP4, file_type="MOSTLY_MXFP4_MOE")
    with pytest.raises(ValueError, match="codec"):
        GGUFLayout(GGMLType.Q4_0, Codec.INT4_FP16)
    with pytest.raises(ValueError, match="codec"):
        SafetensorsLayout(Codec.GGML_BLOCKS, "pack-quantized", None, "channel", None)
    with pytest.raises(ValueError, match="channel"):
        SafetensorsLayout(Codec.INT4_FP16, "pack-quantized", 64, "channel", None)
    with pytest.raises(TypeError, match="GGUFLayout"):
        dataclasses.replace(get_format("q4_k").spec, gguf="Q4_K")
    assert GGUFLayout(GGMLType.Q8_0, file_type=LlamaFileType.MOSTLY_Q8_0).codec is Codec.GGML_BLOCKS
