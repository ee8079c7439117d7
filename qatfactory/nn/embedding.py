"""QuantEmbedding: an nn.Embedding whose lookup returns rows of its fake-quantized weight.

llama.cpp stores ``token_embd`` quantized (Q4_K_M: Q8_0 for SmolLM2's tied 576-wide table, the
base type with its fallback when untied) and reads it with ``ggml_get_rows``, which dequantizes
the selected rows. So the training forward must look up exactly those dequantized rows:

    forward(ids) = dequantize(quantize(W))[ids]          straight-through gradient into W

Every format here quantizes each row on its own (blocks never cross a row; the importance matrix
is per column; NVFP4's per-tensor scale comes from the amax of the whole table, passed in), so
with ``dynamic`` scales the lookup quantizes only the rows it gathers: the same values as
quantizing the whole table, for a fraction of the work (tests/nn/test_nn.py checks the equality).
Frozen / learnable scale state is per row of the whole table; those strategies quantize the table.

A model that ties its output head to the embedding (SmolLM2, Qwen3-0.6B) runs the head as a
QuantLinear that holds this module's ``weight`` Parameter and **this same WeightQuantizer**
(``tie_head``), so the logits multiply by the very tensor the lookup reads, as llama.cpp reuses
``token_embd`` for the output when the file has no ``output.weight``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fake_quant import WeightQuantizer
from .linear import QuantLinear

_INF = float("inf")


class QuantEmbedding(nn.Module):
    def __init__(self, emb: nn.Embedding, weight_format: str, strategy: str = "dynamic", ste: str = "identity",
                 name: str = ""):
        super().__init__()
        if type(emb) is not nn.Embedding:
            raise ValueError(f"{name or 'embedding'}: {type(emb).__name__} is not a plain nn.Embedding (a scaled "
                             f"or custom embedding would change the rows after the lookup); quantized embeddings "
                             f"support nn.Embedding only. Keep it wide: QuantConfig(quantize_embeddings=False)")
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError(f"{name or 'embedding'}: nn.Embedding with max_norm / scale_grad_by_freq / sparse is "
                             f"not supported for quantized embeddings; keep it wide (quantize_embeddings=False)")
        self.num_embeddings = emb.num_embeddings
        self.embedding_dim = emb.embedding_dim
        self.padding_idx = emb.padding_idx
        self.weight = emb.weight
        self.qname = name
        self.weight_quant = WeightQuantizer(weight_format, strategy, (1, self.num_embeddings, self.embedding_dim),
                                            ste, device=self.weight.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_quant.fmt_name}"

    @property
    def weight_format(self) -> str:
        return self.weight_quant.fmt_name

    def amax(self) -> torch.Tensor:
        """Per-tensor amax [1] of the whole table (NVFP4's global scale needs it; ggml types ignore it)."""
        with torch.no_grad():
            return torch.linalg.vector_norm(self.weight.detach(), _INF).float().reshape(1)

    def _amax_dyn(self) -> Optional[torch.Tensor]:
        return self.amax() if self.weight_quant.strategy == "dynamic" else None

    def quantized_weight(self) -> torch.Tensor:
        """The whole fake-quantized table [V, H] in the weight dtype (what a tied head multiplies by)."""
        return self.weight_quant(self.weight.unsqueeze(0), self._amax_dyn())[0].to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight_quant.strategy != "dynamic":
            return F.embedding(input_ids, self.quantized_weight(), self.padding_idx)
        rows = F.embedding(input_ids, self.weight, self.padding_idx)
        shp = rows.shape
        q = self.weight_quant(rows.reshape(1, -1, self.embedding_dim), self.amax())
        return q.reshape(shp).to(self.weight.dtype)

    @torch.no_grad()
    def pack(self, r0: int = 0, r1: Optional[int] = None):
        w = self.weight.detach().unsqueeze(0)
        return self.weight_quant.pack(w, 0, r0, self.num_embeddings if r1 is None else r1, self._amax_dyn())


def tie_head(head: nn.Module, emb: QuantEmbedding, name: str = ""):
    """A QuantLinear for a tied output head: the embedding's Parameter and its quantizer, shared."""
    if getattr(head, "weight", None) is not emb.weight:
        raise ValueError(f"{name}: the output head does not share the embedding's weight; it is not tied")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{name}: a tied output head with a bias is not supported for quantized embeddings")
    q = QuantLinear(head, emb.weight_format, emb.weight_quant.strategy, None, emb.weight_quant.ste, name=name)
    q.weight_quant = emb.weight_quant          # one quantizer (and its state) for both uses
    object.__setattr__(q, "tied_to", emb)      # a reference, not a second registration of the embedding
    return q
