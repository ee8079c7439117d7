"""GGUF files for llama.cpp, written with gguf-py's GGUFWriter from already-quantized blocks.

    out_dir/model.gguf          header, KV metadata (arch, hparams, tokenizer), tensor infos, data
    out_dir/qatfactory.json     numerics record

Tensor data per packed weight ``[out, in]`` (ggml ``ne = {in, out}``; experts ``{in, out, E}``)::

    q4_k / q5_0 / q6_k / q8_0 / mxfp4_ggml / nvfp4_ggml   format.to_bytes(p): the GGUF blocks as is
    int4_lsq / int3_lsq / int2_seq / ternary_seq / ...    (formats/intgrid.py) likewise: Q4_0 / Q3_K / Q2_K /
                                                          TQ2_0 / TQ1_0 blocks
    nvfp4 (ModelOpt numerics)  -> GGML NVFP4, 36 B per 64:  [4 x UE4M3 (e4m3 & 0x7F)]
                                  [4 x 8 B: byte j = code[j] | code[j+8] << 4 inside each 16]
                                  + F32 ``<name>.scale`` = S (amax/2688; [E] for _exps), multiplied
                                  by llama.cpp after the matmul; ``<name>.input_scale`` for W4A4
    mxfp4 (OCP, any scale rule) -> GGML MXFP4, 17 B per 32: [E8M0][byte j = code[j] |
                                  code[j+16] << 4]; written only when gguf-py decodes the repacked
                                  blocks to exactly the student's values

What a format becomes is its spec's ``gguf`` record (formats/layouts.py ``GGUFLayout``): the ggml type
and the codec family its blocks come from (GGML_BLOCKS: ``to_bytes`` as they are; E2M1_E4M3_FP32 /
E2M1_E8M0: repacked as above), and the ``general.file_type`` of a file whose main type it is. The code
below branches on codec families only.

Norms, routers (ffn_gate_inp) and every 1-D tensor are F32; other dense tensors keep their dtype
(BF16/F16/F32). A quantized embedding (QuantConfig.quantize_embeddings, set by the q4_k preset) is a
packed ``token_embd`` like any other: llama.cpp looks its rows up dequantized, and a tied model ships
no ``output.weight`` (llama.cpp then multiplies by that same token_embd). tokenizer.ggml.*: gguf_vocab.py. Architecture ``llama`` (Llama, Mistral, Mixtral with _exps) permutes the rows
of q/k for llama.cpp's interleaved RoPE; rows hold whole quant blocks, so packed rows are
permuted byte-wise. qwen2/qwen3/qwen3moe use NeoX RoPE and are not permuted.

Sources: llama.cpp (commit 0c1e570 as vendored in llama-cpp-python 0.3.36) convert_hf_to_gguf.py,
conversion/llama.py, qwen.py, src/llama-model.cpp, ggml-common.h; gguf-py 0.19.0 constants.py,
gguf_writer.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import gguf
import numpy as np
import torch

from qatfactory.formats import ConvertedModel, PackedTensor, get_format
from qatfactory.formats import codecs as C
from qatfactory.formats.layouts import (
    ENGINE_FLAVOURS,
    GGUF_GLOBAL_SCALE,
    GGUF_INPUT_SCALE,
    Codec,
    GGMLType,
    GGUFLayout,
)

from . import gguf_families as FAM  # per-family names, stored values, hyperparameters, refusals
from . import kv as KV  # the cache type the student was trained for
from .base import (
    Exporter,
    ExportError,
    act_decode_scale,
    activation_mode,
    copy_source_files,
    declared_layout,
    module_of,
    register_exporter,
    spec_of,
    tied_duplicates,
    ties_embeddings,
)
from .gguf_vocab import write_tokenizer_kv

GGUF_NAME = "model.gguf"
SUPPORTED = ("q4_k, q5_0, q6_k, q8_0, mxfp4_ggml, nvfp4_ggml and the low-bit grids int4_lsq ... binary_sign "
             "(GGUF blocks as trained: Q4_0, Q3_K, Q2_K, TQ2_0, TQ1_0); nvfp4 (ModelOpt numerics, "
             "repacked to GGML NVFP4 + .scale); mxfp4/mxfp4_rceil/mxfp4_even (repacked to GGML MXFP4 when the "
             "decoded values are identical)")

# HF model_type -> (GGUF architecture, permute q/k rows, the family's usual llama.cpp pre-tokenizer:
# written only when the tokenizer's own pre_tokenizer is not recognised, see gguf_vocab.py)
ARCHS = {
    "llama": ("llama", True, "llama-bpe"),
    "mistral": ("llama", True, "llama-bpe"),
    "mixtral": ("llama", True, "llama-bpe"),
    "qwen2": ("qwen2", False, "qwen2"),
    "qwen3": ("qwen3", False, "qwen2"),
    "qwen3_moe": ("qwen3moe", False, "qwen2"),
    "gemma3_text": ("gemma3", False, "default"),
}

_LAYER_MAP = [
    (r"input_layernorm\.weight", "attn_norm.weight"),
    (r"post_attention_layernorm\.weight", "ffn_norm.weight"),
    (r"self_attn\.q_proj\.(weight|bias)", r"attn_q.\1"),
    (r"self_attn\.k_proj\.(weight|bias)", r"attn_k.\1"),
    (r"self_attn\.v_proj\.(weight|bias)", r"attn_v.\1"),
    (r"self_attn\.o_proj\.(weight|bias)", r"attn_output.\1"),
    (r"self_attn\.q_norm\.weight", "attn_q_norm.weight"),
    (r"self_attn\.k_norm\.weight", "attn_k_norm.weight"),
    (r"mlp\.gate_proj\.weight", "ffn_gate.weight"),
    (r"mlp\.up_proj\.weight", "ffn_up.weight"),
    (r"mlp\.down_proj\.weight", "ffn_down.weight"),
    (r"(?:mlp|block_sparse_moe)\.gate\.weight", "ffn_gate_inp.weight"),
    (r"mlp\.shared_expert\.gate_proj\.weight", "ffn_gate_shexp.weight"),
    (r"mlp\.shared_expert\.up_proj\.weight", "ffn_up_shexp.weight"),
    (r"mlp\.shared_expert\.down_proj\.weight", "ffn_down_shexp.weight"),
    (r"mlp\.shared_expert_gate\.weight", "ffn_gate_inp_shexp.weight"),
]
_EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str, model_type: Optional[str] = None) -> Tuple[str, Optional[int]]:
    """(GGUF tensor name, expert index or None) for an HF on-disk name; ExportError if unknown."""
    if hf_name in _TOP:
        return _TOP[hf_name], None
    m = _EXPERT_RE.match(hf_name)
    if m:
        proj = m.group(3)
        if proj not in _EXPERT_PROJ:
            raise ExportError(f"{hf_name}: unknown expert projection {proj!r}")
        return f"blk.{m.group(1)}.{_EXPERT_PROJ[proj]}.weight", int(m.group(2))
    m = _LAYER_RE.match(hf_name)
    if m:
        for pat, rep in FAM.layer_names(model_type) + _LAYER_MAP:
            if re.fullmatch(pat, m.group(2)):
                return f"blk.{m.group(1)}." + re.sub(pat, rep, m.group(2)), None
    raise ExportError(f"{hf_name}: no GGUF tensor name known for it (llama/qwen2/qwen3/qwen3moe/mixtral/gemma3 "
                      f"layouts)")


def permute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved order, per head; works on float rows
    and on rows of quant blocks alike (rows move whole)."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise ExportError(f"q/k rows={rows} not divisible by 2*n_head={2 * n_head}")
    return a.reshape(n_head, 2, rows // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    rows = a.shape[0]
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


# ------------------------------------------------------------------------------ repacking
def nvfp4_to_ggml_blocks(p: PackedTensor) -> np.ndarray:
    """Pairs-packed E2M1 + E4M3 [rows, K/16] -> GGML NVFP4 blocks uint8 [rows, K/64*36]."""
    codes = C.unpack_pairs_np(p.codes.cpu().numpy())           # [rows, K]
    rows, k = codes.shape
    if k % 64:
        raise ExportError(f"NVFP4 row length {k} is not a multiple of 64 (the GGML NVFP4 block); llama.cpp "
                          f"cannot hold this tensor as NVFP4 (keep in_features % 64 == 0, or use another format)")
    sub = codes.reshape(rows, k // 64, 4, 16)
    qs = (sub[..., :8] & 0xF) | ((sub[..., 8:] & 0xF) << 4)      # [rows, nb, 4, 8]
    sc = p.scales.cpu().numpy().reshape(rows, k // 64, 4) & 0x7F  # UE4M3: the sign bit dropped
    return np.concatenate([sc, qs.reshape(rows, k // 64, 32)], axis=-1).reshape(rows, -1).astype(np.uint8)


def mxfp4_to_ggml_blocks(p: PackedTensor) -> np.ndarray:
    codes = C.unpack_pairs_np(p.codes.cpu().numpy())
    rows, k = codes.shape
    blk = codes.reshape(rows, k // 32, 32)
    qs = (blk[..., :16] & 0xF) | ((blk[..., 16:] & 0xF) << 4)
    e = p.scales.cpu().numpy().reshape(rows, k // 32, 1)
    return np.concatenate([e, qs], axis=-1).reshape(rows, -1).astype(np.uint8)


def _decode_ggml(blocks: np.ndarray, ggml_type: GGMLType, k: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks, ggml_type).reshape(blocks.shape[0], k)


# the repacks of the pairs codecs into ggml blocks: (codec family, ggml type) -> repacker
_REPACK = {(Codec.E2M1_E4M3_FP32, GGMLType.NVFP4): nvfp4_to_ggml_blocks,
           (Codec.E2M1_E8M0, GGMLType.MXFP4): mxfp4_to_ggml_blocks}


def _layout(name: str, p: PackedTensor) -> GGUFLayout:
    spec = spec_of(p)
    if spec.role == "activation":
        raise NotImplementedError(f"llama_cpp exporter does not support format {p.format!r} ({name}): an activation "
                                  f"format is no weight layout; supported: {SUPPORTED}")
    lay = declared_layout(spec, "gguf", "llama_cpp", name, SUPPORTED)
    if lay.codec is not Codec.GGML_BLOCKS and (lay.codec, lay.ggml_type) not in _REPACK:
        raise ExportError(f"{name}: format {p.format!r} declares GGUF type {lay.ggml_type.name} from codec "
                          f"{lay.codec.name}; no repack of that codec into that type exists "
                          f"({sorted((c.name, t.name) for c, t in _REPACK)})")
    return lay


def gguf_layout(name: str, p: PackedTensor) -> Tuple[int, int, Optional[float]]:
    """(ggml type, bytes per row, per-tensor scale or None) of a packed tensor, without producing
    its bytes; raises every refusal that needs no decoding."""
    spec = spec_of(p)
    k = p.shape[-1]
    if len(p.shape) != 2:
        raise ExportError(f"{name}: packed tensors must be 2-D [out, in] (experts per expert), got {p.shape}")
    lay = _layout(name, p)
    gt = lay.ggml_type
    if lay.codec is Codec.GGML_BLOCKS:
        gs = None if p.global_scale is None else float(torch.as_tensor(p.global_scale, dtype=torch.float32))
        return int(gt), k // spec.super_block * spec.bytes_per_block, gs
    blk, blk_bytes = gguf.GGML_QUANT_SIZES[gt]
    if lay.codec is Codec.E2M1_E4M3_FP32:
        if k % blk:
            raise ExportError(f"{name}: NVFP4 row length {k} is not a multiple of {blk} (the GGML NVFP4 block); "
                              f"llama.cpp cannot hold this tensor as NVFP4 (keep in_features % {blk} == 0, or use "
                              f"another format)")
        sc = p.scales
        # GGML reads the scale byte as UE4M3: no sign bit, and 0x7F decodes to 0 instead of NaN
        if bool(((sc & 0x80) != 0).any()) or bool(((sc & 0x7F) == 0x7F).any()):
            raise ExportError(f"{name}: NVFP4 block scales with the sign bit set or NaN (0x7F), which GGML NVFP4 "
                              f"decodes differently; the student's values cannot be stored in GGUF bit-exactly")
        return int(gt), k // blk * blk_bytes, float(torch.as_tensor(p.global_scale, dtype=torch.float32))
    # Codec.E2M1_E8M0
    if k % blk:
        raise ExportError(f"{name}: MXFP4 row length {k} is not a multiple of {blk}")
    return int(gt), k // blk * blk_bytes, None


def packed_to_gguf(name: str, p: PackedTensor) -> Tuple[np.ndarray, int, Optional[float]]:
    """(uint8 [rows, bytes_per_row], ggml type, per-tensor scale or None) for one 2-D packed tensor."""
    gt, bpr, gs = gguf_layout(name, p)
    lay = spec_of(p).gguf
    k = p.shape[-1]
    if lay.codec is Codec.GGML_BLOCKS:
        raw = np.ascontiguousarray(get_format(p.format).to_bytes(p), dtype=np.uint8).reshape(p.shape[0], -1)
    else:
        raw = _REPACK[(lay.codec, lay.ggml_type)](p)
    if lay.codec is Codec.E2M1_E8M0:
        # the brief's rule for OCP MXFP4: written only when ggml decodes exactly the student's values
        got = _decode_ggml(raw, lay.ggml_type, k)
        want = get_format(p.format).dequantize(p).float().numpy().reshape(p.shape[0], k)
        if not np.array_equal(got, want):
            bad = int((got != want).sum())
            raise ExportError(
                f"{name}: format {p.format!r} repacked into GGML MXFP4 blocks decodes to different values in "
                f"{bad} elements (e.g. NaN E8M0 scales, which ggml has no encoding for); refusing. Train with "
                f"mxfp4_ggml for llama.cpp, or export to vLLM/SGLang with compressed-tensors.")
    if raw.shape != (p.shape[0], bpr):
        raise ExportError(f"{name}: {p.format} bytes have shape {raw.shape}, expected {(p.shape[0], bpr)}")
    return raw, gt, gs


# ------------------------------------------------------------------------------ exporter
def _rope(cfg: Dict[str, Any]) -> Dict[str, Any]:
    rp = FAM.rope_by_layer_type(cfg, "full_attention")   # the global layers' (Gemma 3 nests them by type)
    rs = cfg.get("rope_scaling") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    return {"theta": float(theta), "type": kind, "factor": rp.get("factor", rs.get("factor")),
            "original": rp.get("original_max_position_embeddings", rs.get("original_max_position_embeddings"))}


@register_exporter("llama_cpp")
class LlamaCppExporter(Exporter):
    flavours = ENGINE_FLAVOURS["llama_cpp"]

    def check(self, converted: ConvertedModel, flavour: str, **options) -> None:
        mt = converted.config.get("model_type")
        if mt not in ARCHS:
            raise NotImplementedError(f"llama_cpp exporter: model_type {mt!r} is not supported; supported: "
                                      f"{sorted(ARCHS)}")
        rope = _rope(converted.config)
        if rope["type"] not in ("default", "linear", "yarn"):
            raise NotImplementedError(f"llama_cpp exporter: rope type {rope['type']!r} is not supported "
                                      f"(default, linear, yarn)")
        bad = FAM.problems(converted.config)
        if bad:
            raise NotImplementedError(f"llama_cpp exporter: {mt} student that llama.cpp would run differently: "
                                      + "; ".join(bad))
        for name in list(converted.packed) + list(converted.dense):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if not _FUSED_EXPERT_RE.match(name):
                gguf_name(name, mt)
        scaled = []
        for name, p in converted.packed.items():  # refuse before anything is written
            if gguf_layout(name, p)[2] is not None:
                scaled.append(name)
        why = FAM.scale_problem(mt, sorted(scaled))
        if why:
            raise NotImplementedError(f"llama_cpp exporter: {why}")
        activation_mode(converted)
        tied_duplicates(converted)
        KV.check_kv(converted, "llama_cpp", flavour)   # a llama.cpp cache type, or none

    def write(self, converted: ConvertedModel, out: Path, flavour: str, dense_dtype: str = "auto",
              tokenizer_pre: Optional[str] = None, **options):
        cfg = converted.config
        mt = cfg["model_type"]
        arch, permute, pre_name = ARCHS[mt]
        n_head = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_head)
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // n_head)
        mode = activation_mode(converted)

        path = out / GGUF_NAME
        w = gguf.GGUFWriter(str(path), arch)
        w.add_name(str(cfg.get("_name_or_path") or mt).split("/")[-1] or mt)
        w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
        w.add_embedding_length(hidden)
        w.add_block_count(int(cfg["num_hidden_layers"]))
        if cfg.get("intermediate_size"):
            w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(n_head)
        w.add_head_count_kv(n_kv)
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        rope = _rope(cfg)
        w.add_rope_freq_base(rope["theta"])
        w.add_rope_dimension_count(head_dim)
        if head_dim != hidden // n_head or arch in ("qwen3", "qwen3moe", "gemma3"):
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if rope["type"] in ("linear", "yarn"):
            kind = gguf.RopeScalingType.LINEAR if rope["type"] == "linear" else gguf.RopeScalingType.YARN
            w.add_rope_scaling_type(kind)
            w.add_rope_scaling_factor(float(rope["factor"]))
            if rope["original"]:
                w.add_rope_scaling_orig_ctx_len(int(rope["original"]))
        for key, val in FAM.metadata(cfg).items():
            (w.add_float32 if isinstance(val, float) else w.add_uint32)(f"{arch}.{key}", val)
        vocab_size = int(cfg["vocab_size"])
        w.add_vocab_size(vocab_size)
        n_exp = cfg.get("num_experts") or cfg.get("num_local_experts")
        if n_exp:
            w.add_expert_count(int(n_exp))
            w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
            if cfg.get("moe_intermediate_size"):
                w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        tok_info = write_tokenizer_kv(w, converted.source_dir, cfg, pre_name, vocab_size, tokenizer_pre)

        # ---- a plan of every tensor: shapes and types now, bytes produced one tensor at a time
        # while writing, so peak memory is one tensor (not a second copy of the model)
        plan: Dict[str, _Planned] = {}
        experts: Dict[str, Dict[int, Tuple[str, Any]]] = {}
        type_counts: Dict[int, int] = {}
        file_types: Dict[int, Any] = {}     # ggml type -> the general.file_type its formats declare

        def q_or_k_heads(gname: str) -> Optional[int]:
            if not permute:
                return None
            if ".attn_q." in gname:
                return n_head
            if ".attn_k." in gname:
                return n_kv
            return None

        def packed_rows(name: str, p: PackedTensor, nh: Optional[int]) -> np.ndarray:
            raw = packed_to_gguf(name, p)[0]
            return permute_rows(raw, nh) if nh else raw

        def f32(vals) -> _Planned:
            arr = np.array(vals, dtype=np.float32)
            return _Planned(arr.shape, np.float32, None, lambda: arr)

        def act_scale(m: str) -> float:
            return float(act_decode_scale(converted.act_formats[m], converted.input_amax[m]))

        for name, p in sorted(converted.packed.items()):
            gname, e = gguf_name(name, mt)
            gt, bpr, gs = gguf_layout(name, p)
            type_counts[gt] = type_counts.get(gt, 0) + 1
            file_types.setdefault(gt, spec_of(p).gguf.file_type)
            if e is not None:
                experts.setdefault(gname, {})[e] = ("packed", (name, p, gt, bpr, gs))
                continue
            nh = q_or_k_heads(gname)
            plan[gname] = _Planned((p.shape[0], bpr), np.uint8, gt,
                                   lambda name=name, p=p, nh=nh: packed_rows(name, p, nh))
            stem = gname[: -len(".weight")]
            if gs is not None:
                plan[stem + GGUF_GLOBAL_SCALE] = f32([gs])
            m = module_of(name)
            if mode == "w4a4" and m in converted.input_amax:
                plan[stem + GGUF_INPUT_SCALE] = f32([act_scale(m)])

        # tied lm_head: no output.weight, llama.cpp then reuses token_embd (as transformers' GGUF
        # loader infers tie_word_embeddings from the absence of output.weight)
        skip = set(tied_duplicates(converted))
        for name, t in sorted(converted.dense.items()):
            if name.endswith("rotary_emb.inv_freq") or name in skip:
                continue
            m = _FUSED_EXPERT_RE.match(name)
            if m:  # transformers-5 fused 3-D experts kept dense: split back per projection
                layer = m.group(1)
                if m.group(2) == "gate_up_proj":  # [E, 2I, H] = cat(gate, up) along dim 1
                    half = t.shape[1] // 2
                    plan[f"blk.{layer}.ffn_gate_exps.weight"] = _dense_plan(t[:, :half], dense_dtype, False)
                    plan[f"blk.{layer}.ffn_up_exps.weight"] = _dense_plan(t[:, half:], dense_dtype, False)
                else:
                    plan[f"blk.{layer}.ffn_down_exps.weight"] = _dense_plan(t, dense_dtype, False)
                continue
            gname, e = gguf_name(name, mt)
            force32 = t.ndim == 1 or gname.endswith("_norm.weight") or ".ffn_gate_inp" in gname
            shift = FAM.norm_shift(mt, name)
            if shift:
                # (1 + w) in fp32, as Gemma's RMSNorm computes it: llama.cpp multiplies by the stored value
                t = t.float() + shift
            if e is not None:
                experts.setdefault(gname, {})[e] = ("dense", t)
                continue
            plan[gname] = _dense_plan(t, dense_dtype, force32, q_or_k_heads(gname))

        for gname, per in experts.items():
            ids = sorted(per)
            if ids != list(range(len(ids))):
                raise ExportError(f"{gname}: experts {ids} are not 0..{len(ids) - 1}")
            kinds = {per[i][0] for i in ids}
            if kinds != {"packed"}:
                if kinds != {"dense"}:
                    raise ExportError(f"{gname}: some experts are quantized and some are not; a stacked GGUF "
                                      f"expert tensor has one type")
                plan[gname] = _dense_plan(torch.stack([per[i][1] for i in ids]), dense_dtype, False)
                continue
            items = [per[i][1] for i in ids]  # (name, p, gt, bpr, gs)
            if len({(it[2], it[3], tuple(it[1].shape)) for it in items}) != 1:
                raise ExportError(f"{gname}: experts use different formats or shapes; a stacked GGUF expert tensor "
                                  f"has one type")
            _, p0, gt, bpr, _ = items[0]
            plan[gname] = _Planned((len(items), p0.shape[0], bpr), np.uint8, gt,
                                   lambda items=items: np.stack([packed_to_gguf(it[0], it[1])[0] for it in items]))
            stem = gname[: -len(".weight")]
            gss = [it[4] for it in items]
            if any(g is not None for g in gss):
                plan[stem + GGUF_GLOBAL_SCALE] = f32(gss)
            if mode == "w4a4" and all(module_of(it[0]) in converted.input_amax for it in items):
                # one per expert: llama.cpp checks the shape [n_expert] (as for .scale)
                plan[stem + GGUF_INPUT_SCALE] = f32([act_scale(module_of(it[0])) for it in items])

        if type_counts:
            main = max(type_counts, key=type_counts.get)
            ft = file_types[main]
            if ft is not None:
                w.add_file_type(int(ft))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

        order = sorted(plan, key=_tensor_order)
        for gname in order:
            pl = plan[gname]
            nbytes = int(np.prod(pl.shape)) * np.dtype(pl.dtype).itemsize
            w.add_tensor_info(gname, pl.shape, np.dtype(pl.dtype), nbytes,
                              raw_dtype=None if pl.raw is None else gguf.GGMLQuantizationType(pl.raw))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for gname in order:
            pl = plan[gname]
            arr = np.ascontiguousarray(pl.make())
            if arr.shape != tuple(pl.shape) or arr.dtype != np.dtype(pl.dtype):
                raise ExportError(f"{gname}: produced {arr.dtype} {arr.shape}, planned {np.dtype(pl.dtype)} {pl.shape}")
            w.write_tensor_data(arr)
        w.close()
        files = [GGUF_NAME] + copy_source_files(converted.source_dir, out)
        extra = {"gguf_file": GGUF_NAME, "architecture": arch, "qk_permuted": permute, "tokenizer": tok_info,
                 "ggml_types": {gguf.GGMLQuantizationType(k).name: v for k, v in sorted(type_counts.items())},
                 "mode": mode, "tied_embeddings": ties_embeddings(converted)}
        extra.update(KV.kv_record(converted, "llama_cpp"))   # the cache type and its flags
        return files, extra


@dataclass
class _Planned:
    shape: Tuple[int, ...]
    dtype: Any                  # numpy dtype of the bytes written (uint8 for raw ggml types)
    raw: Optional[int]          # ggml type for raw bytes, None when the numpy dtype decides
    make: Callable[[], np.ndarray]


def _dense_plan(t: torch.Tensor, dense_dtype: str, force_f32: bool, heads: Optional[int] = None) -> _Planned:
    """F32 / F16 numpy, or BF16 written as raw bytes (numpy has no bfloat16)."""
    if dense_dtype not in ("auto", "f32", "f16", "bf16"):
        raise ValueError(f"dense_dtype={dense_dtype!r}; allowed: 'auto', 'f32', 'f16', 'bf16'")
    shape = tuple(t.shape)
    _exact_cast(t, dense_dtype, force_f32)

    def make():
        a = _to_numpy(t, dense_dtype, force_f32)
        if heads:
            a = permute_rows(a, heads)
        if a.dtype == np.uint16:
            a = a.view(np.uint8).reshape(*a.shape[:-1], a.shape[-1] * 2)
        return a

    if force_f32 or dense_dtype == "f32" or (dense_dtype == "auto" and t.dtype == torch.float32):
        return _Planned(shape, np.float32, None, make)
    if dense_dtype == "f16" or (dense_dtype == "auto" and t.dtype == torch.float16):
        return _Planned(shape, np.float16, None, make)
    return _Planned(shape[:-1] + (shape[-1] * 2,), np.uint8, int(gguf.GGMLQuantizationType.BF16), make)


def _exact_cast(t: torch.Tensor, dense_dtype: str, force_f32: bool) -> None:
    """A dense tensor is written in another dtype only where every value survives the cast: the engine
    must run the student's values (an f16 GGUF of a bf16 student rounds them and the gate would FAIL it)."""
    want = torch.float32 if force_f32 or dense_dtype == "f32" else torch.float16 if dense_dtype == "f16" else \
        torch.bfloat16 if dense_dtype == "bf16" else None
    if want is None or want == t.dtype or (want == torch.float32 and t.dtype in (torch.bfloat16, torch.float16)):
        return
    x = t.detach().cpu()
    back = x.to(want).to(x.dtype)
    changed = int((~((back == x) | (back.isnan() & x.isnan()))).sum())
    if changed:
        raise ExportError(f"dense_dtype={dense_dtype!r}: {changed} of {x.numel()} values of a {tuple(x.shape)} "
                          f"{str(x.dtype).replace('torch.', '')} tensor change in the cast, so llama.cpp would not "
                          f"run what the student trained; use dense_dtype='auto' (the student's own dtype) or 'f32'")


def _tensor_order(name: str):
    m = re.match(r"blk\.(\d+)\.", name)
    return (1, int(m.group(1)), name) if m else (0 if name.startswith("token_embd") else 2, 0, name)


def _to_numpy(t: torch.Tensor, dense_dtype: str, force_f32: bool) -> np.ndarray:
    """float32 / float16 numpy, or bf16 bits as uint16 (written with raw type BF16)."""
    if dense_dtype not in ("auto", "f32", "f16", "bf16"):
        raise ValueError(f"dense_dtype={dense_dtype!r}; allowed: 'auto', 'f32', 'f16', 'bf16'")
    t = t.detach().cpu()
    if force_f32 or dense_dtype == "f32" or (dense_dtype == "auto" and t.dtype == torch.float32):
        return t.float().numpy()
    if dense_dtype == "f16" or (dense_dtype == "auto" and t.dtype == torch.float16):
        return t.half().numpy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
