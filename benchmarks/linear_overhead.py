"""Host time of one QuantLinear call (forward + backward) on the CPU, against nn.Linear.

    python benchmarks/linear_overhead.py [--reps 2000] [--out benchmarks/results/linear_overhead.json]

Tiny tensors (a [16, 256] weight, 4 tokens) so the arithmetic is negligible and what is timed is the
Python and dispatch work around it: the module's checks, the quantizers' calls, autograd Functions.
Rows: nn.Linear; QuantLinear W4A16 / W4A4 with the per-forward path (emulator fake quant every call),
and inside ``step_cache.enabled()`` with the weight kept for the step (a cache hit: no weight fake
quant at all), each on the F.linear path and on the recompute-in-backward path the CUDA kernels take.
On a GPU the emulator's cost is replaced by kernel launches, so only the "kept" rows and the gap to
nn.Linear carry over; the GPU step profile (benchmarks/gpu/step.sh) measures the real thing.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if "--repo" in sys.argv:          # time another checkout's qatfactory (e.g. `git archive main qatfactory`)
    sys.path.insert(0, sys.argv[sys.argv.index("--repo") + 1])
else:
    sys.path.insert(0, str(REPO))


def _time_all(fns, reps: int, rounds: int = 9):
    """Microseconds of CPU time (process_time: other processes on the machine do not count) per call,
    the fastest of `rounds` runs of `reps` calls; the rows take turns in every round."""
    for f in fns:
        for _ in range(max(10, reps // 20)):
            f()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            t0 = time.process_time()
            for _ in range(reps):
                f()
            best[i] = min(best[i], (time.process_time() - t0) / reps * 1e6)
    return best


def _keeps() -> bool:
    """Whether this qatfactory has the per-step weight cache (step_cache.enabled(weights=...))."""
    import inspect
    from qatfactory.nn import step_cache
    return "weights" in inspect.signature(step_cache.enabled).parameters


def rows(reps: int):
    from qatfactory.nn import QuantLinear, step_cache
    torch.manual_seed(0)
    x = torch.randn(4, 256, requires_grad=True)
    gy = torch.randn(4, 16)

    def step(m):
        def f():
            y = m(x)
            y.backward(gy)
        return f

    names, fns, ctxs = ["nn.Linear"], [step(torch.nn.Linear(256, 16, bias=False))], [None]
    for label, wf, af in (("W4A16 nvfp4", "nvfp4", None), ("W4A4 nvfp4", "nvfp4", "nvfp4_act"),
                          ("W4A16 mxfp4", "mxfp4", None)):
        for recompute in (False, True):
            m = QuantLinear(torch.nn.Linear(256, 16, bias=False), wf, "dynamic", act_format=af)
            if m.input_quant is not None:
                m.input_quant.amax.fill_(3.0)
            m.recompute_fq = recompute
            path = "recompute path" if recompute else "F.linear path"
            for kept in (False, True) if _keeps() else (False,):
                names.append(f"QuantLinear {label}, {path}, "
                             + ("weight kept for the step" if kept else "per-forward fake quant"))
                fns.append(step(m))
                ctxs.append(kept)

    def wrap(f, kept):
        if not kept:
            return f

        def g():
            with step_cache.enabled(weights=True):
                # the epoch opened by enabled() is filled by the warm-up; time only hits
                for _ in range(reps_inner):
                    f()
        return g
    reps_inner = 50
    timed = [wrap(f, k) for f, k in zip(fns, ctxs)]
    us = _time_all(timed, max(1, reps // reps_inner))
    # a kept row times reps_inner calls per entry into enabled() (whose first call fills the cache)
    return [(n, u / reps_inner if k else u) for n, u, k in zip(names, us, ctxs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repo", default=None, help="import qatfactory from this folder instead (a before/after)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = rows(a.reps)
    base = res[0][1]
    import qatfactory
    print(f"\nQuantLinear host time per forward+backward, CPU ({platform.processor() or platform.machine()}, "
          f"{a.threads} thread), torch {torch.__version__}, [16, 256] weight, 4 tokens, "
          f"qatfactory from {Path(qatfactory.__file__).parent}\n")
    print("| call | us | over nn.Linear (us) |\n|---|---:|---:|")
    for name, us in res:
        print(f"| {name} | {us:.1f} | {us - base:+.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps([{"call": n, "us": u} for n, u in res], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
