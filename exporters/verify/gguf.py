"""The gate for GGUF exports (llama.cpp).

Nothing of the exporter is used: the file is read with gguf-py's ``GGUFReader``; tensor names come
from gguf-py's own HF -> GGUF table (``get_tensor_name_map``, the table llama.cpp's converter uses);
Q/K rows of the ``llama`` architecture are un-permuted with transformers' GGUF code
(``LlamaTensorProcessor``); values are decoded by gguf-py and by libggml's C dequantizers
(libggml-python); metadata is read with gguf-py and through transformers' GGUF config mapping
(``load_gguf_checkpoint``), and compared with the student's config; logits come from transformers'
GGUF loader (or a transformers model rebuilt from gguf-py's decode where that loader cannot build
the model) and from llama.cpp's own runtime (llama_cpp_runtime.py).

The GGML block layouts of the two repacked formats (NVFP4 type 40: 4 UE4M3 bytes + 32 bytes, byte j
of each 16 = element j | element j+8 << 4; MXFP4 type 39: E8M0 + 16 bytes, element j | j+16 << 4;
facts from ggml-common.h) are parsed here to compare codes and scale bytes with the student's; that
parser is a second transcription of the layout, the value checks are gguf-py's and libggml's. Which GGUF
type and codec family a packed tensor must be is what the student's format declares (its spec's ``gguf``
record, formats/layouts.py): the student's truth, never the exporter's choice.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from qatfactory.formats import ConvertedModel, get_format
from qatfactory.formats.layouts import Codec

from ..gguf_tokenizer import gate_check as tokenizer_gate
from . import kv as KVG
from .common import (
    act_decode_scale,
    compare_values,
    exact_logits_check,
    f32_bits,
    fake_quant,
    inside,
    max_ulp,
    model_from_state_dict,
    module_of,
    names_sample,
    nonfinite,
    run_logits,
    student_logits,
    student_mode,
    student_weights,
    tied,
    written_dense,
)
from .gguf_sizes import size_problems
from .gguf_tokens import check_gguf_tokenizer
from .llama_cpp_runtime import runtime_check
from .result import FAIL, OK, Malformed, Missing, VerifyResult, need

# HF model_type -> (gguf-py MODEL_ARCH member name, llama.cpp permutes Q/K rows for interleaved RoPE)
ARCH = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "mixtral": ("LLAMA", True),
        "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False), "qwen3_moe": ("QWEN3MOE", False),
        "gemma3_text": ("GEMMA3", False)}
# Transcribed from llama.cpp (not shared with the exporter): its converter stores Gemma 3's norm weights as
# 1 + w (conversion/gemma.py Gemma3Model.norm_shift, for every name ending in "norm.weight"); its runtime
# (llama-model.cpp, LLM_ARCH_GEMMA3) makes layer il a sliding one unless il % 6 == 5 and scales queries by
# 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 62-layer model, whatever query_pre_attn_scalar says
GEMMA3_SWA_PATTERN = 6
GEMMA3_27B_LAYERS = 62


def norm_shift(arch_name: str, hf_name: str) -> float:
    return 1.0 if arch_name == "gemma3" and hf_name.endswith("norm.weight") else 0.0


def gemma3_query_scalar(n_layer: int, hidden: int, n_head: int, head_dim: int) -> int:
    return hidden // n_head if n_layer == GEMMA3_27B_LAYERS else head_dim
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)$")
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
ACT_NOTE = ("llama.cpp's CPU backend quantizes activations to Q8_0/Q8_K (by weight type), not to the "
            "student's activation format; the .input_scale tensors are kept for backends that use them")


# ============================================================================ names
class Names:
    """HF on-disk tensor name -> (GGUF name, expert index) with gguf-py's table."""

    def __init__(self, gguf, student: ConvertedModel):
        mt = student.config.get("model_type")
        self.arch_key, self.permute = ARCH[mt]
        self.arch = getattr(gguf.MODEL_ARCH, self.arch_key)
        self.arch_name = gguf.MODEL_ARCH_NAMES[self.arch]
        self.tmap = gguf.get_tensor_name_map(self.arch, int(student.config["num_hidden_layers"]))

    def __call__(self, hf: str) -> Tuple[Optional[str], Optional[int]]:
        stem, suffix = (hf[: -len(".weight")], ".weight") if hf.endswith(".weight") else \
            (hf[: -len(".bias")], ".bias") if hf.endswith(".bias") else (hf, "")
        e = None
        m = _EXPERT.match(stem)
        if m:
            stem, e = f"{m.group(1)}.{m.group(3)}", int(m.group(2))
        g = self.tmap.get_name(stem)
        return (None if g is None else g + suffix), e


def find_gguf(d: Path) -> Path:
    """model.gguf, or the only *.gguf in the export directory (never a path read from a file)."""
    if (d / "model.gguf").exists() or (d / "model.gguf").is_symlink():
        return inside(d, "model.gguf")
    cands = sorted(os.path.basename(p) for p in glob.glob(str(d / "*.gguf")))
    if len(cands) != 1:
        raise Malformed(f"expected model.gguf or exactly one *.gguf in the export directory, found {cands}")
    return inside(d, cands[0])


def field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    v = f.contents()
    return v


# ============================================================================ GGML block parsers
def unpack_pairs(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes packed two per byte (element 2i low nibble) -> one code per byte."""
    out = np.empty(codes.shape[:-1] + (codes.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = codes & 0x0F
    out[..., 1::2] = codes >> 4
    return out


def parse_ggml_blocks(raw: np.ndarray, kind: str, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """(codes [rows, K], scale bytes [rows, K/block]) of GGML NVFP4 / MXFP4 rows."""
    rows = raw.shape[0]
    if kind not in ("NVFP4", "MXFP4"):
        raise Malformed(f"no block parser for GGML type {kind} here (NVFP4, MXFP4): a student's pairs codec "
                        f"repacked into {kind} cannot be compared code by code")
    if kind == "NVFP4":
        b = raw.reshape(rows, k // 64, 36)
        sc = b[..., :4].reshape(rows, k // 16)
        qs = b[..., 4:].reshape(rows, k // 64, 4, 8)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)          # j, then j+8, per 16
        return codes.reshape(rows, k), sc
    b = raw.reshape(rows, k // 32, 17)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)              # j, then j+16, per 32
    return codes.reshape(rows, k), b[..., 0]


def libggml_dequantizer():
    """libggml-python's C dequantizers through ctypes (a required check: Missing when absent)."""
    libggml = need("libggml")
    base = os.path.dirname(libggml.__file__)
    cands = sorted(glob.glob(os.path.join(base, "lib*", "libggml-base.so*")))
    if not cands:
        raise Missing("libggml", "libggml-base.so not found in the libggml-python wheel")
    lib = ctypes.CDLL(cands[0])

    def deq(raw: np.ndarray, type_name: str, n: int) -> Optional[np.ndarray]:
        fn = getattr(lib, f"dequantize_row_{type_name.lower().replace('_k', '_K')}", None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        out = np.zeros(n, dtype=np.float32)
        fn(raw.ctypes.data, out.ctypes.data, n)
        return out
    return deq


# ============================================================================ the gate
def verify_gguf(res: VerifyResult, d: Path, student: ConvertedModel, rec: Dict[str, Any], prompt: List[int],
                do_logits: bool, llama_cpp: bool) -> None:
    try:
        gguf = need("gguf")
    except Missing as e:
        res.missing("model.gguf", "gguf-py reader", e)
        return
    try:
        path = find_gguf(d)
    except Malformed as e:
        res.add("model.gguf", "found", FAIL, str(e))
        return
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        res.add(path.name, "readable", FAIL, f"gguf-py cannot read it: {type(e).__name__}: {str(e)[:300]}")
        return
    cfg = student.config
    mt = cfg.get("model_type")
    if mt not in ARCH:
        res.add("student", "representable", FAIL, f"model_type {mt!r} has no llama.cpp architecture here "
                                                   f"({sorted(ARCH)})")
        return
    names = Names(gguf, student)
    mode = student_mode(student)
    if mode == "mixed":
        res.add("student", "representable", FAIL, "the student mixes W4A4 and W4A16 modules")
    _check_record(res, rec, student, path.name, names, mode)
    _metadata(res, reader, student, names, path)   # reads values only (gguf-py, transformers' mapping)
    # size claims against the tensors present, before anything is built from the metadata (llama.cpp's
    # vocabulary load, a transformers model, llama.cpp's runtime)
    arch_f = field(reader, "general.architecture")
    sizes = size_problems(reader, arch_f) if isinstance(arch_f, str) else ["general.architecture missing"]
    if sizes:
        res.add(path.name, "sizes == tensors", FAIL, "; ".join(sizes[:4]) + "; nothing was built from this "
                "metadata", source="gguf.GGUFReader")
        return
    # llama.cpp's own tokenizer on this file against the source's HF tokenizer
    tokenizer_gate(res, path, student.source_dir or d, llama_cpp)
    # every tokenizer.* key by value against the source's tokenizer files (vocabulary, ids, templates)
    check_gguf_tokenizer(res, reader, Path(student.source_dir) if student.source_dir else None, cfg,
                         int(cfg["vocab_size"]))
    tensors = {t.name: t for t in reader.tensors}
    proc = None
    if names.permute:
        try:
            proc = need("transformers.modeling_gguf_pytorch_utils").LlamaTensorProcessor(config={
                "num_attention_heads": int(cfg["num_attention_heads"]),
                "num_key_value_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])})
        except Missing as e:
            res.missing("attn_q/attn_k", "Q/K un-permutation (transformers)", e)
    try:
        cdeq = libggml_dequantizer()
    except Missing as e:
        res.missing("weights", "libggml C dequantizers", e)
        cdeq = None

    def unpermute(arr: np.ndarray, gname: str) -> Optional[np.ndarray]:
        if not names.permute or not (".attn_q." in gname or ".attn_k." in gname):
            return arr
        if proc is None:
            return None
        return np.ascontiguousarray(proc.process(arr, gname).weights)

    expected: Dict[str, str] = {}   # GGUF tensor name -> why it is expected
    decoded: Dict[str, torch.Tensor] = {}
    tolerated: Dict[str, torch.Tensor] = {}
    t = tied(student)
    if t is not None:
        res.ok_or_fail("lm_head", "tied embeddings" if t else "untied lm_head", ("output.weight" in tensors) != t,
                       f"tie_word_embeddings={t}; output.weight {'present' if 'output.weight' in tensors else 'absent'}")
    # ---- packed
    for name, p in sorted(student.packed.items()):
        gname, e = names(name)
        if gname is None:
            res.add(name, "bytes", FAIL, "gguf-py has no GGUF name for this tensor")
            continue
        expected[gname] = name
        try:
            got = _packed(res, gguf, tensors, name, gname, e, p, student, mode, unpermute, cdeq, expected)
        except Malformed as ex:
            res.add(name, "bytes", FAIL, str(ex))
            continue
        if got is not None:
            decoded[name], tol = got
            if tol:
                tolerated[name] = decoded[name]
    # ---- dense
    for name, tt in sorted(written_dense(student).items()):
        m = _FUSED_EXPERTS.match(name)
        if m:  # transformers-5 fused 3-D experts kept dense: stored per projection
            layer, kind = m.group(1), m.group(2)
            if kind == "gate_up_proj":
                half = tt.shape[1] // 2
                parts = [(f"blk.{layer}.ffn_gate_exps.weight", tt[:, :half]), (f"blk.{layer}.ffn_up_exps.weight",
                                                                                 tt[:, half:])]
            else:
                parts = [(f"blk.{layer}.ffn_down_exps.weight", tt)]
            got = []
            for gname, part in parts:
                expected[gname] = name
                got.append(_dense(res, gguf, tensors, f"{name}[{gname}]", gname, None, part, unpermute))
            if all(g is not None for g in got):
                decoded[name] = torch.cat(got, dim=1) if len(got) == 2 else got[0]
            continue
        gname, e = names(name)
        if gname is None:
            res.add(name, "dense", FAIL, "gguf-py has no GGUF name for this tensor")
            continue
        expected[gname] = name
        shift = norm_shift(names.arch_name, name)
        got = _dense(res, gguf, tensors, name, gname, e, tt.float() + shift if shift else tt, unpermute)
        if got is not None:
            decoded[name] = got - shift if shift else got   # the student's own parameter, for rebuilt models
    extra = sorted(set(tensors) - set(expected))
    res.ok_or_fail("tensors", "none extra", not extra, f"{len(extra)} tensors the student does not have: "
                   + names_sample(extra) if extra else f"{len(tensors)} tensors, all expected")
    if any(get_format(p.format).spec.global_scale is not None for p in student.packed.values()) and mode == "w4a4":
        res.notes.append(ACT_NOTE)
    # ---- logits
    if not do_logits:
        res.opted_out("logits", "transformers GGUF", "--no-logits / logits=False")
        res.opted_out("logits", "llama.cpp runtime", "--no-logits / logits=False")
        return
    if any(c.status == FAIL for c in res.checks if c.tensor == "tensors" or c.check in ("bytes", "dense", "found")):
        res.add("logits", "transformers GGUF", FAIL, "not attempted: the file's tensors are incomplete or differ "
                                                     "(above)")
        return
    cache: Dict[str, Any] = {}
    try:
        _transformers_logits(res, d, path, reader, student, names, prompt, decoded, tolerated, cache)
    except Missing as e:
        res.missing("logits", "transformers GGUF", e)
    except Exception as e:
        res.add("logits", "transformers GGUF", FAIL, f"the loader failed: {type(e).__name__}: {str(e)[:300]}")
    if not llama_cpp:
        res.opted_out("logits", "llama.cpp runtime", "llama_cpp=False")
        return
    runtime_check(res, path, student, prompt, {g: tt.tensor_type.name for g, tt in tensors.items()}, names, cache)


def _check_record(res, rec, student, fname, names, mode) -> None:
    want = {"weight_formats": student.formats_used(), "activation_formats": sorted(set(student.act_formats.values())),
            "mode": mode, "architecture": names.arch_name, "qk_permuted": names.permute,
            "tied_embeddings": bool(tied(student)), "gguf_file": fname}
    bad = [f"{k}={rec.get(k)!r} (student / file: {v!r})" for k, v in want.items() if rec.get(k) != v]
    res.ok_or_fail("qatfactory.json", "record == student", not bad, "; ".join(bad) if bad else
                   f"{names.arch_name}, {mode}")
    KVG.check_record(res, rec, student, "llama_cpp")   # the cache type the student was trained for


def _rope(cfg: Dict[str, Any], layer_type: str = "full_attention") -> Dict[str, Any]:
    rp = dict(cfg.get("rope_parameters") or {})
    if isinstance(rp.get(layer_type), dict):   # transformers 5 nests Gemma 3's by layer type
        rp = dict(rp[layer_type])
    rs = dict(cfg.get("rope_scaling") or {})
    return {"theta": float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            "type": rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default",
            "factor": rp.get("factor", rs.get("factor")),
            "original": rp.get("original_max_position_embeddings", rs.get("original_max_position_embeddings"))}


def _f32(x) -> float:
    return float(np.float32(x))


def _metadata(res, reader, student, names, path) -> None:
    """Every hyperparameter llama.cpp reads, from gguf-py, equal to the student's (absent keys
    compared through llama.cpp's default); then the same through transformers' GGUF mapping."""
    cfg = student.config
    a = names.arch_name
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    rope = _rope(cfg)
    # key -> (student value, llama.cpp's value when the key is absent; _REQ = required)
    req = object()
    want: Dict[str, Tuple[Any, Any]] = {
        "general.architecture": (a, req),
        f"{a}.context_length": (int(cfg["max_position_embeddings"]), req),
        f"{a}.embedding_length": (hidden, req),
        f"{a}.block_count": (int(cfg["num_hidden_layers"]), req),
        f"{a}.attention.head_count": (n_head, req),
        f"{a}.attention.head_count_kv": (n_kv, n_head),
        f"{a}.attention.layer_norm_rms_epsilon": (_f32(cfg.get("rms_norm_eps", 1e-6)), req),
        f"{a}.rope.freq_base": (_f32(rope["theta"]), _f32(10000.0)),
        f"{a}.rope.dimension_count": (head_dim, head_dim),
        f"{a}.attention.key_length": (head_dim, hidden // n_head),
        f"{a}.attention.value_length": (head_dim, hidden // n_head),
        f"{a}.vocab_size": (int(cfg["vocab_size"]), None),
    }
    if cfg.get("intermediate_size"):
        want[f"{a}.feed_forward_length"] = (int(cfg["intermediate_size"]), req)
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_exp:
        want[f"{a}.expert_count"] = (int(n_exp), req)
        want[f"{a}.expert_used_count"] = (int(cfg["num_experts_per_tok"]), req)
        if cfg.get("moe_intermediate_size"):
            want[f"{a}.expert_feed_forward_length"] = (int(cfg["moe_intermediate_size"]), req)
    if rope["type"] in ("linear", "yarn"):
        want[f"{a}.rope.scaling.type"] = (rope["type"], req)
        want[f"{a}.rope.scaling.factor"] = (_f32(rope["factor"]), req)
        if rope["original"]:
            want[f"{a}.rope.scaling.original_context_length"] = (int(rope["original"]), req)
    bad = []
    for key, (v, default) in want.items():
        got = field(reader, key)
        if got is None:
            if default is req:
                bad.append(f"{key} missing (student: {v!r})")
            elif default is not None and default != v:
                bad.append(f"{key} absent: llama.cpp uses {default!r}, the student {v!r}")
            continue
        if isinstance(v, float):
            got = _f32(got)
        if got != v:
            bad.append(f"{key}={got!r} (student: {v!r})")
    if field(reader, f"{a}.vocab_size") is None:
        toks = reader.fields.get("tokenizer.ggml.tokens")
        if toks is None or len(toks.data) != int(cfg["vocab_size"]):
            bad.append(f"no {a}.vocab_size and the token list has {None if toks is None else len(toks.data)} "
                       f"entries (student vocab {cfg['vocab_size']})")
    if rope["type"] == "default" and field(reader, f"{a}.rope.scaling.type") not in (None, "none"):
        bad.append(f"{a}.rope.scaling.type={field(reader, f'{a}.rope.scaling.type')!r} (student: no scaling)")
    # what llama.cpp fixes for these architectures must be what the student computes
    if a == "gemma3":
        bad += _gemma3_fixed(reader, cfg, hidden, n_head, head_dim)
    elif cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"student hidden_act={cfg.get('hidden_act')!r}; llama.cpp runs SiLU for {a}")
    if a == "qwen3moe" and cfg.get("norm_topk_prob") is not True:
        bad.append("student norm_topk_prob is not true; llama.cpp's qwen3moe always renormalizes the top-k weights")
    res.ok_or_fail("metadata", "hyperparameters == student", not bad, "; ".join(bad[:6]) if bad else
                   f"{len(want)} keys equal", source="gguf.GGUFReader")
    tm = field(reader, "tokenizer.ggml.model")
    if tm == "gpt2":
        ok = "tokenizer.ggml.pre" in reader.fields and "tokenizer.ggml.merges" in reader.fields
        res.ok_or_fail("metadata", "tokenizer", ok, f"gpt2 pre={field(reader, 'tokenizer.ggml.pre')}")
    else:
        res.ok_or_fail("metadata", "tokenizer", tm is not None, f"model={tm}")
    # the same values as transformers' GGUF config mapping reads them
    try:
        parsed = need("transformers.modeling_gguf_pytorch_utils").load_gguf_checkpoint(
            str(path), return_tensors=False)["config"]
    except Missing as e:
        res.missing("metadata", "transformers GGUF config mapping", e)
        return
    except Exception as e:
        res.add("metadata", "transformers GGUF config mapping", FAIL, f"{type(e).__name__}: {str(e)[:300]}")
        return
    sv = dict(cfg, rope_theta=rope["theta"], head_dim=head_dim, num_key_value_heads=n_kv)
    if n_exp:
        sv["num_experts"] = int(n_exp)
    bad = []
    for k in ("max_position_embeddings", "num_hidden_layers", "intermediate_size", "hidden_size", "head_dim",
              "rope_theta", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size",
              "num_experts", "num_experts_per_tok", "tie_word_embeddings"):
        if k in parsed and k in sv:
            g, w = parsed[k], sv[k]
            if isinstance(w, float) or isinstance(g, float):
                g, w = _f32(g), _f32(w)
            if g != w:
                bad.append(f"{k}={parsed[k]!r} (student: {sv[k]!r})")
    res.ok_or_fail("metadata", "transformers GGUF config == student", not bad, "; ".join(bad) if bad else
                   f"{sum(k in parsed for k in sv)} mapped keys equal", source="transformers load_gguf_checkpoint")


def _gemma3_fixed(reader, cfg, hidden: int, n_head: int, head_dim: int) -> List[str]:
    """Gemma 3: the keys llama.cpp reads beyond the common ones, and what its runtime fixes."""
    bad = []
    n_layer = int(cfg["num_hidden_layers"])
    local = _rope(cfg, "sliding_attention")
    for key, v in (("gemma3.rope.freq_base_swa", _f32(local["theta"])),
                   ("gemma3.attention.sliding_window", cfg.get("sliding_window"))):
        got = field(reader, key)
        if got is None or (_f32(got) if isinstance(v, float) else got) != v:
            bad.append(f"{key}={got!r} (student: {v!r})")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        bad.append(f"student hidden_activation={act!r}; llama.cpp runs tanh GELU for gemma3")
    qs = gemma3_query_scalar(n_layer, hidden, n_head, head_dim)
    if cfg.get("query_pre_attn_scalar") is None or float(cfg["query_pre_attn_scalar"]) != float(qs):
        bad.append(f"student query_pre_attn_scalar={cfg.get('query_pre_attn_scalar')!r}; llama.cpp scales by "
                   f"1/sqrt({qs})")
    fixed = ["full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding_attention" for i in range(n_layer)]
    if list(cfg.get("layer_types") or fixed) != fixed:
        bad.append(f"student layer_types={cfg.get('layer_types')!r}; llama.cpp's pattern is {fixed}")
    if cfg.get("attn_logit_softcapping") is not None:
        bad.append(f"student attn_logit_softcapping={cfg['attn_logit_softcapping']!r}; llama.cpp's gemma3 applies none")
    # the final one llama.cpp applies when the key is there (tanh(x / c) * c), and transformers when the config has it
    cap, got = cfg.get("final_logit_softcapping"), field(reader, "gemma3.final_logit_softcapping")
    if (cap or None) != (got or None) and (cap is None or got is None or _f32(cap) != _f32(got)):
        bad.append(f"gemma3.final_logit_softcapping={got!r} (student: {cap!r})")
    return bad


def _raw(gguf, t, e) -> np.ndarray:
    raw = np.asarray(t.data)
    return raw[e] if e is not None else raw


def _packed(res, gguf, tensors, name, gname, e, p, student, mode, unpermute, cdeq, expected):
    spec = get_format(p.format).spec
    # the GGUF type and codec family the student's format declares (its spec: the student's truth);
    # the file is then read, parsed and decoded by gguf-py, libggml and this module's own block parser
    if spec.gguf is None:
        raise Malformed(f"format {p.format} declares no GGUF layout")
    want_type = gguf.GGMLQuantizationType(int(spec.gguf.ggml_type)).name
    repacked = spec.gguf.codec is not Codec.GGML_BLOCKS   # a pairs codec (E2M1 + E4M3 / E8M0), repacked
    t = tensors.get(gname)
    if t is None:
        raise Malformed(f"{gname} missing from the GGUF")
    rows, k = p.shape
    ne = [k, rows] + ([int(student.config.get("num_experts") or student.config.get("num_local_experts"))]
                      if e is not None else [])
    if t.tensor_type.name != want_type or [int(x) for x in t.shape] != ne:
        raise Malformed(f"{gname} is {t.tensor_type.name} ne={[int(x) for x in t.shape]}, the student's "
                        f"{p.format} needs {want_type} ne={ne}")
    raw = _raw(gguf, t, e)
    raw_hf = unpermute(raw, gname)
    if raw_hf is None:
        return None
    bad = []
    where = gname + (f"[{e}]" if e is not None else "")
    if repacked:
        codes, sc = parse_ggml_blocks(raw_hf, want_type, k)
        want_codes = unpack_pairs(p.codes.cpu().numpy())
        want_sc = p.scales.cpu().numpy()
        if spec.gguf.codec is Codec.E2M1_E4M3_FP32:   # E4M3 block scales: GGML holds them as UE4M3 (no sign)
            if (want_sc & 0x80).any():
                bad.append("the student has E4M3 scales with the sign bit set, which UE4M3 cannot hold")
            want_sc = want_sc & 0x7F
        if not np.array_equal(codes, want_codes):
            bad.append(f"{int((codes != want_codes).sum())} codes differ")
        if not np.array_equal(sc, want_sc):
            bad.append(f"{int((sc != want_sc).sum())} block scale bytes differ")
        src = "GGML block layout (transcription of ggml-common.h)"
    else:
        want_raw = np.ascontiguousarray(get_format(p.format).to_bytes(p), dtype=np.uint8).reshape(rows, -1)
        if raw_hf.shape != want_raw.shape or not np.array_equal(raw_hf, want_raw):
            bad.append("blocks differ from the student's " + p.format + " bytes" +
                       (f" ({int((raw_hf != want_raw).any(-1).sum())} rows)" if raw_hf.shape == want_raw.shape else ""))
        src = "gguf.GGUFReader"
    stem = gname[: -len(".weight")]
    S = None
    if p.global_scale is not None:
        expected[stem + ".scale"] = name
        st = tensors.get(stem + ".scale")
        sv = None if st is None else np.asarray(st.data, dtype=np.float32).reshape(-1)
        if sv is None or st.tensor_type.name != "F32" or sv.size != (1 if e is None else ne[2]):
            bad.append(f"{stem}.scale missing or not F32 [{1 if e is None else ne[2]}]")
        else:
            S = np.float32(sv[e if e is not None else 0])
            if f32_bits(float(S)) != f32_bits(p.global_scale) or not np.isfinite(S):
                bad.append(f".scale={float(S):.9g} (student S={float(p.global_scale):.9g})")
    m = module_of(name)
    if mode == "w4a4" and m in student.act_formats and get_format(student.act_formats[m]).spec.global_scale:
        expected[stem + ".input_scale"] = name
        it = tensors.get(stem + ".input_scale")
        want_in = act_decode_scale(student, m)
        iv = None if it is None else np.asarray(it.data, dtype=np.float32).reshape(-1)
        if iv is None or iv.size != (1 if e is None else ne[2]):
            bad.append(f"{stem}.input_scale missing (the student is W4A4)")
        elif f32_bits(float(iv[e if e is not None else 0])) != f32_bits(want_in):
            bad.append(f".input_scale={float(iv[e if e is not None else 0]):.9g} (student {float(want_in):.9g})")
    res.ok_or_fail(name, "bytes", not bad, "; ".join(bad) if bad else f"{want_type} {where}", source=src)
    # values: gguf-py and libggml's C code decode the stored rows; transformers un-permutes
    got = gguf.quants.dequantize(raw, t.tensor_type).reshape(rows, k)
    if cdeq is not None:
        c = cdeq(raw, want_type, rows * k)
        if c is None:
            res.add(name, "weights (libggml C)", FAIL, f"libggml-python has no dequantizer for {want_type}")
        else:
            eqc = np.array_equal(c.reshape(rows, k), got) and np.isfinite(c).all()
            res.ok_or_fail(name, "weights (libggml C)", eqc, "C dequantizer == gguf-py" if eqc else
                           "libggml and gguf-py disagree (or non-finite)", source="libggml-python")
    got = np.ascontiguousarray(got)
    got_hf = unpermute(got, gname)
    got_t = torch.from_numpy(np.array(got_hf, dtype=np.float32))
    if S is not None:
        got_t = got_t * torch.tensor(float(S), dtype=torch.float32)
    want = fake_quant(student, name)
    eq, mad, n = compare_values(got_t, want)
    src = "gguf.quants.dequantize" + (" x .scale" if S is not None else "") + \
          (" + transformers un-permute" if got_hf is not got and (".attn_q." in gname or ".attn_k." in gname)
           else "")
    if eq:
        res.add(name, "weights", OK, "exact", 0.0, src)
        return got_t, False
    ulp = max_ulp(got_t, want) if nonfinite(got_t) == 0 else 1 << 30
    tol = S is not None and ulp <= 1
    res.ok_or_fail(name, "weights", tol, f"{n}/{want.numel()} elements differ by <= {ulp} fp32 ulp" +
                   (" ((code*fp8)*S as llama.cpp applies S after the matmul, vs code*(fp8*S))" if tol else ""),
                   mad, src)
    return got_t, tol


def _dense(res, gguf, tensors, label, gname, e, tt, unpermute) -> Optional[torch.Tensor]:
    t = tensors.get(gname)
    if t is None:
        res.add(label, "dense", FAIL, f"{gname} missing from the GGUF")
        return None
    if t.tensor_type.name not in ("F32", "F16", "BF16"):
        res.add(label, "dense", FAIL, f"{gname} is {t.tensor_type.name}; the student's tensor is unquantized")
        return None
    arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    if e is not None:
        arr = arr[e]
    shape = tuple(tt.shape)
    if int(np.prod(arr.shape)) != int(np.prod(shape)):
        res.add(label, "dense", FAIL, f"{gname} holds {arr.shape}, the student {shape}")
        return None
    arr = unpermute(np.ascontiguousarray(arr.reshape(shape)), gname)
    if arr is None:
        return None
    got = torch.from_numpy(np.array(arr, dtype=np.float32))
    eq, mad, n = compare_values(got, tt.float())
    res.ok_or_fail(label, "dense", eq, f"{t.tensor_type.name}" + ("" if eq else f": {n} values differ") +
                   (f"; {nonfinite(got)} NaN/Inf" if nonfinite(got) else ""), mad)
    return got


def gguf_config(reader, path: Path, names) -> Dict[str, Any]:
    """The HF config the EXPORT describes: transformers' GGUF mapping, plus the keys that mapping
    does not read taken from the file with gguf-py (qwen3 head_dim, qwen3moe expert FFN width,
    llama-architecture experts = Mixtral)."""
    parsed = dict(need("transformers.modeling_gguf_pytorch_utils").load_gguf_checkpoint(
        str(path), return_tensors=False)["config"])
    a = names.arch_name
    kl = field(reader, f"{a}.attention.key_length")
    if kl is not None:
        parsed["head_dim"] = int(kl)
    eff = field(reader, f"{a}.expert_feed_forward_length")
    if eff is not None:
        parsed["moe_intermediate_size"] = int(eff)
    if a == "llama" and field(reader, f"{a}.expert_count"):
        parsed["model_type"] = "mixtral"
        parsed["num_local_experts"] = int(field(reader, f"{a}.expert_count"))
        parsed["num_experts_per_tok"] = int(field(reader, f"{a}.expert_used_count"))
    if a == "gemma3":
        # what llama.cpp's gemma3 reads or fixes and transformers' mapping leaves at its defaults (a 256 query
        # scale, a 10000 local theta): the model the file describes, as llama.cpp runs it
        n_layer, hidden, n_head = parsed["num_hidden_layers"], parsed["hidden_size"], parsed["num_attention_heads"]
        parsed["query_pre_attn_scalar"] = gemma3_query_scalar(n_layer, hidden, n_head,
                                                              int(parsed.get("head_dim") or hidden // n_head))
        swa = field(reader, f"{a}.rope.freq_base_swa")
        full = {"rope_type": "default", "rope_theta": float(parsed.pop("rope_theta", 10000.0))}
        kind = field(reader, f"{a}.rope.scaling.type")
        if kind == "linear":   # llama.cpp scales the full-attention layers' rope only (Gemma 3 4B and up: x8)
            full.update(rope_type=kind, factor=float(field(reader, f"{a}.rope.scaling.factor")))
        parsed["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(10000.0 if swa is None else swa)}}
        parsed["layer_types"] = ["full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding_attention"
                                 for i in range(n_layer)]
        parsed["hidden_activation"] = "gelu_pytorch_tanh"
        parsed["final_logit_softcapping"] = field(reader, f"{a}.final_logit_softcapping")
    parsed.pop("_model_name_or_path", None)
    return parsed


def _transformers_logits(res, d, path, reader, student, names, prompt, decoded, tolerated, cache):
    tr = need("transformers")
    ref = student_logits(student, prompt, cache)
    gcfg = gguf_config(reader, path, names)
    has_scale = any(p.global_scale is not None for p in student.packed.values())
    moe_as_llama = names.arch_name == "llama" and any(".experts." in n for n in student.packed)
    if has_scale or moe_as_llama:
        # transformers' GGUF loader ignores NVFP4's .scale tensors and builds a dense Llama for
        # llama-architecture MoE files: rebuild from gguf-py's decode (names from gguf-py's table,
        # Q/K un-permuted by transformers) with the config the file describes
        sd = dict(decoded)
        model = model_from_state_dict(gcfg, sd)
        label = "transformers (rebuilt from gguf-py decode" + (" x .scale)" if has_scale else ")")
        src = "gguf-py + transformers"
    else:
        model = tr.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32,
                                                        config=tr.AutoConfig.for_model(**gcfg)).eval()
        label, src = "transformers GGUF loader", "transformers from_pretrained(gguf_file=), config from the file"
    why = ""
    if tolerated:
        sdb = student_weights(student)
        sdb.update(tolerated)
        ref = run_logits(model_from_state_dict(student.config, sdb), prompt)
        why = "reference: the student with the file's (code*fp8)*S weights, each within 1 fp32 ulp"
    exact_logits_check(res, label, ref, run_logits(model, prompt), src, why)
    return ref
