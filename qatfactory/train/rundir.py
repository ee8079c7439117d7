"""The run directory: which one, whether it may be written, and whether a resume is the same run.

* A new run goes into an empty or new directory. One that already holds a run (our record
  ``qatfactory_run.json``, or the checkpoints/config of an older version) is refused without
  ``resume``; an unnamed run (no ``run_dir=``) takes a fresh name instead. Anything else that is
  not empty is refused: a run never writes over somebody else's files.
* ``resume`` must be the same run: a checkpoint trained with other numerics (format, activation
  format, scale strategy, model, method, loss, optimizer, batch...) is refused naming the field;
  other data or another seed go on with a warning. Another number of ranks is allowed when the
  global batch (micro_batch x grad_accum x ranks) stays the same (reshard.py). ``config.yaml`` keeps the original
  run's settings; a resume that changes anything writes ``config.resume-step-N.yaml`` beside it.
* The export directory is checked before training starts (only an empty directory or an earlier
  export of ours is replaced), so a run never fails on it, or deletes a user directory, at the end.

Rank 0 decides and writes; every rank gets the same answer (or the same error).
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from .. import _fsutil
from .._inputs import read_json
from ..exitcodes import BadInputError, UsageError
from . import checkpoint as ckpt
from . import runlock
from .config import RunConfig, to_dict

RUN_RECORD = _fsutil.RUN_RECORD


class ResumeMismatchError(BadInputError):
    """The checkpoint was trained with other numerics than this command asks for."""


class RunDirError(BadInputError):
    """The run directory holds another run, or files that are not ours."""


def _say(msg: str) -> None:
    print(f"[qatfactory] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the same run?
# train fields that change what a step computes; the rest (eval/save/log cadence, progress,
# plots, max_steps under a constant schedule) may change on resume
_TRAIN_NUMERICS = ("zero_stage", "precision", "optimizer", "lr", "schedule", "warmup_steps", "min_lr_ratio",
                   "weight_decay", "betas", "micro_batch", "grad_accum", "clip")
# method fields that only matter before the first step (calibration) or only for reporting
_METHOD_FREE = ("calibrate", "calib_samples", "eval_teacher", "teacher_cache")


def _flat(d: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(d, dict):
        out: Dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _norm(v):
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def compare(old: Dict[str, Any], new: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """(refused, warned): 'field: old -> new' for every difference between two resolved configs
    (``to_dict`` form) that a resume must not (refused) or may but should be told about (warned)."""
    a, b = _flat(old), _flat(new)
    refused, warned = [], []
    for k in sorted(set(a) | set(b)):
        va, vb = _norm(a.get(k, "<absent>")), _norm(b.get(k, "<absent>"))
        if va == vb:
            continue
        line = f"{k}: {va!r} -> {vb!r}"
        top, _, rest = k.partition(".")
        if top in ("quant", "model"):
            refused.append(line)
        elif top == "method":
            (warned if rest.split(".")[0] in _METHOD_FREE else refused).append(line)
        elif top == "train":
            if rest in _TRAIN_NUMERICS:
                refused.append(line)
            elif rest == "max_steps" and (b.get("train.schedule") == "cosine" or b.get("train.warmup_steps")):
                refused.append(line + " (the cosine / warmup schedule depends on it)")
            elif rest in ("seed", "device"):
                warned.append(line)
        elif top in ("data", "plugins"):     # plugins: method.name (compared above) says which method trains
            warned.append(line)
    return refused, warned


def check_resume(saved: Dict[str, Any], cfg: RunConfig, world: int, where: str, warn: bool = True,
                 same_world: bool = True) -> None:
    """Refuse a resume whose numerics differ from the checkpoint's (trainer_state.json), naming each
    field; warn on data / seed / device changes. ``same_world``: the rank count must match too (a
    training resume; an evaluation reads only the module state)."""
    refused, warned = compare(saved.get("config") or {}, to_dict(cfg))
    sw = saved.get("world_size", world)
    if same_world and isinstance(sw, int) and sw != world:
        refused = _world_change(saved.get("config") or {}, cfg, sw, world, refused, where)
    if refused:
        raise ResumeMismatchError(
            f"resume from {where}: the checkpoint was trained with other settings: " + "; ".join(refused[:6])
            + (f" (and {len(refused) - 6} more)" if len(refused) > 6 else "")
            + ". Resume with the original values, or start a new run (another run_dir)")
    if warn:
        for w in warned:
            _say(f"resume from {where}: {w} (the resumed steps see other data / randomness than the original run)")


def _world_change(old: Dict[str, Any], cfg: RunConfig, sw: int, world: int, refused: List[str],
                  where: str) -> List[str]:
    """A resume on another number of ranks (checkpoint.load reshards ZeRO state): allowed
    when every step still sees the same global batch, micro_batch x grad_accum x ranks; micro_batch
    and grad_accum may change for that. Returns what stays refused."""
    t = old.get("train") or {}
    try:
        before = int(t["micro_batch"]) * int(t["grad_accum"]) * sw
    except (KeyError, TypeError, ValueError):
        return refused + [f"world_size: {sw} -> {world} (ranks; the checkpoint's batch is unknown)"]
    after = cfg.train.micro_batch * cfg.train.grad_accum * world
    if before != after:
        hint = ""
        if before % (cfg.train.micro_batch * world) == 0:
            hint = f"; keep it with train.grad_accum={before // (cfg.train.micro_batch * world)}"
        return refused + [f"world_size: {sw} -> {world} (ranks) changes the global batch from {before} to {after} "
                          f"samples per step (micro_batch x grad_accum x ranks){hint}"]
    keep = [r for r in refused if not r.startswith(("train.micro_batch:", "train.grad_accum:"))]
    _say(f"resume from {where}: {sw} -> {world} rank(s), the same global batch of {after} samples per step "
         f"(micro_batch {cfg.train.micro_batch} x grad_accum {cfg.train.grad_accum} x {world})")
    return keep


# ----------------------------------------------------------------------------- the directory
def _legacy_run(d: Path) -> bool:
    """A run directory of a version without the record: config.yaml and a checkpoint of ours."""
    return (d / "config.yaml").is_file() and any((c / "trainer_state.json").is_file()
                                                 for c in ckpt.list_checkpoints(d))


def _describe(d: Path) -> str:
    cks = ckpt.list_checkpoints(d)
    parts = [f"{len(cks)} checkpoint(s){', last ' + cks[-1].name if cks else ''}"]
    for n in ("student", "metrics.jsonl", "summary.json"):
        if (d / n).exists():
            parts.append(n)
    return ", ".join(parts)


def _fresh_name(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(f"runs/{cfg.method.name}-{cfg.quant.name or cfg.quant.weight_format}-{stamp}")
    d, i = base, 2
    while d.exists() or d.is_symlink():
        d = base.with_name(f"{base.name}-{i}")
        i += 1
    return d


def _kind(d: Path) -> Optional[str]:
    """_fsutil.kind_of, where a directory holding nothing but the run lock is empty: the lock is taken
    before the directory is checked, and a run killed right after taking it leaves only that file."""
    k = _fsutil.kind_of(d)
    if k is None and d.is_dir() and not d.is_symlink() and [x.name for x in d.iterdir()] == [_fsutil.RUN_LOCK]:
        return "empty"
    return k


def _decide(cfg: RunConfig, world: int, eval_only: bool, d: Optional[Path] = None) -> Dict[str, Any]:
    """Rank 0: everything that is checked before anything is written."""
    if d is None:
        d = Path(cfg.run_dir) if cfg.run_dir is not None else _fresh_name(cfg)
    kind = _kind(d)
    if eval_only:
        resume_from = ckpt.find_resume(cfg.resume, d)
        ckpt.scan(resume_from)
        check_resume(ckpt.read_state(resume_from), cfg, world, str(resume_from), warn=False, same_world=False)
        return {"run_dir": str(d), "resume_from": str(resume_from), "fresh": False, "restart": False}
    if kind == "run" or (kind is None and d.is_dir() and _legacy_run(d)):
        if not cfg.resume:
            raise RunDirError(f"run_dir={str(d)!r} already holds a run ({_describe(d)}); continue it with "
                              f"resume=auto, or choose a new run_dir. Nothing was changed")
    elif kind not in ("missing", "empty"):
        raise RunDirError(f"run_dir={str(d)!r} exists and is {'not a directory' if not d.is_dir() else 'not empty'}"
                          f" and is not a qatfactory run directory; a run writes only into a new or empty "
                          f"directory. Choose another run_dir. Nothing was changed")
    # leftovers of an interrupted checkpoint write are tidied first (finishing a cut swap), so
    # resume=auto sees every complete checkpoint
    ckpt.tidy(d)
    resume_from = ckpt.find_resume(cfg.resume, d)
    restart = False
    if resume_from is not None:
        ckpt.scan(resume_from)
        st = ckpt.read_state(resume_from)
        if st["step"] > cfg.train.max_steps:
            raise UsageError(f"train.max_steps={cfg.train.max_steps} is below the step of the checkpoint to resume, "
                             f"{st['step']} ({resume_from}): the run is already past it, so nothing would train. "
                             f"Give train.max_steps >= {st['step']} to continue it, or start a new run (another "
                             f"run_dir)")
        check_resume(st, cfg, world, str(resume_from))
    elif kind == "run" or kind is None:
        # resume=auto in a run that never wrote a checkpoint: the same run starts over
        rec = _read_record(d)
        if rec.get("config"):
            check_resume({"config": rec["config"], "world_size": rec.get("world_size", world)}, cfg, world,
                         str(d / RUN_RECORD))
        restart = True
        _say(f"resume=auto: {d} has no checkpoint yet; the run starts over from step 0")
    export_dir = None
    if cfg.export.enabled:
        export_dir = Path(cfg.export.out_dir or (d / f"export-{cfg.export.engine}"))
        protect = [d] + ([cfg.model.path] if cfg.model.path else [])
        for p in (export_dir, export_dir.with_name(export_dir.name + ".FAILED")):
            _fsutil.check_replaceable(p, ("export",), "export.out_dir", protect)
    return {"run_dir": str(d), "resume_from": None if resume_from is None else str(resume_from),
            "fresh": resume_from is None and not restart, "restart": restart,
            "export_dir": None if export_dir is None else str(export_dir)}


def _read_record(d: Path) -> Dict[str, Any]:
    try:
        r = read_json(d / RUN_RECORD)
        return r if isinstance(r, dict) else {}
    except (OSError, ValueError):      # CorruptFileError too: a damaged record is no record of ours
        return {}


_TMP_FILE = re.compile(r"^\.(config\.yaml|config\.resume-step-\d+\.yaml|qatfactory_run\.json|summary\.json|"
                       r"eval-step-\d+\.json)\.[A-Za-z0-9_]{8}\.tmp$|^metrics\.tmp$")


def _tidy_files(d: Path) -> None:
    """Temporary files of ours that a kill left in the run directory (write_text_atomic, the
    metrics rewrite): removed and named."""
    for p in sorted(d.iterdir()) if d.is_dir() else []:
        if _TMP_FILE.match(p.name) and p.is_file() and not p.is_symlink():
            p.unlink()
            _say(f"removed {p} (left by an interrupted write)")


def _write(d: Path, cfg: RunConfig, world: int, decision: Dict[str, Any]) -> None:
    """Rank 0: the record, config.yaml (never overwritten by a resume with other settings)."""
    d.mkdir(parents=True, exist_ok=True)
    _tidy_files(d)
    now = to_dict(cfg)
    if not (d / RUN_RECORD).is_file():
        _fsutil.write_text_atomic(d / RUN_RECORD, json.dumps(
            {"qatfactory_run": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": now,
             "world_size": world}, indent=1, default=str))
    text = OmegaConf.to_yaml(OmegaConf.create(now))
    cy = d / "config.yaml"
    if decision["fresh"] or decision["restart"] or not cy.is_file():
        _fsutil.write_text_atomic(cy, text)
    elif cy.read_text() != text:
        step = ckpt.read_state(Path(decision["resume_from"]))["step"] if decision["resume_from"] else 0
        name = f"config.resume-step-{step:06d}.yaml"
        _fsutil.write_text_atomic(d / name, text)
        _say(f"resumed with other (allowed) settings: {name} holds them; config.yaml keeps the original run's")


def _broadcast(obj):
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def prepare(cfg: RunConfig, rank: int, world: int, eval_only: bool = False) -> Tuple[Path, Optional[Path], Dict]:
    """(run_dir, checkpoint to resume from or None, decision) on every rank. cfg.run_dir is set.
    An error found by rank 0 is raised on every rank (nobody waits in a barrier for a dead rank 0)."""
    out: Any = None
    if rank == 0:
        d = locked = None
        try:
            d = Path(cfg.run_dir) if cfg.run_dir is not None else _fresh_name(cfg)
            # a training run holds its directory from before the first check to its end (runlock.held in
            # loop.run); only a directory a run may use is locked (the lock file goes into it)
            k = _kind(d)
            if not eval_only and (k in ("missing", "empty", "run") or (k is None and d.is_dir() and _legacy_run(d))):
                runlock.acquire(d)
                locked = d
            dec = _decide(cfg, world, eval_only, d)
            if not eval_only:
                _write(Path(dec["run_dir"]), cfg, world, dec)
            out = ("ok", dec)
        except Exception as e:  # noqa: BLE001 - handed to every rank, then raised
            if locked is not None and not isinstance(e, runlock.RunLockedError):
                runlock.release(locked)
            out = ("err", e)
    out = _broadcast(out)
    if out[0] == "err":
        raise out[1]
    dec = out[1]
    cfg.run_dir = dec["run_dir"]
    return Path(dec["run_dir"]), (Path(dec["resume_from"]) if dec["resume_from"] else None), dec
