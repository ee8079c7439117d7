"""The KV-cache part of an export: which engines can run the cache type the student was
trained for, the k/v scale tensors and config keys they read, and the flags that turn the cache on.

Containers (the student's scales are ``ConvertedModel.kv_cache["layers"][attn]["k_scale"]``, float32):

    ModelOpt        <attn>.k_proj.k_scale, <attn>.v_proj.v_scale   float32 0-d   (ModelOpt's HF exporter
                    names; vLLM's maybe_remap_kv_scale_name maps them to <attn>.attn.{k,v}_scale)
                    hf_quant_config.json quantization.kv_cache_quant_algo = "FP8" | "NVFP4";
                    config.json quantization_config: kv_cache_quant_algo and kv_cache_scheme (FP8:
                    {"dynamic": false, "num_bits": 8, "type": "float"}; NVFP4: "NVFP4", as ModelOpt's
                    convert_hf_quant_config_format writes them; vLLM's get_kv_cache_quant_algo_string
                    maps both to its cache dtype when --kv-cache-dtype is auto)
    compressed-     <attn>.k_scale, <attn>.v_scale                float32 [1]   (llm-compressor's names;
    tensors         vLLM's default remap .k_scale -> .attn.k_scale); kv_cache_scheme {num_bits 8, type
                    float, strategy tensor, dynamic false, symmetric true} (vLLM's
                    CompressedTensorsKVCacheMethod accepts 8-bit float, tensor/attn_head, symmetric only)
    GGUF            nothing in the file (llama.cpp reads the cache type from its command line, no GGUF key
                    exists); qatfactory.json records it with the flags to serve it.

The value written is the scale the student's attention divided by (amax / 448 rounded up to a bf16 value, which
vLLM's bf16 parameter keeps unchanged; the gate checks that), bit for bit.

Attention (``ConvertedModel.kv_cache["attention"]``): a student trained with vLLM's FP8 attention
arithmetic (formats/kv_attention.py: ``fa3`` = FLASH_ATTN, ``triton`` = TRITON_ATTN) is served with that
backend: the flags add ``--attention-backend FLASH_ATTN|TRITON_ATTN`` (FLASH_ATTN is also what vLLM picks
on Hopper unasked). No q_scale is written: vLLM then quantizes the query with q_scale = 1.0, which is
what a student trained with those rules used (a ``<attn>.q_scale`` tensor would be loaded and change that).
The default rule is ``none`` (the cache write only; the flags then name no backend).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from qatfactory.formats import ConvertedModel
from qatfactory.formats.kv import get_kv_format, kv_formats_for
from qatfactory.formats.kv_attention import get_kv_attention

from .base import ExportError

# the engines' own flag for the cache dtype a KV format is served with
VLLM_FLAG = "--kv-cache-dtype"
SGLANG_FLAG = "--kv-cache-dtype"
VLLM_BACKEND_FLAG = "--attention-backend"


class KVExportError(ExportError):
    """A student trained for a cache type this engine/flavour cannot store or load."""


def kv_format_of(converted: ConvertedModel) -> Optional[str]:
    kv = getattr(converted, "kv_cache", None) or {}
    return kv.get("format")


def kv_attention_of(converted: ConvertedModel) -> str:
    """The engine attention rule the student trained with ("none": only the cache write)."""
    kv = getattr(converted, "kv_cache", None) or {}
    return kv.get("attention") or "none"


def check_kv(converted: ConvertedModel, engine: str, flavour: str) -> None:
    """Refuse (KVExportError) a KV format the engine does not run with the student's rule."""
    name = kv_format_of(converted)
    if name is None:
        return
    spec = get_kv_format(name).spec
    runs = kv_formats_for(engine)
    if name not in runs:
        raise KVExportError(f"{engine}/{flavour}: the student was trained for the KV-cache format {name!r} "
                            f"({spec.engine}), which {engine} does not write that way; {engine} runs "
                            f"{runs}. Train with one of those (QuantConfig.kv_format), or export for the engine "
                            f"whose rule it is")
    att = kv_attention_of(converted)
    if att != "none":
        rule = get_kv_attention(att)
        if engine != "vllm":
            raise KVExportError(f"{engine}/{flavour}: the student was trained with {rule.engine}'s FP8 attention "
                                f"({att!r}) on the {name!r} cache, which only vLLM runs; export for vllm")
        if name not in rule.kv_formats:
            raise KVExportError(f"vllm/{flavour}: the FP8 attention rule {att!r} reads the {list(rule.kv_formats)} "
                                f"cache, not {name!r}; the student's record pairs them")
    if engine in ("vllm", "sglang"):
        if flavour == "modelopt" and spec.modelopt_algo is None:
            raise KVExportError(f"{engine}/modelopt: KV-cache format {name!r} has no ModelOpt kv_cache_quant_algo")
        if flavour == "compressed-tensors" and spec.ct_scheme() is None:
            raise KVExportError(f"{engine}/compressed-tensors: KV-cache format {name!r} cannot be declared: vLLM's "
                                f"compressed-tensors loader accepts only an 8-bit float kv_cache_scheme; use "
                                f"flavour='modelopt' (kv_cache_quant_algo {spec.modelopt_algo!r})")
    layers = converted.kv_cache.get("layers") or {}
    if spec.static_scale:
        bad = [n for n, d in layers.items() if not _scale_ok(d.get("k_scale")) or not _scale_ok(d.get("v_scale"))]
        if bad or not layers:
            raise KVExportError(f"KV-cache format {name!r}: the student carries no valid k_scale / v_scale for "
                                f"{bad[:4] or 'any layer'}; calibrate the KV scales (quantize.calibrate) first")


def _scale_ok(t) -> bool:
    if t is None:
        return False
    t = torch.as_tensor(t)
    return t.numel() == 1 and t.dtype == torch.float32 and bool(torch.isfinite(t).all()) and float(t.reshape(-1)[0]) > 0


def scale_tensor_names(attn: str, flavour: str) -> Tuple[str, str]:
    if flavour == "modelopt":
        return f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale"
    return f"{attn}.k_scale", f"{attn}.v_scale"


def kv_tensors(converted: ConvertedModel, flavour: str) -> Dict[str, torch.Tensor]:
    """The k/v scale tensors of a safetensors export ({} without a KV format or a per-layer scale)."""
    name = kv_format_of(converted)
    if name is None or not get_kv_format(name).spec.static_scale:
        return {}
    out = {}
    shape = () if flavour == "modelopt" else (1,)
    for attn, d in sorted(converted.kv_cache["layers"].items()):
        kn, vn = scale_tensor_names(attn, flavour)
        out[kn] = torch.as_tensor(d["k_scale"], dtype=torch.float32).reshape(shape).clone()
        out[vn] = torch.as_tensor(d["v_scale"], dtype=torch.float32).reshape(shape).clone()
    return out


def modelopt_kv_config(converted: ConvertedModel) -> Tuple[Optional[str], Any]:
    """(hf_quant_config kv_cache_quant_algo, flat config kv_cache_scheme)."""
    name = kv_format_of(converted)
    if name is None:
        return None, None
    algo = get_kv_format(name).spec.modelopt_algo
    if algo == "FP8":
        return algo, {"dynamic": False, "num_bits": 8, "type": "float"}
    return algo, algo


def ct_kv_scheme(converted: ConvertedModel) -> Optional[Dict[str, Any]]:
    name = kv_format_of(converted)
    return None if name is None else get_kv_format(name).spec.ct_scheme()


def serve_flags(name: Optional[str], engine: str, attention: str = "none") -> str:
    """The command-line flags that make the engine run the cache type (empty without one) and, for a
    student trained with an engine attention rule, the backend that runs it."""
    if name is None:
        return ""
    s = get_kv_format(name).spec
    if engine == "vllm":
        flags = f"{VLLM_FLAG} {s.vllm_cache_dtype}"
        if attention != "none":
            flags += f" {VLLM_BACKEND_FLAG} {get_kv_attention(attention).vllm_backend}"
        return flags
    if engine == "sglang":
        return f"{SGLANG_FLAG} {s.sglang_cache_dtype}"
    if engine == "llama_cpp":
        # a quantized V cache needs flash attention; llama.cpp's -fa auto turns it on, -fa on says so
        return f"--cache-type-k {s.llama_cpp_type} --cache-type-v {s.llama_cpp_type} -fa on"
    raise ValueError(f"serve_flags: engine={engine!r}; allowed: vllm, sglang, llama_cpp")


def kv_record(converted: ConvertedModel, engine: str) -> Dict[str, Any]:
    """qatfactory.json's ``kv_cache`` entry: None-valued without a KV format."""
    name = kv_format_of(converted)
    if name is None:
        return {"kv_cache": None}
    s = get_kv_format(name).spec
    att = kv_attention_of(converted)
    rec: Dict[str, Any] = {"format": name, "engine_rule": s.engine, "serve_flags": serve_flags(name, engine, att),
                           "numerics": s.as_dict(), "attention": att}
    if att != "none":
        r = get_kv_attention(att)
        rec["attention_rule"] = r.as_dict()
        rec["attention_backend"] = r.vllm_backend
    if engine == "llama_cpp":
        rec.update({"cache_type_k": s.llama_cpp_type, "cache_type_v": s.llama_cpp_type,
                    "k_order": "gguf (the converter's permuted q/k rows)" if s.head_order == "gguf" else "hf"})
    else:
        rec["kv_cache_dtype"] = s.vllm_cache_dtype if engine == "vllm" else s.sglang_cache_dtype
        rec["layers"] = len(converted.kv_cache.get("layers") or {})
    return {"kv_cache": rec}
