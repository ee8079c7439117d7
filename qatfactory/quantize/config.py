"""QuantConfig, its module rules and presets: what to quantize, in which format, with which scales."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .._recipes import format_recipe, format_recipes
from ..formats import get_format, list_formats
from ..formats.kv import list_kv_formats
from ..formats.kv_attention import default_attention, list_kv_attentions
from ..formats.scale_search import SEARCH_METHODS
from ..nn import kv_cache as KV  # the KV cache in the loop (nn/kv_cache.py)
from ..nn.lowbit import GRAD_RULES as LOWBIT_GRAD_RULES

SCALE_STRATEGIES = ("dynamic", "frozen", "learnable")


CALIB_METHODS = SEARCH_METHODS   # the block-scale searches the formats know (formats/scale_search.py)


STE_MODES = ("identity", "clipped")


# the engine's attention arithmetic on the FP8 cache (formats/kv_attention.py)
KV_ATTENTION_CHOICES = ("auto", "none") + tuple(list_kv_attentions())


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
    # Qwen3.5 / Qwen3-Next Gated DeltaNet: the per-head b (beta) and a (decay step) projections, num_v_heads rows
    # each, which vLLM stacks into in_proj_ba and runs in the model dtype
    "*.linear_attn.in_proj_a",
    "*.linear_attn.in_proj_b",
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
      ``kv_calib_method``: max | mse. ``kv_attention``: the engine's attention arithmetic on that cache
      (formats/kv_attention.py, nn/kv_attention.py): ``fa3`` (vLLM's default FLASH_ATTN backend on
      Hopper: query cast to FP8, P cast to FP8 with FlashAttention 3's 2^8 offset), ``triton`` (vLLM's
      TRITON_ATTN: the same query cast, P cast without offset), ``none`` (only the cache write is
      emulated; attention in the model dtype) or ``auto`` (= ``fa3`` for fp8_e4m3, ``none`` for every
      other format). ``prepare`` resolves ``auto``; the saved config holds the rule trained with.
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
    * ``kquant_refresh_every``: K >= 1. 1 (default): every fake quant of a llama.cpp k-quant
      runs its full scale search. K > 1: inside the trainer's optimizer steps the search (Q4_K, Q6_K, and
      Q5_0 with an importance matrix) runs on steps 0, K, 2K, ... and the steps between only re-round the
      codes of the current weights under the kept scales; every evaluation, ``convert`` and export run the
      full search (nn/kquant_refresh.py).
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
    # KV-cache format (nn/kv_cache.py); None keeps the cache in the model dtype
    kv_format: Optional[str] = None
    kv_scale_strategy: str = "frozen"
    kv_calib_method: str = "max"
    kv_attention: str = "auto"
    # the k-quant scale search every K optimizer steps (nn/kquant_refresh.py); 1 = every forward
    kquant_refresh_every: int = 1

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
        _check_choice("QuantConfig.kv_attention", self.kv_attention, KV_ATTENTION_CHOICES)
        if isinstance(self.min_coverage, bool) or not isinstance(self.min_coverage, (int, float)) or \
                not 0.0 <= float(self.min_coverage) <= 1.0:
            raise ValueError(f"QuantConfig.min_coverage={self.min_coverage!r}; allowed: a number in 0..1 (the "
                             f"fraction of the Linear-like parameters asked for that must be quantized)")
        if isinstance(self.kquant_refresh_every, bool) or not isinstance(self.kquant_refresh_every, int) or \
                self.kquant_refresh_every < 1:
            raise ValueError(f"QuantConfig.kquant_refresh_every={self.kquant_refresh_every!r}; allowed: an int >= 1 "
                             f"(1 = the k-quant scale search in every forward; K = every K optimizer steps)")
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
            if self.kv_format not in list_kv_formats():
                raise ValueError(f"QuantConfig.kv_format={self.kv_format!r} is not a KV-cache format; allowed: "
                                 f"{list_kv_formats()} or None (the cache in the model dtype)")
            KV.check_attention(self.kv_format, self.resolved_kv_attention())
        elif self.kv_attention not in ("auto", "none"):
            raise ValueError(f"QuantConfig.kv_attention={self.kv_attention!r} without a kv_format: the FP8 attention "
                             f"rules read an FP8 KV cache; allowed: auto or none, or set kv_format=fp8_e4m3")
        if self.scale_strategy == "learnable" and self.lora.rank:
            raise ValueError("QuantConfig.scale_strategy='learnable' with lora.rank>0: LSQ scales and LoRA "
                             "together are not supported; allowed: one of them")
        return self

    def resolved_kv_attention(self) -> str:
        """kv_attention with ``auto`` replaced by what the engine runs by default for kv_format."""
        if self.kv_attention != "auto":
            return self.kv_attention
        return default_attention(self.kv_format) if self.kv_format is not None else "none"

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
        known = presets()
        if name not in known:
            raise ValueError(f"QuantConfig.preset: unknown recipe {name!r}; allowed: {sorted(known)} "
                             f"(recipes/format/*.yaml with a weight format)")
        d = dict(known[name])
        d.update(overrides)
        d.setdefault("name", name)
        return cls(**d)


def presets() -> Dict[str, Dict[str, Any]]:
    """The quantized format recipes (recipes/format/*.yaml, the files the trainer composes) by name."""
    out = {}
    for name in format_recipes():
        d = format_recipe(name)
        if d.get("weight_format") not in (None, "none"):
            out[name] = d
    return out


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
    if name in POLICY_TARGETS:
        return
    fmts = list_formats()
    if name not in fmts:
        raise ValueError(f"{fld}={name!r} is not a registered format; allowed: {fmts} "
                         f"or a policy target {list(POLICY_TARGETS)}")
    role = get_format(name).spec.role
    if role == "activation":
        raise ValueError(f"{fld}={name!r} is an activation-only format; allowed for weights: "
                         f"{[f for f in fmts if get_format(f).spec.role != 'activation']}")


def _check_act_format(fld: str, name: str) -> None:
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
