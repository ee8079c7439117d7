"""Which llama.cpp type each tensor gets in a Q4_K_M-style file: the one place that says it.

Follows ``llama_tensor_get_type_impl`` and ``tensor_type_fallback`` in llama.cpp
``src/llama-quant.cpp`` (read at commit 007dbbf, Nov 2026; summarised in
reference/formats.md 3.6 and exporters.md 6.6) for ftype LLAMA_FTYPE_MOSTLY_Q4_K_M:

    tensor (GGUF role)          type                      condition
    output.weight (lm_head)     q6_k                      row length % 256 == 0, else q8_0
    token_embd, tied            as output.weight          (no output.weight in the file: llama.cpp
                                                           reuses token_embd as the output matmul)
    token_embd, untied          base (q4_k)               then the fallback below (576 wide: q5_0)
    attn_v                      q6_k                      use_more_bits(layer, n_layers)
                                q8_0                      model has exactly 8 experts
    attn_k                      q8_0                      model has exactly 8 experts
    attn_output                 q5_k                      model has exactly 8 experts
    attn_qkv (fused)            q5_k
    ffn_down (dense/experts)    q6_k                      use_more_bits(layer, n_layers)
    anything else               base (q4_k)
    then: row length % block != 0  ->  q4_k: q5_0, q6_k: q8_0, q5_k: q5_1;
          still not divisible by 32 ->  f16

    use_more_bits(i, n) = i < n/8  or  i >= 7n/8  or  (i - n/8) % 3 == 2   (C integer division)

Not modelled: the 70B attn_v bump (needs llama.cpp's model-size class) and Falcon's rules.
Norms and routers are not quantized here (return None). The token embedding gets llama.cpp's type
(SmolLM2's tied 576-wide token_embd: q8_0, as ``llama-quantize ... Q4_K_M`` writes it, checked
against the tool itself in tests/exporters/test_llama_quantize.py); the training side then fake-quantizes
the embedding lookup and, tied, the output matmul with that same tensor (QuantEmbedding).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# 32-element / 256-element block sizes of the ggml types the policy can produce
_BLOCK = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "q5_0": 32, "q5_1": 32, "q8_0": 32}
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
# every registered format a Q4_K_M-style policy can give a tensor (f16 rows aside): what an export must hold
POLICY_FORMATS = tuple(_BLOCK)
_SUPPORTED_BASES = ("q4_k",)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    n8 = n_layers // 8
    # C's % keeps the sign of the dividend; Python's does not. (i - n8) < 0 only when i < n8,
    # which the first test already accepts, so the difference never shows.
    return i_layer < n8 or i_layer >= (7 * n_layers) // 8 or (i_layer - n8) % 3 == 2


def tensor_role(hf_name: str) -> Optional[str]:
    """GGUF role of an HF weight name (on-disk or in-memory), or None if never quantized."""
    n = hf_name[:-len(".weight")] if hf_name.endswith(".weight") else hf_name
    leaf = n.rsplit(".", 1)[-1]
    if leaf == "lm_head":
        return "output"
    if leaf in ("embed_tokens", "wte", "word_embeddings", "tok_embeddings"):
        return "token_embd"
    roles = {
        "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "qkv_proj": "attn_qkv", "query_key_value": "attn_qkv", "Wqkv": "attn_qkv",
        "gate_proj": "ffn_gate", "w1": "ffn_gate", "up_proj": "ffn_up", "w3": "ffn_up",
        "gate_up_proj": "ffn_gate", "down_proj": "ffn_down", "w2": "ffn_down",
    }
    return roles.get(leaf)


def ggml_policy(hf_name: str, shape: Sequence[int], n_layers: int, base: str = "q4_k",
                n_experts: int = 0, tied: bool = False) -> Optional[str]:
    """llama.cpp type for one tensor of a Q4_K_M-style target.

    hf_name: e.g. ``model.layers.3.self_attn.v_proj.weight`` (experts: the per-expert name or the
    fused 3-D parameter name); shape: its shape, rows last (``[..., in_features]``);
    n_layers: ``config.num_hidden_layers``; n_experts: experts per MoE layer (0 for dense);
    tied: the model ties lm_head to the embedding (the file then has no output.weight).
    Returns a format name (``q4_k``, ``q5_0``, ``q6_k``, ``q8_0``, ``q5_k``, ``q5_1``, ``f16``),
    or None for tensors that are not quantized (norms, routers, biases)."""
    if base not in _SUPPORTED_BASES:
        raise ValueError(f"ggml_policy: base={base!r}; allowed: {list(_SUPPORTED_BASES)}")
    if len(shape) < 2:
        return None
    role = tensor_role(hf_name)
    if role is None:
        return None
    m = _LAYER.search(hf_name)
    i_layer = int(m.group(1)) if m else 0
    ncols = int(shape[-1])
    t = base
    if role == "output" or (role == "token_embd" and tied):
        t = "q8_0" if ncols % _BLOCK[base] != 0 else "q6_k"
    elif role == "attn_v":
        if use_more_bits(i_layer, n_layers):
            t = "q6_k"
        if n_experts == 8:
            t = "q8_0"
    elif role == "attn_k":
        if n_experts == 8:
            t = "q8_0"
    elif role == "attn_output":
        if n_experts == 8:
            t = "q5_k"
    elif role == "attn_qkv":
        t = "q5_k"
    elif role == "ffn_down":
        if use_more_bits(i_layer, n_layers):
            t = "q6_k"
    return _fallback(t, ncols)


def _fallback(t: str, ncols: int) -> str:
    if ncols % _BLOCK[t] == 0:
        return t
    t2 = _FALLBACK.get(t)
    if t2 is None or ncols % _BLOCK[t2] != 0:
        return "f16"
    return t2
