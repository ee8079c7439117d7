"""prepare: swap a Hugging Face model's Linear / 3-D expert / embedding modules for fake-quant ones."""
from __future__ import annotations

import warnings

from torch import nn

from ..formats import get_format, list_formats
from ..nn import kept_scales
from ..nn import kv_cache as KV  # the KV cache in the loop (nn/kv_cache.py)
from ..nn.embedding import QuantEmbedding, tie_head
from ..nn.experts import (
    check_supported,
    make_quant_experts,
)
from ..nn.fake_quant import (
    has_global_scale,
)
from ..nn.linear import QuantLinear
from ..nn.lowbit import LowBitQuantizer
from .config import QuantConfig, match
from .coverage import coverage
from .modules import (
    FUSED_SIBLINGS,
    _embedding_name,
    _exclusion,
    _init_scale_state,
    _linear_like,
    _lm_head_name,
    _quant_linears,
    _resolve_format,
    _tied_lm_head,
    as_quant_config,
)


def prepare(model: nn.Module, cfg: QuantConfig) -> nn.Module:
    """Swap nn.Linear -> QuantLinear and fused 3-D experts -> QuantExperts (in place; returns model).

    Frozen/learnable scale state is initialised from the current weights with the ``max`` rule,
    so the model is valid before ``calibrate``; W4A4 with a static activation format needs
    ``calibrate`` before the first forward. Raises CoverageError if a Linear-like module is
    neither quantized nor excluded."""
    cfg = as_quant_config(cfg)
    cfg.validate()
    if getattr(model, "_qf_config", None) is not None:
        raise ValueError("prepare: this model is already prepared")
    config = getattr(model, "config", None)
    lm_name = _lm_head_name(model)
    tied = _tied_lm_head(model, lm_name)
    cands = _linear_like(model)
    names = [n for n, _, _ in cands]
    emb_plan = _plan_embedding(model, cfg, config, tied) if cfg.quantize_embeddings else None
    if emb_plan is not None:
        names.append(emb_plan[0])
    for fld, pats in (("targets", cfg.targets), ("lora.targets", cfg.lora.targets if cfg.lora.rank else [])):
        for p in pats:
            if not any(match(p, n) for n in names):
                raise ValueError(f"QuantConfig.{fld}: pattern {p!r} matches no Linear-like module; "
                                 f"modules are named like {names[:6]}")
    for i, r in enumerate(cfg.rules):
        if not any(match(r.pattern, n) for n in names):
            raise ValueError(f"QuantConfig.rules[{i}].pattern={r.pattern!r} matches no Linear-like module; "
                             f"modules are named like {names[:6]}")

    plan = {}
    for name, mod, kind in cands:
        if kind.startswith("unsupported") or _exclusion(cfg, name, lm_name, tied) is not None:
            continue
        if not any(match(p, name) for p in cfg.targets):
            continue
        wf, af = cfg.resolve(name)
        if kind == "linear":
            w = _resolve_format(cfg, wf, name + ".weight", tuple(mod.weight.shape), config)
            if w is not None:
                plan[name] = (kind, w, w, af)
        else:
            check_supported(mod, name, af is not None)
            wg = _resolve_format(cfg, wf, name + ".gate_up_proj", tuple(mod.gate_up_proj.shape), config)
            wd = _resolve_format(cfg, wf, name + ".down_proj", tuple(mod.down_proj.shape), config)
            if wg is None or wd is None:
                raise NotImplementedError(f"{name}: the {wf} policy leaves an expert tensor in f16; fused experts "
                                          f"must be quantized as a whole: add a rule with an explicit format")
            plan[name] = (kind, wg, wd, af)
    if emb_plan is not None and emb_plan[1] is None:
        emb_plan = None       # the policy keeps this table in f16: it stays in the model dtype

    # mutate only after everything is known to fit; on any error put the model back as it was
    undo = []
    grads = {id(p): p.requires_grad for p in model.parameters()}
    try:
        for name, (kind, wg, wd, af) in plan.items():
            mod = model.get_submodule(name)
            try:
                if kind == "linear":
                    new = QuantLinear(mod, wg, cfg.scale_strategy, af, cfg.ste, name=name)
                    parent_name, _, leaf = name.rpartition(".")
                    parent = model.get_submodule(parent_name) if parent_name else model
                    setattr(parent, leaf, new)
                    undo.append(("linear", parent, leaf, mod))
                else:
                    before = (type(mod), dict(mod._modules), set(mod.__dict__))
                    undo.append(("experts", mod, before, None))
                    make_quant_experts(mod)
                    mod._qf_setup(wg, wd, cfg.scale_strategy, af, af, cfg.ste, name)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if emb_plan is not None:
            ename, ef = emb_plan
            emod = model.get_submodule(ename)
            qe = QuantEmbedding(emod, ef, cfg.scale_strategy, cfg.ste, name=ename)
            _swap(model, ename, qe, emod, undo)
            if tied:   # llama.cpp multiplies by token_embd itself: the head is the same quantized tensor
                head = model.get_submodule(lm_name)
                _swap(model, lm_name, tie_head(head, qe, lm_name), head, undo)
        _build_groups(model, cfg)
        if cfg.lora.rank:
            _add_lora(model, cfg)
        for m in model.modules():
            if isinstance(m, LowBitQuantizer):
                m.grad_rule = cfg.lowbit_grad
        _init_scale_state(model, "max")
        if cfg.kquant_refresh_every > 1:     # k-quant scales kept between searches
            kept_scales.attach_all(model, cfg.kquant_refresh_every)
        if cfg.kv_format is not None:     # K/V fake quant in every attention layer
            undo.append(("kv", model, None, None))
            cfg.kv_attention = cfg.resolved_kv_attention()     # saved as trained: a later default cannot change it
            KV.attach(model, cfg.kv_format, cfg.kv_scale_strategy, cfg.kv_attention)
        model._qf_config = cfg
        rep = coverage(model).raise_if_errors()
    except BaseException:
        _undo_prepare(model, undo, grads)
        raise
    t = rep.totals
    if t["asked_params"] and t["asked_fraction"] < 1.0:
        warnings.warn(f"prepare: {100 * t['asked_fraction']:.1f}% of the {t['asked_params']:,} Linear-like "
                      f"parameters asked for are quantized; kept as they are: "
                      f"{', '.join(t['not_quantized'][:4])}{' ...' if len(t['not_quantized']) > 4 else ''} "
                      f"(see coverage(model).table())", stacklevel=2)
    return model


def _swap(model, name: str, new: nn.Module, old: nn.Module, undo) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)
    undo.append(("linear", parent, leaf, old))


def _plan_embedding(model, cfg: QuantConfig, config, tied: bool):
    """(module name, format or None = the policy keeps it in f16) for quantize_embeddings."""
    name, emb = _embedding_name(model)
    if emb is None:
        raise ValueError("QuantConfig.quantize_embeddings=True but the model has no input embedding "
                         "(get_input_embeddings() returned none); allowed: False for this model")
    wf = cfg.resolve(name)[0]
    w = _resolve_format(cfg, wf, name + ".weight", tuple(emb.weight.shape), config, tied)
    if w is None:
        return name, None
    spec = get_format(w).spec
    if spec.ggml_type is None or spec.global_scale is not None or spec.role == "activation":
        ok = [f for f in list_formats() if get_format(f).spec.ggml_type is not None
              and get_format(f).spec.global_scale is None and get_format(f).spec.role != "activation"]
        raise ValueError(f"QuantConfig.quantize_embeddings: {name} would be stored as {w!r}, which llama.cpp does "
                         f"not look up as trained (quantized embeddings are a GGUF feature; vLLM/SGLang keep "
                         f"embeddings in the model dtype); allowed: a rule giving {name!r} one of {ok}, or "
                         f"quantize_embeddings=False")
    return name, w


def _undo_prepare(model, undo, grads) -> None:
    for kind, a, b, c in reversed(undo):
        if kind == "linear":
            setattr(a, b, c)
        elif kind == "kv":
            KV.detach(a)
        else:
            cls, mods, attrs = b
            a.__class__ = cls
            a._modules.clear()
            a._modules.update(mods)
            for k in set(a.__dict__) - attrs:
                del a.__dict__[k]
    for p in model.parameters():
        p.requires_grad_(grads.get(id(p), p.requires_grad))
    if "_qf_config" in model.__dict__:
        del model.__dict__["_qf_config"]


def _build_groups(model, cfg: QuantConfig) -> None:
    for pname, parent in model.named_modules():
        for sib in FUSED_SIBLINGS:
            mods = [parent._modules.get(s) for s in sib]
            if not all(isinstance(m, QuantLinear) for m in mods):
                continue
            fmts = {m.weight_format for m in mods}
            needs_share = any(has_global_scale(m.weight_quant.fmt) for m in mods)
            if needs_share and len(fmts) > 1:
                raise ValueError(f"{pname}: {'/'.join(sib)} are fused by the engine into one GEMM with one per-tensor "
                                 f"scale but got formats {sorted(fmts)}; give them one format (QuantConfig.rules)")
            acts = {m.input_quant.fmt_name if m.input_quant else None for m in mods}
            if len(acts) > 1:
                raise ValueError(f"{pname}: {'/'.join(sib)} are fused by the engine but got activation formats "
                                 f"{sorted(map(str, acts))}; give them one act format")
            if cfg.share_fused_scales and needs_share:
                for m in mods:
                    m._group = list(mods)


def _add_lora(model, cfg: QuantConfig) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
    n = 0
    for name, m in _quant_linears(model):
        if m.tied_to is not None:   # the tied head is the quantized embedding: an adapter would split them
            continue
        if any(match(p, name) for p in cfg.lora.targets):
            m.add_lora(cfg.lora.rank, cfg.lora.alpha)
            n += 1
    if n == 0:
        raise ValueError(f"QuantConfig.lora.targets={cfg.lora.targets}: no quantized nn.Linear matches "
                         f"(LoRA applies to QuantLinear modules; fused experts are not adapted)")
