"""What a checkpoint holds on disk, read without running code: the DeepSpeed tag, the trainer state,
whether every file a resume reads is there, and torch.load restricted to DeepSpeed's own state
classes. Both loading paths use it: checkpoint.py (same world size) and reshard.py (another one)."""
from __future__ import annotations

import importlib
import os
import pickle
import re
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .. import _fsutil
from .._inputs import read_json
from ..exitcodes import CorruptFileError, UnsafeFileError

DS_TAG = "ds"
_STEP_RE = re.compile(r"^step-(\d+)$")
# what DeepSpeed's own state pickles besides tensors and containers (0.19, ZeRO 0-3, fp32/bf16)
DS_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                   "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum",
                   "deepspeed.utils.tensor_fragment.fragment_address")


def rng_file(ckpt: Path, rank: int) -> Path:
    return Path(ckpt) / f"rng-rank{rank}.safetensors"


def _safe_classes():
    out = []
    for q in DS_SAFE_GLOBALS:
        mod, _, name = q.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return out


def safe_torch_load(path, map_location=None, mmap: bool = False):
    """torch.load with weights_only=True and only DeepSpeed's own state classes allowed; a file that
    would import anything else is refused (UnsafeFileError, exit code 4) without running it.
    ``mmap``: tensors stay in the file until read (a reshard reads every rank's file at once)."""
    p = str(path)
    try:
        with torch.serialization.safe_globals(_safe_classes()):
            return torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e).lower() or \
                "unsupported global" in str(e).lower():
            try:
                found = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(p)
                         if g not in DS_SAFE_GLOBALS]
            except Exception:  # noqa: BLE001 - the scan is for the message only
                found = []
            what = f" it would import {found[:4]}," if found else ""
            raise UnsafeFileError(
                f"{p}: refused to load:{what} which is neither a tensor nor part of DeepSpeed's checkpoint state "
                f"(allowed: {list(DS_SAFE_GLOBALS)}). Unpickling it could run code; a checkpoint is loaded only "
                f"when it holds tensors and plain data") from None
        if isinstance(e, (EOFError, RuntimeError, OSError, ValueError)):
            raise CorruptFileError(f"{p}: cannot be read ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else 'no detail'}); truncated or damaged"
                                   ) from None
        raise


def scan(ckpt: Path) -> None:
    """Refuse, before anything is built or written, a checkpoint whose DeepSpeed files would import
    anything but DeepSpeed's own state classes (read from the pickle's opcodes; nothing is run).
    The loader (:func:`safe_torch_load`) refuses the same files again when it reads them.
    A file or folder of the checkpoint replaced by a symbolic link (to a file outside the run) is
    refused too: a resume reads only the run's own files."""
    for dirpath, dirnames, filenames in os.walk(ckpt):
        for n in sorted(dirnames + filenames):
            _fsutil.own_file(dirpath, n, "a file of checkpoint " + Path(ckpt).name)
    for f in sorted((Path(ckpt) / DS_TAG).glob("*.pt")):
        try:
            found = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(f)) if g not in DS_SAFE_GLOBALS]
        except Exception as e:  # noqa: BLE001 - not a torch file at all
            raise CorruptFileError(f"{f}: not a readable torch checkpoint file ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
        if found:
            raise UnsafeFileError(
                f"{f}: refused to load: it would import {found[:4]}, which is neither a tensor nor part of "
                f"DeepSpeed's checkpoint state (allowed: {list(DS_SAFE_GLOBALS)}). Unpickling it could run "
                f"code; a checkpoint is loaded only when it holds tensors and plain data")


def read_state(ckpt: Path) -> Dict[str, Any]:
    p = Path(ckpt) / "trainer_state.json"
    try:
        st = read_json(p, finite=False)     # a diverged run's saved metrics may hold NaN
    except CorruptFileError as e:
        if not p.is_file():
            raise CorruptFileError(f"{p} not found") from None
        raise e
    except FileNotFoundError:
        raise CorruptFileError(f"{p} not found") from None
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{p}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(st, dict) or not isinstance(st.get("step"), int) or not isinstance(st.get("position"), int) \
            or not isinstance(st.get("config"), dict):
        raise CorruptFileError(f"{p}: missing step / position / config")
    return st


def incomplete(ckpt: Path) -> Optional[str]:
    """None when ``ckpt`` has everything a resume reads; else why not (one line)."""
    ckpt = Path(ckpt)
    try:
        st = read_state(ckpt)
    except CorruptFileError as e:
        return str(e)
    m = _STEP_RE.match(ckpt.name)
    if m and int(m.group(1)) != st["step"]:
        return f"{ckpt}/trainer_state.json says step {st['step']}"
    world = st.get("world_size", 1)
    if not isinstance(world, int) or world < 1:
        return f"{ckpt}/trainer_state.json: world_size={world!r}"
    ds = ckpt / DS_TAG
    if not ds.is_dir():
        return f"{ds} is missing"
    models = [p for p in ds.glob("*model_states.pt") if p.is_file() and p.stat().st_size > 0]
    if not models:
        return f"{ds} holds no model states"
    zero = int(((st.get("config") or {}).get("train") or {}).get("zero_stage", 0) or 0)
    for r in range(world):
        if zero > 0 and not [p for p in ds.glob(f"*zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
                             if p.stat().st_size > 0]:
            return f"{ds}: the optimizer states of rank {r} are missing"
        f = rng_file(ckpt, r)
        if not f.is_file() or f.stat().st_size == 0:
            old = ckpt / f"rng-rank{r}.pt"
            why = " (rng-rank*.pt is the pickle format of older versions, which is not loaded)" if old.exists() else ""
            return f"{f} is missing{why}"
    return None
