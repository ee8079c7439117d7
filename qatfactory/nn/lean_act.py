"""Less activation memory in a Llama-family block, the same bits (the live-QAD peak).

A training step's peak is at the end of the forward (the loss), where every tensor saved for the
backward is alive. Per token and layer of a Hugging Face Llama in bf16 (hidden H, MLP width I), what
autograd keeps includes, besides what the linears need:

* each RMSNorm (two per layer): its input upcast to fp32 (4H bytes) and the normalized value cast back
  to bf16 (2H) -- while the bf16 input itself (2H), the residual stream, is otherwise not kept;
* the MLP's ``act_fn(gate) * up``: the gate output (2I, for SiLU's backward), SiLU's output and the up
  output (2I each, for the product's backward); the product (2I) is the down projection's input.

:func:`register` makes both recompute what they need in the backward from what is kept anyway
(``torch.utils.checkpoint``, non-reentrant, of the norm and of the activation-times-up product only):
a norm keeps its bf16 input (2H instead of 6H), the product keeps gate and up (4I instead of 6I). The
recompute runs the same ops on the same inputs and the backward is autograd's own graph of them, so
forward values and every gradient are bit-identical (tests/nn/test_lean_act.py); the cost is the
recomputed norm (~8 launches each) and SiLU-and-product (2) in the backward. At the benchmarked H200
shape (hidden 2048, MLP 5632, 16 layers, 4 x 2048 tokens) that is 2.06 GiB for the 33 norms and
1.38 GiB for the 16 MLPs (benchmarks/step_memory.py).

Patched per module instance (its ``forward``): RMSNorm modules whose only parameter is ``weight`` (any
such norm is recomputed with its own forward), and MLPs whose forward is Llama's
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (LlamaMLP, Qwen2/3, Mistral). Anything else is left as it is.
"""
from __future__ import annotations

import inspect
import types
from typing import Dict

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_MLP_EXPR = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
_LEAN = "_qf_lean_act"


def _act_mul(act, g, u):
    return act(g) * u


def _lean_mlp_forward(self, x):
    g = self.gate_proj(x)
    u = self.up_proj(x)
    return self.down_proj(checkpoint(_act_mul, self.act_fn, g, u, use_reentrant=False, preserve_rng_state=False))


def _lean_norm_forward(self, x):
    return checkpoint(type(self).forward, self, x, use_reentrant=False, preserve_rng_state=False)


def _is_llama_mlp(m: nn.Module) -> bool:
    if not all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False
    return _MLP_EXPR in " ".join(src.split())


def _is_rms_norm(m: nn.Module) -> bool:
    names = [n for n, _ in m.named_parameters(recurse=False)]
    return type(m).__name__.endswith("RMSNorm") and names == ["weight"] and not list(m.children())


def register(model: nn.Module) -> Dict[str, int]:
    """Patch the model's norms and MLPs in place (idempotent); returns how many of each."""
    n = {"norms": 0, "mlps": 0}
    for m in model.modules():
        if getattr(m, _LEAN, False):
            continue
        if _is_rms_norm(m):
            m.forward = types.MethodType(_lean_norm_forward, m)
            n["norms"] += 1
        elif _is_llama_mlp(m):
            m.forward = types.MethodType(_lean_mlp_forward, m)
            n["mlps"] += 1
        else:
            continue
        setattr(m, _LEAN, True)
    return n


def unregister(model: nn.Module) -> None:
    for m in model.modules():
        if getattr(m, _LEAN, False):
            del m.forward
            delattr(m, _LEAN)
