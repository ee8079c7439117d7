"""Scale-only adapters over native 4-bit checkpoints: the model, the merge and the scale files.

    ck = read_native("exports/nvfp4-ct")                 # qatfactory.readers: ModelOpt / compressed-tensors / GGUF
    model = build_model(ck)                               # HF model, 4-bit linears -> ScaleAdapterLinear
    ...train theta...
    cm = merged_converted(model, ck)                      # ConvertedModel: the codes as read, new scale bytes
    save_scale_file(model, ck, "task.scales.safetensors") # the per-task file (a few % of the checkpoint)
    write_patched(ck.path, "task.scales.safetensors", "exports/task")   # the base, scale bytes replaced

Reading a checkpoint (containers, refusals, the code-plane fingerprint) is qatfactory.readers, beside the
exporters; its public names are re-exported here. A scale file holds every adapted tensor's block-scale
bytes (HF names, HF row order) with what they were trained on: per tensor the SHA-256 of the base's codes
and scale bytes and the bits of its per-tensor scale, and the trust region (max_changed, which tensors
trained). It applies only onto that base, only with bytes the layout's scale grid holds.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import _fsutil
from .exitcodes import BadInputError, CorruptFileError
from .formats import ConvertedModel, PackedTensor, get_format
from .formats.layouts import ENGINE_FLAVOURS, FLAVOUR_TENSORS, GGUF_FLAVOUR, Codec
from .nn.scale_adapter import ScaleAdapterLinear
from .nn.scale_adapter import modules as adapter_modules
from .readers import (  # noqa: F401  (the reader's public names, as they were here)
    INDEX,
    CodePlaneError,
    FormatMismatchError,
    NativeCheckpoint,
    NotNativeError,
    check_target,
    code_plane_sha256,
    read_native,
    resolve_target,
)
from .readers import gguf_file as _gguf_file
from .readers import layouts as _layouts

SCALE_FILE_KIND = "qatfactory_scales"
SCALE_FILE_VERSION = "2"        # 2: per-tensor fingerprint of the base (codes, per-tensor scale) and trust region


# ============================================================================ the model
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
    if _layouts.by_label(layout).codec is Codec.E2M1_E4M3_FP32:
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
    if meta.get("layout") not in _layouts.labels():
        raise CorruptFileError(f"{p}: metadata layout={meta.get('layout')!r}; allowed: "
                               f"{', '.join(map(repr, _layouts.labels()))}")
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
        if ck.container == GGUF_FLAVOUR:
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
        # the first engine whose exporter writes this container flavour (vllm for ModelOpt / compressed-tensors)
        engine = next(e for e, fls in ENGINE_FLAVOURS.items() if ck.container in fls)
        rec = dict(ck.record) if ck.record else {"qatfactory_export": 1, "engine": engine, "flavour": ck.container}
        rec["scales_applied"] = {"scale_file": Path(scale_file).name, "task": meta.get("task", ""),
                                 "base": str(ck.path), "base_code_plane_sha256": ck.code_plane_sha256(),
                                 "scale_bytes_changed": changed,
                                 "applied": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / "qatfactory.json").write_text(json.dumps(rec, indent=2) + "\n")
    return {"out_dir": str(out_dir), "scale_bytes_changed": changed, "code_plane_sha256": ck.code_plane_sha256()}


def _patch_safetensors(ck: NativeCheckpoint, tensors: Dict[str, torch.Tensor], tmp: Path) -> None:
    suffix = FLAVOUR_TENSORS[ck.container].block_scales
    for fn in ck.files:
        with safe_open(str(ck.path / fn), framework="pt") as f:
            meta = f.metadata()
            sd = {k: f.get_tensor(k) for k in f.keys()}
        for k in list(sd):
            w = k[: -len(suffix)] + ".weight"
            if k.endswith(suffix) and w in tensors:
                sd[k] = tensors[w].clone().view(sd[k].dtype)       # the same bytes, in the stored scale dtype
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
    tmap, permute = _gguf_file.name_map(reader, int(ck.config["num_hidden_layers"]))
    by = {t.name: t for t in reader.tensors}
    n_head = int(ck.config["num_attention_heads"])
    n_kv = int(ck.config.get("num_key_value_heads") or n_head)
    with open(dst, "r+b") as out:
        for name, p in sorted(ck.packed.items()):
            gname = tmap.get_name(name[: -len(".weight")]) + ".weight"
            t = by[gname]
            fmt = get_format(_layouts.blocks_format(t.tensor_type))
            old = np.array(t.data, dtype=np.uint8).reshape(p.shape[0], -1)
            q = PackedTensor(fmt.name, p.shape, p.codes, tensors[name].clone(), None)
            new = torch.from_numpy(np.ascontiguousarray(fmt.to_bytes(q)))
            heads = (n_head if ".attn_q." in gname else n_kv if ".attn_k." in gname else None) if permute else None
            if heads:
                new = _gguf_file.permute(new, heads)
            new = new.numpy()
            rt = fmt.to_bytes(PackedTensor(fmt.name, p.shape, p.codes, p.scales, None))
            if heads:
                rt = _gguf_file.permute(torch.from_numpy(np.ascontiguousarray(rt)), heads).numpy()
            if not np.array_equal(rt, old):
                raise CorruptFileError(f"{src}: {gname} does not re-encode to its own bytes; not patched")
            if new.shape != old.shape or int(new.nbytes) != int(t.n_bytes):
                raise CorruptFileError(f"{src}: {gname}: {new.shape} bytes for a {old.shape} tensor")
            out.seek(int(t.data_offset))
            out.write(new.tobytes())
