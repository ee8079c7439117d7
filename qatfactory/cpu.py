"""What this CPU does fast: the compute dtype (bf16 only where it is fast) and the thread count.

On a CPU without native bf16 (AVX2 or plain AVX-512, no AVX512_BF16 / AMX) torch emulates bf16
matmuls: measured 0.9 GFLOP/s against 34 GFLOP/s in fp32 on a 2-core EPYC, which turned a 15-minute
demo into 167 minutes. With AMX (this dev machine) bf16 is ~6x faster than fp32. So the dtype is
decided by a measurement (a bf16 and an fp32 matmul of the demo's shapes, ~0.3 s, cached per CPU
model, flags and torch version under the qatfactory cache directory), with an override:
``QATFACTORY_DTYPE=bfloat16|float32`` or the command's ``--dtype``.

Threads: as many intra-op threads as there are cores free, from the CPUs this process may run on
(``os.sched_getaffinity``) minus what other processes keep busy (a 0.5 s sample of /proc/stat, or
``os.getloadavg`` where that is missing); ``OMP_NUM_THREADS`` set by the user wins. Spinning
intra-op threads on a core somebody else uses made a forward 4-6x slower on a shared 2-core machine.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from ._fsutil import write_text_atomic
from .assets import cache_dir

DTYPES = ("bfloat16", "float32")


def _cpuinfo() -> Tuple[str, set]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k == "model name" and model in ("", platform.machine(), platform.processor()):
                model = v.strip()
            elif k == "flags" and not flags:
                flags = set(v.split())
    except OSError:
        pass
    return model, flags


def native_bf16(flags: Optional[set] = None) -> bool:
    """The CPU has bf16 dot-product instructions (AVX512_BF16 or AMX-BF16)."""
    flags = _cpuinfo()[1] if flags is None else flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def matmul_gflops(dtype_name: str, m: int = 256, k: int = 576, n: int = 1536, seconds: float = 0.12) -> float:
    """GFLOP/s of one [m,k]x[k,n] matmul in ``dtype_name`` with the current thread setting (the best
    of repeated runs for ``seconds``)."""
    dt = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dt)
    b = torch.randn(k, n, generator=g).to(dt)
    a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return 2.0 * m * k * n / max(best, 1e-9) / 1e9


def _cache_file() -> Path:
    return cache_dir() / "cpu-compute-dtype.json"


def compute_dtype(device: str = "cpu", override: Optional[str] = None, cache: bool = True) -> Dict[str, Any]:
    """{"dtype": "bfloat16"|"float32", "why": ..., plus the measurement}: bf16 on GPUs; on a CPU
    bf16 only when a bf16 matmul is at least as fast as an fp32 one here. ``override`` (or the env
    var QATFACTORY_DTYPE) other than "auto" decides outright."""
    override = override or os.environ.get("QATFACTORY_DTYPE") or "auto"
    if override not in DTYPES + ("auto",):
        raise ValueError(f"compute dtype {override!r}; allowed: auto, {', '.join(DTYPES)} "
                         f"(--dtype or QATFACTORY_DTYPE)")
    if override != "auto":
        return {"dtype": override, "why": "asked for (--dtype / QATFACTORY_DTYPE)"}
    if device != "cpu":
        return {"dtype": "bfloat16", "why": f"{device}: bf16 tensor cores"}
    model, flags = _cpuinfo()
    key = hashlib.sha256(json.dumps([model, sorted(flags), torch.__version__]).encode()).hexdigest()[:16]
    p = _cache_file()
    if cache:
        try:
            d = json.loads(p.read_text())
            if d.get("key") == key and d.get("dtype") in DTYPES:
                return dict(d, why=d["why"] + " (measured earlier on this CPU, cached)")
        except (OSError, ValueError):
            pass
    bf, fp = matmul_gflops("bfloat16"), matmul_gflops("float32")
    dtype = "bfloat16" if bf >= fp else "float32"
    d = {"dtype": dtype, "key": key, "cpu": model, "native_bf16": native_bf16(flags),
         "bf16_gflops": round(bf, 2), "fp32_gflops": round(fp, 2),
         "why": f"bf16 matmul {bf:.1f} GFLOP/s vs fp32 {fp:.1f} GFLOP/s here"
                + ("" if dtype == "bfloat16" else ": bf16 is emulated on this CPU, compute in fp32")}
    if cache:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(p, json.dumps(d, indent=1))
        except OSError:
            pass
    return d


def _busy_cores(sample_s: float = 0.5) -> Tuple[float, str]:
    """Cores of our affinity mask that other processes keep busy right now (this process sleeps
    while it samples the per-CPU counters of /proc/stat)."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None

    def read():
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    name, *v = line.split()
                    v = [int(x) for x in v]
                    out[int(name[3:])] = (sum(v[:8]), v[3] + (v[4] if len(v) > 4 else 0))
        return out
    try:
        a = read()
        time.sleep(sample_s)
        b = read()
        cpus = [c for c in (mine if mine is not None else sorted(b)) if c in a and c in b]
        if not cpus:
            raise ValueError("no per-CPU counters")
        busy = sum(1.0 - (b[c][1] - a[c][1]) / max(b[c][0] - a[c][0], 1) for c in cpus)
        return max(0.0, busy), f"/proc/stat over {sample_s:g} s"
    except (OSError, ValueError, IndexError):
        if hasattr(os, "getloadavg"):
            return float(os.getloadavg()[0]), "1-minute load average"
        return 0.0, "no load information"


def choose_threads(apply: bool = True) -> Dict[str, Any]:
    """{"threads": n, "why": ...}: the user's OMP_NUM_THREADS, else the cores of our affinity mask
    that other processes leave free (at least one); sets torch's intra-op threads when ``apply``."""
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = os.environ.get("OMP_NUM_THREADS")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if env and env.strip().isdigit() and int(env) > 0:
        n, why = min(int(env), avail), f"OMP_NUM_THREADS={env}"
    else:
        busy, how = _busy_cores()
        free = avail - busy
        n = max(1, min(avail, int(math.floor(free + 0.5))))
        why = (f"{avail} usable core(s), {busy:.1f} busy with other work ({how}"
               + (f"; load average {load:.2f}" if load is not None else "") + f") -> {n} thread(s)")
    if apply:
        torch.set_num_threads(n)
    return {"threads": n, "why": why, "usable_cores": avail, "load_average": load}
