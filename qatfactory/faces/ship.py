"""ship(): a converted student -> an engine's checkpoint -> the parity gate, written once.

    from qatfactory.faces.ship import ship
    s = ship(converted, "vllm", "modelopt", "out/vllm")     # export, verify, .FAILED on a failing gate
    s.ok, s.path, s.gate["verdict"]

Used by ``qatfactory export``, the end of ``qatfactory train`` (:func:`train_and_ship`: the trainer
returns its student, this face ships it; nothing under train/ imports an exporter) and the demo.
A gate that does not PASS moves the export to ``<out>.FAILED`` with FAILED.json inside (verdict and
reasons), so nothing serves it by its usual path; an earlier ``.FAILED`` of ours is replaced.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _fsutil
from .._inputs import read_json
from ..exitcodes import UsageError
from ..exporters import export
from ..exporters import verify as gate
from ..exporters.verify.adapter import TrainedAdapter, check_adapter
from ..exporters.verify.code_plane import check_code_plane, check_training_logits
from ..exporters.verify.common import default_prompt
from ..train import runlock
from ..train.loop import run as train_run


@dataclass
class Shipped:
    """One export and its gate. ``path``: where it is now (``<out>.FAILED`` when the gate did not
    PASS); ``report``: the exporter's VerifyResult (None when not verified); ``gate``: its verdict,
    reasons and check count (:func:`gate_summary`); ``extra``: entries of method-specific rows."""

    path: Path
    engine: str
    flavour: str
    files: List[str]
    record: Dict[str, Any]
    report: Any = None
    gate: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> Optional[bool]:
        """True: the gate PASSed; False: it did not; None: not verified."""
        return None if self.gate is None else self.gate["verdict"] == "PASS"

    def summary(self) -> Dict[str, Any]:
        """The run summary's entries: export_dir, verify (gate_summary), verify_ok, extras."""
        out: Dict[str, Any] = {"export_dir": str(self.path)}
        if self.gate is not None:
            out["verify"] = self.gate
            out["verify_ok"] = self.ok
        out.update(self.extra)
        return out


def ship(converted, engine: str, flavour: Optional[str], out, verify: bool = True, *, force: bool = False,
         native_base=None, training_logits: Optional[Callable[[List[int]], Tuple[torch.Tensor, str]]] = None,
         adapter: Optional[Dict[str, Any]] = None, **options) -> Shipped:
    """Export ``converted`` (a formats.ConvertedModel) for ``engine`` into ``out`` and, with
    ``verify``, run the parity gate on it. ``force``: replace an earlier export of ours or an empty
    directory (never anything else). ``native_base``: a native 4-bit checkpoint whose code plane the
    export must carry byte for byte; ``training_logits(prompt) -> (logits, how)``: the training
    forward the export's logits must equal (scale adapters); ``adapter``: a LoRA folder shipped beside
    the export and the adapter as trained (Student.adapter), gated together. ``options``: the exporter's own."""
    r = export(converted, str(out), engine=engine, flavour=flavour, force=force, **options)
    s = Shipped(Path(r.path), r.engine, r.flavour, list(r.files), dict(r.record))
    if not verify:
        return s
    res = gate(r.path, converted)
    if native_base is not None:
        s.extra["code_plane"] = check_code_plane(res, r.path, Path(native_base), converted)
    if training_logits is not None:
        prompt = default_prompt(int(converted.config["vocab_size"]))
        logits, how = training_logits(prompt)
        check_training_logits(res, converted, logits, prompt)
        res.notes.append(f"training forward: {how}")
    if adapter is not None:
        check_adapter(res, adapter["dir"], TrainedAdapter(int(adapter["rank"]), float(adapter["alpha"]),
                                                          dict(adapter["modules"]), list(adapter.get("linears") or [])))
    s.report, s.gate = res, gate_summary(res)
    if not s.ok:
        s.path = mark_failed(r.path, s.gate)
        s.gate["moved_to"] = str(s.path)
    return s


def gate_summary(res) -> Dict[str, Any]:
    """Verdict and reasons of an exporters.verify result: ``res.verdict`` (PASS / FAIL / INCOMPLETE)
    when the gate has it, else PASS exactly when ``res.ok``."""
    v = getattr(res, "verdict", None)
    v = v if v in ("PASS", "FAIL", "INCOMPLETE") else ("PASS" if bool(res.ok) else "FAIL")
    if v != "PASS" and bool(getattr(res, "ok", False)):
        v = "FAIL"
    checks = list(getattr(res, "checks", []) or [])
    bad = [c for c in checks if str(getattr(c, "status", "")).upper() not in ("OK", "SKIP", "PASS")]
    reasons = [f"{getattr(c, 'tensor', '')}: {getattr(c, 'check', '')}: {getattr(c, 'status', '')}: "
               f"{getattr(c, 'detail', '')}" for c in bad][:10]
    if v != "PASS" and not reasons:
        reasons = [f"{sum(1 for c in checks if str(getattr(c, 'status', '')).upper() == 'SKIP')} required "
                   f"check(s) did not run" if checks else "no check ran"]
    return {"verdict": v, "reasons": reasons, "checks": len(checks)}


def mark_failed(edir: Path, gate_: Dict[str, Any]) -> Path:
    """Move a failed export out of the way: ``<dir>.FAILED`` with FAILED.json (verdict, reasons)
    inside, so nothing serves it by its usual path; an earlier ``.FAILED`` of ours is replaced. When
    ``<dir>.FAILED`` is somebody else's (or a link, or a file), a fresh ``<dir>.FAILED-XXXXXXXX`` beside it
    takes the export instead: a failed export is never left where a server would load it, and nothing
    that is not ours is replaced."""
    edir = Path(edir)
    failed = edir.with_name(edir.name + ".FAILED")
    _fsutil.write_text_atomic(edir / "FAILED.json", json.dumps(
        {"verdict": gate_["verdict"], "reasons": gate_["reasons"], "exported_as": str(edir),
         "what": "the parity gate did not PASS on this export; do not serve it (see docs/reliability.md)"},
        indent=1))
    try:
        _fsutil.check_replaceable(failed, ("export",), "export.out_dir")
    except _fsutil.NotOursError:
        # an empty directory of a unique name, made atomically; renaming a directory onto an empty one
        # replaces it in one step
        fresh = Path(tempfile.mkdtemp(prefix=edir.name + ".FAILED-", dir=edir.parent))
        os.rename(edir, fresh)
        _fsutil.fsync_dir(edir.parent)
        return fresh
    _fsutil.swap_in(edir, failed)
    return failed


def export_lines(summary: Dict[str, Any]) -> List[str]:
    """What a person reads about a run's export: where it is and what the gate said."""
    v = summary.get("verify")
    if not summary.get("export_dir"):
        return []
    if v is None:
        return [f"export: {summary['export_dir']} (not verified: export.verify=false)"]
    if v["verdict"] == "PASS":
        return [f"export: {summary['export_dir']}  parity gate PASS ({v['checks']} checks)"]
    return ([f"export: parity gate {v['verdict']}: the export was moved to {summary['export_dir']} "
             f"(FAILED.json inside); do not serve it. Why:"] + [f"  {r}" for r in v["reasons"]])


def ship_student(student, run_dir: Optional[str] = None) -> Dict[str, Any]:
    """Ship a run's methods.Student as its ``ship`` request says (rank 0; nothing when it has no
    request); the summary entries. ``run_dir``: its summary.json gets them too (rewritten atomically)."""
    req = getattr(student, "ship", None)
    if student is None or req is None or student.converted is None:
        return {}
    # force: the target was checked before training (rundir.prepare): empty, or an earlier export of ours
    s = ship(student.converted, req["engine"], req["flavour"], req["out"], verify=req["verify"], force=True,
             native_base=student.native_base, training_logits=student.training_logits,
             adapter=getattr(student, "adapter", None))
    out = s.summary()
    if run_dir is not None and (Path(run_dir) / "summary.json").is_file():
        p = Path(run_dir) / "summary.json"
        d = json.loads(p.read_text())
        d.update(out)
        _fsutil.write_text_atomic(p, json.dumps(d, indent=1, default=str))
    for line in export_lines(out):
        print(line, flush=True)
    return out


def model_type_of(cfg) -> Optional[str]:
    """The run's model_type without building it: the random models' architecture, or config.json of
    model.path read with limits (None when no folder is there yet: a packaged asset not prepared)."""
    from ..train.config import TINY_NAMES  # noqa: PLC0415 (the face reads the trainer's table)
    m = cfg.model
    if m.path is None and m.asset is None:
        return TINY_NAMES.get(m.name)
    if m.path is not None and (Path(m.path) / "config.json").is_file():
        mt = read_json(Path(m.path) / "config.json", want=dict).get("model_type")
        return mt if isinstance(mt, str) else None
    return None


def check_request(cfg) -> None:
    """What the export the run asks for needs from the model, checked before training: an architecture the
    engine's exporter writes (exporters/llama_cpp.py ARCHS for GGUF)."""
    if not cfg.export.enabled or cfg.export.engine != "llama_cpp":
        return
    from ..exporters.llama_cpp import ARCHS  # noqa: PLC0415 (the exporter's own table)
    mt = model_type_of(cfg)
    if mt is not None and mt not in ARCHS:
        raise UsageError(f"export=llama_cpp with model_type={mt!r} (model.path={cfg.model.path}): the GGUF exporter "
                         f"writes {sorted(ARCHS)}; allowed: a model of those, or export=vllm / export=sglang")


def train_and_ship(cfg, eval_only: bool = False) -> Dict[str, Any]:
    """``qatfactory train`` as a function: train.run (the student), then ship it when cfg.export
    asks; the run summary with the export's entries (export_dir, verify, verify_ok)."""
    with runlock.held():        # the run directory stays locked through the export written into it
        summary = train_run(cfg, eval_only=eval_only)
        summary.update(ship_student(summary.get("student"), summary.get("run_dir")))
    return summary
