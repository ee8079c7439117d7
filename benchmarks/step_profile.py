"""Where a training step's time goes: GPU busy time against the wall clock, per optimizer step.

    with StepProfile(skip=12, steps=3, device="cuda") as sp:
        run_training()                    # anything that steps a torch.optim optimizer
    sp.result  # {"gpu_busy_ms_per_step", "kernels_per_step", "launches_per_step", "top_kernels", ...}

Steps are counted by a global ``torch.optim`` step post-hook (our trainer's FusedAdam and the peers' AdamW
both fire it), so nothing in the loop being measured changes. ``torch.profiler`` records only the CUDA
activity (kernels, copies, the runtime/driver launch calls: few events, cheap to export) for optimizer
steps ``skip+1 .. skip+steps`` (step ``skip`` is the profiler's warm-up); outside them it records
nothing. GPU busy is the union of the kernel/copy/memset intervals in the window (overlapping streams
are not double counted); the window's wall span per step is reported too (it includes the profiler's
own overhead, so the timing runs' unprofiled ms/step is the wall figure to compare with). On a CPU
the profiler records CPU ops only and GPU busy is None.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _union_ms(intervals) -> float:
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def summarize_trace(events, steps: int) -> dict:
    """Per-step figures from chrome-trace events (``ph == "X"`` entries with cat, name, ts, dur in us)."""
    gpu, launches, ops, names = [], 0, 0, {}
    t0, t1 = None, None
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        t0 = ts if t0 is None else min(t0, ts)
        t1 = ts + dur if t1 is None else max(t1, ts + dur)
        if cat in GPU_CATS:
            gpu.append((ts, ts + dur))
            n = names.setdefault(name[:120], [0.0, 0])
            n[0] += dur
            n[1] += 1
        elif cat in ("cuda_runtime", "cuda_driver") and "aunch" in name:
            launches += 1
        elif cat == "cpu_op":
            ops += 1
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "steps": steps,
        "gpu_busy_ms_per_step": _union_ms(gpu) / steps if gpu else None,
        "kernels_per_step": len(gpu) / steps,
        "launches_per_step": launches / steps,
        "cpu_ops_per_step": ops / steps,
        "window_ms_per_step": (t1 - t0) / 1000.0 / steps if t0 is not None else None,
        "top_kernels": [{"name": k, "ms_per_step": v[0] / 1000.0 / steps, "calls_per_step": v[1] / steps}
                        for k, v in top],
    }


class StepProfile:
    """``op_table``: record CPU ops too and keep torch's op tables (by device and by CPU self time) in
    ``op_text`` (more events: slower to export)."""

    def __init__(self, skip: int, steps: int, device: str, op_table: bool = False):
        self.skip, self.steps, self.device, self.op_table = int(skip), int(steps), device, op_table
        self.result: Optional[dict] = None
        self.op_text: Optional[str] = None
        self._prof = self._hook = None

    def _ready(self, prof) -> None:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                data = json.load(f)
            self.result = summarize_trace(data.get("traceEvents", []) if isinstance(data, dict) else data,
                                          self.steps)
        finally:
            os.unlink(path)
        if self.op_table:
            ka = prof.key_averages()
            keys = (["self_device_time_total"] if self.device == "cuda" else []) + ["self_cpu_time_total"]
            self.op_text = "".join(f"\n== top 40 by {k} ({self.steps} steps)\n" + ka.table(sort_by=k, row_limit=40)
                                   for k in keys)

    def __enter__(self) -> "StepProfile":
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.profiler import ProfilerActivity, profile, schedule
        acts = [ProfilerActivity.CUDA] if self.device == "cuda" else [ProfilerActivity.CPU]
        if self.op_table and self.device == "cuda":
            acts.append(ProfilerActivity.CPU)
        self._prof = profile(activities=acts, schedule=schedule(wait=max(0, self.skip - 1), warmup=1,
                                                                 active=self.steps, repeat=1),
                             on_trace_ready=self._ready)
        self._prof.__enter__()
        prof = self._prof
        self._hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: prof.step())
        return self

    def __exit__(self, *exc) -> bool:
        self._hook.remove()
        self._prof.__exit__(*exc)
        return False
