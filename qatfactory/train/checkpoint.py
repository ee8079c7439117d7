"""Checkpoints that resume a run exactly, and that never run code when loaded.

One checkpoint is one directory ``<run_dir>/checkpoints/step-000123/``::

    ds/                        DeepSpeed's own checkpoint (engine.save_checkpoint, tag "ds"): module state
                               (the quantizer's scales / amax / LoRA live in it), optimizer, LR scheduler,
                               ZeRO partitions per rank
    rng-rank0.safetensors ...  python, numpy, torch (and CUDA) RNG states of each rank, as plain tensors
                               with the few scalars in the safetensors metadata (JSON)
    trainer_state.json         step, data position, eval history, the resolved config, world size

Every rank writes into ``.step-000123.tmp-00000123``; after a barrier rank 0 adds trainer_state.json
and swaps the directory in (qatfactory._fsutil.swap_in), so a crash never leaves a checkpoint that
looks complete; leftovers are tidied at the next start (:func:`tidy`). Only the last ``keep_last``
checkpoints are kept.

Loading never unpickles arbitrary objects: DeepSpeed's files go through :class:`SafeLoad`, a
checkpoint engine whose ``torch.load`` runs with ``weights_only=True`` and an explicit allowlist of the
three DeepSpeed classes its state holds (:data:`DS_SAFE_GLOBALS`); anything else is refused, naming
the file and what it would have imported. The RNG files are safetensors.
"""
from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import _fsutil
from ..exitcodes import BadInputError, CorruptFileError
from . import reshard
from .ckpt_files import (  # noqa: F401  (re-exported: the checkpoint's files are read there)
    _STEP_RE,
    DS_SAFE_GLOBALS,
    DS_TAG,
    incomplete,
    read_state,
    rng_file,
    safe_torch_load,
    scan,
)

_LEFTOVER_RE = re.compile(r"^\.(step-\d+)\.(tmp|old)-[A-Za-z0-9_]{8}$")


def _say(msg: str) -> None:
    print(f"[qatfactory] {msg}", file=sys.stderr, flush=True)


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------- RNG as plain tensors
def rng_tensors() -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, metadata) of the python, numpy, torch and CUDA generators: the state words as
    int64 / uint8 tensors, the few scalars as JSON in the metadata."""
    pv, pstate, pgauss = random.getstate()
    nname, nkeys, npos, nhas, ncached = np.random.get_state()
    t = {"python_state": torch.tensor(list(pstate), dtype=torch.int64),
         "numpy_keys": torch.from_numpy(np.asarray(nkeys, dtype=np.int64).copy()),
         "torch": torch.get_rng_state().clone()}
    meta = {"python_version": pv, "python_gauss_next": pgauss, "numpy_name": nname, "numpy_pos": int(npos),
            "numpy_has_gauss": int(nhas), "numpy_cached_gaussian": float(ncached), "cuda_devices": 0}
    if torch.cuda.is_available():
        states = torch.cuda.get_rng_state_all()
        for i, s in enumerate(states):
            t[f"cuda{i}"] = s.clone()
        meta["cuda_devices"] = len(states)
    return t, {"qatfactory_rng": json.dumps(meta)}


def set_rng_tensors(t: Dict[str, torch.Tensor], meta: Dict[str, str], where: str) -> None:
    try:
        m = json.loads(meta["qatfactory_rng"])
        random.setstate((int(m["python_version"]), tuple(int(x) for x in t["python_state"].tolist()),
                         m["python_gauss_next"]))
        np.random.set_state((m["numpy_name"], t["numpy_keys"].numpy().astype(np.uint32), int(m["numpy_pos"]),
                             int(m["numpy_has_gauss"]), float(m["numpy_cached_gaussian"])))
        torch.set_rng_state(t["torch"])
        if m.get("cuda_devices") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t[f"cuda{i}"] for i in range(int(m["cuda_devices"]))])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptFileError(f"{where}: not a qatfactory RNG state ({type(e).__name__}: {e})") from None


def save_rng(path: Path) -> None:
    t, meta = rng_tensors()
    save_file(t, str(path), metadata=meta)


def load_rng(path: Path) -> None:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # SafetensorError on a damaged file
        raise CorruptFileError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    set_rng_tensors(t, meta, str(path))


# ----------------------------------------------------------------------------- DeepSpeed, safely
def make_safe(engine) -> None:
    """Give the DeepSpeed engine a checkpoint engine whose load is :func:`safe_torch_load`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (  # noqa: PLC0415 (optional: deepspeed)
        TorchCheckpointEngine,
    )
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or type(ce).__name__ == "SafeLoad":
        return
    if not isinstance(ce, TorchCheckpointEngine):
        raise BadInputError(f"checkpoints: DeepSpeed's checkpoint engine is {type(ce).__name__}; qatfactory loads "
                            f"checkpoints only through its torch engine with weights_only=True")

    class SafeLoad(type(ce)):
        def load(self, path: str, map_location=None):
            return safe_torch_load(path, map_location)

    ce.__class__ = SafeLoad


# ----------------------------------------------------------------------------- finding checkpoints
def list_checkpoints(run_dir) -> list:
    d = Path(run_dir) / "checkpoints"
    if d.is_symlink():      # a resume reads only the run's own checkpoints
        _fsutil.own_file(run_dir, "checkpoints", "the run's checkpoints folder")
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()
             and not p.is_symlink()]
    return [p for _, p in sorted(found)]


def find_resume(resume: Optional[str], run_dir) -> Optional[Path]:
    """``None``: start fresh; ``"auto"``: the newest complete checkpoint in run_dir (fresh when there
    is no checkpoint at all; an incomplete newest one is skipped with a warning; none complete is an
    error); else that checkpoint directory, which must be complete."""
    if not resume:
        return None
    if resume == "auto":
        cks = list_checkpoints(run_dir)
        skipped = []
        for c in reversed(cks):
            why = incomplete(c)
            if why is None:
                for s, w in skipped:
                    _say(f"resume=auto: skipping {s} (incomplete: {w}); resuming from {c}")
                return c
            skipped.append((c, why))
        if cks:
            raise CorruptFileError(f"resume=auto: no complete checkpoint in {Path(run_dir) / 'checkpoints'}: "
                                   + "; ".join(f"{c.name}: {w}" for c, w in skipped))
        return None
    p = Path(resume)
    if not p.is_dir():
        raise BadInputError(f"resume={resume!r}: not a directory; give a checkpoints/step-N directory or resume=auto")
    why = incomplete(p)
    if why is not None:
        raise CorruptFileError(f"resume={resume!r} is not a complete checkpoint: {why}")
    return p


def tidy(run_dir) -> List[str]:
    """Rank 0, at the start of a run: finish or remove what interrupted checkpoint writes left."""
    d = Path(run_dir) / "checkpoints"
    done: List[str] = []
    if not d.is_dir():
        return done
    targets = sorted({m.group(1) for p in d.iterdir() if (m := _LEFTOVER_RE.match(p.name))})
    for name in targets:
        done += _fsutil.recover(d / name, say=_say)
    return done


# ----------------------------------------------------------------------------- save / load
def save(engine, run_dir, step: int, state: Dict[str, Any], keep_last: int, rank: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".{final.name}.tmp-{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    engine.save_checkpoint(str(tmp), tag=DS_TAG)
    save_rng(rng_file(tmp, rank))
    _barrier()
    if rank == 0:
        _fsutil.write_text_atomic(tmp / "trainer_state.json", json.dumps(state, indent=1, default=str))
        _fsutil.swap_in(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(engine, ckpt: Path, rank: int) -> Dict[str, Any]:
    """Restore engine (module, optimizer, scheduler) and this rank's RNG; returns trainer_state.

    A checkpoint of another world size: ZeRO-1/2/3 state is gathered once and
    re-partitioned (reshard.py); ZeRO-0 state is not partitioned and loads as it is. Rank r takes
    the RNG state of rank r mod N (every rank is seeded alike at the start of a run)."""
    ckpt = Path(ckpt)
    why = incomplete(ckpt)
    if why is not None:
        raise CorruptFileError(f"checkpoint {ckpt} is incomplete: {why}")
    state = read_state(ckpt)
    saved_world = int(state.get("world_size", 1))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    make_safe(engine)
    if saved_world != world and engine.optimizer is not None and int(engine.zero_optimization_stage()) > 0:
        gdir = reshard.prepare(ckpt, rank)
        reshard.load(engine, gdir, rank, world)
        if rank == 0:
            _say(f"resharded {ckpt.name} from {saved_world} to {world} rank(s) (ZeRO-"
                 f"{int(engine.zero_optimization_stage())}, {gdir})")
    else:
        path, _ = engine.load_checkpoint(str(ckpt), tag=DS_TAG, load_module_strict=True,
                                         load_optimizer_states=engine.optimizer is not None,
                                         load_lr_scheduler_states=engine.lr_scheduler is not None)
        if path is None:
            raise CorruptFileError(f"DeepSpeed found no checkpoint under {ckpt}/{DS_TAG}")
    load_rng(rng_file(ckpt, rank % saved_world))
    return state
