"""The plain-data hand-off from ``quantize.convert`` to the exporters.

Exporters import ``qatfactory.formats`` only, so this container lives here and holds
nothing but tensors, strings and dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .spec import PackedTensor


@dataclass
class ConvertedModel:
    """A trained student as the engines will store it.

    * ``packed``: on-disk HF parameter name (``model.layers.0.self_attn.q_proj.weight``;
      experts per expert, ``...mlp.experts.3.gate_proj.weight``) -> PackedTensor (2-D).
    * ``dense``: every other tensor, by on-disk name, in the model dtype (bf16 usually).
    * ``input_amax``: module name (no ``.weight``) -> activation amax (float32 0-d) for
      W4A4 modules; fused groups already share one value.
    * ``act_formats``: module name -> activation format name (W4A4), absent for W4A16.
    * ``fused_groups``: lists of module names that share one per-tensor scale.
    * ``config``: the HF model config as a dict (``config.to_dict()``).
    * ``quant``: the resolved QuantConfig as a dict; ``coverage``: totals from the report.
    * ``source_dir``: the base model directory (tokenizer, generation config, chat template).
    * ``kv_cache``: {} when the engine's KV cache stays in the model dtype; else ``{"format": a
      qatfactory.formats.kv name, "strategy": "frozen", "layers": {attention module name:
      {"k_scale", "v_scale", "k_amax", "v_amax"} (float32 0-d; empty for cache types without a
      per-tensor scale)}}``: what the student's attention fake-quantized K and V with.
    """

    packed: Dict[str, PackedTensor]
    dense: Dict[str, torch.Tensor]
    config: Dict[str, Any]
    quant: Dict[str, Any] = field(default_factory=dict)
    input_amax: Dict[str, torch.Tensor] = field(default_factory=dict)
    act_formats: Dict[str, str] = field(default_factory=dict)
    fused_groups: List[List[str]] = field(default_factory=list)
    coverage: Dict[str, Any] = field(default_factory=dict)
    recipe: Dict[str, Any] = field(default_factory=dict)
    source_dir: Optional[str] = None
    kv_cache: Dict[str, Any] = field(default_factory=dict)

    def formats_used(self) -> List[str]:
        return sorted({p.format for p in self.packed.values()})
