"""What every exporter shares: the engine registry, atomic output directories, the fused-group
scale check, the ``qatfactory.json`` record, sharded safetensors and source-file copies.

Exporters see a :class:`qatfactory.formats.ConvertedModel` (plain tensors and dicts) and the
format registry; they never import nn/train/quantize, so an export cannot depend on how the
student was trained, only on what ``convert()`` handed over.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import stat
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from safetensors.torch import save_file

import qatfactory._fsutil as _fs
from qatfactory._fsutil import check_replaceable
from qatfactory._inputs import read_json
from qatfactory.formats import ConvertedModel, FormatSpec, PackedTensor, get_format
from qatfactory.formats.layouts import FLAVOUR_ALIASES

QATFACTORY_JSON = "qatfactory.json"

# Files a serving engine reads from the base model directory besides the weights.
SOURCE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
)


class ExportError(ValueError):
    """A converted model that the chosen engine/flavour cannot load (the message says why and
    what to do instead)."""


class NoLayoutError(ExportError, NotImplementedError):
    """The format declares no layout for the engine's container (its FormatSpec.gguf / .safetensors is
    None). An ExportError; also a NotImplementedError, as the refusal of an unsupported format was before."""


# ------------------------------------------------------------------------------ registry
@dataclass
class ExportResult:
    path: Path
    engine: str
    flavour: str
    files: List[str]
    record: Dict[str, Any]


EXPORTERS: Dict[str, Callable[..., "Exporter"]] = {}


def register_exporter(engine: str):
    def deco(cls):
        if engine in EXPORTERS:
            raise ValueError(f"exporter for engine {engine!r} is already registered")
        EXPORTERS[engine] = cls
        cls.engine = engine
        return cls
    return deco


def list_exporters() -> List[str]:
    return sorted(EXPORTERS)


class Exporter:
    """Subclasses set ``flavours`` (first = default) and implement ``write(converted, tmp_dir,
    flavour, **options) -> (files, extra_record)``; ``check`` raises ExportError /
    NotImplementedError before anything is written."""

    engine: str = ""
    flavours: Tuple[str, ...] = ()

    def resolve_flavour(self, flavour: Optional[str]) -> str:
        if flavour is None:
            return self.flavours[0]
        flavour = FLAVOUR_ALIASES.get(flavour, flavour)
        if flavour not in self.flavours:
            raise ValueError(f"{self.engine} exporter: flavour={flavour!r}; allowed: {list(self.flavours)}")
        return flavour

    def check(self, converted: ConvertedModel, flavour: str, **options) -> None:
        raise NotImplementedError

    def write(self, converted: ConvertedModel, out: Path, flavour: str, **options):
        raise NotImplementedError


def export(converted: ConvertedModel, out_dir, engine: str = "vllm", flavour: Optional[str] = None,
           force: bool = False, **options) -> ExportResult:
    """Write ``converted`` for ``engine`` into ``out_dir`` atomically.

    engine: one of :func:`list_exporters` (vllm, sglang, llama_cpp); flavour: the exporter's
    container variant (vllm/sglang: ``modelopt`` | ``compressed-tensors``; llama_cpp: ``gguf``);
    options: the exporter's own (:func:`exporter_options`; an unknown name or a bad value is refused).
    An existing ``out_dir`` is replaced only with ``force=True`` and only when it is empty or an
    earlier qatfactory export (its ``qatfactory.json``); never a directory that is or contains the
    model's ``source_dir``. A failure leaves no ``out_dir`` behind (and an old one untouched)."""
    if engine not in EXPORTERS:
        raise ValueError(f"export: engine={engine!r}; allowed: {list_exporters()}")
    if not isinstance(converted, ConvertedModel):
        raise TypeError(f"export: expected a qatfactory.formats.ConvertedModel, got {type(converted).__name__}")
    exporter = EXPORTERS[engine]()
    flavour = exporter.resolve_flavour(flavour)
    check_options(engine, options)
    out_dir = Path(out_dir)
    protect = [converted.source_dir] if converted.source_dir else []
    # refuse before any work: an existing directory that is not ours, or no force
    check_replaceable(out_dir, ("export",), "export", protect)
    if (out_dir.exists() or out_dir.is_symlink()) and not force:
        raise FileExistsError(f"export: {out_dir} already exists; pass force=True (CLI: --force) to replace it")
    exporter.check(converted, flavour, **options)
    t0 = time.time()
    with atomic_dir(out_dir, force=force, protect=protect) as tmp:
        files, extra = exporter.write(converted, tmp, flavour, **options)
        record = build_record(converted, engine, flavour, extra)
        record["export_seconds"] = round(time.time() - t0, 3)
        write_json(tmp / QATFACTORY_JSON, record)
        files = sorted(set(files) | {QATFACTORY_JSON})
    return ExportResult(out_dir, engine, flavour, files, record)


def exporter_options(engine: str) -> Dict[str, Any]:
    """The options ``export(..., engine=engine, **options)`` accepts, with their defaults (the
    keyword parameters of the exporter's ``write``)."""
    if engine not in EXPORTERS:
        raise ValueError(f"export: engine={engine!r}; allowed: {list_exporters()}")
    sig = inspect.signature(EXPORTERS[engine].write)
    return {n: p.default for n, p in sig.parameters.items()
            if n not in ("self", "converted", "out", "flavour")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_options(engine: str, options: Dict[str, Any]) -> None:
    """Refuse an option the exporter does not take, or a value of the wrong type or range."""
    known = exporter_options(engine)
    bad = sorted(set(options) - set(known))
    if bad:
        raise ValueError(f"export: unknown option(s) {bad} for engine {engine!r}; allowed: "
                         f"{ {k: v for k, v in known.items()} }")
    for k, v in options.items():
        d = known[k]
        if isinstance(d, bool) or isinstance(v, bool):
            ok = isinstance(v, bool) and isinstance(d, bool)
        elif isinstance(d, int):
            ok = isinstance(v, int)
        elif isinstance(d, str):
            ok = isinstance(v, str)
        else:
            ok = v is None or isinstance(v, str)
        if not ok:
            raise ValueError(f"export: option {k}={v!r} has the wrong type; allowed: a "
                             f"{type(d).__name__ if d is not None else 'str or None'} (default {d!r})")
    if "max_shard_bytes" in options and options["max_shard_bytes"] < 1:
        raise ValueError(f"export: max_shard_bytes={options['max_shard_bytes']!r}; allowed: an int >= 1 (bytes per "
                         f"safetensors shard)")
    if "dense_dtype" in options and options["dense_dtype"] not in ("auto", "f32", "f16", "bf16"):
        raise ValueError(f"export: dense_dtype={options['dense_dtype']!r}; allowed: 'auto', 'f32', 'f16', 'bf16'")


# ------------------------------------------------------------------------------ atomic output
@contextmanager
def atomic_dir(target: Path, force: bool = False, protect: Iterable = ()):
    """Yield an empty temporary directory beside ``target``; on success swap it in with
    rename (same filesystem, so the finished export appears at once); on error delete it.
    An existing target is replaced only with ``force`` and only when it is empty or an export of
    ours (``qatfactory._fsutil``: the one implementation every writer shares)."""
    with _fs.atomic_dir(target, replace=force, kinds=("export",), what="export", protect=protect) as tmp:
        yield tmp


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, (Path,)):
        return str(o)
    if isinstance(o, torch.dtype):
        return str(o).replace("torch.", "")
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


# ------------------------------------------------------------------------------ names
def module_of(param_name: str) -> str:
    return param_name[: -len(".weight")] if param_name.endswith(".weight") else param_name


_ROUTER_SUFFIXES = (".mlp.gate", ".block_sparse_moe.gate")


def is_router(module: str) -> bool:
    return module.endswith(_ROUTER_SUFFIXES)


def standard_fused_groups(modules: Iterable[str]) -> List[List[str]]:
    """The groups vLLM/SGLang fuse at load: q/k/v, gate/up, per-expert gate/up (w1/w3), Qwen3.5's Gated DeltaNet
    in_proj_qkv + in_proj_z (vLLM's in_proj_qkvz)."""
    mods = set(modules)
    groups = []
    for m in sorted(mods):
        for first, rest in ((".q_proj", (".k_proj", ".v_proj")), (".gate_proj", (".up_proj",)),
                            (".w1", (".w3",)), (".in_proj_qkv", (".in_proj_z",))):
            if m.endswith(first) and (first != ".w1" or ".experts." in m):
                stem = m[: -len(first)]
                g = [m] + [stem + r for r in rest if stem + r in mods]
                if len(g) > 1:
                    groups.append(g)
    return groups


def fused_groups(converted: ConvertedModel) -> List[List[str]]:
    packed_mods = [module_of(n) for n in converted.packed]
    seen, out = set(), []
    for g in list(converted.fused_groups) + standard_fused_groups(packed_mods):
        key = tuple(sorted(g))
        if key not in seen:
            seen.add(key)
            out.append(list(g))
    return out


def _scalar_bits(t: Optional[torch.Tensor]) -> Optional[int]:
    if t is None:
        return None
    t = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
    if t.numel() != 1:
        raise ExportError(f"expected a single per-tensor scale, got shape {tuple(t.shape)}")
    return int(t.view(torch.int32)[0])


def check_fused_scales(converted: ConvertedModel) -> None:
    """Refuse a converted model whose fused shards carry different per-tensor scales.

    vLLM and SGLang load q/k/v (and gate/up, and each expert's gate/up) into one fused layer
    with ONE weight scale and ONE input scale (the max over shards); a shard encoded against a
    smaller scale would then decode too large. The bits must be identical, not just close."""
    for group in fused_groups(converted):
        mods = [m for m in group if m + ".weight" in converted.packed]
        if len(mods) < 2:
            continue
        fmts = {converted.packed[m + ".weight"].format for m in mods}
        if len(fmts) > 1:
            raise ExportError(f"fused group {mods} mixes formats {sorted(fmts)}; the engine fuses these "
                              f"into one layer with one format. Quantize them with the same format.")
        gs = {m: _scalar_bits(converted.packed[m + ".weight"].global_scale) for m in mods}
        if len(set(gs.values())) > 1:
            vals = {m: float(torch.as_tensor(converted.packed[m + ".weight"].global_scale)) for m in mods}
            raise ExportError(
                f"fused group {mods} has different per-tensor weight scales {vals}; vLLM/SGLang load them "
                f"into one fused layer with a single scale (the max), which would decode the other shards "
                f"wrongly. Train/convert with shared fused scales (QuantConfig.share_fused_scales=True, "
                f"i.e. quantize with amax = max over the group).")
        ia = {m: _scalar_bits(converted.input_amax.get(m)) for m in mods}
        if len(set(ia.values())) > 1:
            raise ExportError(
                f"fused group {mods} has different activation amax values "
                f"{ {m: None if v is None else float(converted.input_amax[m]) for m, v in ia.items()} }; "
                f"the engine keeps one input scale per fused layer. Calibrate them to one shared amax.")


# ------------------------------------------------------------------------------ tied embeddings
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def ties_embeddings(converted: ConvertedModel) -> bool:
    """True when config.json says lm_head IS the input embedding (SmolLM2, Qwen3-0.6B, ...).

    Engines then build lm_head from the embedding and skip any lm_head tensor in the checkpoint
    (vLLM's loaders drop ``lm_head.weight``; llama.cpp reuses ``token_embd`` when ``output`` is
    absent), so what is written must follow the config, not whatever tensors happen to exist."""
    return bool(converted.config.get("tie_word_embeddings", False))


def tied_duplicates(converted: ConvertedModel) -> List[str]:
    """Tensor names to leave out because the config ties them to the embedding; raises when the
    tensors contradict the config (the engine would serve logits the student never produced)."""
    lm_packed, lm_dense = LM_HEAD in converted.packed, LM_HEAD in converted.dense
    if EMBED not in converted.dense and EMBED not in converted.packed:
        return []  # a layout without the standard names: nothing known to check
    if ties_embeddings(converted):
        if lm_packed:
            raise ExportError(
                f"config.tie_word_embeddings is true but {LM_HEAD} is quantized ({converted.packed[LM_HEAD].format}); "
                f"engines skip a tied checkpoint's lm_head and serve the model-dtype embedding instead, so the logits "
                f"would not be the student's. Keep the tied lm_head unquantized, or untie it "
                f"(tie_word_embeddings=false) before training so the quantized lm_head ships")
        if lm_dense:
            a, b = converted.dense[LM_HEAD], converted.dense.get(EMBED)
            if b is None or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                raise ExportError(
                    f"config.tie_word_embeddings is true but {LM_HEAD} differs from {EMBED}; engines would use the "
                    f"embedding for both and silently change the logits. Set tie_word_embeddings=false to ship "
                    f"the separate lm_head, or re-tie the weights")
            return [LM_HEAD]  # a duplicate of the embedding: written once, as the embedding
        return []
    if converted.config.get("tie_word_embeddings") is False and not (lm_packed or lm_dense):
        raise ExportError(
            f"config.tie_word_embeddings is false but the converted model has no {LM_HEAD}; llama.cpp would fall "
            f"back to token_embd and vLLM would leave lm_head unloaded. Set tie_word_embeddings=true if lm_head "
            f"is the embedding, or convert a model that has its own lm_head")
    return []


# ------------------------------------------------------------------------------ modes
def activation_mode(converted: ConvertedModel) -> str:
    """'w4a4' when every packed module quantizes its input, 'w4a16' when none does."""
    mods = [module_of(n) for n in converted.packed]
    with_act = [m for m in mods if m in converted.act_formats]
    if not with_act:
        return "w4a16"
    if len(with_act) == len(mods):
        missing = [m for m in with_act if m not in converted.input_amax]
        if missing and any(_needs_static_act(converted.act_formats[m]) for m in missing):
            raise ExportError(f"W4A4 modules without a calibrated activation amax: {missing[:4]}...; "
                              f"calibrate the student (quantize.calibrate) before exporting")
        return "w4a4"
    without = [m for m in mods if m not in converted.act_formats]
    raise ExportError(f"mixed W4A4/W4A16 checkpoints are not supported by this exporter: {len(with_act)} modules "
                      f"quantize activations, {len(without)} do not (e.g. {without[:3]}); use one activation "
                      f"setting for every quantized module")


def _needs_static_act(act_format: str) -> bool:
    return get_format(act_format).spec.global_scale is not None


def act_decode_scale(act_format: str, amax: torch.Tensor) -> torch.Tensor:
    """The activation format's own per-tensor decode scale for ``amax`` (NVFP4: amax/2688),
    obtained from the format rather than re-derived, so exporter and trainer cannot drift."""
    f = get_format(act_format)
    p = f.quantize(torch.zeros(1, f.spec.super_block), amax=torch.as_tensor(amax, dtype=torch.float32))
    if p.global_scale is None:
        raise ExportError(f"activation format {act_format} has no per-tensor scale")
    return torch.as_tensor(p.global_scale, dtype=torch.float32).reshape(())


# ------------------------------------------------------------------------------ record
def _versions() -> Dict[str, str]:
    out = {}
    for pkg in ("qatfactory", "torch", "safetensors", "gguf", "transformers", "compressed-tensors",
                "nvidia-modelopt"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def build_record(converted: ConvertedModel, engine: str, flavour: str, extra: Dict[str, Any]) -> Dict[str, Any]:
    fmts = converted.formats_used()
    act = sorted(set(converted.act_formats.values()))
    n_params = sum(int(torch.tensor(p.shape).prod()) for p in converted.packed.values())
    n_dense = sum(t.numel() for t in converted.dense.values())
    return {
        "qatfactory_export": 1,
        "engine": engine,
        "flavour": flavour,
        "weight_formats": fmts,
        "activation_formats": act,
        "numerics": {f: get_format(f).spec.as_dict() for f in fmts + act},
        "engine_numerics_follow": {f: get_format(f).spec.engine for f in fmts + act},
        "tensors": {"packed": len(converted.packed), "dense": len(converted.dense),
                    "packed_params": n_params, "dense_params": n_dense},
        "coverage": converted.coverage,
        "quant": converted.quant,
        "recipe": converted.recipe,
        "fused_groups": fused_groups(converted),
        "model_type": converted.config.get("model_type"),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


def read_record(export_dir) -> Dict[str, Any]:
    p = Path(export_dir) / QATFACTORY_JSON
    if not p.is_file():
        raise FileNotFoundError(f"{export_dir}: no {QATFACTORY_JSON}; not a qatfactory export")
    return read_json(p, want=dict, finite=False)


# ------------------------------------------------------------------------------ files
def copy_source_files(source_dir: Optional[str], out: Path) -> List[str]:
    """Copy the tokenizer / generation config / chat template files of ``source_dir`` into ``out``.
    Regular files only: a symbolic link (whatever it points at) or a special file is skipped with a
    warning, never followed."""
    if not source_dir:
        return []
    src = Path(source_dir)
    copied = []
    for name in SOURCE_FILES:
        p = src / name
        if p.is_symlink() or (p.exists() and not stat.S_ISREG(os.lstat(p).st_mode)):
            warnings.warn(f"export: {p} is not a regular file (a symbolic link or a special file); not copied. "
                          f"Replace it with a copy of the file itself to ship it", stacklevel=2)
            continue
        if p.is_file():
            shutil.copyfile(p, out / name, follow_symlinks=False)
            copied.append(name)
    # named chat templates: transformers loads each additional_chat_templates/<name>.jinja
    tdir = src / "additional_chat_templates"
    if tdir.is_dir() and not tdir.is_symlink():
        for p in sorted(tdir.glob("*.jinja")):
            if p.is_symlink() or not stat.S_ISREG(os.lstat(p).st_mode):
                warnings.warn(f"export: {p} is not a regular file; not copied", stacklevel=2)
                continue
            (out / tdir.name).mkdir(exist_ok=True)
            shutil.copyfile(p, out / tdir.name / p.name, follow_symlinks=False)
            copied.append(f"{tdir.name}/{p.name}")
    return copied


def save_sharded(tensors: Dict[str, torch.Tensor], out: Path, max_shard_bytes: int = 5 * 2**30,
                 metadata: Optional[Dict[str, str]] = None) -> List[str]:
    """safetensors shards ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    (one ``model.safetensors`` when everything fits in one shard), in name order."""
    meta = {"format": "pt", **(metadata or {})}
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    files, weight_map, total = [], {}, 0
    n = len(shards)
    for i, sh in enumerate(shards, 1):
        fn = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(sh, str(out / fn), metadata=meta)
        files.append(fn)
        for k, t in sh.items():
            weight_map[k] = fn
            total += t.numel() * t.element_size()
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files + ["model.safetensors.index.json"]


# ------------------------------------------------------------------------------ spec queries
def spec_of(p: PackedTensor) -> FormatSpec:
    return get_format(p.format).spec


def declared_layout(spec: FormatSpec, container: str, engine: str, tensor: str, supported: str):
    """The spec's layout record for ``container`` ("gguf" | "safetensors"); refuses, naming the format and
    the engine, when the format declares none."""
    lay = spec.layout(container)
    if lay is None:
        raise NoLayoutError(
            f"{engine} exporter: format {spec.name!r} (tensor {tensor}) declares no {container} layout "
            f"(its FormatSpec.{container} is None), so {engine} cannot hold it; supported: {supported}, or any "
            f"format whose spec declares a {container} layout")
    return lay
