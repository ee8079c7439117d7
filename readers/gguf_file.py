"""GGUF files (llama.cpp) read back as PackedTensors, with gguf-py's own ``GGUFReader`` and its HF <-> GGUF
tensor-name table; Q/K rows of architectures llama.cpp permutes are un-permuted to the HF order.

What is matched comes from the format spec (readers/layouts.py): the ggml types a frozen-code codec family is
repacked into (its read-as format's ``GGUFLayout``), the format whose own bytes are those blocks (decoding
them), the F32 per-tensor scale beside them (``formats.layouts.GGUF_GLOBAL_SCALE``) and the dense types
(``GGUF_DENSE_TYPES``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import gguf
import numpy as np
import torch

from qatfactory.exitcodes import CorruptFileError
from qatfactory.formats import PackedTensor, get_format
from qatfactory.formats import layouts as L

from . import layouts as R
from .base import (
    NativeCheckpoint,
    NotNativeError,
    check_claimed_sizes,
    check_hf_config,
    export_record,
    inside,
)

# GGUF architectures: (gguf-py MODEL_ARCH member, llama.cpp permutes Q/K rows)
GGUF_ARCH = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


def unpermute(a: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's interleaved Q/K row order -> the HF rotate-half order (rows move whole)."""
    r = a.shape[0]
    return a.reshape(n_head, r // n_head // 2, 2, *a.shape[1:]).transpose(1, 2).reshape(a.shape)


def permute(a: torch.Tensor, n_head: int) -> torch.Tensor:
    """The HF rotate-half row order -> llama.cpp's interleaved order."""
    r = a.shape[0]
    return a.reshape(n_head, 2, r // n_head // 2, *a.shape[1:]).transpose(1, 2).reshape(a.shape)


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def name_map(reader, n_layers: int):
    """(gguf-py's HF -> GGUF tensor-name map, Q/K rows permuted) of a file's architecture."""
    arch_key, perm = GGUF_ARCH[field(reader, "general.architecture")]
    return gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_key), n_layers), perm


def _gguf_config(reader, file: Path) -> Dict[str, Any]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415 (heavy: transformers)
    try:
        cfg = dict(load_gguf_checkpoint(str(file), return_tensors=False)["config"])
    except Exception as e:
        raise NotNativeError(f"{file}: transformers cannot read its model config ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    arch = field(reader, "general.architecture")
    kl = field(reader, f"{arch}.attention.key_length")
    if kl is not None:
        cfg["head_dim"] = int(kl)
    cfg.pop("_model_name_or_path", None)
    cfg["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    return cfg


def read_gguf(d: Path, name: str) -> NativeCheckpoint:
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
    file = inside(d, name, "GGUF file")
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:
        raise CorruptFileError(f"{file}: gguf-py cannot read it ({type(e).__name__}: {e})") from None
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCH:
        raise NotNativeError(f"{file}: architecture {arch!r}; scale adapters read {sorted(GGUF_ARCH)} GGUF files "
                             f"(MoE architectures are not implemented)")
    cfg = _gguf_config(reader, file)
    check_hf_config(file, cfg)
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    check_claimed_sizes(file, cfg, [t.name for t in reader.tensors], r"^blk\.(\d+)\.",
                        (int(emb.shape[1]), int(emb.shape[0])) if emb is not None and len(emb.shape) == 2 else None)
    tmap, perm = name_map(reader, int(cfg["num_hidden_layers"]))
    mt = cfg.pop("model_type")
    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg))
    cfg["model_type"] = mt
    shapes = {k: tuple(v.shape) for k, v in skel.state_dict().items()}
    tensors = {t.name: t for t in reader.tensors}
    n_head, n_kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    frozen = R.by_ggml_type()
    packed: Dict[str, PackedTensor] = {}
    codecs = {}
    dense: Dict[str, torch.Tensor] = {}
    used = set()
    for hf, shape in shapes.items():
        stem, suf = (hf[: -len(".weight")], ".weight") if hf.endswith(".weight") else \
            (hf[: -len(".bias")], ".bias") if hf.endswith(".bias") else (hf, "")
        gname = tmap.get_name(stem)
        if gname is None:
            raise NotNativeError(f"{file}: gguf-py has no GGUF name for {hf}")
        t = tensors.get(gname + suf)
        if t is None:
            if hf == "lm_head.weight" and cfg["tie_word_embeddings"]:
                continue
            raise CorruptFileError(f"{file}: tensor {gname + suf} (for {hf}) is missing")
        used.add(t.name)
        heads = (n_head if ".attn_q." in t.name else n_kv if ".attn_k." in t.name else None) if perm else None
        gt = L.GGMLType(t.tensor_type)
        r = frozen.get(gt)
        if r is not None:
            rows, k = shape
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))
            if heads:
                raw = unpermute(raw, heads)
            p = get_format(r.ggml_blocks_format).from_bytes(raw.numpy(), k)
            if r.has_global_scale and gname + L.GGUF_GLOBAL_SCALE in tensors:
                st = tensors[gname + L.GGUF_GLOBAL_SCALE]
                used.add(st.name)
                sv = np.asarray(st.data, dtype=np.float32).reshape(-1)
                if st.tensor_type != L.GGMLType.F32 or sv.size != 1 or not np.isfinite(sv[0]) or sv[0] <= 0:
                    raise CorruptFileError(f"{file}: {st.name} is not one positive finite F32")
                p = PackedTensor(r.read_as, p.shape, p.codes, p.scales, torch.tensor(float(sv[0]), dtype=torch.float32))
            packed[hf] = p
            codecs[hf] = r
        elif gt in L.GGUF_DENSE_TYPES:
            arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
            v = torch.from_numpy(np.array(arr, dtype=np.float32)).to(getattr(torch, L.GGUF_DENSE_TYPES[gt]))
            dense[hf] = unpermute(v, heads) if heads else v
        else:
            allowed = _or_types(frozen)
            raise NotNativeError(f"{file}: {t.name} is {gt.name}; scale adapters need {allowed} linears (one scale "
                                 f"byte per block over frozen E2M1 codes), not a {gt.name} layout")
    extra = sorted(set(tensors) - used)
    if extra:
        raise NotNativeError(f"{file}: tensors this loader does not map: {extra[:4]}")
    if not packed:
        raise NotNativeError(f"{file}: no {'/'.join(t.name for t in frozen)} tensors")
    fmts = {p.format for p in packed.values()}
    if len(fmts) != 1:
        raise NotNativeError(f"{file}: mixes {sorted(fmts)} tensors; one layout per checkpoint")
    base = fmts.pop()
    label = next(iter(codecs.values())).label
    return NativeCheckpoint(d, L.GGUF_FLAVOUR, label, base, cfg, packed, dense, [name], gguf_file=name,
                            record=export_record(d))


def _or_types(frozen) -> str:
    return " or ".join(t.name for t in frozen)
