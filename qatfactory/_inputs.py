"""Files a user hands us, read with limits before anything is built from them.

* :func:`read_json` / :func:`loads`: JSON with a size and a nesting limit (a 200,000-deep document
  otherwise ends in the parser's RecursionError), and no NaN / Infinity (Python's parser accepts
  them; JSON does not, and a NaN epsilon would flow silently into a model). A file that breaks a
  limit is a CorruptFileError (exit 4) naming the file and the key.
* :func:`safetensors_shapes`: the tensor names and shapes of a model folder's safetensors files,
  from their headers only (no weight is read).
* :func:`check_model_config`: a model folder's config.json against those shapes (layers, vocabulary,
  hidden sizes), so a config that claims 4,000 layers or a 2^40 vocabulary over weights that hold 2
  layers is refused before a model of that size is allocated.

A leaf module (the standard library and exitcodes only), so the trainer, the faces and the exporters
may all import it.
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .exitcodes import CorruptFileError

MAX_BYTES = 64 * 2**20          # config and record files are kilobytes; large tokenizer.json files ~35 MB
MAX_DEPTH = 64                  # Hugging Face configs and tokenizers nest about 5 deep
TOKENIZER_MAX_BYTES = 256 * 2**20  # tokenizer.json of large vocabularies (Gemma's ~33 MB)
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors reference reader's own limit on a header
# an unquoted string body (escapes included) and everything that is not a bracket
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _too_deep(text: str, limit: int) -> bool:
    d = 0
    for c in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        d += 1 if c in "[{" else -1
        if d > limit:
            return True
    return False


def _nonfinite(obj: Any, path: str = "") -> Optional[Tuple[str, float]]:
    """The first (key path, value) holding NaN or +-Infinity, or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return path or "(the document)", obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            hit = _nonfinite(v, f"{path}.{k}" if path else str(k))
            if hit:
                return hit
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            hit = _nonfinite(v, f"{path}[{i}]")
            if hit:
                return hit
    return None


def loads(text: str, where: str, *, max_depth: int = MAX_DEPTH, finite: bool = True) -> Any:
    """``json.loads`` with the limits; ``where`` names the file (and line) in the error."""
    if _too_deep(text, max_depth):
        raise CorruptFileError(f"{where}: JSON nested deeper than {max_depth} levels; allowed: at most {max_depth}")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(f"{where}: not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                               ) from None
    if finite:
        hit = _nonfinite(obj)
        if hit is not None:
            raise CorruptFileError(f"{where}: {hit[0]} = {hit[1]}; allowed: a finite number (JSON has no NaN or "
                                   f"Infinity)")
    return obj


def read_json(path, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH, finite: bool = True,
              want: Optional[type] = None) -> Any:
    """A JSON file read with the limits; ``want`` (e.g. dict) is the type the document must have."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise CorruptFileError(f"{p}: {size:,} bytes; allowed: at most {max_bytes:,} for this file")
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptFileError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CorruptFileError(f"{p}: file not found") from None
    obj = loads(text, str(p), max_depth=max_depth, finite=finite)
    if want is not None and not isinstance(obj, want):
        raise CorruptFileError(f"{p}: the document is a JSON {type(obj).__name__}; allowed: a JSON "
                               f"{'object' if want is dict else want.__name__}")
    return obj


# ----------------------------------------------------------------------------- safetensors headers
def safetensors_header(path) -> Dict[str, Any]:
    """The JSON header of one safetensors file (tensor name -> {dtype, shape, data_offsets})."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CorruptFileError(f"{p}: not a safetensors file (shorter than its 8-byte header length)")
            n = struct.unpack("<Q", raw)[0]
            if n > MAX_HEADER_BYTES or n > p.stat().st_size - 8:
                raise CorruptFileError(f"{p}: safetensors header length {n:,}; allowed: at most "
                                       f"{min(MAX_HEADER_BYTES, p.stat().st_size - 8):,} (the file is truncated or damaged)")
            text = f.read(n).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptFileError(f"{p}: safetensors header is not UTF-8 (the file is truncated or damaged)") from None
    head = loads(text, f"{p} (safetensors header)", max_depth=8)
    if not isinstance(head, dict):
        raise CorruptFileError(f"{p}: safetensors header is no JSON object (the file is truncated or damaged)")
    head.pop("__metadata__", None)
    return head


def safetensors_shapes(model_dir) -> Dict[str, List[int]]:
    """{tensor name: shape} over every ``*.safetensors`` file directly in ``model_dir`` (headers only)."""
    out: Dict[str, List[int]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        if not f.is_file():
            continue
        for name, rec in safetensors_header(f).items():
            shape = rec.get("shape") if isinstance(rec, dict) else None
            if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
                raise CorruptFileError(f"{f}: tensor {name!r} has shape {shape!r} in its header; allowed: a list of "
                                       f"ints >= 0")
            out[name] = shape
    return out


# the decoder's own blocks (a vision tower's "encoder.layers.N" is not counted)
_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
# the config keys a decoder's tensors pin down: (key, tensor-name suffix, shape index)
_PINNED = (("vocab_size", "embed_tokens.weight", 0), ("hidden_size", "embed_tokens.weight", 1),
           ("intermediate_size", "model.layers.0.mlp.gate_proj.weight", 0),
           ("intermediate_size", "model.layers.0.mlp.gate_proj.weight_packed", 0))


def check_model_config(model_dir, config: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """config.json of ``model_dir`` read with the limits and checked against the safetensors headers:
    num_hidden_layers against the layers the tensors hold, vocab_size and hidden_size against the
    input embedding; every size an int >= 1. Returns the config. CorruptFileError (exit 4) names the
    file, the key, its value and what the tensors allow."""
    d = Path(model_dir)
    cpath = d / "config.json"
    cfg = read_json(cpath, want=dict) if config is None else config
    sizes = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "head_dim")
    for k in sizes:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise CorruptFileError(f"{cpath}: {k} = {v!r}; allowed: an int >= 1")
    # the other JSON files a loader parses from the folder, under the same limits (NaN aside: not ours to judge)
    for name, limit in (("tokenizer_config.json", MAX_BYTES), ("generation_config.json", MAX_BYTES),
                        ("special_tokens_map.json", MAX_BYTES), ("tokenizer.json", TOKENIZER_MAX_BYTES)):
        if (d / name).is_file():
            read_json(d / name, max_bytes=limit, finite=False)
    shapes = safetensors_shapes(d)
    if not shapes:
        return cfg
    layers = {int(m.group(1)) for n in shapes for m in [_LAYER.search(n)] if m}
    n_layers = cfg.get("num_hidden_layers")
    if layers and n_layers is not None and n_layers != max(layers) + 1:
        raise CorruptFileError(f"{cpath}: num_hidden_layers = {n_layers}, but the safetensors files hold layers "
                               f"0..{max(layers)}; allowed: {max(layers) + 1}")
    for key, suffix, i in _PINNED:
        v = cfg.get(key)
        emb = [(n, s) for n, s in shapes.items() if n.endswith(suffix) and len(s) == 2]
        if v is not None and emb and emb[0][1][i] != v:
            raise CorruptFileError(f"{cpath}: {key} = {v}, but the safetensors files hold {emb[0][0]} of shape "
                                   f"{emb[0][1]}; allowed: {emb[0][1][i]}")
    return cfg
