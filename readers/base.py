"""What every native-checkpoint reader shares: the checkpoint record, the code-plane fingerprint, the
refusals, and the file checks (a name read from a file is used only when it is a plain file inside the
directory)."""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from qatfactory._inputs import read_json
from qatfactory.exitcodes import BadInputError, CorruptFileError, UnsafeFileError
from qatfactory.formats import PackedTensor

INDEX = "model.safetensors.index.json"
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                "chat_template.json")


class NotNativeError(BadInputError):
    """The checkpoint is not a weight-only NVFP4 / MXFP4 layout the scale adapters can train."""


class FormatMismatchError(BadInputError):
    """The target format cannot hold the base's bytes exactly."""


class CodePlaneError(BadInputError):
    """A scale file made for another code plane (the base's codes changed, or it is another base)."""


@dataclass
class NativeCheckpoint:
    path: Path                       # the directory (GGUF: the directory holding the file)
    container: str                   # a flavour of formats.layouts.ENGINE_FLAVOURS: "modelopt" | "compressed-tensors" | "gguf"
    layout: str                      # the codec family's label (formats.layouts.Codec value): "nvfp4" | "mxfp4"
    base_format: str                 # the registered format the stored bytes decode as
    config: Dict[str, Any]           # HF config (no quantization_config)
    packed: Dict[str, PackedTensor]  # HF weight name -> codes / scale bytes / S (HF row order)
    dense: Dict[str, torch.Tensor]   # every other tensor, by HF name, in its stored dtype
    files: List[str] = field(default_factory=list)
    gguf_file: Optional[str] = None
    record: Dict[str, Any] = field(default_factory=dict)   # qatfactory.json when present (read, not trusted)

    @property
    def source_dir(self) -> Optional[str]:
        return str(self.path) if any((self.path / n).is_file() for n in SOURCE_FILES) else None

    def code_plane_sha256(self) -> str:
        return code_plane_sha256({n: p.codes for n, p in self.packed.items()})

    def nbytes(self) -> Dict[str, int]:
        codes = sum(p.codes.numel() for p in self.packed.values())
        scales = sum(p.scales.numel() for p in self.packed.values())
        dense = sum(t.numel() * t.element_size() for t in self.dense.values())
        return {"codes": codes, "scales": scales, "dense": dense, "total": codes + scales + dense}


def code_plane_sha256(codes: Dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order of ``name \\0 rows x cols \\0 bytes``."""
    h = hashlib.sha256()
    for name in sorted(codes):
        c = codes[name].detach().cpu().contiguous()
        h.update(name.encode() + b"\0" + f"{c.shape[0]}x{c.shape[1]}".encode() + b"\0")
        h.update(c.numpy().tobytes())
    return h.hexdigest()


# ============================================================================ files
def inside(d: Path, name: Any, what: str) -> Path:
    """d / name for a plain file name naming a regular file inside d (never a path that leaves it)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafeFileError(f"{d}: {what} {name!r} is not a plain file name inside the directory; refused, not read")
    p = d / name
    real, root = os.path.realpath(p), os.path.realpath(d)
    if os.path.dirname(real) != root:
        raise UnsafeFileError(f"{d}: {what} {name!r} resolves to {real}, outside the directory; refused, not read")
    if not os.path.isfile(real):
        raise CorruptFileError(f"{d}: {what} {name!r} is missing")
    return p


def json_object(d: Path, name: str) -> Dict[str, Any]:
    p = inside(d, name, "file")
    try:
        obj = read_json(p)
    except CorruptFileError:
        raise
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{p}: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{p}: holds a {type(obj).__name__}, not a JSON object")
    return obj


def export_record(d: Path) -> Dict[str, Any]:
    """qatfactory.json when it is a regular readable JSON object, else {} (read, never trusted)."""
    if (d / "qatfactory.json").is_file() and not (d / "qatfactory.json").is_symlink():
        try:
            return json_object(d, "qatfactory.json")
        except BadInputError:
            return {}
    return {}


def shards(d: Path) -> List[str]:
    if (d / INDEX).exists() or (d / INDEX).is_symlink():
        wm = json_object(d, INDEX).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CorruptFileError(f"{d / INDEX}: no weight_map")
        names = sorted(set(wm.values()))
        for n in names:
            inside(d, n, f"{INDEX} shard")
        return names
    inside(d, "model.safetensors", "weights file")
    return ["model.safetensors"]


# ============================================================================ config checks
def check_hf_config(d, cfg: Dict[str, Any]) -> None:
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise NotNativeError(f"{d}: a mixture-of-experts model; scale adapters on expert tensors are not implemented "
                             f"(dense linears only)")


def check_claimed_sizes(where, cfg: Dict[str, Any], names, layer_pattern: str,
                        embed: Optional[Tuple[int, int]]) -> None:
    """The config's layer count, vocabulary and width against the tensors present, before a model is built from
    the config: a file claiming 200 million layers over two would otherwise have a skeleton of every claimed
    layer made (minutes, gigabytes) before any tensor is compared. ``embed`` is (vocab rows, width)."""
    pat = re.compile(layer_pattern)
    ids = sorted({int(m.group(1)) for n in names for m in [pat.match(n)] if m})
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n != len(ids) or ids != list(range(len(ids))):
        held = f"{len(ids)} layer{'' if len(ids) == 1 else 's'}" + (f" ({ids[0]} .. {ids[-1]})" if ids else "")
        raise CorruptFileError(f"{where}: num_hidden_layers={n!r} claimed; the tensors hold {held}")
    if embed is not None:
        for key, held in (("vocab_size", embed[0]), ("hidden_size", embed[1])):
            v = cfg.get(key)
            if v is not None and v != held:
                raise CorruptFileError(f"{where}: {key}={v!r} claimed; the embedding tensor holds {held}")
