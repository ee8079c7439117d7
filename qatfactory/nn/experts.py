"""QuantExperts: fake quant for transformers' fused 3-D MoE experts.

transformers 5.x keeps MoE experts as two 3-D parameters (Qwen2/3-MoE, Mixtral, OLMoE, ...):

    gate_up_proj [E, 2I, H]   rows 0..I-1 = gate (on disk experts.e.gate_proj / w1), I..2I-1 = up (up_proj / w3)
    down_proj    [E, H, I]    (down_proj / w2)

Blocks run along the last axis (the reduction axis), so each expert's rows are quantized as the
engine will hold them. One per-tensor amax per expert for gate_up (gate and up of an expert share
it: vLLM uses one ``w13_weight_scale_2`` per expert) and one per expert for down. W4A4: one
activation amax per layer for the gate/up input and one for the down input, shared by all
experts (the safe choice for MoE backends that collapse per-expert input scales).

The module is the original experts object with its class swapped for a subclass, so parameter
names stay ``gate_up_proj``/``down_proj`` and the model's configured experts implementation
(eager / grouped_mm / batched_mm) still does the matmuls: during the forward the fake-quantized
tensors shadow the parameters in the instance ``__dict__``. The down-input activation quant hooks
``_apply_gate`` (called by grouped_mm / batched_mm between the two projections).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import step_cache, weight_cache
from .fake_quant import ActQuantizer, WeightQuantizer

_SWAPPED = {}
GATE_HOOK_IMPLS = ("grouped_mm", "batched_mm")


def is_fused_experts(module: nn.Module) -> bool:
    p = module._parameters
    return (isinstance(p.get("gate_up_proj"), nn.Parameter) and p["gate_up_proj"].ndim == 3
            and isinstance(p.get("down_proj"), nn.Parameter) and p["down_proj"].ndim == 3)


def check_supported(module: nn.Module, name: str, w4a4: bool) -> None:
    """Layouts we quantize: concatenated [gate; up], not transposed, no biases, gated."""
    bad = []
    for attr, want in (("is_transposed", False), ("has_bias", False), ("is_concatenated", True),
                       ("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(module, attr, want) != want:
            bad.append(f"{attr}={getattr(module, attr)}")
    if bad:
        raise NotImplementedError(f"{name} ({type(module).__name__}): fused experts with {', '.join(bad)} are not "
                                  f"supported; supported: gate_up_proj [E, 2I, H] concatenated [gate; up], "
                                  f"down_proj [E, H, I], no biases")
    if w4a4:
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if impl not in GATE_HOOK_IMPLS:
            raise ValueError(f"{name}: W4A4 experts need the down-projection input between the two matmuls, which "
                             f"experts_implementation={impl!r} does not expose; allowed: {list(GATE_HOOK_IMPLS)} "
                             f"(load the model with experts_implementation='grouped_mm')")


class QuantExpertsMixin:
    """Mixed into the model's own experts class (see module docstring)."""

    def _qf_setup(self, fmt_gate_up: str, fmt_down: str, strategy: str, act_gate_up: Optional[str],
                  act_down: Optional[str], ste: str, name: str):
        self.qname = name
        dev = self.gate_up_proj.device
        self.gate_up_quant = WeightQuantizer(fmt_gate_up, strategy, tuple(self.gate_up_proj.shape), ste, device=dev)
        self.down_quant = WeightQuantizer(fmt_down, strategy, tuple(self.down_proj.shape), ste, device=dev)
        self.gate_up_input_quant = ActQuantizer(act_gate_up, device=dev) if act_gate_up else None
        self.down_input_quant = ActQuantizer(act_down, device=dev) if act_down else None
        for q, what in ((self.gate_up_input_quant, "gate_up_proj input"), (self.down_input_quant, "down_proj input")):
            if q is not None:
                q.owner = f"{name} ({what})"

    @property
    def intermediate(self) -> int:
        return self.gate_up_proj.shape[1] // 2

    @staticmethod
    def expert_amax(w: torch.Tensor) -> torch.Tensor:
        """Per-expert amax [E] (gate and up share it because they are one row range)."""
        with torch.no_grad():
            return torch.linalg.vector_norm(w.detach(), float("inf"), dim=(1, 2)).float()

    def _dyn(self, q: WeightQuantizer, w: torch.Tensor):
        return self.expert_amax(w) if q.strategy == "dynamic" else None

    def _wc_sites(self):
        s = self.__dict__.get("_wc_site_objs")
        if s is None:
            s = self.__dict__["_wc_site_objs"] = (
                weight_cache.site(self, "gate_up_proj", "gate_up_quant", experts=True),
                weight_cache.site(self, "down_proj", "down_quant", experts=True))
        return s

    def quantized_weights(self):
        if step_cache.weights_cached():
            # inside the trainer: fq(W) once per optimizer step (nn/weight_cache.py), same bits and gradients
            sites = self._wc_sites()
            es = [weight_cache.lookup(s) for s in sites]
            if all(e is not None for e in es):
                return tuple(weight_cache.training_weight(s, e) for s, e in zip(sites, es))
        gu = self.gate_up_quant(self.gate_up_proj, self._dyn(self.gate_up_quant, self.gate_up_proj))
        dn = self.down_quant(self.down_proj, self._dyn(self.down_quant, self.down_proj))
        return gu.to(self.gate_up_proj.dtype), dn.to(self.down_proj.dtype)

    def forward(self, hidden_states, *args, **kwargs):
        gu, dn = self.quantized_weights()
        if self.gate_up_input_quant is not None:
            # rows are tokens and blocks run along H, so quantizing before the per-expert gather
            # equals quantizing each expert's gathered rows (one static amax for all experts)
            hidden_states = self.gate_up_input_quant(hidden_states)
        d = self.__dict__
        d["gate_up_proj"], d["down_proj"] = gu, dn
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            del d["gate_up_proj"], d["down_proj"]

    def _apply_gate(self, gate_up_out):
        y = super()._apply_gate(gate_up_out)
        if self.down_input_quant is not None:
            y = self.down_input_quant(y)
        return y

    @torch.no_grad()
    def pack(self, which: str, e: int, r0: int, r1: int):
        q = self.gate_up_quant if which == "gate_up_proj" else self.down_quant
        w = getattr(self, which)
        return q.pack(w.detach(), e, r0, r1, self._dyn(q, w))


def make_quant_experts(module: nn.Module) -> nn.Module:
    """Swap the class of an experts module for a QuantExperts subclass of it (in place)."""
    cls = type(module)
    if isinstance(module, QuantExpertsMixin):
        return module
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"Quant{cls.__name__}", (QuantExpertsMixin, cls), {"__module__": __name__})
    module.__class__ = _SWAPPED[cls]
    return module


# the name tests and users check against
QuantExperts = QuantExpertsMixin
