"""Native 4-bit checkpoints as frozen codes + scale bytes, for the scale-only adapters.

    ck = read_native("exports/nvfp4-ct")                 # ModelOpt / compressed-tensors / GGUF
    model = build_model(ck)                               # HF model, 4-bit linears -> ScaleAdapterLinear
    ...train theta...
    cm = merged_converted(model, ck)                      # ConvertedModel: the codes as read, new scale bytes
    save_scale_file(model, ck, "task.scales.safetensors") # the per-task file (a few % of the checkpoint)
    write_patched(ck.path, "task.scales.safetensors", "exports/task")   # the base, scale bytes replaced

Containers read (each with its own library: safetensors' ``safe_open``, gguf-py's ``GGUFReader``):

    ModelOpt NVFP4        <m>.weight u8 [out, in/2], .weight_scale f8e4m3 [out, in/16], .weight_scale_2 f32 (S)
    compressed-tensors    <m>.weight_packed u8, .weight_scale f8e4m3 (NVFP4) | u8 E8M0 (MXFP4),
                          .weight_global_scale f32 [1] = G = 1/S (NVFP4; the engine multiplies by fl(1/G))
    GGUF (llama.cpp)      NVFP4 (type 40) blocks [+ F32 <t>.scale = S], MXFP4 (type 39) blocks; Q/K rows of
                          the llama architecture un-permuted; names through gguf-py's own HF <-> GGUF table

Weight-only (W4A16) bases; an activation-quantized one, a checkpoint that is not NVFP4/MXFP4, fused
shards with different per-tensor scales, MoE experts, a path that leaves the directory, NaN scales:
each refused with one line (exitcodes: BadInputError, UnsafeFileError, CorruptFileError). Nothing
read from a file is ever used as a path except plain shard names checked to lie inside the directory.

The code plane: SHA-256 over the packed tensors in name order of ``name \\0 rows x cols \\0 codes``
(E2M1 pairs, element 2i in the low nibble, HF row order), the same for every container; the
gate's own reader (exporters/verify/code_plane.py) computes it independently.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import _fsutil
from ._inputs import read_json
from .exitcodes import BadInputError, CorruptFileError, UnsafeFileError
from .formats import ConvertedModel, PackedTensor, get_format
from .nn.scale_adapter import ScaleAdapterLinear
from .nn.scale_adapter import modules as adapter_modules

INDEX = "model.safetensors.index.json"
SCALE_FILE_KIND = "qatfactory_scales"
SCALE_FILE_VERSION = "2"        # 2: per-tensor fingerprint of the base (codes, per-tensor scale) and trust region
_SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                 "chat_template.json")
# GGUF architectures: (gguf-py MODEL_ARCH member, llama.cpp permutes Q/K rows)
_GGUF_ARCH = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


class NotNativeError(BadInputError):
    """The checkpoint is not a weight-only NVFP4 / MXFP4 layout the scale adapters can train."""


class FormatMismatchError(BadInputError):
    """The target format cannot hold the base's bytes exactly."""


class CodePlaneError(BadInputError):
    """A scale file made for another code plane (the base's codes changed, or it is another base)."""


@dataclass
class NativeCheckpoint:
    path: Path                       # the directory (GGUF: the directory holding the file)
    container: str                   # "modelopt" | "compressed-tensors" | "gguf"
    layout: str                      # "nvfp4" | "mxfp4"
    base_format: str                 # the registered format the stored bytes decode as
    config: Dict[str, Any]           # HF config (no quantization_config)
    packed: Dict[str, PackedTensor]  # HF weight name -> codes / scale bytes / S (HF row order)
    dense: Dict[str, torch.Tensor]   # every other tensor, by HF name, in its stored dtype
    files: List[str] = field(default_factory=list)
    gguf_file: Optional[str] = None
    record: Dict[str, Any] = field(default_factory=dict)   # qatfactory.json when present (read, not trusted)

    @property
    def source_dir(self) -> Optional[str]:
        return str(self.path) if any((self.path / n).is_file() for n in _SOURCE_FILES) else None

    def code_plane_sha256(self) -> str:
        return code_plane_sha256({n: p.codes for n, p in self.packed.items()})

    def nbytes(self) -> Dict[str, int]:
        codes = sum(p.codes.numel() for p in self.packed.values())
        scales = sum(p.scales.numel() for p in self.packed.values())
        dense = sum(t.numel() * t.element_size() for t in self.dense.values())
        return {"codes": codes, "scales": scales, "dense": dense, "total": codes + scales + dense}


def code_plane_sha256(codes: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(codes):
        c = codes[name].detach().cpu().contiguous()
        h.update(name.encode() + b"\0" + f"{c.shape[0]}x{c.shape[1]}".encode() + b"\0")
        h.update(c.numpy().tobytes())
    return h.hexdigest()


# ============================================================================ files
def _inside(d: Path, name: Any, what: str) -> Path:
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


def _json(d: Path, name: str) -> Dict[str, Any]:
    p = _inside(d, name, "file")
    try:
        obj = read_json(p)
    except CorruptFileError:
        raise
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{p}: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{p}: holds a {type(obj).__name__}, not a JSON object")
    return obj


def _record(d: Path) -> Dict[str, Any]:
    if (d / "qatfactory.json").is_file() and not (d / "qatfactory.json").is_symlink():
        try:
            return _json(d, "qatfactory.json")
        except BadInputError:
            return {}
    return {}


def _shards(d: Path) -> List[str]:
    if (d / INDEX).exists() or (d / INDEX).is_symlink():
        wm = _json(d, INDEX).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CorruptFileError(f"{d / INDEX}: no weight_map")
        names = sorted(set(wm.values()))
        for n in names:
            _inside(d, n, f"{INDEX} shard")
        return names
    _inside(d, "model.safetensors", "weights file")
    return ["model.safetensors"]


# ============================================================================ reading
def read_native(path) -> NativeCheckpoint:
    """Read a native NVFP4 / MXFP4 checkpoint: a safetensors export directory (ModelOpt or
    compressed-tensors) or a GGUF file (or a directory holding exactly one)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model.path={str(path)!r} does not exist (a native NVFP4/MXFP4 export directory or "
                                f"GGUF file)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise NotNativeError(f"{p}: a file that is not a .gguf; give a native NVFP4/MXFP4 export directory "
                                 f"(ModelOpt / compressed-tensors safetensors) or a GGUF file")
        return _read_gguf(p.parent, p.name)
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if ggufs:
        if len(ggufs) != 1:
            raise BadInputError(f"{p}: holds {len(ggufs)} GGUF files {ggufs}; give the file itself")
        _inside(p, ggufs[0], "GGUF file")
        return _read_gguf(p, ggufs[0])
    if not (p / "config.json").exists():
        raise NotNativeError(f"{p}: no config.json and no .gguf file: not a native NVFP4/MXFP4 checkpoint")
    return _read_safetensors(p)


def _qconfig(d: Path, cfg: Dict[str, Any]) -> Tuple[str, str, bool]:
    """(container, layout, activations quantized) from config.json / hf_quant_config.json."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict) and (d / "hf_quant_config.json").exists():
        hq = _json(d, "hf_quant_config.json")
        q = hq.get("quantization") if isinstance(hq.get("quantization"), dict) else {}
        qc = dict(q, quant_method="modelopt" if (hq.get("producer") or {}).get("name") == "modelopt" else None)
    if not isinstance(qc, dict):
        raise NotNativeError(f"{d}: config.json has no quantization_config: a high-precision checkpoint, not a native "
                             f"4-bit one. Scale adapters train the block scales of an NVFP4/MXFP4 export (quantize and "
                             f"export it first, e.g. qatfactory train method=ptq export=vllm)")
    qm = qc.get("quant_method")
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    acts = [g.get("input_activations") for g in groups.values() if isinstance(g, dict)]
    if qm == "modelopt":
        algo = str(qc.get("quant_algo") or "").upper()
        if "NVFP4" not in algo:
            raise NotNativeError(f"{d}: ModelOpt quant_algo={qc.get('quant_algo')!r}; scale adapters need NVFP4 "
                                 f"(W4A16_NVFP4)")
        w4a4 = algo == "NVFP4" and not (acts and all(a is None for a in acts))
        return "modelopt", "nvfp4", w4a4
    if qm == "compressed-tensors":
        fmts = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        fmts.discard(None)
        fmts.discard("mixed-precision")
        lay = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
        if len(fmts) != 1 or next(iter(fmts)) not in lay:
            raise NotNativeError(f"{d}: compressed-tensors format {sorted(fmts)}; scale adapters need "
                                 f"nvfp4-pack-quantized or mxfp4-pack-quantized (one scheme)")
        return "compressed-tensors", lay[fmts.pop()], any(a is not None for a in acts)
    raise NotNativeError(f"{d}: quantization_config quant_method={qm!r}; scale adapters need a ModelOpt NVFP4 or "
                         f"compressed-tensors NVFP4/MXFP4 export, or a GGUF with NVFP4/MXFP4 tensors")


def _check_hf_config(d, cfg: Dict[str, Any]) -> None:
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise NotNativeError(f"{d}: a mixture-of-experts model; scale adapters on expert tensors are not implemented "
                             f"(dense linears only)")


def _check_claimed_sizes(where, cfg: Dict[str, Any], names, layer_pattern: str,
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


def _read_safetensors(d: Path) -> NativeCheckpoint:
    cfg = _json(d, "config.json")
    container, layout, w4a4 = _qconfig(d, cfg)
    if w4a4:
        raise NotNativeError(f"{d}: an activation-quantized (W4A4) checkpoint; scale adapters train weight-only "
                             f"(W4A16) bases: export the base without activation quantization")
    _check_hf_config(d, cfg)
    sd: Dict[str, torch.Tensor] = {}
    files = _shards(d)
    for fn in files:
        try:
            with safe_open(str(d / fn), framework="pt") as f:
                for k in f.keys():
                    if k in sd:
                        raise CorruptFileError(f"{d / fn}: tensor {k} is stored twice")
                    sd[k] = f.get_tensor(k)
        except BadInputError:
            raise
        except Exception as e:
            raise CorruptFileError(f"{d / fn}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    emb = sd.get("model.embed_tokens.weight")
    _check_claimed_sizes(d / "config.json", cfg, sd, r"^model\.layers\.(\d+)\.",
                         tuple(emb.shape) if emb is not None and emb.ndim == 2 else None)
    packed: Dict[str, PackedTensor] = {}
    fmt = "nvfp4" if layout == "nvfp4" else "mxfp4"
    code_key = ".weight" if container == "modelopt" else ".weight_packed"
    for key in sorted(k for k in sd if k.endswith(".weight_scale")):
        m = key[: -len(".weight_scale")]
        codes, sc = sd.pop(m + code_key, None), sd.pop(key)
        if codes is None:
            raise CorruptFileError(f"{d}: {key} without {m}{code_key}")
        for w4a4_key in (".input_scale", ".input_global_scale"):
            if m + w4a4_key in sd:
                raise NotNativeError(f"{d}: {m}{w4a4_key}: an activation-quantized (W4A4) module; scale adapters "
                                     f"train weight-only (W4A16) bases")
        bs = 16 if layout == "nvfp4" else 32
        want_sdt = torch.float8_e4m3fn if layout == "nvfp4" else torch.uint8
        if codes.dtype != torch.uint8 or codes.ndim != 2 or sc.dtype != want_sdt or \
                tuple(sc.shape) != (codes.shape[0], codes.shape[1] * 2 // bs):
            raise CorruptFileError(f"{d}: {m}: codes {codes.dtype} {tuple(codes.shape)} / scales {sc.dtype} "
                                   f"{tuple(sc.shape)} are not {layout} (uint8 [out, in/2], "
                                   f"{str(want_sdt)[6:]} [out, in/{bs}])")
        g = None
        if layout == "nvfp4":
            if container == "modelopt":
                s2 = sd.pop(m + ".weight_scale_2", None)
                if s2 is None or s2.dtype != torch.float32 or s2.numel() != 1:
                    raise CorruptFileError(f"{d}: {m}.weight_scale_2 missing or not one float32")
                g = s2.reshape(()).clone()
            else:
                G = sd.pop(m + ".weight_global_scale", None)
                if G is None or G.dtype != torch.float32 or G.numel() != 1:
                    raise CorruptFileError(f"{d}: {m}.weight_global_scale missing or not one float32")
                g = (torch.ones((), dtype=torch.float32) / G.reshape(()))      # vLLM multiplies by fl(1/G)
            if not bool(torch.isfinite(g)) or float(g) <= 0:
                raise CorruptFileError(f"{d}: {m}: per-tensor scale {float(g)} is not a positive finite number")
        packed[m + ".weight"] = PackedTensor(fmt, (codes.shape[0], codes.shape[1] * 2), codes.contiguous(),
                                             sc.contiguous().view(torch.uint8), g)
    if not packed:
        raise NotNativeError(f"{d}: no {layout} tensors (no *.weight_scale) in the checkpoint")
    _check_fused(d, packed)
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return NativeCheckpoint(d, container, layout, fmt, cfg, packed, sd, files, record=_record(d))


def _check_fused(d, packed: Dict[str, PackedTensor]) -> None:
    """vLLM/SGLang load q/k/v and gate/up into one layer with ONE per-tensor scale (the max): a base
    whose shards differ is served differently from what its own bytes say, so it is refused."""
    mods = {n[: -len(".weight")] for n in packed}
    for m in sorted(mods):
        for first, rest in ((".q_proj", (".k_proj", ".v_proj")), (".gate_proj", (".up_proj",))):
            if not m.endswith(first):
                continue
            stem = m[: -len(first)]
            grp = [m] + [stem + r for r in rest if stem + r in mods]
            gs = {int(packed[x + ".weight"].global_scale.view(torch.int32)) for x in grp
                  if packed[x + ".weight"].global_scale is not None}
            if len(gs) > 1:
                raise BadInputError(f"{d}: fused shards {grp} carry different per-tensor scales; vLLM/SGLang decode "
                                    f"them with one (the max), so the checkpoint's own bytes are not what serves. "
                                    f"Re-export the base with shared fused scales")


def _unpermute(a: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's interleaved Q/K row order -> the HF rotate-half order (rows move whole)."""
    r = a.shape[0]
    return a.reshape(n_head, r // n_head // 2, 2, *a.shape[1:]).transpose(1, 2).reshape(a.shape)


def _permute(a: torch.Tensor, n_head: int) -> torch.Tensor:
    r = a.shape[0]
    return a.reshape(n_head, 2, r // n_head // 2, *a.shape[1:]).transpose(1, 2).reshape(a.shape)


def _gguf_config(reader, file: Path) -> Dict[str, Any]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415 (heavy: transformers)
    try:
        cfg = dict(load_gguf_checkpoint(str(file), return_tensors=False)["config"])
    except Exception as e:
        raise NotNativeError(f"{file}: transformers cannot read its model config ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    arch = _field(reader, "general.architecture")
    kl = _field(reader, f"{arch}.attention.key_length")
    if kl is not None:
        cfg["head_dim"] = int(kl)
    cfg.pop("_model_name_or_path", None)
    cfg["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    return cfg


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _read_gguf(d: Path, name: str) -> NativeCheckpoint:
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
    file = _inside(d, name, "GGUF file")
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:
        raise CorruptFileError(f"{file}: gguf-py cannot read it ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise NotNativeError(f"{file}: architecture {arch!r}; scale adapters read {sorted(_GGUF_ARCH)} GGUF files "
                             f"(MoE architectures are not implemented)")
    cfg = _gguf_config(reader, file)
    _check_hf_config(file, cfg)
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    _check_claimed_sizes(file, cfg, [t.name for t in reader.tensors], r"^blk\.(\d+)\.",
                         (int(emb.shape[1]), int(emb.shape[0])) if emb is not None and len(emb.shape) == 2 else None)
    arch_key, permute = _GGUF_ARCH[arch]
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_key), int(cfg["num_hidden_layers"]))
    mt = cfg.pop("model_type")
    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg))
    cfg["model_type"] = mt
    shapes = {k: tuple(v.shape) for k, v in skel.state_dict().items()}
    tensors = {t.name: t for t in reader.tensors}
    n_head, n_kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    packed: Dict[str, PackedTensor] = {}
    dense: Dict[str, torch.Tensor] = {}
    used = set()
    for hf, shape in shapes.items():
        stem, suf = (hf[: -len(".weight")], ".weight") if hf.endswith(".weight") else \
            (hf[: -len(".bias")], ".bias") if hf.endswith(".bias") else (hf, "")
        gname = tmap.get_name(stem)
        if gname is None:
            raise NotNativeError(f"{file}: gguf-py has no GGUF name for {hf}")
        t = tensors.get(gname + suf)
        if t is None:
            if hf == "lm_head.weight" and cfg["tie_word_embeddings"]:
                continue
            raise CorruptFileError(f"{file}: tensor {gname + suf} (for {hf}) is missing")
        used.add(t.name)
        heads = (n_head if ".attn_q." in t.name else n_kv if ".attn_k." in t.name else None) if permute else None
        kind = t.tensor_type.name
        if kind in ("NVFP4", "MXFP4"):
            rows, k = shape
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))
            if heads:
                raw = _unpermute(raw, heads)
            f = get_format("nvfp4_ggml" if kind == "NVFP4" else "mxfp4_ggml")
            p = f.from_bytes(raw.numpy(), k)
            if kind == "NVFP4" and gname + ".scale" in tensors:
                st = tensors[gname + ".scale"]
                used.add(st.name)
                sv = np.asarray(st.data, dtype=np.float32).reshape(-1)
                if st.tensor_type.name != "F32" or sv.size != 1 or not np.isfinite(sv[0]) or sv[0] <= 0:
                    raise CorruptFileError(f"{file}: {st.name} is not one positive finite F32")
                p = PackedTensor("nvfp4", p.shape, p.codes, p.scales, torch.tensor(float(sv[0]), dtype=torch.float32))
            packed[hf] = p
        elif kind in ("F32", "F16", "BF16"):
            arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
            dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
            v = torch.from_numpy(np.array(arr, dtype=np.float32)).to(dt)
            dense[hf] = _unpermute(v, heads) if heads else v
        else:
            raise NotNativeError(f"{file}: {t.name} is {kind}; scale adapters need NVFP4 or MXFP4 linears (one scale "
                                 f"byte per block over frozen E2M1 codes), not a {kind} layout")
    extra = sorted(set(tensors) - used)
    if extra:
        raise NotNativeError(f"{file}: tensors this loader does not map: {extra[:4]}")
    if not packed:
        raise NotNativeError(f"{file}: no NVFP4/MXFP4 tensors")
    fmts = {p.format for p in packed.values()}
    if len(fmts) != 1:
        raise NotNativeError(f"{file}: mixes {sorted(fmts)} tensors; one layout per checkpoint")
    base = fmts.pop()
    layout = "mxfp4" if base.startswith("mxfp4") else "nvfp4"
    return NativeCheckpoint(d, "gguf", layout, base, cfg, packed, dense, [name], gguf_file=name, record=_record(d))


# ============================================================================ the model
def resolve_target(ck: NativeCheckpoint, target: str = "auto") -> str:
    """The format whose encoder rounds the trained scales: 'auto' = the base's (the record's when it
    names a compatible one). Any other must decode the base's bytes to the same values."""
    if target == "auto":
        fs = ck.record.get("weight_formats") if isinstance(ck.record.get("weight_formats"), list) else []
        cand = [f for f in fs if isinstance(f, str)]
        target = ck.base_format
        if len(cand) == 1:
            try:
                check_target(ck, cand[0])
                target = cand[0]
            except (FormatMismatchError, ValueError):
                pass
    check_target(ck, target)
    return target


def check_target(ck: NativeCheckpoint, target: str) -> None:
    f = get_format(target)            # ValueError names the registered formats
    b = get_format(ck.base_format)
    s, sb = f.spec, b.spec
    why = None
    if s.role == "activation":
        why = "an activation format"
    elif s.element != sb.element or s.block_size != sb.block_size:
        why = f"{s.block_size}-element {s.scale_codec} blocks, the base has {sb.block_size}-element {sb.scale_codec} blocks"
    elif (s.global_scale is None) != (sb.global_scale is None):
        why = "a per-tensor scale where the base has none" if s.global_scale else "no per-tensor scale, the base has one"
    else:
        try:
            f.shift_scales(torch.zeros(1, 1, dtype=torch.uint8), torch.zeros(1, 1))
        except NotImplementedError:
            why = "no scale encoder to train with"
    if why is None:
        for n, p in ck.packed.items():
            q = PackedTensor(target, p.shape, p.codes, p.scales, p.global_scale)
            a, c = b.dequantize(p), f.dequantize(q)
            if not (torch.isfinite(a).all() and torch.equal(a, c)):
                why = f"{n} decodes differently (or to NaN)"
                break
    if why is not None:
        raise FormatMismatchError(f"format mismatch between the base ({ck.base_format}, {ck.container}) and the target "
                                  f"{target!r}: {why}; the trained scales must be bytes the base's layout decodes "
                                  f"exactly. Use the base's own format (method.scale.target=auto)")


def build_model(ck: NativeCheckpoint, target: str = "auto", param: str = "dense", rank: int = 8,
                ste: str = "continuous", targets=("*",), dtype: torch.dtype = torch.float32) -> nn.Module:
    """The HF model of ``ck`` with every packed linear a ScaleAdapterLinear (theta = 0: the base, bit for
    bit); every other parameter frozen. ``targets`` (fnmatch on module names) selects which train."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
    tgt = resolve_target(ck, target)
    cfg = dict(ck.config)
    mt = cfg.pop("model_type", None)
    if mt is None:
        raise CorruptFileError(f"{ck.path}: config has no model_type")
    for k in ("transformers_version", "architectures", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg), dtype=dtype)   # no remote code
    model.config._name_or_path = str(ck.path)
    dense = dict(ck.dense)
    named = dict(model.named_modules())
    hits = 0
    for name, p in sorted(ck.packed.items()):
        m = name[: -len(".weight")]
        lin = named.get(m)
        if not isinstance(lin, nn.Linear) or (lin.out_features, lin.in_features) != tuple(p.shape):
            raise CorruptFileError(f"{ck.path}: packed {name} {tuple(p.shape)} matches no linear of the "
                                   f"{mt} model the config describes")
        bias = dense.pop(m + ".bias", None)
        mod = ScaleAdapterLinear(tgt, p.codes, p.scales, p.global_scale, p.shape, bias=bias, param=param, rank=rank,
                                 ste=ste, name=m)
        train = any(fnmatch.fnmatchcase(m, pat) for pat in targets)
        hits += train
        for q in mod.trainable():
            q.requires_grad_(train)
        parent, leaf = m.rsplit(".", 1) if "." in m else ("", m)
        setattr(named[parent] if parent else model, leaf, mod)
    if not hits:
        raise BadInputError(f"method.scale.targets={list(targets)} match none of the {len(ck.packed)} 4-bit linears")
    for q in model.parameters():
        if not any(q is t for mod in adapter_modules(model).values() for t in mod.trainable()):
            q.requires_grad_(False)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                 for k, v in dense.items()}, strict=False)
    adapted = {n for n, _ in model.named_buffers()} | {n for n, _ in model.named_parameters()
                                                       if n.endswith((".theta", ".U", ".V"))}
    missing = [k for k in missing if k not in adapted and not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise CorruptFileError(f"{ck.path}: the tensors do not fit the {mt} model: missing {missing[:4]}, "
                               f"unexpected {list(unexpected)[:4]}")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    return model


# ============================================================================ the merge
@torch.no_grad()
def merged_converted(model: nn.Module, ck: NativeCheckpoint) -> ConvertedModel:
    """The trained model as plain data for the exporters: the base's codes and per-tensor scales as read,
    the scale bytes the forward uses now, every other tensor as the base stored it."""
    mods = adapter_modules(model)
    scales, fmts = {}, {}
    for name, p in ck.packed.items():
        m = mods.get(name[: -len(".weight")])
        if m is None:
            raise ValueError(f"merged_converted: {name} has no ScaleAdapterLinear in the model")
        if not torch.equal(m.codes.cpu(), p.codes):
            raise CodePlaneError(f"merged_converted: the codes of {name} changed in training (they are frozen buffers)")
        scales[name], fmts[name] = m.scale_bytes().cpu(), m.fmt_name
    return converted_with_scales(ck, scales, fmts)


def converted_with_scales(ck: NativeCheckpoint, scales: Dict[str, torch.Tensor], fmts=None) -> ConvertedModel:
    """ConvertedModel of the base with these scale bytes (a scale file's, or the trained ones): codes,
    per-tensor scales, dense tensors and config as the base holds them."""
    if not isinstance(fmts, dict):
        one = resolve_target(ck, fmts or "auto")       # a named format must decode the base's bytes identically
        fmts = {n: one for n in ck.packed}
    packed = {}
    for name, p in ck.packed.items():
        b = torch.as_tensor(scales[name])
        if b.dtype != torch.uint8 or tuple(b.shape) != tuple(p.scales.shape):
            raise CorruptFileError(f"{name}: scale bytes {b.dtype} {tuple(b.shape)}, the base {tuple(p.scales.shape)}")
        packed[name] = PackedTensor(fmts[name], p.shape, p.codes.clone(), b.clone(), p.global_scale)
    dense = {k: v.clone() for k, v in ck.dense.items()}      # biases of the 4-bit linears included
    return ConvertedModel(packed=packed, dense=dense, config=dict(ck.config),
                          quant={"method": "scale_adapter", "base": str(ck.path), "container": ck.container,
                                 "weight_format": sorted({p.format for p in packed.values()})},
                          recipe={"method": "scale_adapter", "base_code_plane_sha256": ck.code_plane_sha256()},
                          source_dir=ck.source_dir)


# ============================================================================ scale files
def _write_scale_file(tensors: Dict[str, torch.Tensor], meta: Dict[str, str], path) -> None:
    """Write atomically; a file already at ``path`` is replaced only when it is a scale file (its header says
    so): anything else there (a user's checkpoint given as --out by mistake) is refused and left alone."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise _fsutil.NotOursError(f"scale file: {path} is {'a symbolic link' if path.is_symlink() else 'not a file'};"
                                   f" it is not replaced. Nothing was changed: choose another path")
    if path.exists():
        try:
            with safe_open(str(path), "pt") as f:
                kind = (f.metadata() or {}).get("kind")
        except Exception:  # not safetensors at all
            kind = None
        if kind != SCALE_FILE_KIND:
            raise _fsutil.NotOursError(f"scale file: {path} exists and is not a qatfactory scale file; only an "
                                       f"earlier scale file is replaced. Nothing was changed: remove it yourself "
                                       f"or choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _gbits(g: Optional[torch.Tensor]) -> Optional[str]:
    """A per-tensor scale as its float32 bits (hex), exact where a decimal print would round."""
    return None if g is None else f"0x{int(g.detach().reshape(()).float().view(torch.int32)) & 0xFFFFFFFF:08x}"


def _bits_value(b: Optional[str]) -> str:
    if not isinstance(b, str):
        return "none"
    return f"{float(np.array([int(b, 16)], dtype=np.uint32).view(np.float32)[0])!r} ({b})"


def _tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def base_fingerprint(ck: NativeCheckpoint) -> Dict[str, str]:
    """What a scale file records of the base it was trained on: per 4-bit tensor the SHA-256 of its codes
    and of its block-scale bytes and the bits of its per-tensor scale (the value every block scale is
    multiplied by: the same scale bytes over another per-tensor scale are other weights)."""
    per = {n: {"codes_sha256": _tensor_sha(p.codes), "scales_sha256": _tensor_sha(p.scales),
               "global_scale": _gbits(p.global_scale)} for n, p in sorted(ck.packed.items())}
    g = hashlib.sha256(json.dumps({n: v["global_scale"] for n, v in per.items()}, sort_keys=True).encode())
    return {"base_code_plane_sha256": ck.code_plane_sha256(),
            "base_scales_sha256": code_plane_sha256({n: p.scales for n, p in ck.packed.items()}),
            "base_global_scales_sha256": g.hexdigest(), "base_tensors": json.dumps(per, sort_keys=True)}


def save_scale_file(model: nn.Module, ck: NativeCheckpoint, path, task: str = "",
                    max_changed: float = 1.0) -> Dict[str, Any]:
    """The trained scale bytes of every adapted linear (HF names, HF row order) with what they were trained
    on (:func:`base_fingerprint`) and the trust region they were trained under: ``max_changed`` (the most
    trained blocks whose byte may differ from the base's, nn.scale_adapter.limit_changed; 1 = no limit) and
    which tensors trained at all. Written atomically. Returns its metadata."""
    mods = adapter_modules(model)
    tensors = {name: mods[name[: -len(".weight")]].scale_bytes().cpu().contiguous() for name in sorted(ck.packed)}
    fmts = sorted({mods[n[: -len(".weight")]].fmt_name for n in ck.packed})
    trained = sorted(n for n in ck.packed if any(q.requires_grad for q in mods[n[: -len(".weight")]].trainable()))
    meta = {"kind": SCALE_FILE_KIND, "version": SCALE_FILE_VERSION, "format": ",".join(fmts), "layout": ck.layout,
            "base_container": ck.container, **base_fingerprint(ck), "max_changed": repr(float(max_changed)),
            "trained": json.dumps(trained), "task": task,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_scale_file(tensors, meta, path)
    return meta


def base_scale_file(ck: NativeCheckpoint, path) -> Dict[str, Any]:
    """The base's own scale bytes as a scale file: applying it is the rollback."""
    meta = {"kind": SCALE_FILE_KIND, "version": SCALE_FILE_VERSION, "format": ck.base_format, "layout": ck.layout,
            "base_container": ck.container, **base_fingerprint(ck), "max_changed": "0.0", "trained": "[]",
            "task": "base (rollback)", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_scale_file({n: p.scales.contiguous() for n, p in sorted(ck.packed.items())}, meta, path)
    return meta


# the scale bytes each layout's block-scale grid can hold; anything else is refused in a scale file
def _bad_bytes(layout: str, b: torch.Tensor):
    """(sign bit set, NaN, what is allowed) for the scale bytes ``b`` of ``layout``. E4M3 (and ggml's UE4M3):
    bit 7 is the sign, and a negative block scale negates the whole block (ggml drops the bit, so the same
    file would mean other weights in another engine); 0x7F / 0xFF are NaN. E8M0: 0xFF is NaN."""
    if layout == "nvfp4":
        return (b >= 0x80, (b & 0x7F) == 0x7F, "NVFP4 block scales are non-negative E4M3 bytes 0x00-0x7E (bit 7 "
                                               "negates the block, 0x7F/0xFF are NaN)")
    return torch.zeros_like(b, dtype=torch.bool), b == 0xFF, "MXFP4 block scales are E8M0 bytes 0x00-0xFE (0xFF is NaN)"


def _check_bytes(p: Path, tensors: Dict[str, torch.Tensor], layout: str) -> None:
    for k, t in sorted(tensors.items()):
        sign, nan, allowed = _bad_bytes(layout, t)
        for what, bad in (("is NaN", nan), ("has its sign bit set", sign)):
            if bool(bad.any()):
                r, c = (int(x) for x in bad.nonzero()[0])
                raise CorruptFileError(f"{p}: {k}: scale byte 0x{int(t[r, c]):02X} at [{r}, {c}] {what} "
                                       f"({int(bad.sum())} such bytes); {allowed}. Refused, nothing written")


def _base_record(p: Path, meta: Dict[str, str], ck: NativeCheckpoint):
    """(per-tensor record, trained names, max_changed) of a scale file's metadata; refused when missing
    (an older file) or malformed."""
    if meta.get("version") != SCALE_FILE_VERSION or "base_tensors" not in meta:
        raise CodePlaneError(f"{p}: scale file version {meta.get('version')!r} records no per-tensor fingerprint "
                             f"of its base (codes and per-tensor scales), so it cannot be checked against "
                             f"{ck.path}; write it again with this qatfactory (train, or scales extract)")
    try:
        rec = json.loads(meta["base_tensors"])
        trained = json.loads(meta.get("trained", ""))
        max_changed = float(meta.get("max_changed", ""))
        ok = isinstance(rec, dict) and all(isinstance(v, dict) for v in rec.values()) and \
            isinstance(trained, list) and all(isinstance(x, str) for x in trained) and 0.0 <= max_changed <= 1.0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise CorruptFileError(f"{p}: metadata base_tensors / trained / max_changed is not what save_scale_file "
                               f"writes; allowed: a JSON object by tensor, a JSON list of names, a fraction 0..1")
    return rec, set(trained), max_changed


def _check_base(p: Path, meta: Dict[str, str], tensors: Dict[str, torch.Tensor], ck: NativeCheckpoint) -> None:
    """The file was trained on this base: every tensor's codes and per-tensor scale are the ones it recorded,
    and its bytes lie inside the trust region it was trained under: at most ``max_changed`` of the trained
    blocks off the base's bytes (nn.scale_adapter.limit_changed), none of an untrained tensor, none of a
    block whose base byte the encoder never moves (zero, NaN, negative)."""
    rec, trained, max_changed = _base_record(p, meta, ck)
    if set(rec) != set(ck.packed) or set(tensors) != set(ck.packed):
        raise CodePlaneError(f"{p}: its 4-bit tensors differ from the base {ck.path}'s "
                             f"({sorted((set(rec) | set(tensors)) ^ set(ck.packed))[:4]}); another checkpoint")
    for n, pk in sorted(ck.packed.items()):
        r = rec[n]
        if r.get("codes_sha256") != _tensor_sha(pk.codes):
            raise CodePlaneError(f"{p}: {n}: trained on codes {str(r.get('codes_sha256'))[:16]}..., the base "
                                 f"{ck.path} holds {_tensor_sha(pk.codes)[:16]}...: another code plane; a scale file "
                                 f"applies only onto the codes it was trained on")
        if r.get("global_scale") != _gbits(pk.global_scale):
            raise CodePlaneError(f"{p}: {n}: trained over the per-tensor scale {_bits_value(r.get('global_scale'))}, "
                                 f"the base {ck.path} has {_bits_value(_gbits(pk.global_scale))}: the same scale "
                                 f"bytes would mean other weights; apply it onto the base it was trained on")
        if tuple(tensors[n].shape) != tuple(pk.scales.shape):
            raise CorruptFileError(f"{p}: {n} has shape {tuple(tensors[n].shape)}, the base {tuple(pk.scales.shape)}")
    # against the block-scale bytes it was trained from: the base's when it still holds them; a tensor the
    # file keeps at exactly those recorded bytes (a rollback file applied onto a task's export) moved nothing
    changed = total = 0
    for n, pk in sorted(ck.packed.items()):
        t = tensors[n]
        if _tensor_sha(pk.scales) == rec[n].get("scales_sha256"):
            diff = t != pk.scales
        elif _tensor_sha(t) == rec[n].get("scales_sha256"):
            diff = torch.zeros_like(t, dtype=torch.bool)
        else:
            raise CodePlaneError(f"{p}: {n}: the base {ck.path} does not hold the block scales this file was trained "
                                 f"from ({str(rec[n].get('scales_sha256'))[:16]}...), so its trust region cannot be "
                                 f"checked; apply it onto the base it was trained on")
        if n not in trained:
            if bool(diff.any()):
                raise CorruptFileError(f"{p}: {n}: {int(diff.sum())} scale bytes differ from the base's, but this "
                                       f"tensor did not train (method.scale.targets); refused, nothing written")
            continue
        sign, nan, _ = _bad_bytes(ck.layout, pk.scales)
        if bool((diff & ((pk.scales == 0) | sign | nan)).any()):
            raise CorruptFileError(f"{p}: {n}: moves a block whose base scale byte is zero, negative or NaN, which "
                                   f"the scale encoder never moves; refused, nothing written")
        changed += int(diff.sum())
        total += t.numel()
    allowed = int(max_changed * total)
    if changed > allowed:
        raise CorruptFileError(f"{p}: {changed} of the {total} trained blocks differ from the base's scale bytes; "
                               f"the trust region it was trained under allows {allowed} (max_changed={max_changed}, "
                               f"nn.scale_adapter.limit_changed); refused, nothing written")


def load_scale_file(path, ck: Optional[NativeCheckpoint] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(HF weight name -> uint8 scale bytes, metadata). Bytes the layout's scale grid cannot hold (a sign
    bit, NaN) are refused; with ``ck``: refused unless it was trained on that base (every tensor's codes and
    per-tensor scale, :func:`_check_base`) and its bytes lie in the trust region it was trained under."""
    p = Path(path)
    if not p.is_file() or p.is_symlink():
        raise FileNotFoundError(f"scale file {str(path)!r} does not exist (or is a symbolic link)")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise CorruptFileError(f"{p}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("kind") != SCALE_FILE_KIND:
        raise BadInputError(f"{p}: not a qatfactory scale file (metadata kind={meta.get('kind')!r})")
    bad = [k for k, t in tensors.items() if t.dtype != torch.uint8 or t.ndim != 2]
    if bad:
        raise CorruptFileError(f"{p}: {bad[:3]} are not 2-D uint8 scale bytes")
    if meta.get("layout") not in ("nvfp4", "mxfp4"):
        raise CorruptFileError(f"{p}: metadata layout={meta.get('layout')!r}; allowed: 'nvfp4', 'mxfp4'")
    if ck is not None and meta["layout"] != ck.layout:
        raise CodePlaneError(f"{p}: made for the code plane of an {meta['layout']} base; {ck.path} is {ck.layout}: "
                             f"another checkpoint")
    _check_bytes(p, tensors, meta["layout"])
    if ck is not None:
        sha = ck.code_plane_sha256()
        if meta.get("base_code_plane_sha256") != sha and "base_tensors" not in meta:
            raise CodePlaneError(f"{p}: made for code plane {str(meta.get('base_code_plane_sha256'))[:16]}..., the base "
                                 f"{ck.path} has {sha[:16]}...: its codes changed or it is another checkpoint; a scale "
                                 f"file applies only onto the code plane it was trained on")
        _check_base(p, meta, tensors, ck)
        if meta.get("base_code_plane_sha256") != sha:
            raise CodePlaneError(f"{p}: made for code plane {str(meta.get('base_code_plane_sha256'))[:16]}..., the base "
                                 f"{ck.path} has {sha[:16]}...; a scale file applies only onto the code plane it was "
                                 f"trained on")
    return tensors, meta


@torch.no_grad()
def apply_scales(model: nn.Module, ck: NativeCheckpoint, path) -> Dict[str, str]:
    """In-memory task swap: the model's adapted linears take the file's bytes (theta reset to 0)."""
    tensors, meta = load_scale_file(path, ck)
    mods = adapter_modules(model)
    for name, t in tensors.items():
        mods[name[: -len(".weight")]].set_scales(t)
    return meta


# ============================================================================ the patched checkpoint
def write_patched(base, scale_file, out_dir, force: bool = False) -> Dict[str, Any]:
    """A copy of the base checkpoint (same container) whose scale bytes are the file's and whose every
    other byte of every tensor (codes, per-tensor scales, dense tensors) is the base's. Written
    atomically; an existing ``out_dir`` is replaced only with ``force`` and only when it is ours."""
    ck = read_native(base)
    tensors, meta = load_scale_file(scale_file, ck)
    protect = [ck.path]
    changed = sum(int((tensors[n] != p.scales).sum()) for n, p in ck.packed.items())
    with _fsutil.atomic_dir(out_dir, replace=force, kinds=("export",), what="scales apply", protect=protect) as tmp:
        if ck.container == "gguf":
            _patch_gguf(ck, tensors, tmp)
        else:
            _patch_safetensors(ck, tensors, tmp)
        for name in sorted(os.listdir(ck.path)):
            src = ck.path / name
            if name in ck.files or name == "qatfactory.json" or name.startswith("."):
                continue
            if src.is_symlink() or not src.is_file():
                continue        # only regular files travel: never a link, never a directory
            shutil.copyfile(src, tmp / name, follow_symlinks=False)
        rec = dict(ck.record) if ck.record else {"qatfactory_export": 1, "engine": "llama_cpp" if ck.container == "gguf"
                                                 else "vllm", "flavour": ck.container}
        rec["scales_applied"] = {"scale_file": Path(scale_file).name, "task": meta.get("task", ""),
                                 "base": str(ck.path), "base_code_plane_sha256": ck.code_plane_sha256(),
                                 "scale_bytes_changed": changed,
                                 "applied": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / "qatfactory.json").write_text(json.dumps(rec, indent=2) + "\n")
    return {"out_dir": str(out_dir), "scale_bytes_changed": changed, "code_plane_sha256": ck.code_plane_sha256()}


def _patch_safetensors(ck: NativeCheckpoint, tensors: Dict[str, torch.Tensor], tmp: Path) -> None:
    for fn in ck.files:
        with safe_open(str(ck.path / fn), framework="pt") as f:
            meta = f.metadata()
            sd = {k: f.get_tensor(k) for k in f.keys()}
        for k in list(sd):
            if k.endswith(".weight_scale") and k[: -len("_scale")] in tensors:
                new = tensors[k[: -len("_scale")]]
                sd[k] = new.view(torch.float8_e4m3fn) if sd[k].dtype == torch.float8_e4m3fn else new.clone()
        save_file(sd, str(tmp / fn), metadata=meta)
    if (ck.path / INDEX).is_file():
        shutil.copyfile(ck.path / INDEX, tmp / INDEX, follow_symlinks=False)


def _patch_gguf(ck: NativeCheckpoint, tensors: Dict[str, torch.Tensor], tmp: Path) -> None:
    """Copy the file, then overwrite each NVFP4/MXFP4 tensor's blocks in place (at the offsets gguf-py
    reads) with the same blocks holding the new scale bytes; every other byte stays the base's."""
    src = ck.path / ck.gguf_file
    dst = tmp / ck.gguf_file
    shutil.copyfile(src, dst, follow_symlinks=False)
    reader = gguf.GGUFReader(str(src))
    arch = _field(reader, "general.architecture")
    arch_key, permute = _GGUF_ARCH[arch]
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_key), int(ck.config["num_hidden_layers"]))
    by = {t.name: t for t in reader.tensors}
    n_head = int(ck.config["num_attention_heads"])
    n_kv = int(ck.config.get("num_key_value_heads") or n_head)
    with open(dst, "r+b") as out:
        for name, p in sorted(ck.packed.items()):
            gname = tmap.get_name(name[: -len(".weight")]) + ".weight"
            t = by[gname]
            fmt = get_format("nvfp4_ggml" if t.tensor_type.name == "NVFP4" else "mxfp4_ggml")
            old = np.array(t.data, dtype=np.uint8).reshape(p.shape[0], -1)
            q = PackedTensor(fmt.name, p.shape, p.codes, tensors[name].clone(), None)
            new = torch.from_numpy(np.ascontiguousarray(fmt.to_bytes(q)))
            heads = (n_head if ".attn_q." in gname else n_kv if ".attn_k." in gname else None) if permute else None
            if heads:
                new = _permute(new, heads)
            new = new.numpy()
            rt = fmt.to_bytes(PackedTensor(fmt.name, p.shape, p.codes, p.scales, None))
            if heads:
                rt = _permute(torch.from_numpy(np.ascontiguousarray(rt)), heads).numpy()
            if not np.array_equal(rt, old):
                raise CorruptFileError(f"{src}: {gname} does not re-encode to its own bytes; not patched")
            if new.shape != old.shape or int(new.nbytes) != int(t.n_bytes):
                raise CorruptFileError(f"{src}: {gname}: {new.shape} bytes for a {old.shape} tensor")
            out.seek(int(t.data_offset))
            out.write(new.tobytes())
