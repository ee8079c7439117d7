"""What every stage of the GPU pipeline (benchmarks/gpu/pipeline.py) shares: the clock and the time
budget, child processes in their own process groups, the nvidia-smi memory monitor, small file helpers.

The run's shared state lives here and only here: ``T0`` (the start that the log's clock and the budget
count from), the list of live children and its lock, and ``REC_LOCK``. Other modules import these
objects; none makes its own. Standard library only: the runners import it first, before torch, and its clock
counts their heavy imports. The carried files (GGUF parts, stash, asset cache) are tools/gpu/staging.py's.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
T0 = time.time()
# NCCL multicast (NVLS) stays off on the lent machines; tools/gpu/run.sh exports the same
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def say(msg: str) -> None:
    print(f"[pipe {time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def du(p: Path) -> int:
    p = Path(p)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


# ============================================================================ budget
class Budget:
    def __init__(self, seconds: float, reserve: float = 8.0):
        self.deadline = T0 + seconds
        self.reserve = reserve

    def left(self) -> float:
        return self.deadline - time.time() - self.reserve

    def timeout(self, cap: float) -> float:
        return max(1.0, min(cap, self.left()))


# ============================================================================ subprocesses
_CHILDREN: List[subprocess.Popen] = []
_CHILD_LOCK = threading.Lock()
# held while the report is serialized and while an export thread updates its record
REC_LOCK = threading.RLock()

# lines of a training / export subprocess worth echoing to the pipeline's own log: the trainer's
# messages and summary, the exporters' verdicts, and anything that looks like a failure
_ECHO_START = ("[qatfactory]", "run: ", "method=", "eval/", "verdict:", "exported ", "qatfactory ", "Traceback")
_ECHO_ANY = ("Error", "FAILED", "out of memory", "Killed", "exits with return code")


def interesting(line: str) -> bool:
    return line.startswith(_ECHO_START) or any(k in line for k in _ECHO_ANY)


class Proc:
    """A child in its own process group (so the whole group can be stopped), output to a log file;
    selected lines are echoed with a tag and a timestamp. ``poll`` runs every 0.2 s in a thread of its
    own while the child lives (the main thread may be busy evaluating meanwhile)."""

    def __init__(self, tag: str, cmd: List[str], log: Path, env: Dict[str, str], cwd: Path = REPO,
                 poll: Optional[Callable[[], None]] = None):
        self.tag, self.cmd, self.log = tag, [str(c) for c in cmd], log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self._f = open(log, "w")
        self._f.write("$ " + " ".join(self.cmd) + "\n")
        self._f.flush()
        self.p = subprocess.Popen(self.cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", bufsize=1, start_new_session=True)
        with _CHILD_LOCK:
            _CHILDREN.append(self.p)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        self._poll = poll
        self._poller = threading.Thread(target=self._poll_loop, daemon=True) if poll is not None else None
        if self._poller is not None:
            self._poller.start()
        self.rc: Optional[int] = None
        self.timed_out = False
        self.seconds = 0.0

    def _pump(self) -> None:
        for line in self.p.stdout:
            self._f.write(line)
            if interesting(line):
                print(f"[{self.tag} +{time.time() - self.t0:5.1f}s] {line.rstrip()[:300]}", flush=True)
        self._f.flush()

    def _poll_loop(self) -> None:
        while self.p.poll() is None:
            try:
                self._poll()
            except Exception as e:        # a watcher must never stop the run
                print(f"[{self.tag}] watcher: {type(e).__name__}: {e}", flush=True)
            time.sleep(0.2)

    def wait(self, timeout: float) -> int:
        end = time.time() + max(1.0, timeout)
        while self.p.poll() is None:
            if time.time() > end:
                self.timed_out = True
                say(f"{self.tag}: timed out after {timeout:.0f} s; stopping it")
                stop(self.p)
                break
            time.sleep(0.2)
        self.p.wait()
        self._reader.join(timeout=10)
        if self._poller is not None:
            self._poller.join(timeout=5)
            self._poll()
        self._f.close()
        self.rc = self.p.returncode
        self.seconds = time.time() - self.t0
        with _CHILD_LOCK:
            if self.p in _CHILDREN:
                _CHILDREN.remove(self.p)
        return self.rc

    def tail(self, n: int = 25) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def stop(p: subprocess.Popen) -> None:
    """SIGTERM to the child's own process group (its deepspeed ranks too), SIGKILL after 10 s."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_children() -> None:
    with _CHILD_LOCK:
        kids = list(_CHILDREN)
    for p in kids:
        stop(p)


def child_env(a, threads: Optional[int] = None, hide_gpus: bool = False) -> Dict[str, str]:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    pp = env.get("PYTHONPATH", "")
    if str(REPO) not in pp.split(os.pathsep):
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + pp if pp else "")
    env.update(NCCL_ENV)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if a.gpu:
        # DeepSpeed's op builder wants a plain arch (the H200 image defaults to "9.0a")
        env["TORCH_CUDA_ARCH_LIST"] = env.get("TORCH_CUDA_ARCH_LIST", "9.0").rstrip("a") or "9.0"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# ============================================================================ GPU memory
class GpuMonitor:
    """Samples nvidia-smi's memory.used per GPU every 500 ms; peak(t0, t1) per GPU index, MiB.
    With one process per GPU under the launcher this is each rank's peak (context and allocator
    cache included); rank 0's torch.cuda.max_memory_allocated comes from the trainer's metrics."""

    def __init__(self, enabled: bool):
        self.samples: List[Tuple[float, int, float]] = []
        self.p = None
        self.names: List[str] = []
        if not enabled or shutil.which("nvidia-smi") is None:
            return
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            self.names = [l.strip() for l in q.stdout.splitlines() if l.strip()]
            self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                       "-lms", "500"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      start_new_session=True)
        except (OSError, subprocess.SubprocessError) as e:
            say(f"nvidia-smi unavailable ({e}); no per-rank GPU memory")
            self.p = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            try:
                i, used = line.split(",")
                self.samples.append((time.time(), int(i), float(used)))
            except ValueError:
                continue

    def peak(self, t0: float, t1: float) -> Optional[Dict[str, float]]:
        if self.p is None:
            return None
        out: Dict[str, float] = {}
        for t, i, m in self.samples:
            if t0 <= t <= t1:
                out[str(i)] = max(out.get(str(i), 0.0), m)
        return out

    def close(self) -> None:
        if self.p is not None:
            stop(self.p)
