"""Checkpoints that resume a run exactly.

One checkpoint is one directory ``<run_dir>/checkpoints/step-000123/``::

    ds/                  DeepSpeed's own checkpoint (engine.save_checkpoint, tag "ds"): module state
                         (the quantizer's scales / amax / LoRA live in it), optimizer, LR scheduler,
                         ZeRO partitions per rank
    rng-rank0.pt ...     python, numpy, torch (and CUDA) RNG states of each rank
    trainer_state.json   step, data position, eval history, the resolved config

Every rank writes into ``.tmp-step-000123``; after a barrier rank 0 adds trainer_state.json and
renames the directory, so a crash never leaves a checkpoint that looks complete. Only the last
``keep_last`` checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

DS_TAG = "ds"
_STEP_RE = re.compile(r"^step-(\d+)$")


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def rng_state() -> Dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: Dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def list_checkpoints(run_dir) -> list:
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_resume(resume: Optional[str], run_dir) -> Optional[Path]:
    """``None``: start fresh; ``"auto"``: the latest checkpoint in run_dir (fresh if none); else a path."""
    if not resume:
        return None
    if resume == "auto":
        cks = list_checkpoints(run_dir)
        return cks[-1] if cks else None
    p = Path(resume)
    if not (p / "trainer_state.json").exists():
        raise FileNotFoundError(f"resume={resume!r}: {p / 'trainer_state.json'} not found; give a "
                                f"checkpoints/step-N directory or resume=auto")
    return p


def save(engine, run_dir, step: int, state: Dict[str, Any], keep_last: int, rank: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    engine.save_checkpoint(str(tmp), tag=DS_TAG)
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(engine, ckpt: Path, rank: int) -> Dict[str, Any]:
    """Restore engine (module, optimizer, scheduler) and this rank's RNG; returns trainer_state."""
    path, _ = engine.load_checkpoint(str(ckpt), tag=DS_TAG, load_module_strict=True,
                                     load_optimizer_states=engine.optimizer is not None,
                                     load_lr_scheduler_states=engine.lr_scheduler is not None)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {ckpt}/{DS_TAG}")
    state = json.loads((Path(ckpt) / "trainer_state.json").read_text())
    rng_p = Path(ckpt) / f"rng-rank{rank}.pt"
    if rng_p.exists():
        set_rng_state(torch.load(rng_p, weights_only=False))
    return state
