"""CPU weight fake-quant of the demo's Q4_K_M target on SmolLM2-135M: per format and shape, and the
whole policy once, for two source trees side by side (before / after a change), 1 and 2 threads.

    .venv/bin/python benchmarks/ggml_policy_cpu.py --baseline REV [--repeat 3] [--threads 1,2]

What is timed is what the demo's ``fake_quant_seconds`` times and what each optimizer step pays:
``Format.fake_quantize(W, imatrix=linspace(0.5, 2, K))`` of every linear the ``q4_k`` preset
resolves (Q4_K_M: q4_k, its q5_0 fallback for 576-wide rows, q6_k, q8_0 for the tied lm_head).
Weights: SmolLM2-135M-Instruct from the asset cache (``qatfactory.assets``), float32; ``--random``
uses N(0, 0.02) tensors of the same shapes instead.

Each (tree, threads) measurement runs in its own process (``--worker``), and the processes are
interleaved: rep 1 of every combination, then rep 2, ... so that a noisy neighbour hits both trees
alike. The baseline tree is ``git archive REV qatfactory recipes`` unpacked into a temporary
directory and put first on PYTHONPATH. Reported: per (format, shape) the best time of one call over all reps, and
the whole policy (all linears once, in model order) as min and median over reps.
A script, not a test: speed is never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _linears(random: bool):
    """[(name, format, weight float32)] of the Q4_K_M policy, in model order."""
    import torch
    from qatfactory import assets
    from qatfactory import quantize as Q
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(assets.prepare_model_dir("smollm2")), dtype=torch.float32)
    qcfg = Q.QuantConfig.preset("q4_k")
    g = torch.Generator().manual_seed(0)
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        shape = tuple(mod.weight.shape)
        wf = Q._resolve_format(qcfg, qcfg.resolve(name)[0], f"{name}.weight", shape, model.config)
        if wf is None:
            continue
        w = mod.weight.detach().float().contiguous()
        if random:
            w = torch.randn(shape, generator=g) * 0.02
        out.append((name, wf, w))
    return out


def worker(threads: int, reps_inner: int, random: bool) -> dict:
    import torch
    torch.set_num_threads(threads)
    import qatfactory
    from qatfactory.formats import get_format
    lin = _linears(random)
    groups = {}
    for name, wf, w in lin:
        groups.setdefault((wf, tuple(w.shape)), []).append(w)
    per = {}
    for (wf, shape), ws in groups.items():
        f = get_format(wf)
        im = torch.linspace(0.5, 2.0, shape[1])
        f.fake_quantize(ws[0], imatrix=im)                 # warm-up
        best, best_cpu = float("inf"), float("inf")
        for _ in range(reps_inner):
            t, c = time.perf_counter(), time.process_time()
            f.fake_quantize(ws[0], imatrix=im)
            best = min(best, time.perf_counter() - t)
            best_cpu = min(best_cpu, time.process_time() - c)
        per[f"{wf} {shape[0]}x{shape[1]}"] = {"format": wf, "count": len(ws), "numel": ws[0].numel(), "s": best,
                                              "cpu_s": best_cpu}
    t, c = time.perf_counter(), time.process_time()
    for name, wf, w in lin:
        get_format(wf).fake_quantize(w, imatrix=torch.linspace(0.5, 2.0, w.shape[1]))
    whole, whole_cpu = time.perf_counter() - t, time.process_time() - c
    return {"qatfactory": str(Path(qatfactory.__file__).parent), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "per": per, "whole_s": whole, "whole_cpu_s": whole_cpu,
            "load": os.getloadavg()[0]}


def _run_worker(tree: Path, threads: int, reps_inner: int, random: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
           "--inner", str(reps_inner)] + (["--random"] if random else [])
    r = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"worker failed ({tree}, {threads} threads):\n{r.stderr[-3000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    if Path(d["qatfactory"]).resolve() != (tree / "qatfactory").resolve():
        raise SystemExit(f"worker imported {d['qatfactory']}, not the tree {tree}")
    return d


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision of the 'before' tree (default HEAD)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved processes per (tree, threads)")
    ap.add_argument("--inner", type=int, default=2, help="timed calls per (format, shape) in one process")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--random", action="store_true", help="N(0, 0.02) weights instead of SmolLM2's")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(int(args.threads), args.inner, args.random)))
        return
    threads = [int(t) for t in args.threads.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="qf-baseline-") as tmp:
        base = Path(tmp)
        arch = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "qatfactory", "recipes"],
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=arch, check=True)
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline],
                             capture_output=True, text=True, check=True).stdout.strip()
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "qatfactory"],
                               capture_output=True, text=True, check=True).stdout.strip()
        trees = {f"before ({rev})": base, f"after ({head}{'+dirty' if dirty else ''})": REPO}
        res = {(k, t): [] for k in trees for t in threads}
        print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, {_cpu_name()}, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.2f}; weights: {'random' if args.random else 'SmolLM2-135M'}",
              flush=True)
        for rep in range(args.repeat):
            for t in threads:
                for k, tree in trees.items():
                    res[(k, t)].append(_run_worker(tree, t, args.inner, args.random))
                    r = res[(k, t)][-1]
                    print(f"#   rep {rep + 1}/{args.repeat}, {t} thread(s), {k}: whole policy {r['whole_s']:.2f} s "
                          f"wall, {r['whole_cpu_s']:.2f} s CPU (load {r['load']:.1f})", flush=True)
    names = list(res[next(iter(res))][0]["per"])
    kb, ka = list(trees)
    for t in threads:
        # CPU time is the steadier measure on a shared machine with 1 thread; with 2 threads it adds
        # both threads' time (and their spin-waits), so wall time is the one that counts there
        for key, what in (("s", "wall"), ("cpu_s", "CPU")):
            print(f"\n## {t} thread(s), {what} seconds per call: best of {args.repeat} processes x {args.inner} calls")
            print("| format, shape | count | " + " | ".join(trees) + " | speed-up |")
            print("|---|---|" + "---|" * len(trees) + "---|")
            for n in names:
                b = min(r["per"][n][key] for r in res[(kb, t)])
                a = min(r["per"][n][key] for r in res[(ka, t)])
                print(f"| {n} | {res[(kb, t)][0]['per'][n]['count']} | {b:.4f} | {a:.4f} | {b / a:.2f}x |")
            fmts = sorted({res[(kb, t)][0]["per"][n]["format"] for n in names})
            for fm in fmts:
                tot = []
                for k in trees:
                    tot.append(sum(min(r["per"][n][key] for r in res[(k, t)]) * res[(k, t)][0]["per"][n]["count"]
                                   for n in names if res[(k, t)][0]["per"][n]["format"] == fm))
                print(f"| **{fm}, all its linears** | | {tot[0]:.2f} | {tot[1]:.2f} | {tot[0] / tot[1]:.2f}x |")
            wk = "whole_s" if key == "s" else "whole_cpu_s"
            wb = [r[wk] for r in res[(kb, t)]]
            wa = [r[wk] for r in res[(ka, t)]]
            print(f"| **whole Q4_K_M policy, one pass (min / median)** | | {min(wb):.2f} / "
                  f"{statistics.median(wb):.2f} | {min(wa):.2f} / {statistics.median(wa):.2f} | {min(wb) / min(wa):.2f}x |")
        loads = [r["load"] for k in trees for r in res[(k, t)]]
        print(f"\nload average (1 min) during the {t}-thread runs: {min(loads):.1f} .. {max(loads):.1f}")


if __name__ == "__main__":
    main()
