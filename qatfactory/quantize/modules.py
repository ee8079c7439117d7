"""What a model holds and what the quantizer makes of it: Linear-like modules, the lm_head and a tied
embedding, exclusions, each parameter's resolved format, the quantized modules and their sites."""
from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..formats import list_formats
from ..formats.policy import ggml_policy
from ..nn.embedding import QuantEmbedding
from ..nn.experts import (
    QuantExpertsMixin,
    is_fused_experts,
)
from ..nn.fake_quant import (
    ActQuantizer,
    WeightQuantizer,
)
from ..nn.linear import QuantLinear
from ..nn.lora import LoRA
from ..nn.lowbit import LowBitQuantizer
from .config import POLICY_TARGETS, QuantConfig, match
from .search import search_scales

# children of one parent that an engine fuses into one GEMM (vLLM qkv_proj / gate_up_proj, and Qwen3.5's Gated
# DeltaNet in_proj_qkvz = in_proj_qkv + in_proj_z)
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                  ("in_proj_qkv", "in_proj_z"))


_QUANT_STATE_TYPES = (WeightQuantizer, LowBitQuantizer, ActQuantizer, LoRA)


_QUANT_MODULES = (QuantLinear, QuantExpertsMixin, QuantEmbedding)


class CoverageError(ValueError):
    """A Linear-like parameter was left out of quantization without being excluded."""


def as_quant_config(cfg) -> QuantConfig:
    """QuantConfig from a QuantConfig, a plain dict, or an OmegaConf/Hydra node."""
    if isinstance(cfg, QuantConfig):
        return cfg
    if isinstance(cfg, dict):
        return QuantConfig.from_dict(cfg)
    if isinstance(cfg, DictConfig):
        obj = OmegaConf.to_object(cfg)
        return obj if isinstance(obj, QuantConfig) else QuantConfig.from_dict(obj)
    raise TypeError(f"prepare: cfg must be a QuantConfig (or a dict / OmegaConf node of one), "
                    f"got {type(cfg).__name__}")


def _n_layers(config) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def _n_experts(config) -> int:
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(config, k, None)
        if v:
            return int(v)
    return 0


def _lm_head_name(model) -> Optional[str]:
    try:
        out = model.get_output_embeddings()
    except Exception:  # not a causal LM
        out = None
    if out is None:
        return None
    for n, m in model.named_modules():
        if m is out:
            return n
    return None


def _tied_lm_head(model, lm_name) -> bool:
    if lm_name is None:
        return False
    try:
        emb = model.get_input_embeddings()
    except Exception:
        return False
    lm = model.get_submodule(lm_name)
    return emb is not None and getattr(lm, "weight", None) is getattr(emb, "weight", None)


def _is_conv1d(m) -> bool:
    """transformers' Conv1D (GPT-2 and relatives): a Linear with a transposed [in, out] weight."""
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers") and \
        getattr(getattr(m, "weight", None), "ndim", 0) == 2


def _linear_like(model):
    """(name, module, kind) for every nn.Linear and fused-experts module, in model order."""
    out = []
    for n, m in model.named_modules():
        if isinstance(m, _QUANT_STATE_TYPES):
            continue
        if isinstance(m, (nn.Linear, QuantLinear)):
            out.append((n, m, "linear"))
        elif _is_conv1d(m):
            out.append((n, m, "unsupported_conv1d"))
        elif is_fused_experts(m):
            out.append((n, m, "experts"))
        elif isinstance(m, nn.modules.conv._ConvNd):
            continue   # a convolution's 3-D weight is no expert stack; engines run it in the model dtype
        else:
            for pn, p in m._parameters.items():
                if p is not None and p.ndim == 3:
                    out.append((n, m, "unsupported_3d"))
                    break
    return out


def _exclusion(cfg: QuantConfig, name: str, lm_name, tied: bool) -> Optional[str]:
    """Why a Linear-like module stays in the model dtype (or is not quantized on its own), or None."""
    if name == lm_name:
        if tied and cfg.quantize_embeddings:
            return "lm_head tied to the input embeddings (quantized with them)"
        if not cfg.quantize_lm_head:
            return "lm_head (quantize_lm_head=False)"
        if tied:
            return "lm_head tied to the input embeddings (kept in the model dtype)"
    for p in cfg.exclude:
        if match(p, name):
            return f"exclude pattern {p!r}"
    return None


def _resolve_format(cfg: QuantConfig, fmt: str, param_name: str, shape, config, tied: bool = False) -> Optional[str]:
    if fmt in POLICY_TARGETS:
        t = ggml_policy(param_name, shape, _n_layers(config), base="q4_k", n_experts=_n_experts(config), tied=tied)
        if t is None:
            t = "q4_k"    # a tensor the policy has no role for: the base type
        if t == "f16":
            return None
        if t not in list_formats():
            raise NotImplementedError(f"{param_name}: the {fmt} policy asks for {t!r}, which is not a registered "
                                      f"format (registered: {list_formats()}); add a rule for this module")
        return t
    return fmt


def _embedding_name(model):
    try:
        emb = model.get_input_embeddings()
    except Exception:  # not a language model
        emb = None
    for n, m in model.named_modules():
        if emb is not None and m is emb:
            return n, m
    return None, None


def _quant_linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def _quant_experts(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantExpertsMixin)]


def _quant_embeddings(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantEmbedding)]


def _sites(model):
    """Every quantized weight: (name, quantizer, w3, amax_for_state) with the shared group amax."""
    out = []
    for name, m in _quant_linears(model):
        if m.tied_to is not None:   # its quantizer is the embedding's, listed below
            continue
        w3 = m.merged_weight().detach().unsqueeze(0)
        out.append((name, m.weight_quant, w3, m.group_amax()))
    for name, m in _quant_embeddings(model):
        out.append((name, m.weight_quant, m.weight.detach().unsqueeze(0), m.amax()))
    for name, m in _quant_experts(model):
        for which, q in (("gate_up_proj", m.gate_up_quant), ("down_proj", m.down_quant)):
            w = getattr(m, which).detach()
            out.append((f"{name}.{which}", q, w, m.expert_amax(w)))
    return out


@torch.no_grad()
def _init_scale_state(model, method: str) -> None:
    for name, q, w3, amax in _sites(model):
        if isinstance(q, LowBitQuantizer):      # the ParetoQ grids initialise their own scales
            try:
                q.init_state(w3, method)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            continue
        if q.strategy == "dynamic":
            if method != "max":
                raise ValueError(f"calibrate: method={method!r} produces fixed block scales, but {name} uses "
                                 f"scale_strategy='dynamic' (recomputed every step); allowed: method 'max', or "
                                 f"QuantConfig.scale_strategy 'frozen' / 'learnable'")
            continue
        q.set_state(amax, search_scales(q.fmt, w3, amax, method))


def _is_quant_site(m: nn.Module, pn: str) -> bool:
    return (isinstance(m, (QuantLinear, QuantEmbedding)) and pn == "weight") or \
        (isinstance(m, QuantExpertsMixin) and pn in ("gate_up_proj", "down_proj"))
