"""Start N rank processes of `qatfactory train` on CPU (gloo) with the environment the deepspeed
launcher would set (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*): one process per rank and no launcher
process (the multi-rank trainer tests, among them the kill-and-resume ones of test_train_resume_ranks.py).

A rank process is forked from a preloaded interpreter, one per rank index, that has imported torch,
transformers, DeepSpeed and qatfactory and run nothing else: those imports are about 6 of the 12 CPU
seconds of a tiny rank, and a resume test starts six ranks. Each rank is still a new process (its own
pid, environment, working directory, log on stdout/stderr, exit code or signal), so a resumed run has
nothing in memory from the run it resumes: every bit of its state comes from the checkpoint on disk.
Python's and numpy's global generators are seeded from the OS in each rank, as in a fresh interpreter.
The ranks of one launch come from different interpreters, so they differ in str hash order as the ranks
of a real launch do; rank r of every launch shares its interpreter's hash order."""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

# a rank: `qatfactory train <overrides>`, or (with a script) python code run after the environment is set
TRAIN = "import sys\nfrom qatfactory.faces.cli import main\nrc = main(['train'] + sys.argv[1:])\n" \
        "print('finished', rc, flush=True)\nsys.exit(rc)\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "NODE_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


# what every rank imports; anything else a rank's code imports it imports itself, as a fresh interpreter would
PRELOAD = ("torch", "deepspeed", "transformers.models.llama.modeling_llama", "qatfactory.faces.cli",
           "qatfactory.train", "qatfactory.train.loop", "qatfactory.train.checkpoint")

# The preloaded interpreter: imports PRELOAD, then serves one request per stdin line. "start" forks a
# rank (its environment, directory, argv and log; the code runs as `python -c` runs it, and the process
# ends as an interpreter does: threads joined, atexit handlers run, streams flushed); "wait" reaps one
# (killing it past the deadline) and answers its exit code, -N for signal N.
ZYGOTE = r"""
import atexit, io, json, os, signal, sys, threading, time, traceback
# the answers go to the parent on a copy of stdout; whatever the imports print goes to stderr
answer = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for m in sys.argv[1:]:
    __import__(m)
def child(req):
    code = 1
    try:
        os.close(answer.fileno())     # the answer pipe is the preloaded interpreter's alone
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2), os.close(fd)
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0), os.close(fd)
        # unbuffered, as PYTHONUNBUFFERED=1 makes the ranks' output
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        # the global generators a fresh interpreter seeds from the OS, seeded from the OS again: a run that
        # drew from them unseeded would differ between its launches as between fresh processes
        import random
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["-c", *req["args"]]
        try:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "start":
        pid = os.fork()
        if pid == 0:
            child(req)
        out = {"pid": pid}
    else:
        pid, deadline, timed_out = req["pid"], time.monotonic() + req["timeout"], False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.05)
        out = {"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out}
    answer.write(json.dumps(out) + "\n")
    answer.flush()
"""

_ZYGOTES: Dict[int, subprocess.Popen] = {}


def _zygote(slot: int) -> subprocess.Popen:
    """The preloaded interpreter of one slot (a rank index): started at first use, kept for the worker's life."""
    z = _ZYGOTES.get(slot)
    if z is None or z.poll() is not None:
        # its own output (the libraries' import messages, which each rank's log would otherwise show) goes
        # to a file that a failed start quotes
        err = tempfile.NamedTemporaryFile("w", prefix=f"rank{slot}-preload-", suffix=".log", delete=False)
        z = subprocess.Popen([sys.executable, "-c", ZYGOTE, *PRELOAD], cwd=REPO, env=clean_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        z.err_path = err.name
        err.close()
        _ZYGOTES[slot] = z
    return z


def _ask(z: subprocess.Popen, **req) -> dict:
    z.stdin.write(json.dumps(req) + "\n")
    z.stdin.flush()
    line = z.stdout.readline()
    if not line:
        raise RuntimeError(f"the preloaded rank interpreter {z.pid} exited (rc {z.wait()}):\n"
                           + Path(z.err_path).read_text()[-3000:])
    return json.loads(line)


@atexit.register
def _close_zygotes() -> None:
    for z in _ZYGOTES.values():
        z.stdin.close()
        z.wait()
        os.unlink(z.err_path)
    _ZYGOTES.clear()


def _start(slot: int, code: str, args: Sequence[str], env: Dict[str, str], cwd: Path, log: Path) -> int:
    return _ask(_zygote(slot), op="start", env=env, cwd=str(cwd), args=[str(a) for a in args], code=code,
                log=str(log))["pid"]


def _wait(slot: int, pid: int, timeout: float) -> dict:
    return _ask(_zygote(slot), op="wait", pid=pid, timeout=max(0.0, timeout))


def run_preloaded(code: str, args: Sequence[str], log: Path, cwd: Path = REPO, env: Optional[Dict[str, str]] = None,
                  timeout: float = 300) -> int:
    """One child running ``code`` (as ``python -c code *args``) with its stdout and stderr in ``log``,
    forked from a preloaded interpreter; its exit code (-N: killed by signal N); TimeoutError past ``timeout``."""
    w = _wait(0, _start(0, code, args, clean_env() if env is None else env, cwd, log), timeout)
    if w["timed_out"]:
        raise TimeoutError(f"a child ran past {timeout} s and was killed\n" + Path(log).read_text()[-3000:])
    return w["rc"]


def launch(tmp: Path, tag: str, world: int, args: Sequence[str], code: str = TRAIN,
           timeout: int = 420) -> Tuple[List[int], str]:
    """``world`` rank processes running ``code`` with ``args``; (exit codes, the logs' tails)."""
    port = free_port()
    base = clean_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)})
    pids = [_start(r, code, args, dict(base, RANK=str(r), LOCAL_RANK=str(r)), REPO, tmp / f"{tag}-rank{r}.log")
            for r in range(world)]
    deadline = time.monotonic() + timeout
    waited = [_wait(r, pid, deadline - time.monotonic()) for r, pid in enumerate(pids)]
    rcs = [w["rc"] for w in waited]
    text = "\n".join(f"===== {tag} rank {r} =====\n" + (tmp / f"{tag}-rank{r}.log").read_text()[-4000:]
                     for r in range(world))
    if any(w["timed_out"] for w in waited):
        raise TimeoutError(f"{tag}: a rank ran past {timeout} s and was killed\n{text}")
    return rcs, text


def losses(run_dir) -> Dict[int, float]:
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}
