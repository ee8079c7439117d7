"""LoRA on a frozen fake-quantized base, merged *before* quantization (QA-LoRA style).

The training forward of a LoRA'd QuantLinear is

    y = x @ fake_quant(W + (alpha / r) * B @ A)^T + b

not ``x @ fake_quant(W)^T + (alpha/r) * x @ A^T @ B^T``. ``convert`` merges W + (alpha/r)·B·A and
then quantizes, so with this forward the packed tensors that ship are exactly the weights the
adapter was trained through ("what trains is what ships"). The unmerged form would train a
bf16 side path that no 4-bit engine runs. Gradients reach A and B through the format's
straight-through estimator. Dropout must be 0: a random input mask does not commute with the
merge. The merge is done in float32 (W + delta is never rounded to bf16 before quantizing), and
convert uses the same ``merge`` function.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class LoRA(nn.Module):
    """A [r, in] and B [out, r] (float32; B starts at zero so the merged weight starts at W)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, device=None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank={rank}; allowed: an int > 0")
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"

    def delta(self) -> torch.Tensor:
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def merge(self, w: torch.Tensor) -> torch.Tensor:
        """W + (alpha/r)·B·A in float32."""
        return w.float() + self.delta()
