"""convert: a prepared model -> ConvertedModel (packed tensors by on-disk HF name); the ZeRO-3 hook."""
from __future__ import annotations

import bisect
import os
from typing import Any, Dict, List

import torch
from torch import nn

from ..formats import ConvertedModel
from ..nn import kv_cache as KV  # the KV cache in the loop (nn/kv_cache.py)
from ..nn.embedding import QuantEmbedding
from ..nn.experts import (
    QuantExpertsMixin,
)
from ..nn.linear import QuantLinear
from .config import QuantConfig
from .coverage import coverage
from .modules import (
    _QUANT_MODULES,
    _is_quant_site,
    _quant_embeddings,
    _quant_experts,
    _quant_linears,
)


def _hf_tensors(model):
    """name -> (tensor, module, param_name) for every tensor a plain HF save would write
    (quantizer/LoRA state left out; tied duplicates written once)."""
    out = {}
    seen = set()
    skip = set()
    for n, m in model.named_modules():
        if isinstance(m, _QUANT_MODULES):
            for cn, c in m.named_modules():
                if cn:
                    skip.add(id(c))
        elif isinstance(m, KV.KVCacheQuantizer):   # its amax reaches the exporters as ConvertedModel.kv_cache
            skip.add(id(m))
    for n, m in model.named_modules():
        if id(m) in skip:
            continue
        for pn, p in m.named_parameters(recurse=False):
            # a tied head is the embedding's tensor: written once, as the embedding
            quant_site = _is_quant_site(m, pn) and not (isinstance(m, QuantLinear) and m.tied_to is not None)
            if id(p) in seen and not quant_site:
                continue
            seen.add(id(p))
            out[f"{n}.{pn}" if n else pn] = (p, m, pn)
        for bn, b in m.named_buffers(recurse=False):
            if b is None or bn in m._non_persistent_buffers_set:
                continue
            out[f"{n}.{bn}" if n else bn] = (b, m, bn)
    return out


def disk_layout(model) -> Dict[str, Any]:
    """On-disk HF name -> (in-memory name, expert index or None, row range or None).

    Found by running transformers' own save-time conversion (revert_weight_conversion, which
    splits fused 3-D experts and renames, e.g. Mixtral's mlp.experts -> block_sparse_moe.experts.E.w1)
    over index tensors, so the layout follows the installed transformers exactly."""
    tensors = _hf_tensors(model)
    idx, starts, names = {}, [], []
    off = 0
    for name, (t, _, _) in tensors.items():
        idx[name] = torch.arange(off, off + t.numel(), dtype=torch.int64).reshape(t.shape)
        starts.append(off)
        names.append(name)
        off += t.numel()
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415 (heavy: transformers)
        reverted = revert_weight_conversion(model, dict(idx))
    except ImportError:  # older transformers: what is in memory is what is on disk
        reverted = dict(idx)
    layout = {}
    for key, v in reverted.items():
        if v.numel() == 0:
            continue
        first = int(v.reshape(-1)[0])
        src = names[bisect.bisect_right(starts, first) - 1]
        st = idx[src]
        local = v - st.reshape(-1)[0]
        if tuple(v.shape) == tuple(st.shape) and torch.equal(v, st):
            layout[key] = (src, None, None)
            continue
        if st.ndim == 3 and v.ndim == 2:
            E, R, K = st.shape
            f = int(local[0, 0])
            e, r0 = f // (R * K), (f % (R * K)) // K
            r1 = r0 + v.shape[0]
            if f % K == 0 and v.shape[1] == K and r1 <= R and torch.equal(v, st[e, r0:r1]):
                layout[key] = (src, e, (r0, r1))
                continue
        raise NotImplementedError(f"convert: on-disk tensor {key} {tuple(v.shape)} is not {src} or a row range of "
                                  f"one of its experts; this model's save-time conversion is not supported")
    return layout


def _module_of(key: str) -> str:
    return key[:-len(".weight")] if key.endswith(".weight") else key


def convert(model: nn.Module):
    """The prepared (trained) model as plain data for the exporters: ``ConvertedModel``.

    Packed tensors by on-disk HF name (experts split per expert), each quantized exactly as the
    forward fake-quantized it (same amax, same scale bytes, LoRA merged first); every other
    tensor in the model dtype."""
    cfg: QuantConfig = getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("convert: the model is not prepared; call qatfactory.quantize.prepare(model, cfg) first")
    rep = coverage(model).raise_if_errors()
    tensors = _hf_tensors(model)
    layout = disk_layout(model)
    packed, dense, input_amax, act_formats, resolved = {}, {}, {}, {}, {}
    disk_of: Dict[str, List[Any]] = {}
    for key, (src, e, rows) in layout.items():
        t, mod, pn = tensors[src]
        disk_of.setdefault(src, []).append((key, e, rows))
        if isinstance(mod, QuantLinear) and pn == "weight":
            r0, r1 = rows if rows is not None else (0, mod.out_features)
            packed[key] = mod.pack(r0, r1)
            aq = mod.input_quant
        elif isinstance(mod, QuantEmbedding) and pn == "weight":
            r0, r1 = rows if rows is not None else (0, mod.num_embeddings)
            packed[key] = mod.pack(r0, r1)
            aq = None
        elif isinstance(mod, QuantExpertsMixin) and pn in ("gate_up_proj", "down_proj"):
            if e is None:
                raise NotImplementedError(f"convert: {src} is written fused on disk as {key}; engines expect "
                                          f"per-expert 2-D tensors")
            packed[key] = mod.pack(pn, e, rows[0], rows[1])
            aq = mod.gate_up_input_quant if pn == "gate_up_proj" else mod.down_input_quant
        else:
            d = t.detach()
            if e is not None:
                d = d[e, rows[0]:rows[1]]
            dense[key] = d.clone()
            continue
        mname = _module_of(key)
        resolved[mname] = {"weight": packed[key].format, "act": aq.fmt_name if aq is not None else None}
        if aq is not None:
            act_formats[mname] = aq.fmt_name
            if aq.static:
                input_amax[mname] = aq.amax.detach().clone().float()
    # every quantized row must have been packed exactly once
    for name, m in _quant_linears(model) + _quant_experts(model) + _quant_embeddings(model):
        if isinstance(m, QuantLinear) and m.tied_to is not None:
            continue   # packed as the embedding
        for pn in (("weight",) if isinstance(m, (QuantLinear, QuantEmbedding)) else ("gate_up_proj", "down_proj")):
            src = f"{name}.{pn}"
            t = tensors[src][0]
            covered = sum((r[1] - r[0]) if r else (t.shape[0] if t.ndim == 2 else t.shape[0] * t.shape[1])
                          for _, _, r in disk_of.get(src, []))
            want = t.shape[0] if t.ndim == 2 else t.shape[0] * t.shape[1]
            if covered != want:
                raise RuntimeError(f"convert: {src} has {want} rows but the on-disk layout covers {covered}")
    groups = []
    for name, m in _quant_linears(model):
        if len(m._group) > 1 and m is m._group[0]:
            groups.append([_module_of(k) for g in m._group for k, _, _ in disk_of[g.qname + ".weight"]])
    for name, m in _quant_experts(model):
        per_e: Dict[int, List[str]] = {}
        for k, e, _ in disk_of[f"{name}.gate_up_proj"]:
            per_e.setdefault(e, []).append(_module_of(k))
        groups.extend(v for _, v in sorted(per_e.items()) if len(v) > 1)
    config = model.config.to_dict() if hasattr(model, "config") else {}
    src_dir = getattr(getattr(model, "config", None), "_name_or_path", None)
    quant = cfg.to_dict()
    quant["resolved"] = resolved
    # plain data on the CPU whatever device trained the model: the exporters write from it and the
    # gate compares it with tensors read back from disk (a CUDA student failed its own gate: device mismatch)
    packed = {k: v.to("cpu") for k, v in packed.items()}
    dense = {k: v.cpu() for k, v in dense.items()}
    input_amax = {k: v.cpu() for k, v in input_amax.items()}
    return ConvertedModel(packed=packed, dense=dense, config=config, quant=quant, input_amax=input_amax,
                          act_formats=act_formats, fused_groups=groups, kv_cache=KV.kv_record(model),
                          coverage={k: v for k, v in rep.totals.items()},
                          recipe={"name": cfg.name} if cfg.name else {},
                          source_dir=src_dir if src_dir and os.path.isdir(str(src_dir)) else None)


def register_zero3_external_params(model: nn.Module) -> int:
    """Under DeepSpeed ZeRO-3 a module's forward sees only its own gathered parameters; a fused
    group member computing the shared amax reads its peers' weights too, so register them as
    external parameters of each member. Returns the number of registrations."""
    try:
        import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    except ImportError:
        raise ImportError("register_zero3_external_params needs DeepSpeed: pip install deepspeed") from None
    n = 0
    for _, m in _quant_linears(model):
        if len(m._group) < 2 or m.weight_quant.strategy != "dynamic":
            continue
        for peer in m._group:
            if peer is m:
                continue
            ps = [peer.weight] + ([peer.lora.lora_A, peer.lora.lora_B] if peer.lora is not None else [])
            for p in ps:
                deepspeed.zero.register_external_parameter(m, p)
                n += 1
    return n
