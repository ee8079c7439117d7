"""Training and export launches of the GPU pipeline (benchmarks/gpu/pipeline.py): ``deepspeed -m
qatfactory.train`` under the launcher with its metrics tailed and a checkpoint timed from outside, and
``qatfactory export`` -> ``qatfactory verify`` of one engine in a thread (GPUs hidden) so it overlaps
the next GPU stage.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from supervise import REC_LOCK, Budget, GpuMonitor, Proc, child_env, du, say


# ============================================================================ training launches
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(p: Path) -> List[dict]:
    if not Path(p).exists():
        return []
    return [json.loads(l) for l in Path(p).read_text().splitlines() if l.strip()]


def launcher(a) -> List[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(a.world), "--master_port",
            str(free_port()), "--module", "qatfactory.train"]


class MetricsTail:
    """Polls a run's metrics.jsonl: prints each new step compactly and notes when it arrived."""

    def __init__(self, tag: str, run_dir: Path):
        self.tag, self.path, self.n, self.arrived = tag, Path(run_dir) / "metrics.jsonl", 0, {}

    def __call__(self) -> None:
        if not self.path.exists():
            return
        try:
            recs = read_jsonl(self.path)
        except json.JSONDecodeError:      # a line being written
            return
        for r in recs[self.n:]:
            if "loss" in r:
                self.arrived.setdefault(r["step"], time.time())
                say(f"{self.tag} step {r['step']}: loss {r['loss']:.5f}, {r['step_ms']:.0f} ms, "
                    f"{r['tokens_per_s']:.0f} tok/s, rank-0 peak {r['mem_gb']:.2f} GiB")
            elif "eval/ce" in r:
                say(f"{self.tag} eval at step {r['step']}: " +
                    ", ".join(f"{k[5:]} {v:.4g}" for k, v in r.items() if k.startswith("eval/")))
        self.n = len(recs)


class CkptWatch:
    """Times a checkpoint from outside: its .tmp directory appearing until the renamed one appears."""

    def __init__(self, run_dir: Path, step: int):
        self.root = Path(run_dir) / "checkpoints"
        self.tmp, self.final = self.root / f".tmp-step-{step:06d}", self.root / f"step-{step:06d}"
        self.t_start = self.t_end = None

    def __call__(self) -> None:
        if self.t_start is None and (self.tmp.exists() or self.final.exists()):
            self.t_start = time.time()
        if self.t_end is None and self.final.exists():
            self.t_end = time.time()

    def seconds(self) -> Optional[float]:
        if self.t_start is None or self.t_end is None:
            return None
        return self.t_end - self.t_start


def train_stats(run_dir: Path, skip: int = 2) -> Dict[str, Any]:
    recs = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]
    timed = [r for r in recs if r["step"] > recs[0]["step"] + skip - 1] if len(recs) > skip else recs
    out: Dict[str, Any] = {"steps_logged": len(recs), "losses": {str(r["step"]): r["loss"] for r in recs}}
    if timed:
        out["ms_per_step_median"] = statistics.median(r["step_ms"] for r in timed)
        out["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in timed)
        out["steps_timed"] = [timed[0]["step"], timed[-1]["step"]]
    if recs:
        out["rank0_torch_peak_gib"] = max(r["mem_gb"] for r in recs)
    sp = Path(run_dir) / "summary.json"
    if sp.exists():
        s = json.loads(sp.read_text())
        out["trainer"] = {k: s.get(k) for k in ("steps", "tokens", "time_s", "world_size", "eval_first", "eval_last",
                                                "student_dir")}
    return out


def run_launch(a, tag: str, overrides: List[str], run_dir: Path, budget: Budget, cap: float, mon: GpuMonitor,
               watch: Optional[CkptWatch] = None, block: bool = True):
    """Start one `deepspeed -m qatfactory.train` launch; block=False returns (proc, finish) where
    finish() waits and returns the record."""
    cmd = launcher(a) + overrides
    say(f"{tag}: launching ({len(overrides)} overrides) -> {run_dir}")
    t0 = time.time()
    tail = MetricsTail(tag, run_dir)

    def poll():
        tail()
        if watch is not None:
            watch()

    p = Proc(tag, cmd, Path(a.work) / "logs" / f"{tag}.log", child_env(a, threads=None if a.gpu else 1), poll=poll)

    def finish() -> Dict[str, Any]:
        p.wait(budget.timeout(cap) - (time.time() - t0))
        rec: Dict[str, Any] = {"command": "deepspeed --num_gpus %d -m qatfactory.train %s" % (a.world, " ".join(overrides)),
                               "rc": p.rc, "wall_s": p.seconds, "timed_out": p.timed_out, "log": str(p.log)}
        first = min(tail.arrived.values()) if tail.arrived else None
        if first is not None:
            rec["launch_to_first_step_s"] = first - t0
        rec["gpu_peak_mib_per_rank"] = mon.peak(t0, time.time())
        rec.update(train_stats(run_dir))
        if p.rc != 0:
            rec["error_tail"] = p.tail(30)
            say(f"{tag}: FAILED rc={p.rc}" + (" (timed out)" if p.timed_out else "") + f"\n{p.tail(15)}")
        else:
            say(f"{tag}: done in {p.seconds:.1f} s")
        return rec

    if block:
        return finish()
    return p, finish


# ============================================================================ export + verify
class ExportJob:
    """qatfactory export -> qatfactory verify of one engine, in a thread (CPU only, GPUs hidden),
    so it overlaps the next GPU stage."""

    def __init__(self, a, tag: str, student: Path, engine: str, flavour: str, out_root: Path, budget: Budget,
                 source_dir: Optional[str] = None):
        self.rec: Dict[str, Any] = {"engine": engine, "flavour": flavour, "status": "running"}
        self.a, self.tag, self.student, self.engine, self.flavour = a, tag, student, engine, flavour
        self.edir = out_root / f"{engine}-{flavour}"
        self.vjson = out_root / f"{engine}-{flavour}.verify.json"
        self.source_dir, self.budget = source_dir, budget
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _cli(self, what: str, args: List[str]) -> Proc:
        threads = max(1, ((os.cpu_count() or 2) - 4) // 2) if self.a.gpu else 1
        p = Proc(f"{self.tag}-{what}-{self.engine}", [sys.executable, "-m", "qatfactory.faces.cli", what] + args,
                 Path(self.a.work) / "logs" / f"{self.tag}-{what}-{self.engine}-{self.flavour}.log",
                 child_env(self.a, threads=threads, hide_gpus=True))
        p.wait(self.budget.timeout(1e9))
        return p

    def _set(self, **kw) -> None:
        with REC_LOCK:
            self.rec.update(kw)

    def _run(self) -> None:
        try:
            args = [str(self.student), "--engine", self.engine, "--flavour", self.flavour, "--out", str(self.edir),
                    "--force"] + (["--source-dir", self.source_dir] if self.source_dir else [])
            self._set(export_command="qatfactory export " + " ".join(args))
            p = self._cli("export", args)
            self._set(export_s=p.seconds, export_rc=p.rc)
            if p.rc != 0:
                # rc 2: refused with a reason (every target chosen here is one the exporters support)
                self._set(status="export refused" if p.rc == 2 else "export failed", error=p.tail(6))
                return
            self._set(bytes=du(self.edir), path=str(self.edir))
            args = [str(self.edir), "--against", str(self.student), "--json", str(self.vjson), "--quiet"] + \
                (["--source-dir", self.source_dir] if self.source_dir else [])
            self._set(verify_command="qatfactory verify " + " ".join(args))
            p = self._cli("verify", args)
            r: Dict[str, Any] = {"verify_s": p.seconds, "verify_rc": p.rc}
            if self.vjson.exists():
                v = json.loads(self.vjson.read_text())
                checks = v.get("checks", [])
                r["verify_ok"] = bool(v.get("ok"))
                r["checks"] = {st: sum(c["status"] == st for c in checks) for st in ("ok", "FAIL", "INCOMPLETE")}
                r["verdict"] = v.get("verdict") or ("PASS" if v.get("ok") else "FAIL")
                r["install"] = v.get("install") or []
                r["failures"] = [f"{c['tensor']}: {c['check']}: {c['detail']}"[:200]
                                 for c in checks if c["status"] == "FAIL"][:8]
                lg = v.get("logits") or {}
                r["logits"] = {k: lg[k] for k in list(lg)[:6]} if isinstance(lg, dict) else {}
            else:
                r["verify_ok"] = False
                r["error"] = p.tail(6)
            # PASS / FAIL / INCOMPLETE (a required check could not run: r["install"] says what is missing)
            r["status"] = r.get("verdict") or ("PASS" if r["verify_ok"] else "FAIL")
            self._set(**r)
        except Exception as e:
            self._set(status="error", error=f"{type(e).__name__}: {e}")
        finally:
            r = self.rec
            say(f"{self.tag} {self.engine}/{self.flavour}: {r['status']}"
                + (f" (export {r.get('export_s', 0):.1f} s, verify {r.get('verify_s', 0):.1f} s)"
                   if "verify_s" in r else ""))

    def join(self, timeout: float) -> Dict[str, Any]:
        self.th.join(max(0.0, timeout))
        if self.th.is_alive():
            self._set(status="not finished in the budget")
        return self.rec
