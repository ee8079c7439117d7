"""The whole flow in a few lines, for a model you loaded and a loop you already have.

    import qatfactory as qf
    model = qf.quantize_model(model, "nvfp4_w4a16", calib=batches) # fake quantization for the format + calibration
    distill = qf.Distiller(teacher)                            # optional: the frozen teacher and our KL loss
    ...                                                        # train with anything: loss = distill(model, ids, attn, labels)
    shipped = qf.ship(model, "vllm", out="out/vllm")           # convert, export, parity gate
    shipped.gate["verdict"]                                    # PASS, or the export moved to out/vllm.FAILED

The names are the command line's: ``format`` is a recipe of recipes/format/ (``qatfactory train
format=...``), ``engine`` / ``flavour`` / ``out`` / ``force`` / ``source_dir`` / ``verify`` are
``qatfactory export``'s options, and the loss fields are ``method.loss.*``; the defaults are theirs too
(format nvfp4_w4a16, the qad recipe's forward KL, engine vllm). A bad value raises
:class:`qatfactory.exitcodes.UsageError` with the CLI's one line (field, value, what is allowed).
Hugging Face ``Trainer`` / TRL: :mod:`qatfactory.integrations.transformers`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
import torch.nn as nn

from . import quantize as Q
from ._recipes import recipes_dir
from .distill.losses import LossConfig
from .exitcodes import UsageError
from .faces.ship import Shipped
from .faces.ship import ship as _ship
from .integrations.distill import Distiller
from .quantize import QuantConfig, coverage

__all__ = ["format_names", "quant_config", "quantize_model", "calibration_batches", "save", "load", "ship", "coverage",
           "Distiller", "QuantConfig", "LossConfig", "Shipped", "DEFAULT_FORMAT", "DEFAULT_ENGINE"]

DEFAULT_FORMAT = "nvfp4_w4a16"     # recipes/config.yaml's format
DEFAULT_ENGINE = "vllm"            # ExportConfig.engine
CALIB_SAMPLES = 8                  # MethodConfig.calib_samples


def format_names() -> List[str]:
    """The format recipes that quantize (``format=`` of the CLI, bf16 aside)."""
    return sorted(Q.presets())


def quant_config(format: Union[str, QuantConfig] = DEFAULT_FORMAT, **fields) -> QuantConfig:
    """The QuantConfig of a format recipe (recipes/format/<format>.yaml), ``fields`` overriding its
    ``quant.*`` fields (``scale_strategy="frozen"``); a QuantConfig is taken as it is."""
    if isinstance(format, QuantConfig):
        return format if not fields else QuantConfig.from_dict({**format.to_dict(), **fields})
    if not isinstance(format, str) or format not in format_names():
        have = sorted(p.stem for p in (recipes_dir() / "format").glob("*.yaml"))
        why = " (bf16 quantizes nothing)" if format == "bf16" else ""
        raise UsageError(f"format={format}: no such recipe{why}; allowed: {[h for h in have if h != 'bf16']}")
    known = {f for f in QuantConfig.__dataclass_fields__}
    bad = sorted(set(fields) - known)
    if bad:
        raise UsageError(f"quant: unknown field(s) {bad}; allowed: {sorted(known)}")
    try:
        return QuantConfig.preset(format, **fields).validate()
    except (ValueError, TypeError) as e:
        raise UsageError(str(e).splitlines()[0]) from None


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def calibration_batches(samples: Iterable[Any], n: int = CALIB_SAMPLES, device=None) -> List[Dict[str, torch.Tensor]]:
    """The first ``n`` samples as one-sample batches of ``input_ids`` / ``attention_mask`` (what the
    trainer calibrates on: method.calib_samples of the training data, in file order). A sample is a
    token id list, a 1-D / [1, T] tensor, or a dict holding ``input_ids`` (and ``attention_mask``)."""
    out = []
    for s in samples:
        if len(out) >= n:
            break
        attn = None
        if isinstance(s, Mapping):     # a dict, a tokenizer's BatchEncoding
            if "input_ids" not in s:
                raise UsageError(f"calib: a sample without input_ids (keys {sorted(s)}); allowed: token ids, a tensor "
                                 f"or a dict with input_ids")
            ids, attn = s["input_ids"], s.get("attention_mask")
        else:
            ids = s
        ids = torch.as_tensor(ids, dtype=torch.long)
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
        attn = torch.ones_like(ids) if attn is None else torch.as_tensor(attn, dtype=torch.long).reshape(ids.shape)
        out.append({"input_ids": ids.to(device) if device is not None else ids,
                    "attention_mask": attn.to(device) if device is not None else attn})
    return out


def quantize_model(model: nn.Module, format: Union[str, QuantConfig] = DEFAULT_FORMAT, calib: Optional[Iterable] = None, *,
             calib_method: Optional[str] = None, calib_samples: int = CALIB_SAMPLES, calibrate: bool = True,
             **fields) -> nn.Module:
    """Prepare ``model`` (a loaded Hugging Face causal LM) for ``format`` and calibrate it: Linear layers
    and MoE experts become fake-quantized modules that train as the engine will run them (in place;
    the model is returned). ``calib``: samples to calibrate on (:func:`calibration_batches`; the first
    ``calib_samples`` are used); W4A4 and KV-cache formats need them. ``calib_method``: ``quant.calib_method``
    (default: the recipe's). ``calibrate=False``: prepare only (the CLI's ``method.calibrate=false``)."""
    cfg = quant_config(format, **fields)
    if getattr(model, "_qf_config", None) is not None:
        raise UsageError("quantize_model: this model is already quantized (prepared); give it the model as loaded")
    Q.prepare(model, cfg)
    if calibrate:
        batches = None if calib is None else calibration_batches(calib, calib_samples, _device_of(model))
        Q.calibrate(model, batches, calib_method or cfg.calib_method)
    return model


def save(model: nn.Module, out_dir: Union[str, os.PathLike], source_dir: Optional[str] = None) -> str:
    """Save the quantized student with its format state (the folder ``qatfactory export`` and
    ``qatfactory verify --against`` take). ``source_dir``: the model folder its tokenizer comes from."""
    return Q.save_student(model, os.fspath(out_dir), source_dir=source_dir)


def load(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A saved student, rebuilt and prepared (never remote code)."""
    return Q.load_student(os.fspath(path), dtype=dtype)


def ship(model: Any, engine: str = DEFAULT_ENGINE, flavour: Optional[str] = None, out: Optional[str] = None, *,
         verify: bool = True, force: bool = False, source_dir: Optional[str] = None, **options) -> Shipped:
    """Convert, export for ``engine`` (vllm | sglang | llama_cpp) into ``out`` and run the parity gate:
    ``qatfactory export STUDENT --engine E --flavour F --out OUT --verify`` as one call. ``model``: a
    quantized model, a saved student folder or a ConvertedModel. ``source_dir``: where the tokenizer,
    generation config and chat template are copied from (default: the folder the model was loaded from).
    ``options``: the exporter's (``dense_dtype`` for llama_cpp, ``max_shard_bytes`` for vllm / sglang).
    A gate that does not PASS moves the export to ``<out>.FAILED`` (FAILED.json says why):
    ``shipped.ok`` / ``shipped.gate["verdict"]`` tell."""
    from .exporters import list_exporters  # noqa: PLC0415 (the exporters load on the first export)
    from .formats.converted import ConvertedModel  # noqa: PLC0415
    if engine not in list_exporters():
        raise UsageError(f"--engine {engine}: allowed: {list_exporters()}")
    if out is None:
        raise UsageError("--out: required (the export directory, written atomically)")
    if isinstance(model, (str, os.PathLike)):
        from .faces.export import load_converted  # noqa: PLC0415
        cm = load_converted(os.fspath(model), source_dir)
    elif isinstance(model, ConvertedModel):
        cm = model
    elif isinstance(model, nn.Module):
        if getattr(model, "_qf_config", None) is None:
            raise UsageError("ship: the model is not quantized; call qatfactory.quantize_model(model, format) first")
        cm = Q.convert(model)
    else:
        raise UsageError(f"ship: model={type(model).__name__}; allowed: a quantized model, a student folder or "
                         f"a ConvertedModel")
    if source_dir is not None:
        if not os.path.isdir(source_dir):
            raise FileNotFoundError(f"--source-dir {source_dir!r} does not exist")
        cm.source_dir = os.fspath(source_dir)
    return _ship(cm, engine, flavour, out, verify=verify, force=force, **options)
