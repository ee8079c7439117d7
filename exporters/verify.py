"""The parity gate: reload an export with third-party code and compare it with the student.

Per packed tensor, three levels:

1. bytes    the codes and scales on disk equal the training quantizer's bytes (ConvertedModel)
2. weights  the engine's own decoder (compressed-tensors compressors; gguf-py; libggml's C
            dequantizers when libggml-python is installed; for ModelOpt NVFP4 a transcription of
            vLLM's ``dequantize_to_dtype`` rule: code x (fp8 x weight_scale_2)) equals the student's
            fake-quant weights
3. logits   a model rebuilt by a third-party loader (transformers + compressed-tensors
            ``dequantize=True``; transformers' GGUF loader) gives the student's logits on a fixed
            prompt; llama.cpp's runtime (llama-cpp-python) too when it is importable

Where a container's convention makes bit-equality impossible the row says so and gives the
difference: compressed-tensors stores NVFP4's per-tensor scale as its reciprocal G = 1/S and
decodes code x (fp8 / G) into bf16; llama.cpp multiplies NVFP4's S after the matmul. Everything
else must match exactly. Logits are compared with weight-only fake quantization: activation
quantization (W4A4) happens in the engine's kernels, which these CPU loaders do not run; its
static scales are checked at the bytes level.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from qatfactory.formats import ConvertedModel, get_format

from .base import LM_HEAD, QATFACTORY_JSON, act_decode_scale, fused_groups, load_safetensors_dir, module_of, read_record

# E2M1 magnitudes written out here (not imported) so the decode below stays independent of ours
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@dataclass
class Check:
    tensor: str
    check: str
    status: str          # "ok" | "FAIL" | "skip"
    detail: str = ""
    max_abs_diff: Optional[float] = None
    source: str = ""     # the third-party code that produced the compared values


@dataclass
class VerifyResult:
    export_dir: str
    engine: str
    flavour: str
    checks: List[Check] = field(default_factory=list)
    logits: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.status != "FAIL" for c in self.checks)

    @property
    def failures(self) -> List[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def add(self, *a, **kw) -> Check:
        c = Check(*a, **kw)
        self.checks.append(c)
        return c

    def table(self, width: int = 60) -> str:
        rows = [("tensor", "check", "status", "max|diff|", "detail")]
        for c in self.checks:
            d = "" if c.max_abs_diff is None else f"{c.max_abs_diff:.3g}"
            t = c.tensor if len(c.tensor) <= width else "..." + c.tensor[-(width - 3):]
            rows.append((t, c.check, c.status, d, (c.detail + (f" [{c.source}]" if c.source else ""))))
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(r[i].ljust(w[i]) for i in range(4)) + "  " + r[4] for r in rows]
        n = {s: sum(c.status == s for c in self.checks) for s in ("ok", "FAIL", "skip")}
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(f"verdict: {verdict}  ({n['ok']} ok, {n['FAIL']} failed, {n['skip']} skipped) "
                     f"{self.engine}/{self.flavour} {self.export_dir}")
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        return {"export_dir": self.export_dir, "engine": self.engine, "flavour": self.flavour, "ok": self.ok,
                "checks": [asdict(c) for c in self.checks], "logits": self.logits}


def default_prompt(vocab_size: int, n: int = 12) -> List[int]:
    return [(7 * i + 3) % vocab_size for i in range(n)]


def verify(export_dir, student: ConvertedModel, prompt_ids: Optional[List[int]] = None, logits: bool = True,
           llama_cpp: Optional[bool] = None, logits_rtol: float = 1e-2) -> VerifyResult:
    """Check ``export_dir`` against ``student`` (a ConvertedModel). ``llama_cpp`` None = run the
    llama.cpp runtime when llama-cpp-python imports; True = require it."""
    export_dir = Path(export_dir)
    rec = read_record(export_dir)
    res = VerifyResult(str(export_dir), rec["engine"], rec["flavour"])
    prompt = prompt_ids or default_prompt(int(student.config["vocab_size"]))
    if rec["engine"] in ("vllm", "sglang"):
        _verify_safetensors(res, export_dir, student, rec, prompt, logits, logits_rtol)
    elif rec["engine"] == "llama_cpp":
        _verify_gguf(res, export_dir, student, rec, prompt, logits, llama_cpp, logits_rtol)
    else:
        res.add("-", "engine", "FAIL", f"unknown engine {rec['engine']!r} in {QATFACTORY_JSON}")
    return res


# ============================================================================ helpers
def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        ib = {2: torch.int16, 4: torch.int32, 1: torch.uint8, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ib), b.contiguous().view(ib))
    return torch.equal(a, b)


def _cmp(a: torch.Tensor, b: torch.Tensor):
    """(all equal as values, max abs diff, number of differing elements)."""
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False, float("inf"), -1
    d = (a - b).abs()
    nan_mismatch = torch.isnan(a) != torch.isnan(b)
    n = int(((d > 0) | nan_mismatch).sum())
    return n == 0, float(torch.nan_to_num(d, nan=float("inf")).max()) if d.numel() else 0.0, n


def _student_weights(student: ConvertedModel) -> Dict[str, torch.Tensor]:
    sd = {k: v for k, v in student.dense.items()}
    for name, p in student.packed.items():
        sd[name] = get_format(p.format).dequantize(p).float()
    return sd


def _model_from_state_dict(config: Dict[str, Any], sd: Dict[str, torch.Tensor]):
    """An HF model (float32) built by transformers' own loader from on-disk-named tensors."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="qf-verify-") as d:
        cfg = dict(config)
        cfg.pop("quantization_config", None)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, default=str)
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"))
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@torch.no_grad()
def _logits(model, prompt: List[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def _student_logits(student: ConvertedModel, prompt: List[int], cache: Dict[str, Any]) -> torch.Tensor:
    if "student" not in cache:
        cache["student"] = _logits(_model_from_state_dict(student.config, _student_weights(student)), prompt)
    return cache["student"]


def _logit_check(res: VerifyResult, name: str, ref: torch.Tensor, got: torch.Tensor, exact: bool, rtol: float,
                 source: str) -> None:
    eq, mad, n = _cmp(got, ref)
    scale = float(ref.abs().max())
    argmax_eq = bool(torch.equal(got.argmax(-1), ref.argmax(-1)))
    res.logits[name] = {"max_abs_diff": mad, "max_abs_logit": scale, "exact": eq, "argmax_equal": argmax_eq,
                        "source": source}
    if exact:
        status = "ok" if eq else "FAIL"
        detail = "bit-identical logits" if eq else f"{n} logits differ (weights were exact, so they must not)"
    else:
        status = "ok" if mad <= rtol * max(scale, 1.0) else "FAIL"
        detail = f"|diff| <= {rtol:g} x max|logit| ({scale:.3g}); argmax equal={argmax_eq}"
    res.add("logits", name, status, detail, mad, source)


def _tie_check(res: VerifyResult, student: ConvertedModel, has_lm_head: bool, what: str,
               exported_tie: Optional[bool]) -> None:
    """lm_head follows config.tie_word_embeddings: a tied model ships no lm_head (engines reuse the
    embedding; transformers' GGUF loader even infers the tie from a missing output.weight); an
    untied one must ship it, or llama.cpp would silently fall back to token_embd."""
    want = student.config.get("tie_word_embeddings")
    if want is None:
        return
    ok = has_lm_head != bool(want)
    if exported_tie is not None:  # safetensors: the engine reads the tie from the exported config.json
        ok = ok and exported_tie == bool(want)
    res.add("lm_head", "tied embeddings" if want else "untied lm_head", "ok" if ok else "FAIL",
            f"tie_word_embeddings={bool(want)}; {what} {'present' if has_lm_head else 'absent'}"
            + ("" if exported_tie is None else f"; exported config tie_word_embeddings={exported_tie}"))


# ============================================================================ safetensors
def _vllm_nvfp4_decode(packed: torch.Tensor, sf: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU reference for ModelOpt NVFP4 (nvfp4_emulation_utils.dequantize_to_dtype), written
    out here: low nibble first, value table lookup, fp8 scale to fp32 times weight_scale_2, then
    one product per element; checkpoint scales are row-major so no un-swizzle is needed."""
    m, half = packed.shape
    lo, hi = packed & 0x0F, packed >> 4
    vals = _E2M1[torch.stack([lo, hi], -1).reshape(m, half * 2).long()]
    s = sf.view(torch.float8_e4m3fn).to(torch.float32) * weight_scale_2.to(torch.float32)
    return (vals.reshape(m, -1, 16) * s.unsqueeze(-1)).reshape(m, half * 2)


def _verify_safetensors(res, d: Path, student, rec, prompt, do_logits, rtol):
    sd = load_safetensors_dir(d)
    with open(d / "config.json") as f:
        cfg = json.load(f)
    qc = cfg.get("quantization_config") or {}
    flavour = rec["flavour"]
    lay = rec.get("layout")
    mode = rec.get("mode")
    excluded = set(rec.get("exclude_modules", []))
    scheme = None
    # ---- config
    if flavour == "modelopt":
        hq_path = d / "hf_quant_config.json"
        if not hq_path.is_file():
            res.add("hf_quant_config.json", "config", "FAIL", "missing")
        else:
            hq = json.loads(hq_path.read_text())
            q = hq.get("quantization", {})
            missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in q]
            prod = (hq.get("producer") or {}).get("name")
            ok = not missing and prod == "modelopt" and q.get("group_size") == 16 and \
                q.get("quant_algo") == ("NVFP4" if mode == "w4a4" else "W4A16_NVFP4")
            res.add("hf_quant_config.json", "config", "ok" if ok else "FAIL",
                    f"quant_algo={q.get('quant_algo')} producer={prod} missing={missing}")
        flat_missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in qc]
        ok = qc.get("quant_method") == "modelopt" and set(qc.get("ignore", [])) == excluded and not flat_missing
        res.add("config.json", "config", "ok" if ok else "FAIL",
                f"quant_method={qc.get('quant_method')} quant_algo={qc.get('quant_algo')} "
                f"ignore={len(qc.get('ignore', []))} missing={flat_missing}")
    else:
        try:
            from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
            qcfg = QuantizationConfig.model_validate(qc)
            g = qcfg.config_groups["group_0"]
            scheme = g if isinstance(g, QuantizationScheme) else QuantizationScheme.model_validate(g)
            ok = qcfg.format == {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}[lay] and \
                set(qcfg.ignore or []) == excluded and \
                ((scheme.input_activations is not None) == (mode == "w4a4"))
            res.add("config.json", "config", "ok" if ok else "FAIL",
                    f"format={qcfg.format} ignore={len(qcfg.ignore or [])} input_activations="
                    f"{'set' if scheme.input_activations is not None else 'null'}",
                    source="compressed_tensors.QuantizationConfig")
        except ImportError:
            res.add("config.json", "config", "skip", "compressed-tensors is not installed")
        except Exception as e:  # a config compressed-tensors refuses is a failed export
            res.add("config.json", "config", "FAIL", f"compressed-tensors rejects it: {e}")
    tied = bool(cfg.get("tie_word_embeddings"))
    _tie_check(res, student, any(k.startswith("lm_head.") for k in sd), "lm_head.*", tied)
    for m in sorted(excluded):
        t = sd.get(m + ".weight")
        if tied and m + ".weight" == LM_HEAD:
            # listed so config-driven loaders leave it alone; the engines build it from the embedding
            # (a tied lm_head written anyway is the tied-embeddings check's failure, not this one's)
            if not any(k.startswith(m + ".") for k in sd):
                res.add(m, "excluded (model dtype)", "ok", "tied: not written, listed as unquantized")
            continue
        ok = t is not None and t.dtype == student.dense.get(m + ".weight", torch.empty(0)).dtype and \
            all(m + s not in sd for s in (".weight_scale", ".weight_packed"))
        res.add(m, "excluded (model dtype)", "ok" if ok else "FAIL", "" if t is None else str(t.dtype))

    # ---- per packed tensor
    decoded: Dict[str, torch.Tensor] = {}
    compressor = None
    if flavour != "modelopt" and scheme is not None:
        from compressed_tensors.compressors import BaseCompressor
        compressor = BaseCompressor.get_value_from_registry(qc["format"])
    for name, p in sorted(student.packed.items()):
        m = module_of(name)
        want = get_format(p.format).dequantize(p).float()
        if flavour == "modelopt":
            w, sf, s2 = sd.get(m + ".weight"), sd.get(m + ".weight_scale"), sd.get(m + ".weight_scale_2")
            if w is None or sf is None or s2 is None:
                res.add(m, "bytes", "FAIL", "weight / weight_scale / weight_scale_2 missing")
                continue
            ok = (w.dtype == torch.uint8 and torch.equal(w, p.codes) and sf.dtype == torch.float8_e4m3fn
                  and torch.equal(sf.view(torch.uint8), p.scales) and s2.dtype == torch.float32
                  and _bits_equal(s2.reshape(()), torch.as_tensor(p.global_scale, dtype=torch.float32).reshape(())))
            detail = f"codes {tuple(w.shape)} e4m3 {tuple(sf.shape)} S={float(s2):.6g}"
            if mode == "w4a4":
                ins = sd.get(m + ".input_scale")
                want_in = act_decode_scale(student.act_formats[m], student.input_amax[m])
                ok = ok and ins is not None and _bits_equal(ins.reshape(()), want_in)
                detail += f" input_scale={'missing' if ins is None else f'{float(ins):.6g}'}"
            elif m + ".input_scale" in sd:
                ok, detail = False, detail + " unexpected input_scale in W4A16"
            res.add(m, "bytes", "ok" if ok else "FAIL", detail)
            got = _vllm_nvfp4_decode(w, sf, s2)
            src = "vLLM dequantize_to_dtype rule"
        else:
            w, sf = sd.get(m + ".weight_packed"), sd.get(m + ".weight_scale")
            if w is None or sf is None:
                res.add(m, "bytes", "FAIL", "weight_packed / weight_scale missing")
                continue
            ok = torch.equal(w, p.codes) and torch.equal(sf.contiguous().view(torch.uint8), p.scales)
            detail = f"codes {tuple(w.shape)} scales {sf.dtype} {tuple(sf.shape)}"
            local = {"weight_packed": w, "weight_scale": sf}
            if lay == "nvfp4":
                g = sd.get(m + ".weight_global_scale")
                S = torch.as_tensor(p.global_scale, dtype=torch.float32).reshape(())
                ok = ok and g is not None and _bits_equal(g.reshape(()), 1.0 / S)
                detail += f" G=1/S={'missing' if g is None else f'{float(g):.6g}'}"
                if g is not None:
                    local["weight_global_scale"] = g
                if mode == "w4a4":
                    ig = sd.get(m + ".input_global_scale")
                    want_in = 1.0 / act_decode_scale(student.act_formats[m], student.input_amax[m])
                    ok = ok and ig is not None and _bits_equal(ig.reshape(()), want_in)
                    if ig is not None:
                        local["input_global_scale"] = ig
            res.add(m, "bytes", "ok" if ok else "FAIL", detail)
            if compressor is None:
                res.add(m, "weights", "skip", "compressed-tensors is not installed")
                continue
            got = compressor.decompress(local, scheme)["weight"]
            src = f"compressed_tensors {type(compressor).__name__}.decompress"
        decoded[name] = got
        if got.dtype == torch.float32:
            eq, mad, n = _cmp(got, want)
            res.add(m, "weights", "ok" if eq else "FAIL", "exact" if eq else f"{n} elements differ", mad, src)
        else:
            # compressed-tensors decodes into bf16: compare with the student's bf16 fake-quant weight
            eq, mad, n = _cmp(got, want.to(got.dtype))
            if eq:
                res.add(m, "weights", "ok", f"exact in {str(got.dtype)[6:]}", 0.0, src)
            else:
                ulp = _max_ulp_bf16(got, want.to(got.dtype))
                tolerated = lay == "nvfp4" and ulp <= 1
                res.add(m, "weights", "ok" if tolerated else "FAIL",
                        f"{n}/{got.numel()} elements differ by <= {ulp} bf16 ulp"
                        + (" (CT stores G=1/S and divides: fp8/G != fp8*S in the last bit)" if tolerated else ""),
                        mad, src)

    # ---- fused groups share their per-tensor scales on disk too
    for g in fused_groups(student):
        keys = [".weight_scale_2", ".input_scale"] if flavour == "modelopt" else \
            [".weight_global_scale", ".input_global_scale"]
        for suf in keys:
            vals = [sd[m + suf] for m in g if m + suf in sd]
            if len(vals) > 1:
                same = all(_bits_equal(v.reshape(()), vals[0].reshape(())) for v in vals)
                res.add(",".join(x.rsplit(".", 1)[-1] for x in g) + f" @{g[0].rsplit('.', 1)[0]}",
                        f"shared{suf}", "ok" if same else "FAIL", f"{len(vals)} shards")

    if not do_logits:
        return
    cache: Dict[str, Any] = {}
    ref = _student_logits(student, prompt, cache)
    if flavour == "modelopt":
        # transformers cannot load ModelOpt NVFP4; rebuild from the export's tensors + vLLM's rule
        sd2 = {k: v for k, v in sd.items() if not k.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))}
        sd2.update(decoded)
        model = _model_from_state_dict(student.config, sd2)
        _logit_check(res, "transformers(rebuilt: export tensors, vLLM rule)", ref, _logits(model, prompt),
                     exact=True, rtol=rtol, source="safetensors + transformers")
        return
    if compressor is None:
        res.add("logits", "transformers", "skip", "compressed-tensors is not installed (pip install "
                "compressed-tensors)")
        return
    is_moe = any(".experts." in n for n in student.packed)
    if lay == "nvfp4" and is_moe:
        # transformers' fused-expert CT decompression drops weight_global_scale (exporters.md 7.1):
        # rebuild from compressed-tensors' own per-module decode instead
        sd2 = {k: v for k, v in sd.items() if not any(k.endswith(s) for s in
               (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale"))}
        sd2.update(decoded)
        model = _model_from_state_dict(student.config, sd2)
        src = "compressed_tensors decompress + transformers"
    else:
        from transformers import AutoModelForCausalLM
        from transformers.utils.quantization_config import CompressedTensorsConfig
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True)
                                                     ).eval()
        # it leaves decompressed experts in bf16 (compute in bf16); the values are bf16-exact, so
        # widening them to fp32 is lossless and makes the arithmetic the student's
        model = model.float()
        src = "transformers CompressedTensorsConfig(dequantize=True)"
        # transformers 5.17 (not 5.24) keeps compressed-tensors' runtime scheme on the decompressed linears, so
        # a W4A4 checkpoint's forward also fake-quantizes inputs with CT's own rule; this check is about
        # the weights (the reference is the weights-only student), so switch that QDQ off
        kept = [mod for mod in model.modules() if getattr(mod, "quantization_scheme", None) is not None]
        for mod in kept:
            mod.quantization_enabled = False
        if kept:
            src += f"; CT runtime QDQ switched off on {len(kept)} modules"
    exact = lay == "mxfp4"
    if not exact:  # bf16 weights from CT: compare with a student carrying the same bf16 rounding
        sdb = _student_weights(student)
        for name in student.packed:
            sdb[name] = sdb[name].to(torch.bfloat16)
        ref = _logits(_model_from_state_dict(student.config, sdb), prompt)
        exact = all(c.detail.startswith("exact") for c in res.checks if c.check == "weights")
    _logit_check(res, src.split(" ")[0] + (" (rebuilt)" if "decompress" in src else ""), ref,
                 _logits(model, prompt), exact=exact, rtol=rtol, source=src)


def _max_ulp_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    ib = b.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    # sign-magnitude -> ordered integers
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


# ============================================================================ GGUF
def _libggml_dequant():
    """libggml-python's C dequantizers through ctypes, or None when the wheel is absent."""
    try:
        import ctypes
        import glob
        import libggml
    except ImportError:
        return None
    base = os.path.dirname(libggml.__file__)
    cands = sorted(glob.glob(os.path.join(base, "lib*", "libggml-base.so*")))
    if not cands:
        return None
    lib = ctypes.CDLL(cands[0])
    names = {2: "q4_0", 6: "q5_0", 8: "q8_0", 12: "q4_K", 14: "q6_K", 39: "mxfp4", 40: "nvfp4"}

    def deq(raw: np.ndarray, ggml_type: int, n: int) -> Optional[np.ndarray]:
        fn = getattr(lib, f"dequantize_row_{names.get(ggml_type, '?')}", None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        out = np.zeros(n, dtype=np.float32)
        fn(raw.ctypes.data, out.ctypes.data, n)
        return out
    return deq


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.types) and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode()
    if len(f.types) and f.types[0].name == "ARRAY":
        return len(f.data)
    return f.parts[f.data[0]].tolist()[0] if f.data else None


def _verify_gguf(res, d: Path, student, rec, prompt, do_logits, llama_cpp, rtol):
    import gguf

    from .llama_cpp import ARCHS, gguf_name, packed_to_gguf, unpermute_rows

    path = d / rec.get("gguf_file", "model.gguf")
    reader = gguf.GGUFReader(str(path))
    cfg = student.config
    arch, permute, _ = ARCHS[cfg["model_type"]]
    # ---- metadata
    req = [f"{arch}.context_length", f"{arch}.embedding_length", f"{arch}.block_count",
           f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv",
           f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.rope.freq_base", "tokenizer.ggml.model"]
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        req += [f"{arch}.expert_count", f"{arch}.expert_used_count"]
    missing = [k for k in req if k not in reader.fields]
    got_arch = _field(reader, "general.architecture")
    res.add("metadata", "keys", "ok" if not missing and got_arch == arch else "FAIL",
            f"architecture={got_arch} missing={missing}", source="gguf.GGUFReader")
    tm = _field(reader, "tokenizer.ggml.model")
    if tm == "gpt2":
        ok = "tokenizer.ggml.pre" in reader.fields and "tokenizer.ggml.merges" in reader.fields
        res.add("metadata", "tokenizer", "ok" if ok else "FAIL",
                f"gpt2 pre={_field(reader, 'tokenizer.ggml.pre')} tokens={_field(reader, 'tokenizer.ggml.tokens')}")
    else:
        res.add("metadata", "tokenizer", "ok", f"model={tm}")
    # issue 13: llama.cpp's own tokenizer on this file against the source's HF tokenizer (gguf_tokenizer.py)
    from .gguf_tokenizer import gate_check as _tokenizer_gate
    _tokenizer_gate(res, path, student.source_dir or d, llama_cpp)

    tensors = {t.name: t for t in reader.tensors}
    cdeq = _libggml_dequant()
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)

    def heads(gname):
        if not permute:
            return None
        return n_head if ".attn_q." in gname else n_kv if ".attn_k." in gname else None

    tied = student.config.get("tie_word_embeddings") is True
    _tie_check(res, student, "output.weight" in tensors, "output.weight", None)
    decoded: Dict[str, torch.Tensor] = {}
    exact_all = True
    for name, p in sorted(student.packed.items()):
        gname, e = gguf_name(name)
        t = tensors.get(gname)
        if t is None:
            res.add(name, "bytes", "FAIL", f"{gname} missing from the GGUF")
            exact_all = False
            continue
        raw = np.asarray(t.data)
        if e is not None:
            raw = raw[e]
        if heads(gname):
            raw = unpermute_rows(raw, heads(gname))
        want_raw, want_type, gs = packed_to_gguf(name, p)
        ok = int(t.tensor_type) == want_type and raw.shape == want_raw.shape and np.array_equal(raw, want_raw)
        detail = f"{gguf.GGMLQuantizationType(int(t.tensor_type)).name} {gname}" + (f"[{e}]" if e is not None else "")
        scale_t = tensors.get(gname[: -len(".weight")] + ".scale")
        S = None
        if gs is not None:
            sv = None if scale_t is None else np.asarray(scale_t.data).reshape(-1)
            sv = None if sv is None else sv[e if e is not None else 0]
            ok = ok and sv is not None and np.float32(sv).view(np.int32) == np.float32(gs).view(np.int32)
            S = None if sv is None else np.float32(sv)
            detail += f" .scale={'missing' if sv is None else f'{float(sv):.6g}'}"
        m = module_of(name)
        if m in student.input_amax and m in student.act_formats:
            it = tensors.get(gname[: -len(".weight")] + ".input_scale")
            want_in = float(act_decode_scale(student.act_formats[m], student.input_amax[m]))
            got_in = None if it is None else np.asarray(it.data).reshape(-1)[e if e is not None else 0]
            ok = ok and got_in is not None and np.float32(got_in) == np.float32(want_in)
            detail += f" .input_scale={'missing' if got_in is None else f'{float(got_in):.6g}'}"
        res.add(name, "bytes", "ok" if ok else "FAIL", detail)
        k = p.shape[-1]
        got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t.tensor_type))).reshape(p.shape)
        if cdeq is not None:
            c = cdeq(raw, int(t.tensor_type), int(np.prod(p.shape)))
            if c is None:
                res.add(name, "weights (libggml C)", "skip", "this libggml has no dequantizer for the type")
            else:
                eqc = np.array_equal(c.reshape(p.shape), got, equal_nan=True)
                res.add(name, "weights (libggml C)", "ok" if eqc else "FAIL",
                        "C dequantizer == gguf-py" if eqc else "libggml and gguf-py disagree", source="libggml-python")
        want = get_format(p.format).dequantize(p).float()
        got_t = torch.from_numpy(np.ascontiguousarray(got)).float()
        if S is not None:
            got_t = got_t * torch.tensor(float(S), dtype=torch.float32)
        decoded[name] = got_t
        eq, mad, n = _cmp(got_t, want)
        if eq:
            res.add(name, "weights", "ok", "exact", 0.0, "gguf.quants.dequantize" + (" x .scale" if S else ""))
        else:
            ulp = _max_ulp_f32(got_t, want)
            tolerated = S is not None and ulp <= 1
            exact_all = False
            res.add(name, "weights", "ok" if tolerated else "FAIL",
                    f"{n}/{want.numel()} elements differ by <= {ulp} fp32 ulp" +
                    (" ((code*fp8)*S as llama.cpp applies S after the matmul, vs code*(fp8*S))" if tolerated else ""),
                    mad, "gguf.quants.dequantize x .scale")
    # dense tensors: as stored (F32 norms/routers; BF16/F16/F32 others) they must decode to the student's
    dense_decoded: Dict[str, torch.Tensor] = {}
    for name, tt in sorted(student.dense.items()):
        if name.endswith("rotary_emb.inv_freq") or name.endswith(("gate_up_proj", "experts.down_proj")):
            continue
        gname, e = gguf_name(name)
        if tied and name == "lm_head.weight":  # a tied duplicate: llama.cpp reads token_embd for it
            gname = "token_embd.weight"
        t = tensors.get(gname)
        if t is None:
            res.add(name, "dense", "FAIL", f"{gname} missing")
            continue
        arr = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(int(t.tensor_type)))
        if e is not None:
            arr = arr[e]
        arr = arr.reshape(tt.shape)
        if heads(gname):
            arr = unpermute_rows(arr, heads(gname))
        dense_decoded[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
        eq, mad, n = _cmp(dense_decoded[name], tt.float())
        res.add(name, "dense", "ok" if eq else "FAIL", gguf.GGMLQuantizationType(int(t.tensor_type)).name, mad)

    if do_logits:
        cache: Dict[str, Any] = {}
        ref = _student_logits(student, prompt, cache)
        has_scale = any(n.endswith(".scale") for n in tensors)
        moe_as_llama = arch == "llama" and any(".experts." in n for n in student.packed)
        if has_scale or moe_as_llama:
            # transformers' GGUF loader ignores the NVFP4 .scale tensors and builds a dense Llama for
            # Mixtral-style files: rebuild from gguf-py's decode of every tensor instead
            sd2 = dict(student.dense)
            sd2.update(dense_decoded)
            sd2.update(decoded)
            model = _model_from_state_dict(student.config, sd2)
            label = "transformers(rebuilt from gguf-py decode" + (" x .scale)" if has_scale else ")")
            _logit_check(res, label, ref, _logits(model, prompt),
                         exact=exact_all, rtol=rtol, source="gguf-py + transformers")
        else:
            from transformers import AutoConfig, AutoModelForCausalLM
            kw = {}
            if cfg["model_type"] in ("qwen3", "qwen3_moe"):
                # its GGUF config mapping ignores <arch>.attention.key_length (head_dim) and
                # expert_feed_forward_length (exporters.md 7.1): hand it the student's config
                c = dict(cfg)
                c.pop("quantization_config", None)
                kw["config"] = AutoConfig.for_model(**c)
            model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32,
                                                         **kw).eval()
            _logit_check(res, "transformers GGUF loader", ref, _logits(model, prompt), exact=exact_all, rtol=rtol,
                         source="transformers from_pretrained(gguf_file=)")
        _llama_cpp_check(res, path, prompt, ref, llama_cpp)
    elif llama_cpp:
        _llama_cpp_check(res, path, prompt, None, llama_cpp)


def _max_ulp_f32(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.float().contiguous().view(torch.int32).to(torch.int64)
    ib = b.float().contiguous().view(torch.int32).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max())


_LLAMA_RUNNER = """
import json, sys
import numpy as np
import llama_cpp.llama_cpp as C
from llama_cpp import Llama
# no "extra" (repack/AMX) weight buffers: a -march=native build's AMX kernels trap (SIGILL) on machines
# whose kernel does not grant the AMX tile state; the plain CPU kernels quantize activations alike
_defaults = C.llama_model_default_params
def _params():
    p = _defaults()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
path, prompt, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, logits_all=True, n_ctx=max(64, len(prompt) + 8), verbose=False)
llm.eval(prompt)
np.save(out, np.array(llm.scores[: len(prompt)], dtype=np.float32))
"""


def _llama_cpp_check(res, path: Path, prompt, ref, want: Optional[bool]) -> None:
    import importlib.util
    import subprocess
    import sys

    if want is False:
        return
    if importlib.util.find_spec("llama_cpp") is None:
        if want:
            res.add("logits", "llama.cpp runtime", "FAIL", "llama-cpp-python is not installed but was required")
        else:
            res.add("logits", "llama.cpp runtime", "skip", "llama-cpp-python not installed (opt-in)")
        return
    # a separate process: llama.cpp brings its own libggml, which must not meet libggml-python's
    # (same soname, different ABI) loaded above for the C dequantizer check
    with tempfile.TemporaryDirectory(prefix="qf-llama-") as td:
        out = os.path.join(td, "scores.npy")
        r = subprocess.run([sys.executable, "-c", _LLAMA_RUNNER, str(path), json.dumps(list(prompt)), out],
                           capture_output=True, text=True)
        if r.returncode != 0:
            res.add("logits", "llama.cpp runtime", "FAIL", "llama.cpp failed to load/run the file: " +
                    (r.stderr.strip().splitlines() or ["?"])[-1], source="llama-cpp-python")
            return
        got = torch.from_numpy(np.load(out))
    if ref is None:
        res.add("logits", "llama.cpp runtime", "ok", "loaded and evaluated", source="llama-cpp-python")
        return
    mad = float((got - ref).abs().max())
    rel = mad / max(float(ref.abs().max()), 1e-6)
    am = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    res.logits["llama.cpp"] = {"max_abs_diff": mad, "max_rel": rel, "argmax_agreement": am}
    # the CPU kernels quantize activations to Q8_0/Q8_K: close, not equal (exporters.md 7.1: 1-2 %)
    res.add("logits", "llama.cpp runtime", "ok" if rel < 0.05 else "FAIL",
            f"max rel err {rel:.3%}, argmax agreement {am:.0%} (activations quantized to Q8 by the CPU kernels)",
            mad, "llama-cpp-python")
