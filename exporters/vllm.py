"""Safetensors checkpoints for vLLM (and SGLang, see sglang.py): two container flavours.

ModelOpt (``quant_method: modelopt``; NVFP4 only) per quantized linear ``<m>``::

    <m>.weight          uint8          [out, in/2]   E2M1 codes, element 2i in the low nibble
    <m>.weight_scale    float8_e4m3fn  [out, in/16]  block scales, row-major (engine swizzles)
    <m>.weight_scale_2  float32        0-d           S_w = amax_w/2688, MULTIPLIED at decode
    <m>.input_scale     float32        0-d           S_a = amax_a/2688 (W4A4 only)
    + hf_quant_config.json {producer, quantization{quant_algo, group_size, kv_cache_quant_algo,
      exclude_modules}} and the flat config.json quantization_config (vLLM reads config.json first).

compressed-tensors (``nvfp4-pack-quantized`` | ``mxfp4-pack-quantized``)::

    <m>.weight_packed        uint8   [out, in/2]   same packing
    <m>.weight_scale         e4m3 [out, in/16] (NVFP4) | uint8 E8M0 [out, in/32] (MXFP4)
    <m>.weight_global_scale  float32 [1]   G_w = 1/S_w, a DIVISOR (NVFP4 only)
    <m>.input_global_scale   float32 [1]   G_a = 1/S_a (NVFP4 W4A4 only; MX activations are dynamic)

compressed-tensors int4 W4A16 (``"format": "pack-quantized"``; the 4-bit LSQ grids int4_lsq,
int4_lsq_g32, int4_lsq_g128 of formats/intgrid.py)::

    <m>.weight_packed  int32  [out, in/8]   code + 8 (0..15), element i at bits 4*(i % 8) of word i // 8
    <m>.weight_scale   [out, 1] (channel) | [out, in/group] (group), in the model's dense dtype: the fp16
                       scale d as is, refused when that dtype cannot hold it exactly (bf16 keeps 8 bits)
    <m>.weight_shape   int64 [2]   (out, in)
    decode: code * weight_scale (compressed-tensors ``PackedQuantizationCompressor``, in the scale dtype)

Sources: vLLM 0.33 ``quantization/modelopt.py`` and ``compressed_tensors/``; ModelOpt 0.47
``export/unified_export_hf.py``; compressed-tensors 0.20.1 ``compressors/nvfp4``, ``mxfp4``. Experts are written per expert
(``...experts.E.gate_proj.weight``); routers, lm_head and every other unquantized linear stay in
the model dtype and are listed in ``exclude_modules``/``ignore``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from qatfactory.formats import ConvertedModel, get_format
from qatfactory.formats.layouts import ENGINE_FLAVOURS, FLAVOUR_TENSORS, MODELOPT_CONFIG_FILE, Codec, SafetensorsLayout
from qatfactory.formats.policy import tensor_role

from . import kv as KV  # k/v scales and kv-cache config keys
from .base import (
    EMBED,
    LM_HEAD,
    Exporter,
    ExportError,
    act_decode_scale,
    activation_mode,
    check_fused_scales,
    copy_source_files,
    declared_layout,
    module_of,
    register_exporter,
    save_sharded,
    spec_of,
    tied_duplicates,
    ties_embeddings,
    write_json,
)

MODELOPT_PRODUCER_VERSION = "0.47.0"  # the ModelOpt release whose export layout this follows
# why a checkpoint of this codec family gets no ModelOpt container here: the ModelOpt writer holds the
# E2M1 + E4M3 + fp32-scale codec only, under the quant_algo its layout names
_NO_MODELOPT = {
    Codec.E2M1_E4M3_FP32: "its layout declares no ModelOpt quant_algo; use flavour='compressed-tensors'",
    Codec.E2M1_E8M0: "ModelOpt checkpoints have no MXFP4 linear algorithm in vLLM/SGLang (their table holds FP8 "
                     "variants, NVFP4, W4A16_NVFP4, MXFP8); use flavour='compressed-tensors' (mxfp4-pack-quantized) "
                     "instead",
    Codec.INT4_FP16: "the ModelOpt container written here holds NVFP4 only; use flavour='compressed-tensors' (int4 "
                     "pack-quantized W4A16)",
}
SUPPORTED = {
    "modelopt": "NVFP4 (nvfp4), W4A4 with an NVFP4 activation format or W4A16",
    "compressed-tensors": "NVFP4 (nvfp4) W4A4/W4A16 and MXFP4 (mxfp4, mxfp4_rceil, mxfp4_even: any OCP-MX "
                          "scale rule, the container stores only the exponent byte) W4A4/W4A16; int4 W4A16 "
                          "pack-quantized (int4_lsq per channel, int4_lsq_g32 / int4_lsq_g128 per group)",
}


def excluded_linears(converted: ConvertedModel) -> List[str]:
    """Module names of the linears left in the model dtype (lm_head, routers, anything the
    QuantConfig excluded): 2-D ``.weight`` tensors that are not embeddings or norms. A tied
    lm_head is not written (the engine reuses the embedding) but is still listed, as
    llm-compressor and ModelOpt list it: a loader that builds the module tree from the config
    (transformers 5.17's CompressedTensorsConfig; 5.24 copes) otherwise takes ``lm_head`` for a
    quantized ``Linear``, drops its ``weight`` and fails when it ties it to the embedding."""
    out = []
    skip = set(tied_duplicates(converted))
    if ties_embeddings(converted) and LM_HEAD not in converted.packed and \
            (EMBED in converted.dense or EMBED in converted.packed):
        out.append(module_of(LM_HEAD))
    for name, t in converted.dense.items():
        if name in skip or not name.endswith(".weight") or t.ndim != 2:
            continue
        m = module_of(name)
        leaf = m.rsplit(".", 1)[-1]
        if "embed" in leaf or leaf in ("wte", "wpe") or "norm" in leaf:
            continue
        out.append(m)
    return sorted(out)


def _format_error(engine: str, flavour: str, fmt: str, why: str) -> ExportError:
    return ExportError(f"{engine}/{flavour}: cannot export format {fmt!r}: {why}")


class SafetensorsExporter(Exporter):
    flavours = ENGINE_FLAVOURS["vllm"]

    # ---------------------------------------------------------------- checks
    def layout_for(self, converted: ConvertedModel, flavour: str) -> SafetensorsLayout:
        """The one safetensors layout the formats of the checkpoint declare, or a refusal saying why."""
        layouts = set()
        for name, p in converted.packed.items():
            spec = spec_of(p)
            if spec.safetensors is None and spec.gguf is not None and spec.ggml_type is not None:
                raise _format_error(
                    self.engine, flavour, p.format,
                    f"it is a llama.cpp/ggml format ({spec.engine}) whose bytes only GGUF holds; export it "
                    f"with engine='llama_cpp', or train with an OCP/NVIDIA format (nvfp4, mxfp4) for "
                    f"vLLM/SGLang")
            if spec.role == "activation":
                raise NotImplementedError(
                    f"{self.engine}/{flavour} exporter does not support format {p.format!r} (tensor {name}): an "
                    f"activation format is no weight layout; supported: {SUPPORTED[flavour]}")
            lay = declared_layout(spec, "safetensors", self.engine, name, SUPPORTED[flavour])
            if flavour == "modelopt" and (lay.modelopt_algo is None or lay.codec is not Codec.E2M1_E4M3_FP32):
                # the ModelOpt writer below holds the E2M1 + E4M3 + fp32-scale codec, with the algo the spec names
                raise _format_error(self.engine, flavour, p.format, _NO_MODELOPT[lay.codec])
            layouts.add(lay)
            if lay.codec is Codec.INT4_FP16:
                if p.codes.dtype != torch.int8 or p.codes.ndim != 2 or p.codes.shape[-1] % 8:
                    raise ExportError(f"{name}: int4 codes must be a 2-D int8 tensor [out, in] with in % 8 == 0, "
                                      f"got {p.codes.dtype} {tuple(p.codes.shape)}")
                continue
            if p.codes.dtype != torch.uint8 or p.codes.ndim != 2:
                raise ExportError(f"{name}: packed codes must be a 2-D uint8 tensor [out, in/2] (experts per "
                                  f"expert), got {p.codes.dtype} {tuple(p.codes.shape)}")
        if not layouts:
            raise ExportError(f"{self.engine}: the converted model has no packed tensors; nothing is quantized")
        codecs = {lay.codec for lay in layouts}
        if len(codecs) > 1:
            raise ExportError(f"{self.engine}/{flavour}: one checkpoint mixes {' and '.join(sorted(codecs))} "
                              f"tensors; vLLM reads one quantization scheme per checkpoint here. Use one format.")
        if len(layouts) > 1:
            schemes = sorted(((lay.strategy, lay.group_size) for lay in layouts), key=str)
            raise ExportError(f"{self.engine}/{flavour}: {codecs.pop()} tensors with different scale groupings "
                              f"{schemes} (channel / group sizes); the checkpoint holds one weight scheme here. "
                              f"Use formats of one grouping (e.g. one of int4_lsq, int4_lsq_g32, int4_lsq_g128).")
        return layouts.pop()

    def check(self, converted: ConvertedModel, flavour: str, **options) -> None:
        emb = sorted(n for n in converted.packed if tensor_role(n) == "token_embd")
        # the embedding advice only when the rest of the student fits this container: otherwise keeping the
        # embeddings wide leads to the next refusal (layout_for names the format that does not fit)
        rest = [p for n, p in converted.packed.items() if n not in emb]
        if emb and all(spec_of(p).safetensors is not None for p in rest):
            raise ExportError(
                f"{self.engine}/{flavour}: {emb[0]} is quantized ({converted.packed[emb[0]].format}); vLLM and SGLang "
                f"keep embeddings in the model dtype (their checkpoints have no quantized embedding), so the engine "
                f"would not look up what the student trained on. Prepare with QuantConfig(quantize_embeddings=False) "
                f"for a safetensors export, or export this student with engine='llama_cpp' (GGUF)")
        lay = self.layout_for(converted, flavour)
        check_fused_scales(converted)
        tied_duplicates(converted)
        KV.check_kv(converted, self.engine, flavour)
        mode = activation_mode(converted)
        if lay.codec is Codec.INT4_FP16:
            if mode == "w4a4":
                raise ExportError(f"{self.engine}/{flavour}: int4 pack-quantized is weight-only (W4A16); drop the "
                                  f"activation format")
            sdt = _scale_dtype(lay, converted)
            for name, p in converted.packed.items():
                _int4_scale(name, p, sdt)
        if mode == "w4a4":
            for m, af in converted.act_formats.items():
                aspec = get_format(af).spec
                if lay.codec is Codec.E2M1_E4M3_FP32 and aspec.global_scale is None:
                    raise ExportError(f"{m}: W4A4 NVFP4 needs an NVFP4 activation format with a static "
                                      f"per-tensor scale (e.g. nvfp4_act), got {af!r}")
                if lay.codec is Codec.E2M1_E8M0 and (aspec.element != "e2m1" or aspec.block_size != lay.group_size):
                    raise ExportError(f"{m}: W4A4 MXFP4 needs an MXFP4 activation format (block 32, E2M1), "
                                      f"got {af!r}")

    # ---------------------------------------------------------------- write
    def write(self, converted: ConvertedModel, out: Path, flavour: str, max_shard_bytes: int = 5 * 2**30,
              **options) -> Tuple[List[str], Dict[str, Any]]:
        lay = self.layout_for(converted, flavour)
        mode = activation_mode(converted)
        exclude = excluded_linears(converted)
        both = sorted(set(converted.dense) & set(converted.packed))
        if both:
            raise ExportError(f"{both[:3]} are both dense and packed in the converted model")
        tensors: Dict[str, torch.Tensor] = {}
        skip = set(tied_duplicates(converted))  # config ties lm_head: engines read only the embedding
        for name, t in converted.dense.items():
            if name not in skip:
                tensors[name] = t
        sdt = _scale_dtype(lay, converted)
        T = FLAVOUR_TENSORS[flavour]     # the tensor names of the flavour (the readers read the same table)
        for name, p in converted.packed.items():
            m = module_of(name)
            if flavour == "modelopt":   # E2M1_E4M3_FP32 (the only codec with a ModelOpt algo): S multiplied
                tensors[m + T.codes] = p.codes
                tensors[m + T.block_scales] = p.scales.view(sdt)
                tensors[m + T.global_scale] = _f32_scalar(p.global_scale)
                if mode == "w4a4":
                    tensors[m + T.input_scale] = act_decode_scale(converted.act_formats[m], converted.input_amax[m])
            elif lay.codec is Codec.INT4_FP16:
                tensors[m + T.codes] = pack_int4(p.codes)
                tensors[m + T.block_scales] = _int4_scale(name, p, sdt)
                tensors[m + ".weight_shape"] = torch.tensor(list(p.shape), dtype=torch.int64)
            else:
                tensors[m + T.codes] = p.codes
                tensors[m + T.block_scales] = p.scales.view(sdt)
                if lay.codec is Codec.E2M1_E4M3_FP32:
                    # compressed-tensors divides by a global scale: store the reciprocal of S in fp32
                    tensors[m + T.global_scale] = (1.0 / _f32_scalar(p.global_scale)).reshape(1)
                    if mode == "w4a4":
                        s_a = act_decode_scale(converted.act_formats[m], converted.input_amax[m])
                        tensors[m + T.input_scale] = (1.0 / s_a).reshape(1)
        untie = flavour == "modelopt" and ties_embeddings(converted) and EMBED in converted.dense and \
            converted.config.get("model_type") not in EMBEDDING_IS_HEAD
        if untie:
            # vLLM (0.24, checked on an H200) cannot tie lm_head under a ModelOpt quantization config: its
            # ModelOpt get_quant_method gives the ParallelLMHead a linear method, excluded or not, and
            # ParallelLMHead.tie_weights then raises NotImplementedError. The export therefore ships the
            # head untied: lm_head.weight is the embedding's own bytes, listed in exclude_modules, so the
            # engine computes the same logits the tied student does.
            tensors[LM_HEAD] = converted.dense[EMBED].clone()
        kv_t = KV.kv_tensors(converted, flavour)           # per-layer k_scale / v_scale
        if set(kv_t) & set(tensors):
            raise ExportError(f"k/v scale names {sorted(set(kv_t) & set(tensors))[:3]} clash with model tensors")
        tensors.update(kv_t)
        files = save_sharded(tensors, out, max_shard_bytes=max_shard_bytes)

        cfg = dict(converted.config)
        if untie:
            cfg["tie_word_embeddings"] = False
        cfg.pop("quantization_config", None)
        for k in ("_name_or_path", "_commit_hash"):   # where the student was loaded from: not for publishing
            cfg.pop(k, None)
        if not cfg.get("torch_dtype"):
            cfg["torch_dtype"] = cfg.get("dtype") or _dtype_name(converted)
        if cfg.get("dtype") is None:   # one setting, two names: never a null beside a value
            cfg.pop("dtype", None)
        if not cfg.get("architectures"):  # engines pick the model class from it
            cfg["architectures"] = _architectures(cfg.get("model_type"))
        if flavour == "modelopt":
            qc, hf_quant = self._modelopt_config(lay, mode, exclude)
            algo, scheme = KV.modelopt_kv_config(converted)     # None/None without a KV format
            hf_quant["quantization"]["kv_cache_quant_algo"] = algo
            qc["kv_cache_quant_algo"], qc["kv_cache_scheme"] = algo, scheme
            write_json(out / MODELOPT_CONFIG_FILE, hf_quant)
            files.append(MODELOPT_CONFIG_FILE)
        else:
            qc = self._ct_config(lay, mode, exclude)
            qc["kv_cache_scheme"] = KV.ct_kv_scheme(converted)
        cfg["quantization_config"] = qc
        write_json(out / "config.json", cfg)
        files.append("config.json")
        files += copy_source_files(converted.source_dir, out)
        extra = {"layout": lay.codec.value, "mode": mode, "exclude_modules": exclude,
                 "tied_embeddings": bool(cfg.get("tie_word_embeddings")),
                 "untied_lm_head_copy": bool(untie),
                 "global_scale_convention": ("multiply (S = amax/2688)" if flavour == "modelopt" else
                                             "divide (G = 1/S)" if lay.codec is Codec.E2M1_E4M3_FP32 else
                                             "none (one scale per row / group)" if lay.codec is Codec.INT4_FP16 else
                                             "none (E8M0 only)")}
        extra.update(KV.kv_record(converted, self.engine))
        return files, extra

    @staticmethod
    def _modelopt_config(lay: SafetensorsLayout, mode: str, exclude: List[str]):
        algo = lay.modelopt_algo[0] if mode == "w4a4" else lay.modelopt_algo[1]
        g = lay.group_size
        producer = {"name": "modelopt", "version": MODELOPT_PRODUCER_VERSION}
        hf_quant = {"producer": producer,
                    "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": g,
                                     "exclude_modules": list(exclude)}}
        args = {"dynamic": False, "num_bits": lay.num_bits, "type": lay.type, "group_size": g}
        # the three keys vLLM demands of the nested form are repeated at the top of the flat form
        # (some vLLM builds check them there too); kv_cache_scheme is the flat form's own key
        qc = {"quant_method": "modelopt", "quant_algo": algo, "group_size": g, "kv_cache_quant_algo": None,
              "kv_cache_scheme": None,
              "ignore": list(exclude), "exclude_modules": list(exclude), "producer": producer,
              "config_groups": {"group_0": {"input_activations": dict(args) if mode == "w4a4" else None,
                                            "weights": dict(args), "targets": ["Linear"]}}}
        return qc, hf_quant

    @staticmethod
    def _ct_config(lay: SafetensorsLayout, mode: str, exclude: List[str]) -> Dict[str, Any]:
        if lay.codec is Codec.INT4_FP16:
            w = {"num_bits": lay.num_bits, "type": lay.type, "symmetric": True, "strategy": lay.strategy,
                 "group_size": lay.group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
            a = None
        else:
            w = {"num_bits": lay.num_bits, "type": lay.type, "symmetric": True, "group_size": lay.group_size,
                 "strategy": lay.strategy, "dynamic": False, "scale_dtype": f"torch.{lay.scale_dtype}"}
            # a static per-tensor input scale (E2M1_E4M3_FP32) or dynamic MX activations
            a = dict(w, dynamic="local", observer="static_minmax") if lay.codec is Codec.E2M1_E4M3_FP32 else \
                dict(w, dynamic=True)
        fmt = lay.ct_format
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                              "input_activations": a if mode == "w4a4" else None,
                                              "output_activations": None, "format": fmt}},
                "ignore": list(exclude), "kv_cache_scheme": None}


# ------------------------------------------------------------------------------ int4 pack-quantized
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [out, in] -> int32 [out, in/8]: code + 8, element i at bits 4*(i % 8) of word i // 8
    (compressed-tensors' dense int32 packing, read back with its ``unpack_from_int32`` in the gate)."""
    u = (codes.to(torch.int64) + 8).reshape(codes.shape[0], -1, 8)
    if bool((u < 0).any()) or bool((u > 15).any()):
        raise ExportError("int4 codes outside -8..7")
    sh = torch.arange(0, 32, 4, dtype=torch.int64)
    w = (u << sh).sum(-1)                                          # 0 .. 2^32 - 1, disjoint nibbles
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def _scale_dtype(lay: SafetensorsLayout, converted: ConvertedModel) -> torch.dtype:
    """The torch dtype of weight_scale: the layout's, or (None) the model's dense dtype, the dtype vLLM
    loads an int4 weight_scale into."""
    return getattr(torch, lay.scale_dtype or _dtype_name(converted))


def _int4_scale(name: str, p, dtype: torch.dtype) -> torch.Tensor:
    """The fp16 engine scales in the dtype vLLM loads them into (the model's), refused when inexact."""
    d = p.scales.float()
    s = d.to(dtype)
    if not torch.equal(s.float(), d):
        n = int((s.float() != d).sum())
        raise ExportError(f"{name}: {n} of its int4 scales (fp16 values) are not exact in the model dtype "
                          f"{str(dtype)[6:]}, into which vLLM loads weight_scale; the engine would run other "
                          f"weights than the student. Train with int4_lsq_bf16 / int4_lsq_g128_bf16 (scales on the bf16 "
                          f"grid), in float16/float32, or export to llama.cpp (Q4_0 stores fp16 scales as they are)")
    return s.contiguous()


# model types whose vLLM class has no lm_head at all and computes logits through its embedding table
# (vllm/model_executor/models/gemma3.py: compute_logits(self.model.embed_tokens, ...), and its constructor
# asserts tie_word_embeddings): there the tie that the ModelOpt untie works around never happens, and an
# untied config would be refused
EMBEDDING_IS_HEAD = ("gemma3_text",)


def _architectures(model_type):
    try:
        from transformers.models.auto.modeling_auto import (  # noqa: PLC0415 (heavy: transformers)
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names,
        )
    except ImportError:  # transformers is an install requirement; keep the export going without it
        return None
    cls = names.get(model_type)
    if cls is None:
        raise ExportError(f"config.json has no 'architectures' and model_type {model_type!r} is no causal LM "
                          f"transformers knows; set config.architectures before converting")
    return [cls]


def _f32_scalar(t) -> torch.Tensor:
    return torch.as_tensor(t, dtype=torch.float32).reshape(())


def _dtype_name(converted: ConvertedModel) -> str:
    for t in converted.dense.values():
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "bfloat16"


@register_exporter("vllm")
class VLLMExporter(SafetensorsExporter):
    pass
