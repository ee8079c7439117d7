"""Checks made when a run is composed, before a model is built: every number in its range, the data the
run reads, and whether the export asked for can hold what the run trains.

* :func:`check_numbers`: no NaN / Infinity anywhere in the settings; signs and bounds of the trainer's and the
  methods' numbers (Adam's betas in [0, 1), a seed the generators take, ...).
* :func:`data_selection` / :func:`check_inputs`: ``data.train=[...]`` selects your files (the default data group
  is random tokens, for the tiny random models of tests and smoke runs); a file that does not exist is refused
  by path; a trained model (``model.path`` / ``model.asset``) never trains or calibrates on random tokens unless
  the command line asks for them (``data=synthetic`` or ``data.synthetic=N``).
* :func:`check_export`: the format's tensors against the engine's container, as the format specs declare
  (``FormatSpec.safetensors`` / ``.gguf``), so an export that cannot be written is refused before training.

Each refusal is a ValueError naming the field, the value and what is allowed (compose turns it into a
UsageError, exit 3); a missing model folder is a BadInputError (exit 4), as when the model is loaded.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, List, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser

from .._inputs import read_json
from ..distill.losses import check_topk
from ..exitcodes import BadInputError, UsageError
from ..formats import get_format, list_formats
from ..formats.layouts import ENGINE_CONTAINER, ENGINE_FLAVOURS, FLAVOUR_ALIASES
from ..formats.policy import POLICY_FORMATS
from ..quantize.config import POLICY_TARGETS, QuantConfig, presets

SEED_MAX = 2**32 - 1      # numpy's and torch's generators both take it


# ----------------------------------------------------------------------------- numbers
def _finite(obj: Any, name: str) -> None:
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _finite(getattr(obj, f.name), f"{name}.{f.name}" if name else f.name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _finite(v, f"{name}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _finite(v, f"{name}[{i}]")
    elif isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"{name}={obj!r}; allowed: a finite number")


def check_numbers(cfg) -> None:
    """Ranges of the numbers the types cannot say (the rest are checked beside their choices in validate)."""
    _finite(cfg, "")
    t, m = cfg.train, cfg.method
    for fld, v in (("train.seed", t.seed), ("model.init_seed", cfg.model.init_seed)):
        if not 0 <= int(v) <= SEED_MAX:
            raise ValueError(f"{fld}={v!r}; allowed: an int in 0..{SEED_MAX}")
    if t.weight_decay < 0:
        raise ValueError(f"train.weight_decay={t.weight_decay!r}; allowed: a number >= 0")
    if not all(0.0 <= float(b) < 1.0 for b in t.betas):
        raise ValueError(f"train.betas={list(t.betas)!r}; allowed: two numbers in [0, 1) (Adam's moment decay rates)")
    if t.clip < 0:
        raise ValueError(f"train.clip={t.clip!r}; allowed: a number >= 0 (the gradient-norm limit; 0: no clipping)")
    lo = 1 if m.calibrate else 0
    if int(m.calib_samples) < lo:
        raise ValueError(f"method.calib_samples={m.calib_samples!r}; allowed: an int >= {lo}"
                         + (" (the training samples the scales are calibrated on)" if lo else ""))
    if cfg.data.max_docs is not None and int(cfg.data.max_docs) < 1:
        raise ValueError(f"data.max_docs={cfg.data.max_docs!r}; allowed: an int >= 1, or null (every document)")


# ----------------------------------------------------------------------------- data
def data_selection(overrides: List[str]) -> Tuple[List[str], bool]:
    """(the overrides with ``data=files`` added when ``data.train`` is given without a data group, whether the
    command line asks for random tokens: ``data=synthetic`` or ``data.synthetic=N`` with N > 0)."""
    group, train, synthetic = None, False, False
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        k = o.key_or_group
        if k == "data" and not o.is_delete():
            group = str(o.value())
        elif k == "data.train" and not o.is_delete():
            v = o.value()
            train = bool(v) and v != "null"
        elif k == "data.synthetic" and not o.is_delete():
            try:
                synthetic = int(o.value()) > 0
            except (TypeError, ValueError):
                pass      # the schema names the bad value
    out = list(overrides) + (["data=files"] if train and group is None else [])
    return out, group == "synthetic" or synthetic


def check_data_source(cfg) -> None:
    """Random tokens and your files are never mixed up: data.train with random tokens is refused."""
    d = cfg.data
    if d.synthetic and d.train:
        raise ValueError(f"data.train={list(d.train)!r} with data.synthetic={d.synthetic} (data=synthetic): random "
                         f"tokens would replace your files; allowed: one source: data=files data.train=[...], or "
                         f"random tokens without data.train")


def check_sequence_parallel(cfg, method, default_loss: bool) -> None:
    """train.sequence_parallel against the data and the method (the world size is checked once it exists);
    ``default_loss``: the method keeps the trainer's loss (Method.loss)."""
    sp = cfg.train.sequence_parallel
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"train.sequence_parallel={sp!r}; allowed: an int >= 1 (1: off)")
    if sp == 1:
        return
    if cfg.data.seq_len % sp:
        raise ValueError(f"train.sequence_parallel={sp} with data.seq_len={cfg.data.seq_len}; allowed: a seq_len that "
                         f"splits into {sp} equal shards")
    if cfg.data.doc_mask:
        raise ValueError(f"train.sequence_parallel={sp} with data.doc_mask=true; allowed: doc_mask=false (Ulysses "
                         f"attention drops the mask, so packed documents would attend across each other)")
    if method.needs.rollouts or not default_loss:
        raise ValueError(f"train.sequence_parallel={sp} with method={cfg.method.name}; allowed: 1 for this method (the "
                         f"sequence-parallel loss is the distillation / CE loss of the trainer's own student module)")


def check_inputs(cfg, method, asked_synthetic: bool) -> None:
    """The files the settings name exist, and a trained model reads real text (see the module docstring)."""
    m = cfg.model
    for fld, v in (("model.path", m.path), ("model.tokenizer", m.tokenizer), ("method.teacher_path",
                                                                            cfg.method.teacher_path)):
        # never looked up on a model hub: a name that is not here is a folder that is missing
        if v is not None and not Path(v).exists():
            raise BadInputError(f"{fld}={v!r} does not exist (a local Hugging Face model directory)")
    for fld, paths in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        for p in paths:
            if not Path(p).exists():
                raise UsageError(f"{fld}: {p} does not exist; allowed: existing files or directories (.txt, .jsonl, "
                                 f"a saved datasets directory)")
    if cfg.method.loss.kind == "topk_kl" and m.path is not None and (Path(m.path) / "config.json").is_file():
        # the vocabulary of a model folder, for method.loss.top_k's range (a config.json without a top-level
        # vocab_size is checked when the loss first runs)
        vocab = read_json(Path(m.path) / "config.json", want=dict).get("vocab_size")
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1:
            check_topk(cfg.method.loss, vocab)
    trained = m.path is not None or m.asset is not None
    if trained and cfg.data.synthetic and not asked_synthetic and not method.needs.rollouts:
        raise UsageError(f"data.synthetic={cfg.data.synthetic} (the default data group: random tokens) with "
                         f"{'model.path=' + repr(m.path) if m.path else 'model.asset=' + repr(m.asset)}, a trained "
                         f"model: it would train or calibrate on random tokens; allowed: your text "
                         f"(data.train=[a.jsonl,...]), or data=synthetic on the command line to ask for random tokens")


# ----------------------------------------------------------------------------- export
def weight_formats(q: QuantConfig) -> List[str]:
    """The registered formats a QuantConfig can give a tensor (a policy target: every format of the policy)."""
    out: List[str] = []
    for f in [q.weight_format] + [r.weight for r in q.rules if r.weight]:
        for g in (POLICY_FORMATS if f in POLICY_TARGETS else (f,)):
            if g in list_formats() and g not in out:
                out.append(g)
    return out


def export_refusal(q: QuantConfig, engine: str):
    """Why ``engine`` cannot hold a student quantized as ``q`` (one sentence), or None."""
    container = ENGINE_CONTAINER[engine]
    bad = [f for f in weight_formats(q) if get_format(f).spec.layout(container) is None]
    if bad:
        return f"format {bad[0]!r} declares no {container} layout, and {engine} reads {container} checkpoints"
    if q.quantize_embeddings and container == "safetensors":
        return ("quant.quantize_embeddings=true: vLLM and SGLang keep embeddings in the model dtype (their "
                "checkpoints have no quantized embedding)")
    return None


def flavour_refusal(q: QuantConfig, engine: str, flavour) -> str:
    """Why ``engine``'s container variant ``flavour`` (None: its default) cannot hold ``q``, or None."""
    allowed = ENGINE_FLAVOURS[engine]
    f = FLAVOUR_ALIASES.get(flavour, flavour) if flavour is not None else allowed[0]
    if f not in allowed:
        return f"export.flavour={flavour!r} is no flavour of export={engine}; allowed: {list(allowed)}"
    if f == "modelopt":
        bad = [g for g in weight_formats(q) if getattr(get_format(g).spec.safetensors, "modelopt_algo", None) is None]
        if bad:
            return (f"export.flavour={flavour or 'null'} (export={engine} writes {f} then) cannot hold format "
                    f"{bad[0]!r}: its spec declares no ModelOpt quant_algo; allowed: export.flavour=compressed-tensors")
    return None


def check_export(cfg, no_quant) -> None:
    e, q = cfg.export, cfg.quant
    if not e.enabled or q.weight_format in no_quant:
        return
    why = export_refusal(q, e.engine)
    if why is None:
        why = flavour_refusal(q, e.engine, e.flavour)
        if why is not None:
            raise ValueError(f"export={e.engine} with format={q.name or q.weight_format}: {why}")
    if why is None:
        return
    fits = sorted(n for n in presets() if export_refusal(QuantConfig.preset(n), e.engine) is None
                  and flavour_refusal(QuantConfig.preset(n), e.engine, e.flavour) is None)
    others = [g for g in ENGINE_CONTAINER if g != e.engine and export_refusal(q, g) is None]
    hint = ("; or quant.quantize_embeddings=false" if "quantize_embeddings" in why and
            export_refusal(dataclasses.replace(q, quantize_embeddings=False), e.engine) is None else "")
    raise ValueError(f"export={e.engine} with format={q.name or q.weight_format}: {why}; allowed with "
                     f"export={e.engine}: format={fits}" + hint
                     + (f"; this format exports with export={others}" if others else ""))
