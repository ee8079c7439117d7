"""One rank of benchmarks/gpu/scaling.py: ``qatfactory train <overrides>``; with SCALING_PROFILE=<file>
the optimizer steps after the first SCALING_WARMUP run under torch.profiler (the final evaluation is
outside the window), and rank 0 writes to that file: milliseconds per step in all-gathers (ZeRO-3's
parameter fetches), reduce-scatters, all-reduces and broadcasts (NCCL kernels on a GPU, the c10d ops
on CPU), the profiled step time, tokens per step, and the profiler's table."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

OUT = os.environ.get("SCALING_PROFILE") or ""
WARMUP = int(os.environ.get("SCALING_WARMUP", "2"))
KINDS = (("all_gather", ("allgather", "all_gather")), ("reduce_scatter", ("reducescatter", "reduce_scatter")),
         ("all_reduce", ("allreduce", "all_reduce")), ("broadcast", ("broadcast",)))


def _arg(name: str) -> int:
    return int(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(name + "=")))


def _kind(name: str):
    n = name.lower()
    for k, keys in KINDS:
        if any(x in n for x in keys):
            return k
    return None


def summarise(prof, steps: int, seconds: float, tokens_per_step: int) -> dict:
    cuda = torch.cuda.is_available()
    per: dict = {}
    for e in prof.key_averages():
        k = _kind(e.key)
        if k is None:
            continue
        if cuda:     # the collective kernels themselves (what the GPU spends), not their launches
            if "nccl" not in e.key.lower():
                continue
            t = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        else:        # the c10d ops: on gloo they return when the collective is done (gloo's own records are async)
            if not e.key.startswith("c10d::"):
                continue
            t = e.self_cpu_time_total
        per[k] = per.get(k, 0.0) + t / 1000.0
    n = max(steps, 1)
    return {"steps": steps, "step_ms": seconds * 1000.0 / n, "tokens_per_step": tokens_per_step,
            "per_step_ms": {k: v / n for k, v in per.items()},
            "per_1k_tokens_ms": {k: v / n / (tokens_per_step / 1000.0) for k, v in per.items()},
            "table": prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                               row_limit=25)}


def main() -> int:
    box = {"prof": None, "t0": 0.0, "s0": 0, "done": None}
    if OUT:
        import deepspeed.runtime.engine as DE
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        last = _arg("train.max_steps")
        real_step = DE.DeepSpeedEngine.step

        def sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def step(self, *a, **k):
            out = real_step(self, *a, **k)
            if box["prof"] is None and box["done"] is None and self.global_steps >= WARMUP and \
                    self.global_steps < last:
                sync()
                box["prof"] = profile(activities=acts)
                box["prof"].__enter__()
                box["t0"], box["s0"] = time.time(), self.global_steps
            elif box["prof"] is not None and self.global_steps >= last:
                sync()
                seconds = time.time() - box["t0"]
                box["prof"].__exit__(None, None, None)
                tokens = self.train_batch_size() * _arg("data.seq_len")
                box["done"] = summarise(box["prof"], self.global_steps - box["s0"], seconds, tokens)
                box["prof"] = None
            return out
        DE.DeepSpeedEngine.step = step
    from qatfactory.faces.cli import main as cli
    rc = cli(["train"] + sys.argv[1:])
    if OUT and box["done"] is not None and int(os.environ.get("RANK", "0")) == 0:
        Path(OUT).write_text(json.dumps(box["done"], indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
