"""prepare / calibrate / convert / coverage for Hugging Face causal LMs (dense and MoE).

    cfg = QuantConfig.preset("nvfp4_w4a4", scale_strategy="frozen")
    model = prepare(model, cfg)            # nn.Linear -> QuantLinear, 3-D experts -> QuantExperts
    calibrate(model, batches, "mse")       # PTQ: frozen block scales + static activation amax
    register_zero3_external_params(model)  # only under DeepSpeed ZeRO-3
    ...train...                            # save_student / load_student for the parity gate and resume
    cm = convert(model)                    # ConvertedModel: packed tensors by on-disk HF name
    print(coverage(model).table())

Scale strategies: ``dynamic`` (block and per-tensor scales recomputed from the weights every
forward), ``frozen`` (calibrated, kept as buffers), ``learnable`` (LSQ step sizes, rounded onto the
format's E4M3/E8M0 grid each forward). Calibration methods ``mse``/``four_over_six`` need frozen or
learnable scales. Convert and calibrate expect whole (not ZeRO-partitioned) parameters.

The promise kept here: the prepared model's forward equals, with atol=0, the forward of a
model rebuilt from ``convert(model)``'s dequantized tensors.
"""
from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .nn.embedding import QuantEmbedding, tie_head
from .nn.experts import QuantExpertsMixin, check_supported, is_fused_experts, make_quant_experts
from .nn.fake_quant import ActQuantizer, WeightQuantizer, has_global_scale, quant_kwargs, scale_grid
from .nn.linear import QuantLinear
from .nn.lora import LoRA
from .nn.lowbit import GRAD_RULES as LOWBIT_GRAD_RULES, LowBitQuantizer
from .nn import kv_cache as KV  # issue 22: the KV cache in the loop (nn/kv_cache.py)

SCALE_STRATEGIES = ("dynamic", "frozen", "learnable")
CALIB_METHODS = ("max", "mse", "four_over_six")
STE_MODES = ("identity", "clipped")
# weight "formats" that are not one registry entry but a per-tensor policy (formats/policy.py)
POLICY_TARGETS = ("q4_k_m",)
# an explicit "leave this module's activations alone" inside a rule
NO_ACT = ("none",)

# Routers must stay bf16 (vLLM's Qwen3-MoE GateLinear expects them unquantized, llama.cpp keeps
# ffn_gate_inp in F32); these are excluded unless the user replaces the list.
DEFAULT_EXCLUDE = [
    "*.mlp.gate",                 # Qwen2/3-MoE, OLMoE router
    "*.block_sparse_moe.gate",    # Mixtral router
    "*.mlp.router",
    "*.mlp.router.*",
    "*shared_expert_gate",        # Qwen2-MoE shared-expert gate (a [1, H] linear)
]


@dataclass
class ModuleRule:
    """One "first match wins" rule: modules whose name matches ``pattern`` (fnmatch glob, or
    ``re:<regex>`` matched with re.fullmatch) get these formats. ``weight``/``act`` None inherit
    the config's ``weight_format``/``act_format``; ``act="none"`` forces W4A16 for the match."""

    pattern: str = "*"
    weight: Optional[str] = None
    act: Optional[str] = None


@dataclass
class LoRAConfig:
    """LoRA on the frozen fake-quantized base. rank 0 = off. Training forward uses
    fake_quant(W + (alpha/rank) * B @ A) (merge, then quantize): see nn/lora.py."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: List[str] = field(default_factory=lambda: ["*"])


@dataclass
class QuantConfig:
    """What to quantize, to which format, and how scales are found. Plain fields only, so
    Hydra's ConfigStore can hold it.

    * ``weight_format``: a registered format (``list_formats()``) or a policy target (``q4_k_m``).
    * ``act_format``: None = W4A16; else the activation format for W4A4 (``nvfp4_act`` with a
      static calibrated amax; an MX rule such as ``mxfp4_rceil`` for MXFP4).
    * ``rules``: per-module overrides, first match wins; unmatched modules use the two above.
    * ``targets``: which Linear-like modules are quantized (patterns); ``exclude`` are kept in the
      model dtype (routers by default); ``quantize_lm_head`` decides lm_head. Patterns in
      ``targets``, ``rules`` and ``lora.targets`` must each match some module (a typo is an error);
      ``exclude`` patterns may match nothing (the defaults name MoE routers, absent in dense models).
      A Linear-like module (nn.Linear, fused 3-D experts) that is neither quantized nor excluded is
      an error (``coverage``), never a silent bf16 leftover.
    * ``scale_strategy``: dynamic | frozen | learnable; ``calib_method``: max | mse | four_over_six.
    * ``share_fused_scales``: q/k/v, gate/up and per-expert gate/up share one per-tensor scale,
      as vLLM/SGLang fuse them at load.
    * ``lowbit_grad``: the scale gradient of the ParetoQ grids (int4_lsq ... binary_sign): ``released``
      (ParetoQ's code, ternary quirk included) or ``clean`` (ternary clipped-region gradient 2/3).
    * ``kv_format``: None = the engine's cache stays in the model dtype; else a KV-cache format
      (``qatfactory.formats.kv.list_kv_formats()``: fp8_e4m3, nvfp4_kv, q8_0_kv, ...) whose write rule
      fake-quantizes K and V in every attention layer (nn/kv_cache.py). ``kv_scale_strategy``:
      frozen (calibrated per-layer K/V amax) | dynamic (per-forward amax, frozen before convert);
      ``kv_calib_method``: max | mse.
    * ``min_coverage``: the smallest fraction of the Linear-like parameters asked for (targeted and
      not excluded) that must come out quantized; a policy that keeps rows in f16 (Q4_K_M on rows
      that no block size divides) or unsupported layers bring it down. Below it ``prepare`` /
      ``convert`` refuse (CoverageError); between it and 100% ``prepare`` warns.
    * ``quantize_embeddings``: fake-quantize the input embedding table as llama.cpp stores
      ``token_embd`` (the lookup returns the dequantized rows, nn/embedding.py). Its format is
      ``resolve(<embedding module>)`` (a rule may name the module); for the ``q4_k_m`` policy,
      llama-quantize's choice (a tied table takes the output head's type: q8_0 / q6_k). A tied
      head is then the same quantized tensor. Only for llama.cpp (GGUF): vLLM/SGLang keep
      embeddings in the model dtype. The ``q4_k`` preset sets it (as llama-quantize does); set it
      False to keep the embeddings (and a tied head) wide.
    """

    weight_format: str = "nvfp4"
    act_format: Optional[str] = None
    rules: List[ModuleRule] = field(default_factory=list)
    targets: List[str] = field(default_factory=lambda: ["*"])
    exclude: List[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    quantize_lm_head: bool = False
    scale_strategy: str = "dynamic"
    calib_method: str = "max"
    ste: str = "identity"
    share_fused_scales: bool = True
    quantize_embeddings: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    name: str = ""
    min_coverage: float = 0.5
    lowbit_grad: str = "released"
    # issue 22: KV-cache format (nn/kv_cache.py); None keeps the cache in the model dtype
    kv_format: Optional[str] = None
    kv_scale_strategy: str = "frozen"
    kv_calib_method: str = "max"

    def __post_init__(self):
        # Hydra/OmegaConf may hand us dicts for the nested dataclasses
        self.rules = [r if isinstance(r, ModuleRule) else ModuleRule(**dict(r)) for r in (self.rules or [])]
        if not isinstance(self.lora, LoRAConfig):
            self.lora = LoRAConfig(**dict(self.lora))
        self.targets = list(self.targets)
        self.exclude = list(self.exclude)
        self.lora.targets = list(self.lora.targets)
        _check_choice("QuantConfig.scale_strategy", self.scale_strategy, SCALE_STRATEGIES)
        _check_choice("QuantConfig.calib_method", self.calib_method, CALIB_METHODS)
        _check_choice("QuantConfig.ste", self.ste, STE_MODES)
        _check_choice("QuantConfig.lowbit_grad", self.lowbit_grad, LOWBIT_GRAD_RULES)
        _check_choice("QuantConfig.kv_scale_strategy", self.kv_scale_strategy, KV.KV_STRATEGIES)
        _check_choice("QuantConfig.kv_calib_method", self.kv_calib_method, KV.KV_CALIB_METHODS)
        if isinstance(self.min_coverage, bool) or not isinstance(self.min_coverage, (int, float)) or \
                not 0.0 <= float(self.min_coverage) <= 1.0:
            raise ValueError(f"QuantConfig.min_coverage={self.min_coverage!r}; allowed: a number in 0..1 (the "
                             f"fraction of the Linear-like parameters asked for that must be quantized)")
        if not isinstance(self.lora.rank, int) or self.lora.rank < 0:
            raise ValueError(f"QuantConfig.lora.rank={self.lora.rank!r}; allowed: an int >= 0 (0 = LoRA off)")
        if self.lora.rank and not self.lora.alpha > 0:
            raise ValueError(f"QuantConfig.lora.alpha={self.lora.alpha!r}; allowed: a number > 0")
        if self.lora.dropout != 0.0:
            # a random mask would make the merged-then-quantized training weight differ from
            # what convert ships; see nn/lora.py
            raise ValueError(f"QuantConfig.lora.dropout={self.lora.dropout!r}; allowed: 0.0 (the trained "
                             f"weight fake_quant(W + s*B@A) must be exactly what convert ships)")
        for fld, pats in (("targets", self.targets), ("exclude", self.exclude),
                          ("lora.targets", self.lora.targets)):
            for p in pats:
                _check_pattern(f"QuantConfig.{fld}", p)
        for i, r in enumerate(self.rules):
            _check_pattern(f"QuantConfig.rules[{i}].pattern", r.pattern)

    # -- format-name checks need the registry, which the format files fill at import time
    def validate(self) -> "QuantConfig":
        """Check every format name against the registry; returns self."""
        _check_weight_format("QuantConfig.weight_format", self.weight_format)
        if self.act_format is not None:
            _check_act_format("QuantConfig.act_format", self.act_format)
        for i, r in enumerate(self.rules):
            if r.weight is not None:
                _check_weight_format(f"QuantConfig.rules[{i}].weight", r.weight)
            if r.act is not None and r.act not in NO_ACT:
                _check_act_format(f"QuantConfig.rules[{i}].act", r.act)
        if self.kv_format is not None:
            from .formats.kv import list_kv_formats
            if self.kv_format not in list_kv_formats():
                raise ValueError(f"QuantConfig.kv_format={self.kv_format!r} is not a KV-cache format; allowed: "
                                 f"{list_kv_formats()} or None (the cache in the model dtype)")
        if self.scale_strategy == "learnable" and self.lora.rank:
            raise ValueError("QuantConfig.scale_strategy='learnable' with lora.rank>0: LSQ scales and LoRA "
                             "together are not supported; allowed: one of them")
        return self

    def resolve(self, module_name: str):
        """(weight_format, act_format or None) for a module, first matching rule wins."""
        w, a = self.weight_format, self.act_format
        for r in self.rules:
            if match(r.pattern, module_name):
                if r.weight is not None:
                    w = r.weight
                if r.act is not None:
                    a = None if r.act in NO_ACT else r.act
                break
        return w, a

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "QuantConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"QuantConfig: unknown field(s) {bad}; allowed: {sorted(known)}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> "QuantConfig":
        """The recipe names: nvfp4_w4a16, nvfp4_w4a4, mxfp4_w4a16, mxfp4_w4a4, q4_k (Q4_K_M policy),
        mxfp4_gguf / nvfp4_gguf (llama.cpp's MXFP4 / NVFP4 block types, embeddings Q8_0)."""
        if name not in PRESETS:
            raise ValueError(f"QuantConfig.preset: unknown recipe {name!r}; allowed: {sorted(PRESETS)}")
        d = dict(PRESETS[name])
        d.update(overrides)
        d.setdefault("name", name)
        return cls(**d)


PRESETS: Dict[str, Dict[str, Any]] = {
    "nvfp4_w4a16": dict(weight_format="nvfp4", act_format=None),
    "nvfp4_w4a4": dict(weight_format="nvfp4", act_format="nvfp4_act"),
    "mxfp4_w4a16": dict(weight_format="mxfp4", act_format=None),
    # activations at serving time are quantized by the engine's own MX rule (FlashInfer/TRT-LLM
    # and triton_kernels: RCEIL), see formats.md 2.2
    "mxfp4_w4a4": dict(weight_format="mxfp4", act_format="mxfp4_rceil"),
    # llama.cpp Q4_K_M: q4_k base, q6_k for output and the use_more_bits attn_v/ffn_down,
    # q5_0 where rows are not a multiple of 256; token_embd by llama-quantize's rule (formats/policy.py)
    "q4_k": dict(weight_format="q4_k_m", act_format=None, quantize_lm_head=True, quantize_embeddings=True),
    # llama.cpp's own FP4 block types in a GGUF, as llama-quantize writes a dense model with every
    # linear overridden (--tensor-type ...=mxfp4 / nvfp4) over Q8_0: token_embd and output stay Q8_0
    "mxfp4_gguf": dict(weight_format="mxfp4_ggml", act_format=None, quantize_lm_head=True, quantize_embeddings=True,
                       rules=[dict(pattern="model.embed_tokens", weight="q8_0"), dict(pattern="lm_head", weight="q8_0")]),
    "nvfp4_gguf": dict(weight_format="nvfp4_ggml", act_format=None, quantize_lm_head=True, quantize_embeddings=True,
                       rules=[dict(pattern="model.embed_tokens", weight="q8_0"), dict(pattern="lm_head", weight="q8_0")]),
}


# ----------------------------------------------------------------------------- helpers
def match(pattern: str, name: str) -> bool:
    """fnmatch glob, or ``re:<regex>`` (full match)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _check_pattern(fld: str, p) -> None:
    if not isinstance(p, str) or not p:
        raise ValueError(f"{fld}: pattern {p!r} must be a non-empty string (a glob, or 're:<regex>')")
    if p.startswith("re:"):
        try:
            re.compile(p[3:])
        except re.error as e:
            raise ValueError(f"{fld}: pattern {p!r} is not a valid regex: {e}") from None


def _check_choice(fld: str, v, allowed) -> None:
    if v not in allowed:
        raise ValueError(f"{fld}={v!r}; allowed: {list(allowed)}")


def _check_weight_format(fld: str, name: str) -> None:
    from .formats import list_formats
    if name in POLICY_TARGETS:
        return
    fmts = list_formats()
    if name not in fmts:
        raise ValueError(f"{fld}={name!r} is not a registered format; allowed: {fmts} "
                         f"or a policy target {list(POLICY_TARGETS)}")
    from .formats import get_format
    role = get_format(name).spec.role
    if role == "activation":
        raise ValueError(f"{fld}={name!r} is an activation-only format; allowed for weights: "
                         f"{[f for f in fmts if get_format(f).spec.role != 'activation']}")


def _check_act_format(fld: str, name: str) -> None:
    from .formats import get_format, list_formats
    fmts = list_formats()
    if name not in fmts:
        raise ValueError(f"{fld}={name!r} is not a registered format; allowed: {fmts}, "
                         f"or None for weight-only (W4A16)")
    if get_format(name).spec.role == "weight":
        raise ValueError(f"{fld}={name!r} is a weight-only format (not the engine's runtime activation rule); "
                         f"allowed: {[f for f in fmts if get_format(f).spec.role != 'weight']}")
    if get_format(name).spec.ggml_type is not None and get_format(name).spec.role != "activation":
        # llama.cpp quantizes activations to q8_0 itself; a ggml weight type says nothing about them
        raise ValueError(f"{fld}={name!r}: llama.cpp formats have no W4A4 activation rule; "
                         f"allowed: {[f for f in fmts if get_format(f).spec.ggml_type is None]}")


# ============================================================================= prepare

# children of one parent that an engine fuses into one GEMM (vLLM qkv_proj / gate_up_proj)
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
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
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:
        DictConfig = None
    if DictConfig is not None and isinstance(cfg, DictConfig):
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
        from .formats.policy import ggml_policy
        t = ggml_policy(param_name, shape, _n_layers(config), base="q4_k", n_experts=_n_experts(config), tied=tied)
        if t is None:
            t = "q4_k"    # a tensor the policy has no role for: the base type
        if t == "f16":
            return None
        from .formats import list_formats
        if t not in list_formats():
            raise NotImplementedError(f"{param_name}: the {fmt} policy asks for {t!r}, which is not a registered "
                                      f"format (registered: {list_formats()}); add a rule for this module")
        return t
    return fmt


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
        if cfg.kv_format is not None:     # issue 22: K/V fake quant in every attention layer
            undo.append(("kv", model, None, None))
            KV.attach(model, cfg.kv_format, cfg.kv_scale_strategy)
        model._qf_config = cfg
        rep = coverage(model).raise_if_errors()
    except BaseException:
        _undo_prepare(model, undo, grads)
        raise
    t = rep.totals
    if t["asked_params"] and t["asked_fraction"] < 1.0:
        import warnings
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


def _embedding_name(model):
    try:
        emb = model.get_input_embeddings()
    except Exception:  # not a language model
        emb = None
    for n, m in model.named_modules():
        if emb is not None and m is emb:
            return n, m
    return None, None


def _plan_embedding(model, cfg: QuantConfig, config, tied: bool):
    """(module name, format or None = the policy keeps it in f16) for quantize_embeddings."""
    from .formats import get_format, list_formats
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


def _quant_linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def _quant_experts(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantExpertsMixin)]


def _quant_embeddings(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantEmbedding)]


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


# ============================================================================= scale search
def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2 y) for y > 0 from the float bits (torch.log2 rounds near powers of two)."""
    m, e = torch.frexp(y)
    return torch.where(m == 0.5, e - 1, e)


@torch.no_grad()
def search_scales(fmt, w3: torch.Tensor, amax: torch.Tensor, method: str) -> torch.Tensor:
    """Block-scale bytes [G, R, K/block] for w3 [G, R, K] with per-tensor amax [G].

    max: the format's own rule. mse: per block, the byte among the max-derived one and its
    neighbours on the scale grid (E4M3: -6..+2 steps; E8M0: -1..+1) with the least squared error.
    four_over_six: per block, the better of scaling the block max to 6 or to 4 (NVIDIA's
    "Four Over Six"; with the exporter's fixed g = amax/2688 a scale above 448 saturates and loses)."""
    _check_choice("calibrate method", method, CALIB_METHODS)
    grid = scale_grid(fmt)
    if grid is None:
        raise NotImplementedError(f"block-scale calibration is not supported for {fmt.name!r}")
    kw = quant_kwargs(fmt, amax=amax)
    p = fmt.quantize(w3, **kw)
    base = p.scales
    if method == "max":
        return base
    x = w3.float()
    nb = base.shape[-1]
    xb = x.reshape(*base.shape, -1)

    def err(c):
        y = fmt.dequantize(fmt.quantize(w3, scales=c, **kw)).reshape(xb.shape)
        return ((y - xb) ** 2).sum(-1)

    if method == "mse":
        lo, hi = (1, 0x7E) if grid == "e4m3" else (0, 254)
        offs = [o for o in (range(-6, 3) if grid == "e4m3" else range(-1, 2)) if o != 0]
        cands = [base] + [(base.int() + o).clamp(lo, hi).to(torch.uint8) for o in offs]
    else:
        amax_b = xb.abs().amax(-1)
        zero = amax_b == 0
        if grid == "e4m3":
            g = p.global_scale.float() if p.global_scale is not None else torch.ones((), device=w3.device)
            g = g.reshape(*g.shape, *([1] * (amax_b.ndim - g.ndim)))
            from .formats import codecs as C
            b6 = base
            b4 = C.e4m3_encode((amax_b / (4.0 * g)).clamp(C.E4M3_MIN_SUBNORMAL, C.E4M3_MAX))
        else:
            safe = torch.where(zero, torch.ones_like(amax_b), amax_b)
            b6 = (_ceil_log2(safe / 6.0) + 127).clamp(0, 254).to(torch.uint8)
            b4 = (_ceil_log2(safe / 4.0) + 127).clamp(0, 254).to(torch.uint8)
        cands = [torch.where(zero, base, b6), torch.where(zero, base, b4)]
    best, best_err = cands[0], err(cands[0])
    for c in cands[1:]:
        e = err(c)
        better = e < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, e, best_err)
    return best


# ============================================================================= calibrate
def _act_quantizers(model):
    out = []
    for name, m in _quant_linears(model):
        if m.input_quant is not None:
            out.append((name, m.input_quant))
    for name, m in _quant_experts(model):
        for q in (m.gate_up_input_quant, m.down_input_quant):
            if q is not None:
                out.append((name, q))
    return out


def _imatrix_hook(acc):
    def hook(mod, args):
        x = args[0].detach()
        x2 = x.reshape(-1, x.shape[-1]).double()
        acc[0] += (x2 * x2).sum(0)
        acc[1] += x2.shape[0]
    return hook


def set_quantization(model: nn.Module, enabled: bool) -> int:
    """Switch the fake quantization of every QuantLinear on or off (off: the plain linear on the latent
    weights, the full-precision phase of ``train.quant_start``). Quantizer state is kept either way.
    Returns the number of modules switched; fused experts have no off switch and refuse."""
    if getattr(model, "_qf_config", None) is None:
        raise ValueError("set_quantization: the model is not prepared")
    if not enabled and _quant_experts(model):
        raise NotImplementedError("set_quantization(False): fused 3-D experts cannot run unquantized here; "
                                  "train.quant_start supports dense models")
    n = 0
    for _, m in _quant_linears(model):
        m.quant_enabled = bool(enabled)
        n += 1
    return n


def calibrate(model: nn.Module, batches=None, method: Optional[str] = None) -> Dict[str, Any]:
    """PTQ: block scales from the weights (``max`` | ``mse`` | ``four_over_six``) for frozen /
    learnable strategies, and static activation amax for W4A4 (forward hooks' running max of
    |input| over ``batches``; fused groups then share the max).

    llama.cpp types (q4_k, q6_k, ...): with ``batches``, each QuantLinear also gets an importance
    matrix, the per-column mean of x^2 over all tokens (what llama-imatrix computes), which the
    format's quantizer then uses in training and in convert alike. Fused 3-D experts get none.

    ``batches``: an iterable of dicts of model kwargs, or of input_ids tensors."""
    cfg: QuantConfig = getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("calibrate: the model is not prepared; call qatfactory.quantize.prepare(model, cfg) first")
    method = method or cfg.calib_method
    _check_choice("calibrate method", method, CALIB_METHODS)
    _init_scale_state(model, method)
    acts = [(n, q) for n, q in _act_quantizers(model) if q.static]
    imat = [(n, m) for n, m in _quant_linears(model) if m.weight_quant.uses_imatrix] if batches is not None else []
    kvq = [(n, q) for n, q in KV.kv_quantizers(model) if q.static]    # issue 22: per-layer K/V amax
    n_batches = 0
    if acts and batches is None:
        raise ValueError("calibrate: W4A4 with a static activation amax needs batches= (an iterable of "
                         "input_ids tensors or dicts of model kwargs)")
    if kvq and batches is None:
        raise ValueError(f"calibrate: the KV-cache format {cfg.kv_format!r} has one K and one V scale per layer, "
                         f"calibrated on batches=; give an iterable of input_ids tensors or dicts of model kwargs")
    if kvq and (acts or imat) and not isinstance(batches, (list, tuple)):
        batches = list(batches)    # the KV pass below runs over them again
    if acts or imat:
        for _, q in acts:
            q.amax.zero_()
            q.calibrating = True
        for _, q in kvq:
            q.calibrating = "pass"    # K/V untouched until their own pass below
        sums = {n: [torch.zeros(m.in_features, dtype=torch.float64, device=m.weight.device), 0] for n, m in imat}
        hooks = [m.register_forward_pre_hook(_imatrix_hook(sums[n])) for n, m in imat]
        for _, m in imat:     # statistics of the inputs the plain quantizer would see
            m.weight_quant.imatrix.zero_()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for b in batches:
                    model(**b) if isinstance(b, dict) else model(input_ids=b)
                    n_batches += 1
        finally:
            for _, q in acts:
                q.calibrating = False
            for _, q in kvq:
                q.calibrating = None
            for h in hooks:
                h.remove()
            model.train(was_training)
        for n, m in imat:
            s2, cnt = sums[n]
            if cnt:
                m.weight_quant.imatrix.copy_((s2 / cnt).float())
        for name, m in _quant_linears(model):
            if m.input_quant is not None and len(m._group) > 1:
                a = torch.stack([g.input_quant.amax for g in m._group]).amax()
                for g in m._group:
                    g.input_quant.amax.copy_(a)
        missing = sorted({n for n, q in acts if not float(q.amax) > 0})
        if missing:
            raise ValueError(f"calibrate: no non-zero activation reached {missing[:8]} over {n_batches} batch(es); "
                             f"give batches that exercise every module")
    out = {"method": method, "batches": n_batches, "activation_quantizers": len(acts), "imatrix": len(imat)}
    if kvq:   # issue 22: a pass of its own, after the above: K and V as the served (quantized) model computes them
        out["kv_cache"] = _calibrate_kv(model, kvq, batches, cfg.kv_calib_method)
        out["batches"] = max(n_batches, out["kv_cache"]["batches"])
    return out


def _calibrate_kv(model, kvq, batches, method: str) -> Dict[str, Any]:
    was_training = model.training
    model.eval()
    for _, q in kvq:
        q.start_calibration(method)
    n = 0
    try:
        with torch.no_grad():
            for b in batches:
                model(**b) if isinstance(b, dict) else model(input_ids=b)
                n += 1
    finally:
        amax = {name: q.finish_calibration() for name, q in kvq}
        model.train(was_training)
    missing = sorted(name for name, a in amax.items() if not (a["k_amax"] > 0 and a["v_amax"] > 0))
    if missing:
        raise ValueError(f"calibrate: no non-zero K/V reached the KV-cache quantizers of {missing[:8]} over {n} "
                         f"batch(es); give batches with tokens")
    return {"format": kvq[0][1].fmt_name, "method": method, "layers": len(kvq), "batches": n, "amax": amax}


# ============================================================================= coverage
@dataclass
class CoverageRow:
    name: str
    shape: List[int]
    numel: int
    format: str          # format name, or the dtype for tensors kept as they are
    bits: float          # storage bits of the whole tensor as shipped
    status: str          # quantized | excluded | kept (a policy's f16) | dense | tied | adapter | quantizer | MISSING
    note: str = ""


@dataclass
class CoverageReport:
    rows: List[CoverageRow]
    totals: Dict[str, Any]
    errors: List[str]

    def raise_if_errors(self) -> "CoverageReport":
        if self.errors:
            raise CoverageError("coverage: " + "; ".join(self.errors[:10])
                                + (f" (and {len(self.errors) - 10} more)" if len(self.errors) > 10 else ""))
        return self

    def table(self) -> str:
        w = max([len(r.name) for r in self.rows] + [9])
        lines = [f"{'parameter':<{w}}  {'shape':<16} {'format':<10} {'bits/p':>7}  status"]
        for r in self.rows:
            bpp = r.bits / r.numel if r.numel else 0.0
            note = f"  ({r.note})" if r.note else ""
            lines.append(f"{r.name:<{w}}  {str(tuple(r.shape)):<16} {r.format:<10} {bpp:>7.3f}  {r.status}{note}")
        t = self.totals
        lines.append(f"total {t['params']:,} parameters, {t['quantized_params']:,} quantized "
                     f"({100 * t['quantized_fraction']:.1f}%), {t['bits_per_param']:.3f} bits/parameter "
                     f"({t['bits_per_quantized_param']:.3f} in quantized tensors)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _dtype_bits(t: torch.Tensor) -> int:
    return t.element_size() * 8


def coverage(model: nn.Module, cfg: Optional[QuantConfig] = None) -> CoverageReport:
    """Every parameter with its format and bits; errors for Linear-like weights left out
    without being excluded (nn.Linear, fused 3-D experts) and for targeted modules not quantized."""
    cfg = cfg or getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("coverage: the model is not prepared and no cfg= was given")
    lm_name = _lm_head_name(model)
    tied = _tied_lm_head(model, lm_name)
    rows: List[CoverageRow] = []
    errors: List[str] = []
    seen: Dict[int, str] = {}
    state_owner = {}
    for n, m in model.named_modules():
        if isinstance(m, _QUANT_MODULES):
            for cn, c in m.named_modules():
                if isinstance(c, _QUANT_STATE_TYPES) and cn:
                    state_owner[id(c)] = "adapter" if isinstance(c, LoRA) else "quantizer"
    for n, m in model.named_modules():
        kind_state = state_owner.get(id(m))
        for pn, p in m.named_parameters(recurse=False):
            full = f"{n}.{pn}" if n else pn
            quant_site = _is_quant_site(m, pn)
            was_seen = id(p) in seen
            tied_head = isinstance(m, QuantLinear) and m.tied_to is not None
            if (was_seen and not quant_site) or tied_head:
                other = seen.get(id(p)) or f"{m.tied_to.qname}.weight"
                rows.append(CoverageRow(full, list(p.shape), p.numel(), str(p.dtype).replace("torch.", ""), 0,
                                        "tied", f"same tensor as {other}; counted there"))
                continue
            seen.setdefault(id(p), full)
            shape, numel = list(p.shape), p.numel()
            if kind_state is not None:
                rows.append(CoverageRow(full, shape, numel, str(p.dtype).replace("torch.", ""),
                                        numel * _dtype_bits(p), kind_state))
                continue
            if quant_site:
                q = m.weight_quant if isinstance(m, (QuantLinear, QuantEmbedding)) else (
                    m.gate_up_quant if pn == "gate_up_proj" else m.down_quant)
                fmt = q.fmt
                n_glob = q.shape3[0] if has_global_scale(fmt) else 0
                note = q.strategy + (", shares storage with the embeddings" if was_seen else "")
                rows.append(CoverageRow(full, shape, numel, q.fmt_name,
                                        numel * fmt.spec.bits_per_weight + 32 * n_glob, "quantized", note))
                continue
            linear_like = (isinstance(m, nn.Linear) and pn == "weight") or p.ndim == 3
            if _is_conv1d(m) and pn == "weight":
                why = _exclusion(cfg, n, lm_name, tied)
                if why is None and any(match(t, n) for t in cfg.targets):
                    errors.append(f"{full} {tuple(p.shape)} is a transformers Conv1D (GPT-2 style) weight, which "
                                  f"qatfactory does not quantize; add it to QuantConfig.exclude to keep it as it is")
                    rows.append(CoverageRow(full, list(p.shape), p.numel(), str(p.dtype).replace("torch.", ""),
                                            p.numel() * _dtype_bits(p), "MISSING", "Conv1D is not supported"))
                    continue
                linear_like = True
            status, note = "dense", ""
            if linear_like:
                why = _exclusion(cfg, n, lm_name, tied)
                policy = False
                if why is None and isinstance(m, nn.Linear) and cfg.resolve(n)[0] in POLICY_TARGETS and \
                        _resolve_format(cfg, cfg.resolve(n)[0], full, tuple(p.shape),
                                        getattr(model, "config", None)) is None:
                    why = f"the {cfg.resolve(n)[0]} policy keeps rows of length {p.shape[-1]} in f16"
                    policy = True
                if why is not None:
                    status, note = ("kept" if policy else "excluded"), why
                elif any(match(t, n) for t in cfg.targets):
                    status = "MISSING"
                    errors.append(f"{full} {tuple(p.shape)} is matched by targets but was not quantized")
                else:
                    status = "MISSING"
                    errors.append(f"{full} {tuple(p.shape)} is a Linear-like weight left out without being excluded "
                                  f"(add it to QuantConfig.exclude or to targets)")
            elif p.ndim >= 2 and any(match(e, n) for e in cfg.exclude):
                status, note = "excluded", "exclude pattern"
            rows.append(CoverageRow(full, shape, numel, str(p.dtype).replace("torch.", ""),
                                    numel * _dtype_bits(p), status, note))
    shipped = [r for r in rows if r.status not in ("adapter", "quantizer", "tied")]
    q = [r for r in shipped if r.status == "quantized"]
    # asked for: Linear-like weights that the config targets and does not exclude (a policy's f16
    # rows and unsupported layers count as asked for and not delivered)
    asked = [r for r in shipped if r.status in ("quantized", "kept", "MISSING")]
    n_asked = sum(r.numel for r in asked)
    frac = (sum(r.numel for r in q) / n_asked) if n_asked else 1.0
    min_cov = float(getattr(cfg, "min_coverage", 0.0) or 0.0)
    if n_asked and frac < min_cov:
        kept = [r for r in asked if r.status != "quantized"]
        why = sorted({r.note for r in kept if r.note})
        errors.append(f"{100 * frac:.1f}% of the {n_asked:,} Linear-like parameters asked for are quantized, below "
                      f"QuantConfig.min_coverage={min_cov:g} (kept as they are: {', '.join(r.name for r in kept[:3])}"
                      f"{' ...' if len(kept) > 3 else ''}; {'; '.join(why[:2])}). Pick a format whose block size "
                      f"divides the rows, add a rule, or lower min_coverage to accept it")
    n_all = sum(r.numel for r in shipped)
    n_q = sum(r.numel for r in q)
    by_fmt: Dict[str, int] = {}
    for r in q:
        by_fmt[r.format] = by_fmt.get(r.format, 0) + r.numel
    totals = {
        "params": n_all,
        "quantized_params": n_q,
        "quantized_fraction": n_q / n_all if n_all else 0.0,
        "bits_total": sum(r.bits for r in shipped),
        "bits_per_param": sum(r.bits for r in shipped) / n_all if n_all else 0.0,
        "bits_per_quantized_param": sum(r.bits for r in q) / n_q if n_q else 0.0,
        "by_format": by_fmt,
        "excluded": [r.name for r in shipped if r.status == "excluded"],
        "missing": [r.name for r in rows if r.status == "MISSING"],
        "asked_params": n_asked,
        "asked_fraction": frac,
        "not_quantized": [r.name for r in asked if r.status != "quantized"],
    }
    return CoverageReport(rows, totals, errors)


# ============================================================================= convert
def _is_quant_site(m: nn.Module, pn: str) -> bool:
    return (isinstance(m, (QuantLinear, QuantEmbedding)) and pn == "weight") or \
        (isinstance(m, QuantExpertsMixin) and pn in ("gate_up_proj", "down_proj"))


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
        from transformers.core_model_loading import revert_weight_conversion
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
    from .formats import ConvertedModel
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
    return ConvertedModel(packed=packed, dense=dense, config=config, quant=quant, input_amax=input_amax,
                          act_formats=act_formats, fused_groups=groups, kv_cache=KV.kv_record(model),
                          coverage={k: v for k, v in rep.totals.items()},
                          recipe={"name": cfg.name} if cfg.name else {},
                          source_dir=src_dir if src_dir and os.path.isdir(str(src_dir)) else None)


# ============================================================================= ZeRO-3
def register_zero3_external_params(model: nn.Module) -> int:
    """Under DeepSpeed ZeRO-3 a module's forward sees only its own gathered parameters; a fused
    group member computing the shared amax reads its peers' weights too, so register them as
    external parameters of each member. Returns the number of registrations."""
    try:
        import deepspeed
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


# ============================================================================= save / load
QUANT_FILE = "qatfactory_quant.json"


def _student_state(model) -> Dict[str, torch.Tensor]:
    """state_dict without tied duplicates (safetensors refuses shared storage)."""
    sd = model.state_dict()
    out, seen = {}, {}
    for k, v in sd.items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) if v.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def save_student(model: nn.Module, out_dir: str) -> str:
    """config.json + model.safetensors (weights and quantizer state) + qatfactory_quant.json.
    Written to a temporary directory beside out_dir, then renamed into place. An existing out_dir
    is replaced only when it is empty or an earlier save_student output (its qatfactory_quant.json)."""
    from safetensors.torch import save_file

    from . import _fsutil
    cfg: QuantConfig = getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("save_student: the model is not prepared")
    with _fsutil.atomic_dir(out_dir, replace=True, kinds=("student",), what="save_student") as tmp:
        tmp = str(tmp)
        model.config.save_pretrained(tmp)
        state = _student_state(model)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt", "producer": "qatfactory"})
        dtype = str(next(iter(p for p in model.parameters())).dtype).replace("torch.", "")
        with open(os.path.join(tmp, QUANT_FILE), "w") as f:
            json.dump({"quant_config": cfg.to_dict(), "dtype": dtype,
                       "model_class": type(model).__name__}, f, indent=2)
    return out_dir


def load_student(path: str, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Rebuild a saved student: from_config (never remote code), prepare with the saved
    QuantConfig, then load weights and quantizer state through safetensors. A damaged file is
    named in the error (exitcodes.CorruptFileError, exit code 4)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ._fsutil import load_safetensors
    from .exitcodes import CorruptFileError
    qpath = os.path.join(path, QUANT_FILE)
    if not os.path.isfile(qpath):
        raise FileNotFoundError(f"load_student: {qpath} not found; {path} is not a directory written by save_student")
    try:
        with open(qpath) as f:
            meta = json.load(f)
        qc = meta["quant_config"]
        if qc is None and meta.get("plain"):
            raise FileNotFoundError(f"load_student: {path} holds a plain (unquantized) model from a format=bf16 "
                                    f"run; load it with transformers' from_pretrained")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptFileError(f"load_student: {qpath} is not a valid record ({type(e).__name__}: {e})") from None
    cfg = QuantConfig.from_dict(qc)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"load_student: {os.path.join(path, 'config.json')} cannot be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    dt = dtype or getattr(torch, meta.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=dt)
    prepare(model, cfg)
    state = load_safetensors(os.path.join(path, "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(_student_tied_keys(model))
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CorruptFileError(f"load_student: {path}/model.safetensors does not fit the rebuilt model: "
                               f"missing {missing[:8]}, unexpected {list(unexpected)[:8]}")
    return model


def _student_tied_keys(model) -> List[str]:
    sd = model.state_dict()
    kept = set(_student_state(model))
    return [k for k in sd if k not in kept]
