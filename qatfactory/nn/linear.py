"""QuantLinear: an nn.Linear whose weight (and, for W4A4, input) is fake-quantized.

Keeps the original ``weight``/``bias`` Parameter objects under the same names, so the HF state
dict keys do not change; quantizer state sits in ``weight_quant.*`` / ``input_quant.*``.
Members of an engine-fused group (q/k/v, gate/up) share one per-tensor amax: in ``dynamic`` mode
each member reads all members' weights every forward (under ZeRO-3 call
``qatfactory.quantize.register_zero3_external_params`` so they are gathered).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fake_quant import ActQuantizer, WeightQuantizer
from .lora import LoRA


class QuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, weight_format: str, strategy: str = "dynamic",
                 act_format: Optional[str] = None, ste: str = "identity", name: str = ""):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.qname = name
        dev = self.weight.device
        self.weight_quant = WeightQuantizer(weight_format, strategy, (1, self.out_features, self.in_features), ste,
                                            device=dev)
        self.input_quant = ActQuantizer(act_format, device=dev) if act_format else None
        if self.input_quant is not None:
            self.input_quant.owner = name
        self.lora: Optional[LoRA] = None
        self._group: List["QuantLinear"] = [self]     # plain list: peers are not submodules

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"

    @property
    def weight_format(self) -> str:
        return self.weight_quant.fmt_name

    def add_lora(self, rank: int, alpha: float) -> LoRA:
        self.lora = LoRA(self.in_features, self.out_features, rank, alpha, device=self.weight.device)
        return self.lora

    def merged_weight(self) -> torch.Tensor:
        """The weight the quantizer sees: W, or W + (alpha/r)·B·A (float32) with LoRA."""
        return self.weight if self.lora is None else self.lora.merge(self.weight)

    def group_amax(self) -> torch.Tensor:
        """Shared per-tensor amax [1]: max |W| over the fused group, from detached weights."""
        with torch.no_grad():
            a = torch.stack([m.merged_weight().detach().abs().amax().float() for m in self._group]).amax()
        return a.reshape(1)

    def quantized_weight(self) -> torch.Tensor:
        w = self.merged_weight()
        amax = self.group_amax() if self.weight_quant.strategy == "dynamic" else None
        return self.weight_quant(w.unsqueeze(0), amax)[0].to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return F.linear(x, self.quantized_weight(), self.bias)

    @torch.no_grad()
    def pack(self, r0: int = 0, r1: Optional[int] = None):
        w = self.merged_weight().detach().unsqueeze(0)
        amax = self.group_amax() if self.weight_quant.strategy == "dynamic" else None
        return self.weight_quant.pack(w, 0, r0, self.out_features if r1 is None else r1, amax)
