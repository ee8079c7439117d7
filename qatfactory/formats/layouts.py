"""What each engine container holds for a format: typed per-engine layout records, and the typed rules
that code dispatches on.

A :class:`~qatfactory.formats.FormatSpec` declares, per container, how its tensors are stored:

* ``spec.gguf``: a :class:`GGUFLayout` (llama.cpp): the ggml tensor type (a
  ``gguf.GGMLQuantizationType`` member), the codec family the blocks come from, the
  ``general.file_type`` when that type is the file's main one;
* ``spec.safetensors``: a :class:`SafetensorsLayout` (vLLM / SGLang): the codec family, the
  compressed-tensors format name and scheme fields, the scale dtype, the ModelOpt ``quant_algo``.

``None`` means the format has no layout in that container (the exporter refuses, naming the format
and the engine). Exporters, the verify gate and the kernels read these records and branch on a
:class:`Codec` (a codec family: how the PackedTensor holds codes and scales), never on a format
name; a new format whose tensors fit an existing codec family is its file plus its registry line.

The rule enums (:class:`ScaleRule`, :class:`TieRule`, :class:`NibbleOrder`) are ``StrEnum``: each
member's value is the human-readable rule written in the spec (and the README), its name is what
code keys on, so rewording a rule cannot silently unplug a kernel or an implementation.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

from gguf import GGMLQuantizationType, LlamaFileType

GGMLType = GGMLQuantizationType


# the container each engine's checkpoints are (exporters/: vllm.py and sglang.py write safetensors, llama_cpp.py
# GGUF): a format whose spec declares no layout for it cannot be exported for that engine
ENGINE_CONTAINER = {"vllm": "safetensors", "sglang": "safetensors", "llama_cpp": "gguf"}
# the container variants each engine's exporter writes, its default first (the exporters' own table), and the
# other spellings of their names
ENGINE_FLAVOURS = {"vllm": ("modelopt", "compressed-tensors"), "sglang": ("modelopt", "compressed-tensors"),
                   "llama_cpp": ("gguf",)}
FLAVOUR_ALIASES = {"ct": "compressed-tensors", "compressed_tensors": "compressed-tensors"}
# the flavour names are the containers' own: config.json quantization_config.quant_method ("modelopt",
# "compressed-tensors") and hf_quant_config.json producer.name ("modelopt")
MODELOPT, COMPRESSED_TENSORS = ENGINE_FLAVOURS["vllm"]
GGUF_FLAVOUR = ENGINE_FLAVOURS["llama_cpp"][0]
# the ModelOpt export's own quantization record beside config.json (older exports carry only this one)
MODELOPT_CONFIG_FILE = "hf_quant_config.json"
# compressed-tensors' top-level "format" when config groups differ; each group then names its own
CT_MIXED_FORMAT = "mixed-precision"


class Codec(enum.StrEnum):
    """A codec family: how a PackedTensor holds a tensor, as the engine containers see it. The value
    is the label the export record writes (``layout`` in qatfactory.json)."""

    GGML_BLOCKS = "ggml"          # Format.to_bytes(p) are the engine's ggml block records, as they are
    E2M1_E4M3_FP32 = "nvfp4"      # E2M1 codes in pairs [.., K/2] (element 2i low nibble), one E4M3 scale
    #                               byte per 16, an fp32 per-tensor decode scale (global_scale, multiplied)
    E2M1_E8M0 = "mxfp4"           # E2M1 codes in pairs [.., K/2], one E8M0 scale byte per 32, no per-tensor scale
    INT4_FP16 = "int4"            # int8 codes -8..7 [.., K], one fp16 scale per row or per group ([.., G])


class ScaleRule(enum.StrEnum):
    """Block-scale rules that code dispatches on (formats/mxfp4.py, kernels/); the value is the rule."""

    NVFP4_MODELOPT = "s = amax_b / fl(6*g); 0 -> 1.0; clamp [2^-9, 448]; RNE to E4M3"
    NVFP4_VLLM_ACT = ("SF = S * fl(vmax * RN(1/6)), S = 1/(amax/2688); e4m3 RN satfinite; no lower clamp "
                      "(tiny -> 0)")
    MX_FLOOR = "floor(log2 amax) - 2"
    MX_RCEIL = "ceil(log2(amax / 6))"
    MX_EVEN = "floor(log2(amax rounded half-up to 2 significant bits)) - 2"
    MX_GGML = "floor(log2f(amax)) - 2, byte mod 256"
    NVFP4_GGML = ("ggml_fp32_to_ue4m3(amax_b / 6): half-up mantissa, subnormal (int)(x*512+0.5), "
                  ">=248 -> 0x7E")
    Q4_K = "make_qkx2_quants (imatrix: make_qkx3_quants + make_qp_quants); 6-bit ls/lm vs fp16 d/dmin"
    Q5_0 = ("d = max/-16 (max = signed largest-|x|), fp16 RNE; elements use id = 1/d unrounded. "
            "imatrix: d = make_qx_quants(32, 16, w = imatrix*sqrt(sigma2 + x^2))")
    Q6_K = ("make_qx_quants(16, 32) per sub-block (rmse search over 19 iscales); "
            "iscale = -128/max_scale, d = fp16(1/iscale), sc = min(127, nearest_int(iscale*scale))")
    Q8_0 = "d = amax/127 (fp32 division), stored fp16 RNE; elements use id = 1/d unrounded"


class TieRule(enum.StrEnum):
    """Element tie rules that code dispatches on."""

    RNE = "rne"                       # IEEE round-half-even, sign bit kept
    TOWARD_ZERO = "toward_zero"
    ARGMIN_FIRST = "argmin_first"     # ggml's argmin over the code values, first index wins (ties toward zero)


class NibbleOrder(enum.StrEnum):
    """Orders of 4-bit codes in the engine bytes that code dispatches on."""

    PAIRS = "pairs"                   # byte i = c[2i] | c[2i+1] << 4
    SPLIT_HALVES = "split_halves"     # per block of n: byte j = c[j] | c[j+n/2] << 4


_GGUF_CODECS = (Codec.GGML_BLOCKS, Codec.E2M1_E4M3_FP32, Codec.E2M1_E8M0)
_ST_CODECS = (Codec.E2M1_E4M3_FP32, Codec.E2M1_E8M0, Codec.INT4_FP16)


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp holds a format's tensors in a GGUF file.

    ``codec``: GGML_BLOCKS when ``Format.to_bytes`` are the blocks of ``ggml_type``; a pairs codec
    (E2M1_E4M3_FP32, E2M1_E8M0) when the exporter repacks the PackedTensor's codes and scales into
    ``ggml_type``'s blocks (a per-tensor scale, when the tensor has one, ships as an F32
    ``<name>.scale``)."""

    ggml_type: GGMLQuantizationType
    codec: Codec = Codec.GGML_BLOCKS
    file_type: Optional[LlamaFileType] = None    # general.file_type when this type is the file's main one

    def __post_init__(self):
        if not isinstance(self.ggml_type, GGMLQuantizationType):
            raise TypeError(f"GGUFLayout.ggml_type={self.ggml_type!r}; allowed: a gguf.GGMLQuantizationType member")
        if self.codec not in _GGUF_CODECS:
            raise ValueError(f"GGUFLayout.codec={self.codec!r}; allowed: {[c.name for c in _GGUF_CODECS]}")
        if self.file_type is not None and not isinstance(self.file_type, LlamaFileType):
            raise TypeError(f"GGUFLayout.file_type={self.file_type!r}; allowed: a gguf.LlamaFileType member or None")


@dataclass(frozen=True)
class SafetensorsLayout:
    """How vLLM / SGLang hold a format's tensors in a safetensors checkpoint (ModelOpt and
    compressed-tensors containers). Field values are the containers' own names."""

    codec: Codec
    ct_format: str                         # compressed-tensors CompressionFormat value ("format" in config.json)
    group_size: Optional[int]              # elements per weight scale; None: one scale per output row
    strategy: str                          # compressed-tensors QuantizationStrategy value
    scale_dtype: Optional[str]             # torch dtype name of weight_scale; None: the model's dense dtype
    num_bits: int = 4
    type: str = "float"                    # compressed-tensors QuantizationType value: "float" | "int"
    modelopt_algo: Optional[Tuple[str, str]] = None   # ModelOpt quant_algo (W4A4, W4A16); None: no ModelOpt algo

    def __post_init__(self):
        if self.codec not in _ST_CODECS:
            raise ValueError(f"SafetensorsLayout.codec={self.codec!r}; allowed: {[c.name for c in _ST_CODECS]}")
        if (self.group_size is None) != (self.strategy == "channel"):
            raise ValueError(f"SafetensorsLayout: strategy={self.strategy!r} with group_size={self.group_size!r}; "
                             f"a per-row scale is strategy 'channel' with group_size None, any other has a group")



@dataclass(frozen=True)
class ContainerTensors:
    """The tensors a safetensors flavour stores for one E2M1 linear ``<m>``: suffixes of the module name.

    ``global_scale`` is the fp32 per-tensor scale of a codec that has one (E2M1_E4M3_FP32): S itself,
    multiplied at decode, or (``global_scale_divides``) G = 1/S, which the engine divides by (multiplies
    by fl(1/G)). ``input_scale`` exists only in an activation-quantized (W4A4) checkpoint."""

    codes: str              # uint8 [out, in/2], E2M1 pairs
    block_scales: str       # [out, in/group], the layout's scale_dtype
    global_scale: str
    global_scale_divides: bool
    input_scale: str


# vLLM 0.33 quantization/modelopt.py and compressed_tensors/ (ModelOpt 0.47 unified_export_hf.py,
# compressed-tensors 0.20.1 compressors/nvfp4, mxfp4): what the exporters write and the readers read
FLAVOUR_TENSORS = {
    MODELOPT: ContainerTensors(codes=".weight", block_scales=".weight_scale", global_scale=".weight_scale_2",
                               global_scale_divides=False, input_scale=".input_scale"),
    COMPRESSED_TENSORS: ContainerTensors(codes=".weight_packed", block_scales=".weight_scale",
                                         global_scale=".weight_global_scale", global_scale_divides=True,
                                         input_scale=".input_global_scale"),
}

# GGUF: the F32 tensor beside a repacked E2M1_E4M3_FP32 weight ``<name>`` (``<name minus .weight>.scale``) that
# holds S, multiplied by llama.cpp after the matmul; ``.input_scale`` likewise for W4A4 activations
GGUF_GLOBAL_SCALE = ".scale"
GGUF_INPUT_SCALE = ".input_scale"
# GGUF tensor types that hold a dense (unquantized) tensor, with the torch dtype it is read into
GGUF_DENSE_TYPES = {GGMLQuantizationType.F32: "float32", GGMLQuantizationType.F16: "float16",
                    GGMLQuantizationType.BF16: "bfloat16"}

# the format a checkpoint of each frozen-code codec family reads back as: the container stores the bytes and
# not the scale rule that made them, and this format decodes every rule's bytes (mxfp4 decodes the bytes of
# mxfp4_rceil / mxfp4_even alike); its spec's layouts name the container fields (ct_format, modelopt_algo,
# group_size, scale_dtype, ggml_type) a reader matches
CODEC_READ_AS = {Codec.E2M1_E4M3_FP32: "nvfp4", Codec.E2M1_E8M0: "mxfp4"}
