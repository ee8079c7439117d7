"""The gate for safetensors exports (vLLM / SGLang): ModelOpt NVFP4 and compressed-tensors NVFP4/MXFP4.

What is checked comes from the student: its formats decide the layout (NVFP4: E2M1 pairs + E4M3
block scales + an fp32 per-tensor scale; MXFP4: E2M1 pairs + E8M0), its activation formats decide
W4A4 vs W4A16, its packed tensors decide which modules must be quantized. The export's
config.json, hf_quant_config.json and qatfactory.json are compared against those facts.

Independent code per flavour:
* ModelOpt: nvidia-modelopt's own ``NVFP4QTensor.dequantize`` decodes every packed tensor (the
  library that defines the layout); a transcription of vLLM's ``dequantize_to_dtype`` rule is a
  second, labelled decode. vLLM itself has no CPU kernel for these formats: it runs on a GPU only
  (benchmarks/gpu).
* compressed-tensors: its ``QuantizationConfig`` validates the config, its compressors decode,
  ``apply_quantization_config`` on a transformers skeleton built from the exported config.json says
  which modules it would quantize, and transformers' ``CompressedTensorsConfig(dequantize=True)``
  loads the directory for the logits.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import torch

from qatfactory.formats import ConvertedModel, get_format
from qatfactory.formats.layouts import Codec

from . import kv as KVG  # k/v scales and kv-cache config against the student
from .common import (
    EMBED,
    LM_HEAD,
    act_decode_scale,
    compare_hf_config,
    compare_values,
    exact_logits_check,
    f32_bits,
    fake_quant,
    fused_groups,
    inside,
    max_ulp,
    model_from_state_dict,
    module_of,
    names_sample,
    nonfinite,
    read_json,
    run_logits,
    same_bits,
    student_logits,
    student_mode,
    student_weights,
    tied,
    written_dense,
)
from .config_sizes import config_size_problems
from .files import check_files
from .result import FAIL, INCOMPLETE, OK, Malformed, Missing, VerifyResult, need

# E2M1 magnitudes written out here (not imported) for the vLLM transcription
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# what each codec family is in a compressed-tensors checkpoint (this gate's own knowledge, not the spec's)
NV, MX, INT4 = Codec.E2M1_E4M3_FP32, Codec.E2M1_E8M0, Codec.INT4_FP16
CT_FORMAT = {NV: "nvfp4-pack-quantized", MX: "mxfp4-pack-quantized", INT4: "pack-quantized"}
INDEX = "model.safetensors.index.json"
TEMPLATES_DIR = "additional_chat_templates"   # transformers' named chat templates, one .jinja each
# files an engine reads beside the weights, copied from the student's base model directory
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
                "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                "chat_template.json", "preprocessor_config.json")
VLLM_NOTE = ("vLLM/SGLang themselves have no CPU kernels for FP4 checkpoints: the engines run these exports "
             "only on a GPU (benchmarks/gpu); on CPU the layout is proven with the format's own libraries")


# ============================================================================ student facts
def layout_of(fmt: str) -> Optional[Codec]:
    """The codec family the student's format declares for the safetensors containers (its spec's
    ``safetensors`` record: the student's truth, not the exporter's), as the record labels it: 'nvfp4'
    (E2M1 pairs + E4M3 per 16 + fp32 per-tensor scale), 'mxfp4' (E2M1 pairs + E8M0 per 32), 'int4'
    (compressed-tensors int4 pack-quantized); None when the format declares no safetensors layout.
    What each family must look like in the checkpoint is this gate's own knowledge (below), checked
    with the containers' own libraries."""
    s = get_format(fmt).spec
    if s.safetensors is None or s.role == "activation":
        return None
    return s.safetensors.codec


def unquantized_linears(student: ConvertedModel) -> List[str]:
    """Module names of the student's linears left in the model dtype (2-D dense weights other than
    embeddings and norms), plus a tied lm_head (not written, listed so loaders leave it alone)."""
    out = set()
    if tied(student) and LM_HEAD not in student.packed and (EMBED in student.dense or EMBED in student.packed):
        out.add("lm_head")
    for name, t in written_dense(student).items():
        if not name.endswith(".weight") or t.ndim != 2:
            continue
        leaf = module_of(name).rsplit(".", 1)[-1]
        if "embed" in leaf or leaf in ("wte", "wpe") or "norm" in leaf:
            continue
        out.add(module_of(name))
    return sorted(out)


def expected_tensors(student: ConvertedModel, flavour: str, layout: str, mode: str) -> Set[str]:
    names = set(written_dense(student))
    for name in student.packed:
        m = module_of(name)
        if flavour == "modelopt":
            names |= {m + ".weight", m + ".weight_scale", m + ".weight_scale_2"}
            if mode == "w4a4":
                names.add(m + ".input_scale")
        else:
            names |= {m + ".weight_packed", m + ".weight_scale"}
            if layout is INT4:
                names.add(m + ".weight_shape")
            if layout is NV:
                names.add(m + ".weight_global_scale")
                if mode == "w4a4":
                    names.add(m + ".input_global_scale")
    return names


# ============================================================================ reading
def load_tensors(d: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the export, read with safetensors; the index's weight_map may only name
    plain files inside the directory, and each shard must hold exactly the tensors mapped to it."""
    st = need("safetensors")
    files: Dict[str, Set[str]] = {}
    if (d / INDEX).exists() or (d / INDEX).is_symlink():
        idx = read_json(d, INDEX)
        wm = idx.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise Malformed(f"{INDEX} has no weight_map")
        for k, fn in wm.items():
            inside(d, fn, f"{INDEX} weight_map[{k!r}]")
            files.setdefault(fn, set()).add(k)
    else:
        inside(d, "model.safetensors")
        files = {"model.safetensors": set()}
    out: Dict[str, torch.Tensor] = {}
    for fn, mapped in sorted(files.items()):
        p = inside(d, fn)
        try:
            with st.safe_open(str(p), framework="pt") as f:
                keys = list(f.keys())
                for k in keys:
                    if k in out:
                        raise Malformed(f"tensor {k} is stored twice (again in {fn})")
                    out[k] = f.get_tensor(k)
        except Malformed:
            raise
        except Exception as e:  # a truncated/garbled shard is the export's fault, said plainly
            raise Malformed(f"{fn} is not a readable safetensors file: {type(e).__name__}: {e}") from None
        if mapped and set(keys) != mapped:
            extra, lost = set(keys) - mapped, mapped - set(keys)
            raise Malformed(f"{fn} does not hold what {INDEX} maps to it: not mapped {names_sample(extra)}; "
                            f"missing {names_sample(lost)}")
    return out


def detect_flavour(d: Path, qc: Dict[str, Any]) -> Optional[str]:
    qm = qc.get("quant_method")
    if qm == "modelopt" or (d / "hf_quant_config.json").exists():
        return "modelopt"
    if qm == "compressed-tensors":
        return "compressed-tensors"
    return None


# ============================================================================ the gate
def verify_safetensors(res: VerifyResult, d: Path, student: ConvertedModel, rec: Dict[str, Any],
                       prompt: List[int], do_logits: bool) -> None:
    try:
        cfg = read_json(d, "config.json")
    except Malformed as e:
        res.add("config.json", "readable", FAIL, str(e))
        return
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        res.add("config.json", "quantization_config", FAIL, f"missing or not an object: {qc!r}")
        return
    flavour = detect_flavour(d, qc)
    res.flavour = flavour or res.flavour
    if not res.ok_or_fail("config.json", "container", flavour is not None and flavour == rec.get("flavour"),
                          f"quant_method={qc.get('quant_method')!r} -> {flavour}; qatfactory.json says "
                          f"{rec.get('flavour')!r}"):
        if flavour is None:
            return
    # ---- what the student says must be there
    layouts = {n: layout_of(p.format) for n, p in student.packed.items()}
    bad = sorted(n for n, l in layouts.items() if l is None)
    lays = set(layouts.values()) - {None}
    mode = student_mode(student)
    if bad or len(lays) != 1 or mode == "mixed":
        res.add("student", "representable", FAIL,
                f"formats {sorted({student.packed[n].format for n in bad})} have no {flavour} layout" if bad else
                f"the student mixes layouts {sorted(lays)}" if len(lays) != 1 else
                "the student mixes W4A4 and W4A16 modules; the container holds one activation setting")
        return
    layout = lays.pop()
    if flavour == "modelopt" and layout is not NV:
        res.add("student", "representable", FAIL, f"ModelOpt checkpoints hold NVFP4 only; the student is {layout}")
        return
    engine = rec.get("engine")
    if engine == "sglang" and layout is MX:
        dense_mx = [module_of(n) for n in student.packed if ".experts." not in n]
        res.ok_or_fail("student", "SGLang scheme", not dense_mx,
                       "SGLang loads compressed-tensors MXFP4 for MoE experts only; dense MXFP4 linears: "
                       + names_sample(dense_mx) if dense_mx else "MXFP4 on experts only")
    exclude = unquantized_linears(student)
    # vLLM cannot tie an lm_head under a ModelOpt config (ParallelLMHead.tie_weights raises; seen with vLLM
    # 0.24 on an H200): a tied student is shipped untied there, lm_head.weight = the embedding's bytes
    # ... except where vLLM's model class has no lm_head and reads logits off the embedding (Gemma 3: its
    # Gemma3ForCausalLM asserts tie_word_embeddings), which then must stay tied
    untie = flavour == "modelopt" and tied(student) is True and EMBED in student.dense and \
        student.config.get("model_type") != "gemma3_text"
    _check_record(res, rec, student, layout, mode, exclude, untie)
    want_cfg = _json_normalized(student)
    if untie:
        want_cfg.config = dict(want_cfg.config, tie_word_embeddings=False)
    compare_hf_config(res, {k: v for k, v in cfg.items()}, want_cfg)
    if flavour == "modelopt":
        _modelopt_config(res, d, qc, mode, exclude, student)
        scheme = None
    else:
        scheme = _ct_config(res, qc, layout, mode, exclude, student)
        KVG.check_ct_config(res, qc, student)
    KVG.check_record(res, rec, student, engine)
    # ---- the tensors
    try:
        sd = load_tensors(d)
    except Malformed as e:
        res.add("tensors", "readable", FAIL, str(e))
        return
    except Missing as e:
        res.missing("tensors", "readable", e)
        return
    want = expected_tensors(student, flavour, layout, mode) | ({LM_HEAD} if untie else set()) | \
        set(KVG.expected_scale_tensors(student, flavour))
    sizes = config_size_problems(cfg, sd)
    if sizes:   # the rows below compare; only the models built from this config are left out
        res.add("config.json", "sizes == tensors", FAIL, "; ".join(sizes[:4]) + "; no model was built from this "
                "config")
    extra, lost = set(sd) - want, want - set(sd)
    res.ok_or_fail("tensors", "none extra", not extra, f"{len(extra)} tensors the student does not have: "
                   + names_sample(extra) if extra else f"{len(sd)} tensors, all expected")
    res.ok_or_fail("tensors", "none missing", not lost, f"{len(lost)} missing: " + names_sample(lost)
                   if lost else f"all {len(want)} present")
    t = tied(student)
    if untie:
        copy = LM_HEAD in sd and same_bits(sd[LM_HEAD], student.dense[EMBED])
        res.ok_or_fail("lm_head", "tied embeddings (shipped untied)", copy and cfg.get("tie_word_embeddings") is False,
                       "the student ties lm_head to the embedding; the export writes lm_head.weight = the embedding's "
                       "bytes with tie_word_embeddings=false (vLLM cannot tie an lm_head under a ModelOpt config)"
                       + ("" if copy else "; lm_head.weight is missing or differs from model.embed_tokens.weight"))
    elif t is not None:
        has_lm = any(k.startswith("lm_head.") for k in sd)
        res.ok_or_fail("lm_head", "tied embeddings" if t else "untied lm_head", has_lm != t and
                       cfg.get("tie_word_embeddings") is t,
                       f"tie_word_embeddings={t}; lm_head.* {'present' if has_lm else 'absent'}; exported "
                       f"config tie_word_embeddings={cfg.get('tie_word_embeddings')}")
    for name, tt in sorted(written_dense(student).items()):
        got = sd.get(name)
        if got is None:
            continue  # named in "none missing"
        good = same_bits(got, tt) and nonfinite(got) == 0
        res.ok_or_fail(name, "dense", good, f"{got.dtype} {tuple(got.shape)}" + (
            "" if same_bits(got, tt) else f" != student {tt.dtype} {tuple(tt.shape)} (bytes differ)") +
            (f"; {nonfinite(got)} NaN/Inf" if nonfinite(got) else ""))
    # ---- per packed tensor: bytes, then the engine library's decode vs the student's fake-quant weights
    decoded: Dict[str, torch.Tensor] = {}
    compressor = None
    if flavour == "compressed-tensors" and scheme is not None:
        try:
            compressor = need("compressed_tensors.compressors").BaseCompressor.get_value_from_registry(
                CT_FORMAT[layout])
        except Missing as e:
            res.missing("weights", "compressed-tensors decompress", e)
    modelopt_q = None
    if flavour == "modelopt":
        try:
            modelopt_q = need("modelopt.torch.quantization.qtensor.nvfp4_tensor").NVFP4QTensor
        except Missing as e:
            res.missing("weights", "nvidia-modelopt NVFP4QTensor.dequantize", e)
    for name, p in sorted(student.packed.items()):
        m = module_of(name)
        try:
            if flavour == "modelopt":
                got = _modelopt_tensor(res, m, name, sd, student, p, mode, modelopt_q)
            else:
                got = _ct_tensor(res, m, name, sd, student, p, mode, layout, compressor, scheme)
        except Malformed as e:
            res.add(m, "bytes", FAIL, str(e))
            continue
        if got is not None:
            decoded[name] = got
    _fused_scales(res, sd, student, flavour)
    KVG.check_scale_tensors(res, sd, student, flavour)
    KVG.check_scales_survive_serving(res, sd, student, flavour, cfg)
    _source_files(res, d, student)
    check_files(res, d, _expected_files(d, student, flavour))
    if not sizes and flavour == "compressed-tensors":   # both build a skeleton from config.json
        _ct_skeleton(res, d, student)
    elif not sizes:
        _modelopt_exclusion(res, d, student, qc)
    if flavour == "modelopt":
        res.notes.append("ModelOpt NVFP4: decoded with nvidia-modelopt's NVFP4QTensor.dequantize and a labelled "
                         "transcription of vLLM's dequantize_to_dtype; " + VLLM_NOTE)
    else:
        res.notes.append("compressed-tensors: " + VLLM_NOTE)
    # ---- logits
    if not do_logits:
        res.opted_out("logits", "transformers", "--no-logits / logits=False")
        return
    if sizes:
        res.add("logits", "transformers", FAIL, "not attempted: config.json claims sizes its tensors do not hold "
                                                "(above)")
        return
    if any(c.status == FAIL for c in res.checks if c.tensor in ("tensors",) or c.check == "bytes"):
        res.add("logits", "transformers", FAIL, "not attempted: the export's tensors are incomplete or differ (above)")
        return
    try:
        _logits(res, d, cfg, sd, student, prompt, flavour, layout, decoded)
    except Missing as e:
        res.missing("logits", "transformers", e)
    except Exception as e:  # a loader that refuses the export is a failed export, said in one line
        res.add("logits", "transformers", FAIL, f"the loader failed: {type(e).__name__}: {str(e)[:300]}")


def _json_normalized(student: ConvertedModel) -> ConvertedModel:
    """The student's config as it reads back from JSON (int dict keys become strings)."""
    c = ConvertedModel(packed=student.packed, dense=student.dense, config=json.loads(json.dumps(student.config,
                       default=str)))
    return c


def _check_record(res, rec, student, layout, mode, exclude, untie: bool = False) -> None:
    want = {"weight_formats": student.formats_used(), "activation_formats": sorted(set(student.act_formats.values())),
            "mode": mode, "layout": layout, "exclude_modules": exclude,
            "tied_embeddings": bool(tied(student)) and not untie, "untied_lm_head_copy": untie}
    bad = [f"{k}={rec.get(k)!r} (student: {v!r})" for k, v in want.items() if rec.get(k) != v]
    res.ok_or_fail("qatfactory.json", "record == student", not bad, "; ".join(bad) if bad else
                   f"{mode}, {layout}, {len(exclude)} unquantized linears")


def _modelopt_config(res, d, qc, mode, exclude, student=None) -> None:
    algo = "NVFP4" if mode == "w4a4" else "W4A16_NVFP4"
    try:
        hq = read_json(d, "hf_quant_config.json")
    except Malformed as e:
        res.add("hf_quant_config.json", "config", FAIL, str(e))
        hq = None
    if student is not None:
        KVG.check_modelopt_config(res, qc, hq, student)   # kv_cache_quant_algo / kv_cache_scheme
    if hq is not None:
        q = hq.get("quantization") if isinstance(hq.get("quantization"), dict) else {}
        prod = (hq.get("producer") or {}).get("name") if isinstance(hq.get("producer"), dict) else None
        bad = [k + " missing" for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in q]
        if q.get("quant_algo") != algo:
            bad.append(f"quant_algo={q.get('quant_algo')!r} (student is {mode}: {algo})")
        if q.get("group_size") != 16:
            bad.append(f"group_size={q.get('group_size')!r} (NVFP4: 16)")
        if sorted(q.get("exclude_modules") or []) != exclude:
            bad.append(f"exclude_modules differ from the student's unquantized linears: {names_sample(set(q.get('exclude_modules') or []) ^ set(exclude))}")
        if prod != "modelopt":
            bad.append(f"producer={prod!r}")
        res.ok_or_fail("hf_quant_config.json", "config == student", not bad, "; ".join(bad) if bad else
                       f"quant_algo={algo} group_size=16")
    bad = [k + " missing" for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in qc]
    if qc.get("quant_algo") != algo:
        bad.append(f"quant_algo={qc.get('quant_algo')!r} (student is {mode}: {algo})")
    if qc.get("group_size") != 16:
        bad.append(f"group_size={qc.get('group_size')!r}")
    for key in ("ignore", "exclude_modules"):
        if sorted(qc.get(key) or []) != exclude:
            bad.append(f"{key} differs from the student's unquantized linears")
    g = ((qc.get("config_groups") or {}).get("group_0") or {}) if isinstance(qc.get("config_groups"), dict) else {}
    w, a = g.get("weights") or {}, g.get("input_activations")
    if g and (w.get("group_size") != 16 or w.get("num_bits") != 4 or w.get("type") != "float"):
        bad.append(f"config_groups weights={w!r}")
    if g and ((a is not None) != (mode == "w4a4")):
        bad.append(f"config_groups input_activations={'set' if a is not None else 'null'} (student: {mode})")
    res.ok_or_fail("config.json", "quantization_config == student", not bad, "; ".join(bad) if bad else
                   f"quant_method=modelopt quant_algo={algo}")


def _int4_schemes(student: ConvertedModel) -> Set[tuple]:
    """(strategy, group_size) the student's int4 formats need: per row -> channel, per group -> group."""
    out = set()
    for p in student.packed.values():
        g = getattr(get_format(p.format), "group", 0)
        out.add(("group", int(g)) if g else ("channel", None))
    return out


def _ct_config(res, qc, layout, mode, exclude, student=None):
    """compressed-tensors' own QuantizationConfig parses the config; its fields must say what the
    student is. Returns the scheme (None when it cannot be used)."""
    try:
        q = need("compressed_tensors.quantization")
    except Missing as e:
        res.missing("config.json", "quantization_config (compressed-tensors)", e)
        return None
    try:
        qcfg = q.QuantizationConfig.model_validate(qc)
        groups = qcfg.config_groups or {}
        if len(groups) != 1:
            raise ValueError(f"{len(groups)} config groups (the student has one scheme)")
        g = next(iter(groups.values()))
        scheme = g if isinstance(g, q.QuantizationScheme) else q.QuantizationScheme.model_validate(g)
    except Exception as e:  # a config compressed-tensors refuses is a failed export
        res.add("config.json", "quantization_config == student", FAIL,
                f"compressed-tensors rejects it: {type(e).__name__}: {str(e)[:300]}",
                source="compressed_tensors.QuantizationConfig")
        return None
    w, a = scheme.weights, scheme.input_activations
    bs, strat = (16, "tensor_group") if layout is NV else (32, "group")
    bad = []
    if qcfg.format != CT_FORMAT[layout]:
        bad.append(f"format={qcfg.format!r} (student: {CT_FORMAT[layout]})")
    if layout is INT4:
        want = _int4_schemes(student) if student is not None else set()
        got = (str(getattr(w.strategy, "value", w.strategy)), w.group_size) if w is not None else None
        if w is None or w.num_bits != 4 or str(getattr(w.type, "value", w.type)) != "int" or not w.symmetric or \
                len(want) != 1 or got not in want:
            bad.append(f"weights num_bits={getattr(w, 'num_bits', None)} type={getattr(w, 'type', None)} "
                       f"symmetric={getattr(w, 'symmetric', None)} strategy/group={got} (student: 4-bit "
                       f"symmetric int, {sorted(want, key=str)})")
    elif w is None or w.num_bits != 4 or str(getattr(w.type, "value", w.type)) != "float" or w.group_size != bs or \
            str(getattr(w.strategy, "value", w.strategy)) != strat:
        bad.append(f"weights num_bits={getattr(w, 'num_bits', None)} group_size={getattr(w, 'group_size', None)} "
                   f"strategy={getattr(w, 'strategy', None)} (student: 4-bit float, group {bs}, {strat})")
    if (a is not None) != (mode == "w4a4"):
        bad.append(f"input_activations={'set' if a is not None else 'null'} (student: {mode})")
    elif a is not None and (a.num_bits != 4 or a.group_size != bs):
        bad.append(f"input_activations num_bits={a.num_bits} group_size={a.group_size}")
    if sorted(qcfg.ignore or []) != exclude:
        bad.append("ignore differs from the student's unquantized linears: "
                   + names_sample(set(qcfg.ignore or []) ^ set(exclude)))
    res.ok_or_fail("config.json", "quantization_config == student", not bad, "; ".join(bad) if bad else
                   f"format={qcfg.format} {mode}", source="compressed_tensors.QuantizationConfig")
    return scheme


def _scalar(t: Optional[torch.Tensor], shape, what: str) -> torch.Tensor:
    if t is None:
        raise Malformed(f"{what} missing")
    if t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise Malformed(f"{what} is {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
    return t


def _nan_scales(sf: torch.Tensor, codec: str) -> int:
    b = sf.contiguous().view(torch.uint8)
    return int(((b & 0x7F) == 0x7F).sum()) if codec == "e4m3" else int((b == 0xFF).sum())


def _modelopt_tensor(res, m, name, sd, student, p, mode, NVFP4QTensor) -> Optional[torch.Tensor]:
    w, sf = sd.get(m + ".weight"), sd.get(m + ".weight_scale")
    if w is None or sf is None:
        raise Malformed(f"{m}.weight / .weight_scale missing")
    s2 = _scalar(sd.get(m + ".weight_scale_2"), (), f"{m}.weight_scale_2")
    bad = []
    if w.dtype != torch.uint8 or not torch.equal(w, p.codes):
        bad.append(f"codes {w.dtype} {tuple(w.shape)} differ")
    if sf.dtype != torch.float8_e4m3fn or not torch.equal(sf.contiguous().view(torch.uint8), p.scales):
        bad.append(f"block scales {sf.dtype} {tuple(sf.shape)} differ")
    if f32_bits(s2) != f32_bits(p.global_scale):
        bad.append(f"weight_scale_2={float(s2):.9g} (student S={float(p.global_scale):.9g})")
    if _nan_scales(sf, "e4m3") or nonfinite(s2) or float(s2) <= 0:
        bad.append(f"{_nan_scales(sf, 'e4m3')} NaN block scales; S={float(s2)}")
    if mode == "w4a4":
        ins = sd.get(m + ".input_scale")
        want = act_decode_scale(student, m)
        if ins is None:
            bad.append("input_scale missing (the student is W4A4)")
        elif ins.dtype != torch.float32 or tuple(ins.shape) != () or f32_bits(ins) != f32_bits(want):
            bad.append(f"input_scale={ins.dtype} {tuple(ins.shape)} {float(ins.reshape(-1)[0]):.9g} (student {float(want):.9g})")
    res.ok_or_fail(m, "bytes", not bad, "; ".join(bad) if bad else
                   f"codes {tuple(w.shape)} e4m3 {tuple(sf.shape)} S={float(s2):.6g}" +
                   (" input_scale" if mode == "w4a4" else ""))
    if w.dtype != torch.uint8 or sf.dtype != torch.float8_e4m3fn or w.ndim != 2 or \
            tuple(sf.shape) != (w.shape[0], w.shape[1] * 2 // 16):
        res.add(m, "weights", FAIL, "not decodable as ModelOpt NVFP4 (dtypes/shapes above)")
        return None
    want = fake_quant(student, name)
    got = None
    if NVFP4QTensor is not None:
        q = NVFP4QTensor(torch.Size([w.shape[0], w.shape[1] * 2]), torch.float32, w)
        got = q.dequantize(dtype=torch.float32, scale=sf, double_scale=s2, block_sizes={-1: 16})
        eq, mad, n = compare_values(got, want)
        res.ok_or_fail(m, "weights", eq, "exact" if eq else f"{n}/{want.numel()} elements differ", mad,
                       "nvidia-modelopt NVFP4QTensor.dequantize")
    v = _vllm_decode(w, sf, s2)
    eq, mad, n = compare_values(v, want)
    res.ok_or_fail(m, "weights (vLLM rule)", eq, ("exact" if eq else f"{n}/{want.numel()} elements differ") +
                   " (a transcription of vLLM's dequantize_to_dtype, not vLLM itself)", mad, "transcription")
    return got if got is not None else v


def _vllm_decode(packed: torch.Tensor, sf: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU reference for ModelOpt NVFP4 (nvfp4_emulation_utils.dequantize_to_dtype), written
    out here: low nibble first, value table lookup, fp8 scale to fp32 times weight_scale_2, then
    one product per element; checkpoint scales are row-major so no un-swizzle is needed."""
    m, half = packed.shape
    vals = _E2M1[torch.stack([packed & 0x0F, packed >> 4], -1).reshape(m, half * 2).long()]
    s = sf.view(torch.float8_e4m3fn).to(torch.float32) * s2.to(torch.float32)
    return (vals.reshape(m, -1, 16) * s.unsqueeze(-1)).reshape(m, half * 2)


def _int4_bytes(m, sd, p, w, sf, bad: List[str], local: Dict[str, torch.Tensor]) -> None:
    """int4 pack-quantized: compressed-tensors' own unpacking of the int32 words gives the student's codes,
    the stored scales are the student's fp16 scales as values (in the dtype the engine loads them in)."""
    unpack = need("compressed_tensors.compressors.pack_quantized.helpers").unpack_from_int32
    ws = sd.get(m + ".weight_shape")
    if ws is None or ws.dtype not in (torch.int32, torch.int64) or tuple(ws.tolist()) != tuple(p.shape):
        bad.append(f"weight_shape {None if ws is None else ws.tolist()} (student {list(p.shape)})")
    else:
        local["weight_shape"] = ws
    if w.dtype != torch.int32 or not torch.equal(unpack(w, 4, torch.Size(p.shape)), p.codes.to(torch.int8)):
        bad.append(f"codes {w.dtype} {tuple(w.shape)} differ (compressed-tensors unpack_from_int32)")
    if not sf.is_floating_point() or tuple(sf.shape) != tuple(p.scales.shape) or \
            not torch.equal(sf.float(), p.scales.float()):
        bad.append(f"scales {sf.dtype} {tuple(sf.shape)} are not the student's fp16 scales")
    elif nonfinite(sf):
        bad.append(f"{nonfinite(sf)} non-finite scales")


def _ct_tensor(res, m, name, sd, student, p, mode, layout, compressor, scheme) -> Optional[torch.Tensor]:
    w, sf = sd.get(m + ".weight_packed"), sd.get(m + ".weight_scale")
    if w is None or sf is None:
        raise Malformed(f"{m}.weight_packed / .weight_scale missing")
    bad = []
    local = {"weight_packed": w, "weight_scale": sf}
    if layout is INT4:
        _int4_bytes(m, sd, p, w, sf, bad, local)
        res.ok_or_fail(m, "bytes", not bad, "; ".join(bad) if bad else f"int4 codes {tuple(w.shape)} int32, scales "
                       f"{sf.dtype} {tuple(sf.shape)}", source="compressed_tensors unpack_from_int32")
        return _ct_decode(res, m, name, student, layout, compressor, scheme, local)
    want_sdt = torch.float8_e4m3fn if layout is NV else torch.uint8
    if w.dtype != torch.uint8 or not torch.equal(w, p.codes):
        bad.append(f"codes {w.dtype} {tuple(w.shape)} differ")
    if sf.dtype != want_sdt or not torch.equal(sf.contiguous().view(torch.uint8), p.scales):
        bad.append(f"block scales {sf.dtype} {tuple(sf.shape)} differ (want {want_sdt})")
    if _nan_scales(sf, "e4m3" if layout is NV else "e8m0"):
        bad.append(f"{_nan_scales(sf, 'e4m3' if layout is NV else 'e8m0')} NaN block scales")
    if layout is NV:
        g = _scalar(sd.get(m + ".weight_global_scale"), (1,), f"{m}.weight_global_scale")
        S = torch.as_tensor(p.global_scale, dtype=torch.float32)
        if f32_bits(g) != f32_bits(1.0 / S):
            bad.append(f"weight_global_scale={float(g):.9g} (student 1/S={float(1.0 / S):.9g})")
        local["weight_global_scale"] = g
        if mode == "w4a4":
            ig = sd.get(m + ".input_global_scale")
            want = 1.0 / act_decode_scale(student, m)
            if ig is None:
                bad.append("input_global_scale missing (the student is W4A4)")
            elif ig.dtype != torch.float32 or tuple(ig.shape) != (1,) or f32_bits(ig) != f32_bits(want):
                bad.append(f"input_global_scale={float(ig.reshape(-1)[0]):.9g} (student {float(want):.9g})")
            else:
                local["input_global_scale"] = ig
    res.ok_or_fail(m, "bytes", not bad, "; ".join(bad) if bad else f"codes {tuple(w.shape)} scales {sf.dtype} "
                   f"{tuple(sf.shape)}" + (" G=1/S" if layout is NV else ""))
    return _ct_decode(res, m, name, student, layout, compressor, scheme, local)


def _ct_decode(res, m, name, student, layout, compressor, scheme, local) -> Optional[torch.Tensor]:
    if compressor is None:
        return None
    want = fake_quant(student, name)
    try:
        got = compressor.decompress(local, scheme)["weight"]
    except Exception as e:
        res.add(m, "weights", FAIL, f"compressed-tensors cannot decode it: {type(e).__name__}: {str(e)[:200]}")
        return None
    src = f"compressed_tensors {getattr(compressor, '__name__', type(compressor).__name__)}.decompress"
    if tuple(got.shape) != tuple(want.shape):
        res.add(m, "weights", FAIL, f"decodes to shape {tuple(got.shape)}, student {tuple(want.shape)}", source=src)
        return None
    if got.dtype == torch.float32:
        eq, mad, n = compare_values(got, want)
        res.ok_or_fail(m, "weights", eq, "exact" if eq else f"{n} elements differ", mad, src)
        return got
    # compressed-tensors decodes into bf16 (NVFP4; int4: the scale dtype): compare with the student's
    # fake-quant weight rounded to that dtype (int4: CT multiplies code x scale once, in that dtype)
    eq, mad, n = compare_values(got, want.to(got.dtype))
    if eq:
        res.add(m, "weights", OK, f"exact in {str(got.dtype)[6:]}", 0.0, src)
        return got
    ulp = max_ulp(got.float(), want.to(got.dtype).float(), torch.bfloat16) if nonfinite(got) == 0 else 1 << 30
    tolerated = layout is NV and ulp <= 1
    res.ok_or_fail(m, "weights", tolerated, f"{n}/{got.numel()} elements differ by <= {ulp} bf16 ulp" +
                   (" (CT stores G=1/S and divides: fp8/G != fp8*S in the last bit)" if tolerated else ""), mad, src)
    return got


def _fused_scales(res, sd, student, flavour) -> None:
    keys = [".weight_scale_2", ".input_scale"] if flavour == "modelopt" else [".weight_global_scale",
                                                                              ".input_global_scale"]
    for g in fused_groups(student):
        for suf in keys:
            vals = [sd[m + suf] for m in g if m + suf in sd]
            if len(vals) > 1:
                same = len({f32_bits(v) for v in vals}) == 1
                res.ok_or_fail(",".join(x.rsplit(".", 1)[-1] for x in g) + f" @{g[0].rsplit('.', 1)[0]}",
                               f"shared{suf}", same, f"{len(vals)} shards (the engine fuses them into one layer)")


def _templates(d: Optional[Path]) -> List[str]:
    """additional_chat_templates/*.jinja under ``d`` (transformers loads each as a named template)."""
    t = d / TEMPLATES_DIR if d is not None else None
    if t is None or t.is_symlink() or not t.is_dir():
        return []
    return sorted(f"{TEMPLATES_DIR}/{p.name}" for p in t.iterdir() if p.name.endswith(".jinja"))


def _expected_files(d: Path, student: ConvertedModel, flavour: str) -> List[str]:
    """What the container holds for this student: the record, config(s), the weights the index names
    (or model.safetensors), and the source files (judged by value in the "source files" row)."""
    out = ["qatfactory.json", "config.json"] + (["hf_quant_config.json"] if flavour == "modelopt" else [])
    if (d / INDEX).exists() or (d / INDEX).is_symlink():
        out.append(INDEX)
        try:
            wm = read_json(d, INDEX).get("weight_map")
            out += sorted({v for v in wm.values() if isinstance(v, str)}) if isinstance(wm, dict) else []
        except Malformed:
            pass   # the tensors row names what is wrong with the index
    else:
        out.append("model.safetensors")
    src = Path(student.source_dir) if student.source_dir else None
    return out + list(SOURCE_FILES) + sorted(set(_templates(d)) | set(_templates(src)))


def _source_files(res, d: Path, student: ConvertedModel) -> None:
    """Tokenizer, generation config and chat templates as the engine reads them: byte-equal to the
    student's base model directory (ConvertedModel.source_dir), nothing the student does not have."""
    src = Path(student.source_dir) if student.source_dir else None
    shipped = [n for n in SOURCE_FILES if (d / n).exists() or (d / n).is_symlink()] + _templates(d)
    if src is None or not any((src / n).is_file() for n in SOURCE_FILES):
        if shipped:  # the student cannot vouch for them: say where the truth would be, never pass
            res.add("source files", "== student's source_dir", INCOMPLETE,
                    f"not compared: {', '.join(shipped)} ship with the export but the student's source_dir "
                    f"({src}) holds none of them; give the base model directory (qatfactory verify --source-dir, "
                    f"ConvertedModel.source_dir)")
        else:
            res.add("source files", "== student's source_dir", OK, "none (the student has no tokenizer files)")
        return
    bad, n = [], 0
    for name in list(SOURCE_FILES) + sorted(set(_templates(d)) | set(_templates(src))):
        sub, _, leaf = name.rpartition("/")
        mine = src is not None and (src / name).is_file()
        there = (d / name).exists() or (d / name).is_symlink()
        if not mine and not there:
            continue
        n += 1
        if not there:
            bad.append(f"{name} missing (the student's source_dir has it)")
            continue
        if not mine:
            bad.append(f"{name} is not in the student's source_dir ({src}), so nothing vouches for it")
            continue
        try:
            if inside(d / sub if sub else d, leaf).read_bytes() != (src / name).read_bytes():
                bad.append(f"{name} differs from {src / name}")
        except Malformed as e:
            bad.append(str(e))
    res.ok_or_fail("source files", "== student's source_dir", not bad, "; ".join(bad) if bad else
                   f"{n} files byte-equal" if n else "none (the student has no tokenizer files)")


def _skeleton(d: Path):
    tr = need("transformers")
    with torch.device("meta"):
        cfg = tr.AutoConfig.from_pretrained(str(d))
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        return tr.AutoModelForCausalLM.from_config(cfg)


def _linear_names(model) -> Set[str]:
    return {n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}


def _ct_skeleton(res, d, student) -> None:
    """compressed-tensors itself decides, from the exported config.json, which linears of a
    transformers skeleton it quantizes: exactly the student's packed linears (experts aside:
    transformers holds them fused, vLLM maps them per expert)."""
    try:
        q = need("compressed_tensors.quantization")
        qcfg = q.QuantizationConfig.model_validate(json.loads((inside(d, "config.json")).read_text())
                                                   ["quantization_config"])
        sk = _skeleton(d)
        q.apply_quantization_config(sk, qcfg, show_progress=False)
    except Missing as e:
        res.missing("modules", "quantized set (compressed-tensors)", e)
        return
    except Exception as e:
        res.add("modules", "quantized set (compressed-tensors)", FAIL, f"{type(e).__name__}: {str(e)[:300]}")
        return
    schemed = {n: mod for n, mod in sk.named_modules() if getattr(mod, "quantization_scheme", None) is not None}
    # with a kv_cache_scheme, compressed-tensors also hooks the attention modules it recognises (which ones
    # depends on the transformers version): a scheme of input activations equal to the KV scheme and no
    # weights is the KV cache, checked by the "kv cache" rows, not a linear it would quantize
    kv = qcfg.kv_cache_scheme
    kv_hooked = {n for n, mod in schemed.items() if kv is not None and not isinstance(mod, torch.nn.Linear)
                 and getattr(mod.quantization_scheme, "weights", None) is None
                 and getattr(mod.quantization_scheme, "input_activations", None) == kv}
    got = set(schemed) - kv_hooked
    want = {module_of(n) for n in student.packed if ".experts." not in n}
    kv_note = f"; {len(kv_hooked)} attention modules carry only the KV-cache scheme" if kv_hooked else ""
    res.ok_or_fail("modules", "quantized set (compressed-tensors)", got == want,
                   (f"{len(got)} linears == the student's packed" if got == want else
                    f"CT would quantize {names_sample(got - want)} (not packed) / leave {names_sample(want - got)}")
                   + kv_note,
                   source="compressed_tensors.apply_quantization_config on a transformers skeleton")


def _modelopt_exclusion(res, d, student, qc) -> None:
    """vLLM's ModelOpt loader quantizes every linear not matched by exclude_modules (exact name or
    wildcard; a transcription of its is_layer_excluded): that set must be the student's packed one."""
    try:
        sk = _skeleton(d)
    except Missing as e:
        res.missing("modules", "quantized set (exclude_modules)", e)
        return
    except Exception as e:
        res.add("modules", "quantized set (exclude_modules)", FAIL, f"{type(e).__name__}: {str(e)[:300]}")
        return
    pats = list(qc.get("exclude_modules") or qc.get("ignore") or [])
    got = {n for n in _linear_names(sk) if not any(n == p or fnmatch.fnmatchcase(n, p) for p in pats)}
    want = {module_of(n) for n in student.packed if ".experts." not in n}
    res.ok_or_fail("modules", "quantized set (exclude_modules)", got == want,
                   f"{len(got)} linears == the student's packed" if got == want else
                   f"vLLM would quantize {names_sample(got - want)} (not packed) / leave {names_sample(want - got)}",
                   source="transcription of vLLM's exclude_modules matching")


def _logits(res, d, cfg, sd, student, prompt, flavour, layout, decoded) -> None:
    cache: Dict[str, Any] = {}
    ref = student_logits(student, prompt, cache)
    export_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    if flavour == "modelopt":
        # no CPU loader for ModelOpt NVFP4 exists; transformers builds the model from the EXPORT's
        # config.json and tensors, the packed ones decoded by nvidia-modelopt
        sd2 = {k: v for k, v in sd.items() if not k.endswith((".weight_scale", ".weight_scale_2", ".input_scale",
                                                              ".k_scale", ".v_scale"))}
        sd2.update(decoded)
        model = model_from_state_dict(export_cfg, sd2)
        exact_logits_check(res, "transformers (export config + modelopt decode)", ref, run_logits(model, prompt),
                           "safetensors + nvidia-modelopt + transformers")
        return
    is_moe = any(".experts." in n for n in student.packed)
    tr = need("transformers")
    if layout is NV and is_moe:
        # transformers' fused-expert CT decompression drops weight_global_scale (exporters.md 7.1):
        # rebuild from compressed-tensors' own per-module decode, with the export's config
        sd2 = {k: v for k, v in sd.items() if not k.endswith((".weight_packed", ".weight_scale",
                                                               ".weight_global_scale", ".input_global_scale",
                                                               ".k_scale", ".v_scale"))}
        sd2.update(decoded)
        model = model_from_state_dict(export_cfg, sd2)
        src, label = "compressed_tensors decompress + transformers", "compressed_tensors (rebuilt)"
    else:
        CTC = need("transformers.utils.quantization_config").CompressedTensorsConfig
        need("compressed_tensors")
        model = tr.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                        quantization_config=CTC(dequantize=True)).eval().float()
        # transformers 5.17 (not 5.24) keeps CT's runtime scheme on the decompressed linears; this
        # check is about the weights, so switch that activation QDQ off where it is kept
        kept = [mod for mod in model.modules() if getattr(mod, "quantization_scheme", None) is not None]
        for mod in kept:
            mod.quantization_enabled = False
        src, label = "transformers CompressedTensorsConfig(dequantize=True)", "transformers"
    # the reference: the student's config and weights, with the packed ones as compressed-tensors
    # decoded them (each already compared element by element above, bf16 within 1 ulp)
    if any(v.dtype != torch.float32 for v in decoded.values()):
        sdb = student_weights(student)
        sdb.update({k: v.float() for k, v in decoded.items()})
        ref = run_logits(model_from_state_dict(student.config, sdb), prompt)
        why = "reference: the student with compressed-tensors' bf16-decoded weights"
    else:
        why = ""
    exact_logits_check(res, label, ref, run_logits(model, prompt), src, why)
