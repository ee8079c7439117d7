"""Persistent workers for benchmarks/step.py: every variant runs many times in one GPU call.

A variant through the trainer costs 15-25 s of process start (imports, DeepSpeed, FusedAdam's load)
before its first step; the table needs every variant run several times, interleaved. So the parent
keeps two worker processes (ours: the trainer; peer: benchmarks/step_peers.py's plain loops and Model
Optimizer, never in the same process as our code) and sends them one job at a time over stdin; a worker
frees everything between jobs (gc, empty_cache) and reports the memory still allocated before each job
(``mem_before_gib``) and after it (``mem_after_gib``), so peak memory stays per variant. A job that leaves
more than ``LEAK_GIB`` allocated after the free (the H100 MoE run of 2026-12-06: 30 GiB after every Model
Optimizer job, which the next jobs of both workers then lacked) ends its worker: the row says so and the next
job starts a fresh process. Only one job runs at a time. A worker that dies or overruns its job's time limit
is killed (it is our own child) and restarted, and the row says why.

Rounds: every job once per round, ours and peers alternating, rounds repeated until ``--repeat`` or
until the ``--budget`` (seconds) would be exceeded by the next job (estimated from its first round),
so a time-limited call still ends with a table. Round 0 also profiles each job (benchmarks/step_profile.py).
"""
from __future__ import annotations

import gc
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LEAK_GIB = 1.0          # allocated after a job's free beyond this: the worker is replaced before the next job


def _free_device() -> float:
    """Collect garbage and return cached blocks; GiB still allocated (0 on a CPU)."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**30
    return 0.0


def serve(kind: str, run_job, free=_free_device) -> int:
    """The worker loop: a JSON job per stdin line -> one ``ROW {...}`` line on stdout. After a job that leaked
    (more than LEAK_GIB still allocated once freed) the row carries ``worker_restarted`` and the loop ends."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        job = json.loads(line)
        if job.get("exit"):
            break
        t0 = time.time()
        before = free()
        try:
            row = run_job(job)
        except Exception as e:   # a failed variant is a row, not a dead worker
            traceback.print_exc(file=sys.stderr)
            row = {"variant": job["name"], "error": f"{type(e).__name__}: {e}"[-600:]}
        row["mem_before_gib"] = before
        row["job_s"] = time.time() - t0
        after = row["mem_after_gib"] = free()
        leaked = after > LEAK_GIB
        if leaked:
            row["worker_restarted"] = f"{after:.2f} GiB still allocated after the job: {kind} worker replaced"
        sys.stderr.flush()
        print("ROW " + json.dumps(row), flush=True)
        if leaked:
            break
    return 0


class Worker:
    """One persistent child (``cmd`` + ``--serve``), restarted when it dies."""

    def __init__(self, kind: str, cmd, log_path: Path, env):
        self.kind, self.cmd, self.log_path, self.env = kind, list(cmd), log_path, env
        self.proc = None
        self.q: "queue.Queue" = queue.Queue()

    def _start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, bufsize=1, env=self.env)
        log.close()
        self.q = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.q), daemon=True).start()

    @staticmethod
    def _read(proc, q) -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    def _tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text()[-n:].replace("\n", " | ")
        except OSError:
            return ""

    def run(self, job: dict, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.stop()
            return {"variant": job["name"], "error": f"{self.kind} worker died before the job: {self._tail()}"}
        deadline = time.time() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                self.stop()
                return {"variant": job["name"], "error": f"timed out after {timeout:.0f} s (worker killed)"}
            if line is None:
                self.stop()
                return {"variant": job["name"], "error": f"{self.kind} worker died: {self._tail()}"}
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                if row.get("worker_restarted"):
                    self.stop()       # it is exiting: wait for it, so the next job starts a fresh one
                return row

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            try:
                p.stdin.write(json.dumps({"exit": True}) + "\n")
                p.stdin.flush()
                p.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()


def run_rounds(jobs, cmds, args, log_dir: Path):
    """Run ``jobs`` ([(kind, name, profile)]) in interleaved rounds on persistent workers.
    Returns (order, runs, notes): runs[name] = rows of every round."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = {k: Worker(k, c, log_dir / f"step_worker_{k}.log", env) for k, c in cmds.items()}
    ours = [j for j in jobs if j[0] == "ours"]
    peers = [j for j in jobs if j[0] != "ours"]
    seq = []
    for i in range(max(len(ours), len(peers))):
        seq += ([ours[i]] if i < len(ours) else []) + ([peers[i]] if i < len(peers) else [])
    t0 = time.time()
    est, runs, order, notes = {}, {}, [], []
    try:
        for rnd in range(args.repeat):
            for kind, name, prof in seq:
                left = args.budget - (time.time() - t0) if args.budget else None
                if left is not None and left < est.get(name, args.job_timeout / 3):
                    notes.append(f"round {rnd}: '{name}' not run (budget: {left:.0f} s left, "
                                 f"the job took {est.get(name, 0):.0f} s)")
                    continue
                job = {"name": name, "round": rnd, "profile": bool(prof and rnd == 0)}
                tl = args.job_timeout if left is None else max(30.0, min(args.job_timeout, left))
                row = workers[kind].run(job, tl)
                if args.fresh:
                    workers[kind].stop()
                row["variant"], row["round"] = name, rnd
                est[name] = max(est.get(name, 0.0), row.get("job_s", 0.0))
                if name not in runs:
                    order.append((kind, name))
                runs.setdefault(name, []).append(row)
                brief = {k: v for k, v in row.items() if k not in ("step_ms_all", "profile")}
                print(f"[bench] {time.time() - t0:6.0f} s  round {rnd} {name}: {json.dumps(brief)}",
                      file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.stop()
    return order, runs, notes


def profile_table(order, runs) -> str:
    """Round 0's profile per variant: wall ms/step (unprofiled timing runs) against GPU busy."""
    L = ["| variant | wall ms/step | GPU busy ms/step | GPU idle ms/step | busy | kernels/step | launches/step "
         "| top kernel (ms/step) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for _, name in order:
        rows = [r for r in runs[name] if r.get("profile")]
        if not rows:
            continue
        p, ok = rows[0]["profile"], [r["ms_per_step"] for r in runs[name] if "ms_per_step" in r]
        if not p:
            continue
        wall = statistics.median(ok) if ok else None
        busy = p.get("gpu_busy_ms_per_step")
        top = p["top_kernels"][0] if p.get("top_kernels") else None
        cells = [name, "-" if wall is None else f"{wall:.1f}", "n/a (no GPU)" if busy is None else f"{busy:.1f}",
                 "-" if busy is None or wall is None else f"{wall - busy:.1f}",
                 "-" if busy is None or not wall else f"{100 * busy / wall:.0f}%",
                 f"{p['kernels_per_step']:.0f}" if busy is not None else f"({p['cpu_ops_per_step']:.0f} CPU ops)",
                 f"{p['launches_per_step']:.0f}",
                 "-" if top is None else f"{top['name'][:60]} ({top['ms_per_step']:.1f})"]
        L.append("| " + " | ".join(cells) + " |")
    return "\n".join(L)
