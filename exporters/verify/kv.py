"""The gate's KV-cache checks: the scales and config keys an engine reads to run the cache
type the student was trained for, compared with the student (``ConvertedModel.kv_cache``).

Written here from the engines' conventions, not from the exporter (exporters/kv.py):

* vLLM / SGLang, ModelOpt flavour: ``<attn>.k_proj.k_scale`` and ``<attn>.v_proj.v_scale``, float32
  0-d, the student's scales bit for bit (vLLM remaps them to ``<attn>.attn.{k,v}_scale`` and uses them
  as the quantization divisor and dequantization factor); hf_quant_config.json
  ``quantization.kv_cache_quant_algo`` and config.json's flat ``kv_cache_quant_algo`` = the format's
  ModelOpt algo; ``kv_cache_scheme``, the key vLLM's ``get_kv_cache_quant_algo_string`` reads first,
  must resolve to the student's vLLM cache dtype (FP8: an 8-bit float dict; NVFP4: "NVFP4").
* compressed-tensors flavour: ``<attn>.k_scale`` / ``<attn>.v_scale`` float32 [1]; ``kv_cache_scheme``
  parsed by compressed-tensors' own ``QuantizationArgs`` and held to what vLLM's
  ``CompressedTensorsKVCacheMethod`` accepts (8-bit float, tensor strategy, symmetric, static).
* GGUF: no key exists for the cache type in the file; qatfactory.json's ``kv_cache`` record must name
  the student's llama.cpp cache type for K and V and the flags that select it.
* qatfactory.json's ``kv_cache.attention`` must be the attention rule the student trained with and,
  for an FP8 attention rule (vLLM's FLASH_ATTN = FA3 or TRITON_ATTN), the serving flags must select that
  backend (``--attention-backend``), and no ``q_scale`` tensor may be in the checkpoint: vLLM would load
  it in place of the q_scale = 1.0 the student's query cast used.
Without a KV format in the student, none of these may be present (a cache the student never saw).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from qatfactory.formats import ConvertedModel
from qatfactory.formats.kv import get_kv_format

from .common import f32_bits
from .result import Missing, VerifyResult, need


def student_kv(student: ConvertedModel):
    kv = getattr(student, "kv_cache", None) or {}
    name = kv.get("format")
    return (None, None, {}) if name is None else (name, get_kv_format(name).spec, kv.get("layers") or {})


def expected_scale_tensors(student: ConvertedModel, flavour: str) -> Dict[str, Tuple[Tuple[int, ...], torch.Tensor]]:
    """name -> (shape, the student's scale) of every k/v scale tensor the export must hold."""
    name, spec, layers = student_kv(student)
    if name is None or not spec.static_scale:
        return {}
    out = {}
    for attn, d in layers.items():
        if flavour == "modelopt":
            out[f"{attn}.k_proj.k_scale"] = ((), d["k_scale"])
            out[f"{attn}.v_proj.v_scale"] = ((), d["v_scale"])
        else:
            out[f"{attn}.k_scale"] = ((1,), d["k_scale"])
            out[f"{attn}.v_scale"] = ((1,), d["v_scale"])
    return out


_SERVED = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "float": torch.float32}


def served_scale_dtype(cfg: Optional[Dict[str, Any]]) -> torch.dtype:
    """The dtype vLLM holds k_scale / v_scale in: its KVCacheScaleParameter is made while torch's default
    dtype is the model's (quantization/kv_cache.py of 0.24, a transcription), i.e. config.json's
    torch_dtype (transformers 5: dtype). With --dtype auto vLLM downcasts a float32 config to the platform's
    first supported dtype, bfloat16 on CUDA (config/model.py _resolve_auto_dtype, read in 0.24); an unnamed one
    is taken as bfloat16 too."""
    name = str((cfg or {}).get("torch_dtype") or (cfg or {}).get("dtype") or "bfloat16").replace("torch.", "")
    dt = _SERVED.get(name, torch.bfloat16)
    return torch.bfloat16 if dt == torch.float32 else dt


def check_scales_survive_serving(res: VerifyResult, sd: Dict[str, torch.Tensor], student: ConvertedModel,
                                 flavour: str, cfg: Optional[Dict[str, Any]]) -> None:
    """Each k/v scale in the file must come back unchanged from a cast to the dtype vLLM holds it in (SGLang
    holds float32), or the engine divides by another scale than the student (torch's own cast decides)."""
    want = expected_scale_tensors(student, flavour)
    if not want:
        return
    dt = served_scale_dtype(cfg)
    bad = []
    for n in sorted(want):
        t = sd.get(n)
        if t is None or t.dtype != torch.float32:
            continue                                  # reported by check_scale_tensors
        v = float(t.reshape(-1)[0])
        held = float(t.reshape(-1)[0].to(dt))
        if held != v:
            bad.append(f"{n}={v:.9g} is held as {held:.9g}")
    res.ok_or_fail("kv cache", f"k/v scales survive vLLM's {str(dt).replace('torch.', '')} parameter", not bad,
                   "; ".join(bad[:3]) + (f" (+{len(bad) - 3})" if len(bad) > 3 else "") +
                   ": vLLM keeps k_scale / v_scale in the model's dtype, so its cache divides by another scale than "
                   "the student's; convert the student again with this qatfactory (its KV scales, amax / 448, are now "
                   "rounded up to a bf16 value; a few QAD steps with the cache on re-adapt it)"
                   if bad else f"{len(want)} scales unchanged by torch's cast to {str(dt).replace('torch.', '')}",
                   source="torch cast; vLLM 0.24 quantization/kv_cache.py KVCacheScaleParameter (a transcription)")


def check_scale_tensors(res: VerifyResult, sd: Dict[str, torch.Tensor], student: ConvertedModel, flavour: str) -> None:
    att = (getattr(student, "kv_cache", None) or {}).get("attention") or "none"
    if att != "none":
        qs = sorted(n for n in sd if n.endswith(".q_scale"))
        res.ok_or_fail("kv cache", "no q_scale (vLLM: q_scale 1.0)", not qs,
                       f"{len(qs)} q_scale tensor(s) ({qs[:2]}): vLLM loads them as the query's FP8 scale, the "
                       f"student's query cast used 1.0 ({att})" if qs else
                       f"none: vLLM casts the query with q_scale 1.0, as the student ({att}) did")
    want = expected_scale_tensors(student, flavour)
    if not want:
        return
    bad = []
    for n, (shape, s) in sorted(want.items()):
        t = sd.get(n)
        if t is None:
            bad.append(f"{n} missing")
        elif t.dtype != torch.float32 or tuple(t.shape) != shape:
            bad.append(f"{n} is {t.dtype} {tuple(t.shape)} (want float32 {shape})")
        elif f32_bits(t) != f32_bits(s) or not float(t.reshape(-1)[0]) > 0:
            bad.append(f"{n}={float(t.reshape(-1)[0]):.9g} (student {float(s):.9g})")
    res.ok_or_fail("kv cache", "k/v scales == student", not bad, "; ".join(bad[:4]) + (f" (+{len(bad) - 4})" if
                   len(bad) > 4 else "") if bad else f"{len(want)} scales, bit-equal to the student's "
                   f"({student.kv_cache['format']})")


def check_modelopt_config(res: VerifyResult, qc: Dict[str, Any], hq: Optional[Dict[str, Any]],
                          student: ConvertedModel) -> None:
    name, spec, _ = student_kv(student)
    algo = None if name is None else spec.modelopt_algo
    bad = []
    if hq is not None:
        q = hq.get("quantization") if isinstance(hq.get("quantization"), dict) else {}
        if "kv_cache_quant_algo" not in q:
            bad.append("hf_quant_config.json quantization.kv_cache_quant_algo missing (vLLM requires the key)")
        elif q.get("kv_cache_quant_algo") != algo:
            bad.append(f"hf_quant_config.json kv_cache_quant_algo={q.get('kv_cache_quant_algo')!r} (student: {algo!r})")
    if qc.get("kv_cache_quant_algo") != algo:
        bad.append(f"config.json kv_cache_quant_algo={qc.get('kv_cache_quant_algo')!r} (student: {algo!r})")
    # what vLLM's get_kv_cache_quant_algo_string derives from the flat config (a transcription)
    got = _vllm_modelopt_cache_dtype(qc)
    want = None if algo is None else {"FP8": "fp8_e4m3", "NVFP4": "nvfp4"}.get(algo, "?")
    if got != want:
        bad.append(f"config.json kv_cache_scheme={qc.get('kv_cache_scheme')!r} resolves to vLLM cache dtype "
                   f"{got!r} (student: {want!r})")
    res.ok_or_fail("kv cache", "config == student", not bad, "; ".join(bad) if bad else
                   (f"kv_cache_quant_algo={algo}, vLLM --kv-cache-dtype auto -> {want}" if algo else
                    "no KV-cache quantization declared (the student has none)"),
                   source="transcription of vLLM's get_kv_cache_quant_algo_string")


def _vllm_modelopt_cache_dtype(qc: Dict[str, Any]) -> Optional[str]:
    inner = qc.get("quantization", qc) if isinstance(qc.get("quantization", qc), dict) else qc
    algo = inner.get("kv_cache_scheme") or qc.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo") or \
        qc.get("kv_cache_quant_algo")
    if isinstance(algo, dict):
        if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
            return "fp8_e4m3"
        if algo.get("num_bits") == 4 and algo.get("type") == "float":
            return "nvfp4"
        return "auto"
    if isinstance(algo, str):
        return {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}.get(algo.lower(), "auto")
    return None


def check_ct_config(res: VerifyResult, qc: Dict[str, Any], student: ConvertedModel) -> None:
    name, spec, _ = student_kv(student)
    sch = qc.get("kv_cache_scheme")
    if name is None:
        res.ok_or_fail("kv cache", "config == student", sch is None,
                       f"kv_cache_scheme={sch!r} but the student has no KV-cache format" if sch is not None else
                       "no kv_cache_scheme (the student has none)")
        return
    try:
        args = need("compressed_tensors.quantization").QuantizationArgs.model_validate(sch)
    except Missing as e:
        res.missing("kv cache", "config == student", e)
        return
    except Exception as e:
        res.add("kv cache", "config == student", "FAIL", f"compressed-tensors rejects kv_cache_scheme {sch!r}: "
                f"{type(e).__name__}: {str(e)[:200]}", source="compressed_tensors.QuantizationArgs")
        return
    v = lambda x: str(getattr(x, "value", x))  # noqa: E731
    bad = []
    if args.num_bits != spec.ct_num_bits or v(args.type) != "float":
        bad.append(f"num_bits={args.num_bits} type={v(args.type)} (student: {spec.ct_num_bits}-bit float)")
    if v(args.strategy) != "tensor" or not args.symmetric or args.dynamic not in (False, "false"):
        bad.append(f"strategy={v(args.strategy)} symmetric={args.symmetric} dynamic={args.dynamic} (student: one static "
                   f"symmetric scale per tensor)")
    res.ok_or_fail("kv cache", "config == student", not bad, "; ".join(bad) if bad else
                   f"kv_cache_scheme {spec.ct_num_bits}-bit float, tensor, static ({name})",
                   source="compressed_tensors.QuantizationArgs")


def check_record(res: VerifyResult, rec: Dict[str, Any], student: ConvertedModel, engine: str) -> None:
    name, spec, layers = student_kv(student)
    kv = rec.get("kv_cache")
    if name is None:
        res.ok_or_fail("qatfactory.json", "kv_cache == student", kv is None,
                       f"kv_cache={kv!r} but the student has no KV-cache format" if kv is not None else
                       "no KV-cache format (as the student)")
        return
    if not isinstance(kv, dict):
        res.add("qatfactory.json", "kv_cache == student", "FAIL", f"kv_cache={kv!r}; the student was trained for {name}")
        return
    bad = []
    if kv.get("format") != name:
        bad.append(f"format={kv.get('format')!r} (student: {name!r})")
    if engine == "llama_cpp":
        t = spec.llama_cpp_type
        if t is None:
            bad.append(f"the student's KV-cache format {name!r} is no llama.cpp cache type")
        else:
            if kv.get("cache_type_k") != t or kv.get("cache_type_v") != t:
                bad.append(f"cache_type_k/v={kv.get('cache_type_k')!r}/{kv.get('cache_type_v')!r} (student: {t})")
            flags = str(kv.get("serve_flags", "")).split()
            for f, val in (("--cache-type-k", t), ("--cache-type-v", t)):
                if f not in flags or flags.index(f) + 1 >= len(flags) or flags[flags.index(f) + 1] != val:
                    bad.append(f"serve_flags {kv.get('serve_flags')!r} do not select {f} {val}")
    else:
        dt = spec.vllm_cache_dtype if engine == "vllm" else spec.sglang_cache_dtype
        if dt is None:
            bad.append(f"{engine} does not run the student's KV-cache format {name!r}")
        elif kv.get("kv_cache_dtype") != dt or f"--kv-cache-dtype {dt}" not in str(kv.get("serve_flags", "")):
            bad.append(f"kv_cache_dtype={kv.get('kv_cache_dtype')!r} / serve_flags {kv.get('serve_flags')!r} "
                       f"(student: {dt})")
        if kv.get("layers") != len(layers):
            bad.append(f"layers={kv.get('layers')!r} (student: {len(layers)})")
    att = (getattr(student, "kv_cache", None) or {}).get("attention") or "none"
    if (kv.get("attention") or "none") != att:
        bad.append(f"attention={kv.get('attention')!r} (student trained with {att!r})")
    elif att != "none":
        backend = {"fa3": "FLASH_ATTN", "triton": "TRITON_ATTN"}.get(att, "?")   # vLLM's names for the kernels
        flags = str(kv.get("serve_flags", "")).split()
        f = "--attention-backend"
        if engine != "vllm" or f not in flags or flags.index(f) + 1 >= len(flags) or flags[flags.index(f) + 1] != backend:
            bad.append(f"serve_flags {kv.get('serve_flags')!r} do not select vLLM's {f} {backend} (the student trained "
                       f"with its FP8 attention, {att})")
    res.ok_or_fail("qatfactory.json", "kv_cache == student", not bad, "; ".join(bad) if bad else
                   f"{name}: {kv.get('serve_flags')}")

