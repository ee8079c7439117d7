"""Pieces every flavour of the gate uses: the student's facts (the truth), safe file access inside the
export directory, exact comparisons, config comparison and reference models.

Nothing here imports the exporters: the gate decides what to check from the student
(``ConvertedModel``) and the format registry, and reads the export only to compare it.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from qatfactory.formats import ConvertedModel, get_format

from .result import FAIL, Malformed, Missing, VerifyResult, need

RECORD = "qatfactory.json"
LM_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
# config keys an export may add to the student's config.json (checked on their own)
ADDED_KEYS = ("quantization_config", "torch_dtype", "dtype", "architectures", "transformers_version")
# keys that say where a config was loaded from (a local folder, a hub revision), not what the model
# computes: the same student read from another folder must compare equal, so neither side's counts
LOCATION_KEYS = ("_name_or_path", "_commit_hash", "_model_name_or_path")
DTYPE_KEYS = ("dtype", "torch_dtype")   # one setting under two names (transformers renamed it)


def default_prompt(vocab_size: int, n: int = 12) -> List[int]:
    return [(7 * i + 3) % vocab_size for i in range(n)]


# ============================================================================ files
def inside(d: Path, name: Any, what: str = "file") -> Path:
    """``d / name`` when ``name`` is a plain file name of a regular file inside ``d`` (a symlink
    whose target leaves ``d`` counts as leaving it); Malformed otherwise, without reading it."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise Malformed(f"{what} {name!r} is not a plain file name inside the export directory (refused, not read)")
    p = d / name
    real, root = os.path.realpath(p), os.path.realpath(d)
    if os.path.dirname(real) != root:
        raise Malformed(f"{what} {name!r} resolves to {real}, outside the export directory (refused, not read)")
    if not os.path.isfile(real):
        raise Malformed(f"{what} {name!r} is missing from the export directory")
    return p


def read_json(d: Path, name: str) -> Dict[str, Any]:
    p = inside(d, name)
    try:
        with open(p) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise Malformed(f"{name} is not readable JSON: {e}") from None
    if not isinstance(obj, dict):
        raise Malformed(f"{name} holds a {type(obj).__name__}, not a JSON object")
    return obj


# ============================================================================ the student (the truth)
def module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def student_mode(student: ConvertedModel) -> str:
    """'w4a4' when every packed module quantizes its input, 'w4a16' when none does, else 'mixed'."""
    mods = [module_of(n) for n in student.packed]
    n_act = sum(m in student.act_formats for m in mods)
    return "w4a16" if n_act == 0 else "w4a4" if n_act == len(mods) else "mixed"


def act_decode_scale(student: ConvertedModel, module: str) -> torch.Tensor:
    """The activation format's per-tensor decode scale for the module's calibrated amax, as the
    format registry computes it (NVFP4: amax/2688)."""
    f = get_format(student.act_formats[module])
    amax = student.input_amax.get(module)
    if amax is None:
        raise Malformed(f"{module}: the student quantizes its input with {f.spec.name} but has no calibrated amax")
    p = f.quantize(torch.zeros(1, f.spec.super_block), amax=torch.as_tensor(amax, dtype=torch.float32))
    if p.global_scale is None:
        raise Malformed(f"{module}: activation format {f.spec.name} has no per-tensor scale")
    return torch.as_tensor(p.global_scale, dtype=torch.float32).reshape(())


def fake_quant(student: ConvertedModel, name: str) -> torch.Tensor:
    p = student.packed[name]
    return get_format(p.format).dequantize(p).float()


def student_weights(student: ConvertedModel) -> Dict[str, torch.Tensor]:
    sd = dict(student.dense)
    for name in student.packed:
        sd[name] = fake_quant(student, name)
    return sd


def tied(student: ConvertedModel) -> Optional[bool]:
    t = student.config.get("tie_word_embeddings")
    return None if t is None else bool(t)


def written_dense(student: ConvertedModel) -> Dict[str, torch.Tensor]:
    """The dense tensors an engine reads: all of them, less a tied lm_head (the engines build it
    from the embedding) and rotary caches."""
    out = {}
    for k, v in student.dense.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k == LM_HEAD and tied(student):
            continue
        out[k] = v
    return out


def fused_groups(student: ConvertedModel) -> List[List[str]]:
    """Modules vLLM/SGLang load into one layer with one per-tensor scale: q/k/v, gate/up, each
    expert's gate/up (w1/w3), Qwen3.5's in_proj_qkv + in_proj_z (vLLM qwen3_5.py packed_modules_mapping
    "in_proj_qkvz"), plus any group the student names."""
    mods = {module_of(n) for n in student.packed}
    groups, seen = [], set()
    cands = [list(g) for g in student.fused_groups]
    for m in sorted(mods):
        for first, rest in ((".q_proj", (".k_proj", ".v_proj")), (".gate_proj", (".up_proj",)), (".w1", (".w3",)),
                            (".in_proj_qkv", (".in_proj_z",))):
            if m.endswith(first):
                stem = m[: -len(first)]
                cands.append([m] + [stem + r for r in rest if stem + r in mods])
    for g in cands:
        key = tuple(sorted(g))
        if len(g) > 1 and key not in seen:
            seen.add(key)
            groups.append(g)
    return groups


# ============================================================================ comparisons
def nonfinite(t: torch.Tensor) -> int:
    t = torch.as_tensor(t)
    if not t.is_floating_point():
        return 0
    return int((~torch.isfinite(t.float())).sum())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def f32_bits(x) -> int:
    return int(torch.as_tensor(x, dtype=torch.float32).reshape(-1)[0].view(torch.int32))


def compare_values(got: torch.Tensor, want: torch.Tensor) -> Tuple[bool, float, int]:
    """(equal, max |diff|, elements that differ); any NaN/Inf counts as a difference."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return False, float("inf"), -1
    bad = ~torch.isfinite(got) | ~torch.isfinite(want)
    d = (got - want).abs()
    n = int(((d > 0) | bad).sum())
    mad = float("inf") if bool(bad.any()) else (float(d.max()) if d.numel() else 0.0)
    return n == 0, mad, n


def max_ulp(a: torch.Tensor, b: torch.Tensor, dtype=torch.float32) -> int:
    """Largest distance in units of the last place of ``dtype`` (float32 or bfloat16)."""
    bits, mask = (torch.int32, 0x7FFFFFFF) if dtype == torch.float32 else (torch.int16, 0x7FFF)
    ia = a.to(dtype).contiguous().view(bits).to(torch.int64)
    ib = b.to(dtype).contiguous().view(bits).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & mask), ia)
    ib = torch.where(ib < 0, -(ib & mask), ib)
    return int((ia - ib).abs().max()) if ia.numel() else 0


# ============================================================================ configs
def _eq(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (type(a) is type(b) and a == b)
    return a == b


def _dtype_str(v) -> str:
    return str(v).replace("torch.", "")


def dtype_name(student: ConvertedModel) -> str:
    for t in student.dense.values():
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "bfloat16"


def compare_hf_config(res: VerifyResult, exported: Dict[str, Any], student: ConvertedModel) -> bool:
    """Every key of the student's config.json equal in the export (rms_norm_eps, rope, hidden_act,
    head counts, vocab, context length, tie flag, ...), no key the student does not have besides
    the container's own (quantization_config, torch_dtype, architectures), all checked here."""
    want = {k: v for k, v in student.config.items() if k not in ("quantization_config",) + LOCATION_KEYS}
    bad = []
    for k, v in want.items():
        if k in ("transformers_version", "architectures") + DTYPE_KEYS:
            continue  # architectures: checked below (an export fills in a missing one); dtype: below
        if k not in exported:
            bad.append(f"{k} missing (student: {v!r})")
        elif not _eq(exported[k], v):
            bad.append(f"{k}={exported[k]!r} (student: {v!r})")
    for k in exported:
        if k in LOCATION_KEYS:
            # engines do not read it; a copy of a published export still carries it, so it is said, not failed
            if exported[k]:
                res.notes.append(f"config.json carries {k}={exported[k]!r}, the folder the student was loaded "
                                 f"from (no engine reads it; the exporter no longer writes it)")
        elif k not in want and k not in ADDED_KEYS:
            bad.append(f"{k}={exported[k]!r} is not in the student's config")
    # dtype and torch_dtype name one setting: each value the export states (under either name) must be
    # the student's (under either name) and the dtype of the student's tensors
    got_dt = {_dtype_str(exported[k]) for k in DTYPE_KEYS if exported.get(k) is not None}
    want_dt = {_dtype_str(want[k]) for k in DTYPE_KEYS if want.get(k) is not None}
    for dt in sorted(got_dt):
        if dt != dtype_name(student) or (want_dt and dt not in want_dt) or len(got_dt) > 1:
            bad.append(f"dtype/torch_dtype={sorted(got_dt)} (student config: {sorted(want_dt) or 'unset'}, "
                       f"student tensors: {dtype_name(student)})")
            break
    arch = exported.get("architectures")
    want_arch = student.config.get("architectures")
    if not want_arch:
        try:
            names = need("transformers.models.auto.modeling_auto").MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            want_arch = [names[student.config.get("model_type")]]
        except (Missing, KeyError):
            want_arch = None
    if want_arch is not None and arch != list(want_arch):
        bad.append(f"architectures={arch!r} (the student's model class: {want_arch})")
    return res.ok_or_fail("config.json", "model config == student", not bad,
                          "; ".join(bad[:6]) + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
                          if bad else f"{len(want)} keys equal")


# ============================================================================ models and logits
def model_from_state_dict(config: Dict[str, Any], sd: Dict[str, torch.Tensor], eager_experts: bool = False):
    """An HF model (float32) built by transformers' own loader from on-disk-named tensors."""
    save_file = need("safetensors.torch").save_file
    tr = need("transformers")
    with tempfile.TemporaryDirectory(prefix="qf-verify-") as d:
        cfg = dict(config)
        cfg.pop("quantization_config", None)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, default=str)
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"))
        kw = {"experts_implementation": "eager"} if eager_experts else {}
        return tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()


@torch.no_grad()
def run_logits(model, prompt: List[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def student_logits(student: ConvertedModel, prompt: List[int], cache: Dict[str, Any]) -> torch.Tensor:
    if "student" not in cache:
        cache["student"] = run_logits(model_from_state_dict(student.config, student_weights(student)), prompt)
    return cache["student"]


def exact_logits_check(res: VerifyResult, name: str, ref: torch.Tensor, got: torch.Tensor, source: str,
                       why: str = "") -> bool:
    """Weights were compared element by element; a third-party loader given those weights and the
    export's config must then give the reference's logits bit for bit."""
    eq, mad, n = compare_values(got, ref)
    argmax_eq = bool(torch.equal(got.argmax(-1), ref.argmax(-1)))
    res.logits[name] = {"max_abs_diff": mad, "max_abs_logit": float(ref.abs().max()), "exact": eq,
                        "argmax_equal": argmax_eq, "source": source}
    if eq:
        detail = "bit-identical logits" + (f" ({why})" if why else "")
    else:
        nf = nonfinite(got)
        detail = f"{n} logits differ (argmax equal={argmax_eq})" + (f"; {nf} non-finite" if nf else "") + \
            "; the weights were compared exactly, so a config/loader difference remains"
    return res.ok_or_fail("logits", name, eq, detail, mad, source)


def check_finite(res: VerifyResult, tensor: str, what: str, t: torch.Tensor) -> bool:
    n = nonfinite(t)
    if n:
        res.add(tensor, what, FAIL, f"{n} NaN/Inf values")
    return n == 0


def names_sample(xs: Iterable[str], k: int = 4) -> str:
    xs = sorted(xs)
    return ", ".join(xs[:k]) + (f" (+{len(xs) - k} more)" if len(xs) > k else "")

