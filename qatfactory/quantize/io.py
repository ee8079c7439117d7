"""save_student / load_student: a prepared model on disk (safetensors + JSON) and back, never pickle."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import safetensors.torch
import torch
from torch import nn

from .. import _fsutil
from .._fsutil import load_safetensors
from .._inputs import check_model_config, read_json
from ..exitcodes import CorruptFileError
from .config import QuantConfig
from .prepare import prepare

QUANT_FILE = "qatfactory_quant.json"


def _student_state(model) -> Dict[str, torch.Tensor]:
    """state_dict without tied duplicates (safetensors refuses shared storage)."""
    sd = model.state_dict()
    out, seen = {}, {}
    for k, v in sd.items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) if v.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def _model_folder(path) -> Optional[str]:
    """``path`` as an absolute folder name when it is a model folder (config.json, not a student of ours)."""
    if not path or not isinstance(path, (str, os.PathLike)):
        return None
    p = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(p, "config.json")) or os.path.isfile(os.path.join(p, QUANT_FILE)):
        return None
    return p


def save_student(model: nn.Module, out_dir: str, source_dir: Optional[str] = None) -> str:
    """config.json + model.safetensors (weights and quantizer state) + qatfactory_quant.json.
    Written to a temporary directory beside out_dir, then renamed into place. An existing out_dir
    is replaced only when it is empty or an earlier save_student output (its qatfactory_quant.json).
    The record names the model folder the student came from (``source_dir``, else the folder the model
    was loaded from), where `qatfactory export` finds the tokenizer; loaders check it before use."""
    cfg: QuantConfig = getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("save_student: the model is not prepared")
    source = _model_folder(source_dir) or _model_folder(getattr(getattr(model, "config", None), "_name_or_path", None))
    with _fsutil.atomic_dir(out_dir, replace=True, kinds=("student",), what="save_student") as tmp:
        tmp = str(tmp)
        model.config.save_pretrained(tmp)
        state = _student_state(model)
        # looked up when called (tests/exporters/test_safety_files.py kills the process half-way through this write)
        safetensors.torch.save_file(state, os.path.join(tmp, "model.safetensors"),
                                    metadata={"format": "pt", "producer": "qatfactory"})
        dtype = str(next(iter(p for p in model.parameters())).dtype).replace("torch.", "")
        with open(os.path.join(tmp, QUANT_FILE), "w") as f:
            json.dump({"quant_config": cfg.to_dict(), "dtype": dtype,
                       "model_class": type(model).__name__, "source_dir": source}, f, indent=2)
    return out_dir


def load_student(path: str, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Rebuild a saved student: from_config (never remote code), prepare with the saved
    QuantConfig, then load weights and quantizer state through safetensors. A damaged file is
    named in the error (exitcodes.CorruptFileError, exit code 4)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)

    qpath = os.path.join(path, QUANT_FILE)
    if not os.path.isfile(qpath):
        raise FileNotFoundError(f"load_student: {qpath} not found; {path} is not a directory written by save_student")
    meta = read_record(path)
    if meta["quant_config"] is None:
        raise FileNotFoundError(f"load_student: {path} holds a plain (unquantized) model from a format=bf16 "
                                f"run; load it with transformers' from_pretrained")
    try:
        cfg = QuantConfig.from_dict(meta["quant_config"])
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise CorruptFileError(f"load_student: {qpath}: quant_config is not a valid QuantConfig "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    # config.json with limits and against the weights' headers, before a model of its sizes is built
    check_model_config(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"load_student: {os.path.join(path, 'config.json')} cannot be read "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    dt = dtype or getattr(torch, meta["dtype"])
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=dt)
    prepare(model, cfg)
    state = load_safetensors(os.path.join(path, "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(_student_tied_keys(model))
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CorruptFileError(f"load_student: {path}/model.safetensors does not fit the rebuilt model: "
                               f"missing {missing[:8]}, unexpected {list(unexpected)[:8]}")
    return model


STUDENT_DTYPES = ("float32", "bfloat16", "float16")


def read_record(path: str) -> Dict:
    """A student folder's qatfactory_quant.json, checked field by field: ``quant_config`` an object (or
    null with ``plain``: a format=bf16 run), ``dtype`` one of STUDENT_DTYPES. A record that is not
    JSON, or a field of another type, is a CorruptFileError (exit 4) naming the file and the field."""
    qpath = os.path.join(path, QUANT_FILE)
    meta = read_json(qpath, want=dict)
    qc = meta.get("quant_config", "(missing)")
    if not (isinstance(qc, dict) or (qc is None and meta.get("plain"))):
        raise CorruptFileError(f"{qpath}: quant_config = {str(qc)[:60]!r}; allowed: a JSON object (the QuantConfig "
                               f"the student was prepared with)")
    dt = meta.get("dtype", "float32")
    if dt not in STUDENT_DTYPES:
        raise CorruptFileError(f"{qpath}: dtype = {str(dt)[:60]!r}; allowed: {list(STUDENT_DTYPES)}")
    meta.setdefault("dtype", dt)
    src = meta.get("source_dir")
    if src is not None and not (isinstance(src, str) and os.path.isabs(src)):
        raise CorruptFileError(f"{qpath}: source_dir = {str(src)[:60]!r}; allowed: null or an absolute folder name "
                               f"(the model folder the student came from)")
    return meta


def _student_tied_keys(model) -> List[str]:
    sd = model.state_dict()
    kept = set(_student_state(model))
    return [k for k in sd if k not in kept]


# the files a tokenizer loads from (transformers' fast / sentencepiece tokenizers and their settings)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def recorded_source(student: str) -> Tuple[Optional[str], Optional[str]]:
    """(the model folder a student's record names, why it is not used). The folder is used only while it still
    is that model: a folder (not a link) whose config.json has the student's model type and vocabulary size,
    holding tokenizer files. Anything else is not followed and the second value says why; (None, None) when
    the record names no folder. A malformed record is a CorruptFileError (exit 4)."""
    src = read_record(student).get("source_dir")
    if not src:
        return None, None
    mine = read_json(os.path.join(student, "config.json"), want=dict)
    why = None
    if os.path.islink(src) or not os.path.isdir(src):
        why = "it no longer exists" if not os.path.lexists(src) else "it is not a folder"
    else:
        try:
            with open(os.path.join(src, "config.json")) as f:
                theirs = json.load(f)
        except (OSError, ValueError):
            theirs = None
        if not isinstance(theirs, dict):
            why = "it holds no readable config.json"
        elif (theirs.get("model_type"), theirs.get("vocab_size")) != (mine.get("model_type"), mine.get("vocab_size")):
            why = (f"its config.json ({theirs.get('model_type')}, vocabulary {theirs.get('vocab_size')}) is not the "
                   f"student's ({mine.get('model_type')}, vocabulary {mine.get('vocab_size')})")
        elif not any(os.path.isfile(os.path.join(src, n)) for n in TOKENIZER_FILES):
            why = "it holds no tokenizer files"
    if why:
        return None, f"the student's source model folder {src} is not used ({why})"
    return src, None
