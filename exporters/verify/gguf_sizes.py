"""A GGUF's size claims against the tensors it actually holds, before anything is built from them.

The gate builds models from a file's metadata (transformers' config mapping, llama.cpp's runtime),
so a 2-block file claiming ``llama.block_count = 200,000,000`` would have it prepare 200 million
layers before any comparison. Each size key that a tensor's shape also states is compared with that
shape first (gguf-py's ``GGUFReader`` gives each tensor's ne), and a disagreement is refused in one
line naming the key, the claimed value and what the tensors hold:

    <arch>.block_count                 the blk.<n> groups present (0 .. n-1, each once)
    <arch>.embedding_length            token_embd.weight ne[0]
    <arch>.vocab_size, token list      token_embd.weight ne[1]
    <arch>.attention.head_count(_kv)   attn_q / attn_k rows = heads x key_length
    <arch>.feed_forward_length         ffn_up.weight rows (dense blocks)
    <arch>.expert_count                ffn_up_exps / ffn_gate_inp: experts
    <arch>.expert_feed_forward_length  ffn_up_exps rows

Only what the file states is read; nothing here allocates in proportion to a claimed value.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

_BLK = re.compile(r"^blk\.(\d+)\.")


def _int(reader, key: str) -> Optional[Any]:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        v = f.contents()
    except Exception:
        return "unreadable"
    return v


def _ne(tensors: Dict[str, Any], name: str) -> Optional[List[int]]:
    t = tensors.get(name)
    return None if t is None else [int(x) for x in t.shape]


def size_problems(reader, arch: str) -> List[str]:
    """Each size claim of the metadata that the tensors contradict, as 'key=claimed: the tensors hold ...'."""
    tensors = {t.name: t for t in reader.tensors}
    bad: List[str] = []

    def claim(key: str):
        v = _int(reader, f"{arch}.{key}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            bad.append(f"{arch}.{key}={v!r}: not a non-negative integer")
            return None
        return v

    blocks = sorted({int(m.group(1)) for n in tensors for m in [_BLK.match(n)] if m})
    n_blk = claim("block_count")
    if n_blk is not None and (n_blk != len(blocks) or blocks != list(range(len(blocks)))):
        held = f"{len(blocks)} blocks" + (f" (blk.{blocks[0]} .. blk.{blocks[-1]})" if blocks else "")
        bad.append(f"{arch}.block_count={n_blk} claimed; the tensors hold {held}")
    emb = _ne(tensors, "token_embd.weight")
    width = claim("embedding_length")
    if emb is not None and len(emb) == 2:
        if width is not None and width != emb[0]:
            bad.append(f"{arch}.embedding_length={width} claimed; token_embd.weight holds rows of {emb[0]}")
        vs = claim("vocab_size")
        if vs is not None and vs != emb[1]:
            bad.append(f"{arch}.vocab_size={vs} claimed; token_embd.weight holds {emb[1]} rows")
        toks = reader.fields.get("tokenizer.ggml.tokens")
        if toks is not None and len(toks.data) != emb[1]:
            bad.append(f"tokenizer.ggml.tokens has {len(toks.data)} entries; token_embd.weight holds {emb[1]} rows")
    heads, heads_kv = claim("attention.head_count"), claim("attention.head_count_kv")
    key_len = claim("attention.key_length")
    if key_len is None and heads and width:
        key_len = width // heads if width % heads == 0 else None
    q, k = _ne(tensors, "blk.0.attn_q.weight"), _ne(tensors, "blk.0.attn_k.weight")
    if heads is not None and key_len and q is not None and heads * key_len != q[-1]:
        bad.append(f"{arch}.attention.head_count={heads} claimed (x key_length {key_len}); blk.0.attn_q.weight "
                   f"holds {q[-1]} rows")
    if heads_kv is not None and key_len and k is not None and heads_kv * key_len != k[-1]:
        bad.append(f"{arch}.attention.head_count_kv={heads_kv} claimed (x key_length {key_len}); "
                   f"blk.0.attn_k.weight holds {k[-1]} rows")
    ff = claim("feed_forward_length")
    up = _ne(tensors, "blk.0.ffn_up.weight")
    if ff is not None and up is not None and len(up) == 2 and ff != up[1]:
        bad.append(f"{arch}.feed_forward_length={ff} claimed; blk.0.ffn_up.weight holds {up[1]} rows")
    n_exp, eff = claim("expert_count"), claim("expert_feed_forward_length")
    exps = _ne(tensors, "blk.0.ffn_up_exps.weight")
    if exps is not None and len(exps) == 3:
        if n_exp is not None and n_exp != exps[2]:
            bad.append(f"{arch}.expert_count={n_exp} claimed; blk.0.ffn_up_exps.weight holds {exps[2]} experts")
        if eff is not None and eff != exps[1]:
            bad.append(f"{arch}.expert_feed_forward_length={eff} claimed; blk.0.ffn_up_exps.weight holds "
                       f"{exps[1]} rows")
        if arch == "llama" and ff is not None and up is None and ff != exps[1]:
            bad.append(f"{arch}.feed_forward_length={ff} claimed; blk.0.ffn_up_exps.weight holds {exps[1]} rows")
    elif n_exp:
        gate = _ne(tensors, "blk.0.ffn_gate_inp.weight")
        if gate is None or gate[-1] != n_exp:
            bad.append(f"{arch}.expert_count={n_exp} claimed; the tensors hold "
                       f"{'no expert tensors' if gate is None else f'{gate[-1]} router rows'}")
    used = claim("expert_used_count")
    if used is not None and (n_exp is None and used > 0 or n_exp is not None and used > n_exp):
        bad.append(f"{arch}.expert_used_count={used} claimed; the file has {n_exp or 0} experts")
    return bad
