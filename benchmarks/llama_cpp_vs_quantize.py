"""Our GGUF exports against llama-quantize's, scored by llama.cpp itself, at equal file size.

    .venv/bin/python benchmarks/llama_cpp_vs_quantize.py                 # SmolLM2-135M, CPU, ~30 min on 2 cores
    .venv/bin/python benchmarks/llama_cpp_vs_quantize.py --families q4_k --steps 24 --out runs/lcq
    .venv/bin/python benchmarks/llama_cpp_vs_quantize.py --model /path/to/hf_dir --no-results
    .venv/bin/python benchmarks/llama_cpp_vs_quantize.py --rescore runs/lcq   # llama.cpp scoring again, no training

What runs (the demo's pipeline, ``qatfactory demo --targets ... --vs-llama-quantize``):

* teacher: the model directory converted to F32 by llama.cpp's own ``convert_hf_to_gguf.py``; its logits
  over the held-out Wikipedia articles saved by ``llama-perplexity --kl-divergence-base``;
* llama.cpp's quantizations of that teacher: ``llama-quantize Q4_K_M`` without and with an importance
  matrix (``llama-imatrix`` over the training text), and MXFP4 / NVFP4 as llama-quantize writes them for
  a dense model (every linear ``--tensor-type ...=mxfp4|nvfp4`` over Q8_0; NVFP4 is refused as a file type);
* ours, per family: the PTQ student (prepare + calibrate, the demo's calibration samples) and the QAD
  student (the trainer, a short live-teacher run as the demo's), exported to GGUF with the same tensor
  types as llama-quantize's file (recipes q4_k, mxfp4_gguf, nvfp4_gguf), so the files have equal size;
* every GGUF scored with ``llama-perplexity --kl-divergence`` (mean KL(teacher || model), perplexity,
  top-1 agreement) on llama.cpp's CPU runtime.

The demo runs as users run it, a ``qatfactory demo`` process (``--rescore``: ``qatfactory demo --rescore
RUN_DIR --vs-llama-quantize``); this script reads the results.json it writes. Writes the demo's run
directory (report.md with the table and plots/llama_cpp_kl.png, results.json) and, unless ``--no-results``,
a dated section between markers in benchmarks/RESULTS.md. A script, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qatfactory.faces import llama_compare as LC  # noqa: E402

FAMILIES = {"q4_k": "q4_k", "mxfp4": "mxfp4_gguf", "nvfp4": "nvfp4_gguf"}
BEGIN, END = "<!-- llama-cpp-vs-quantize -->", "<!-- /llama-cpp-vs-quantize -->"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local HF model directory (default: the demo's SmolLM2-135M)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"subset of {list(FAMILIES)}")
    p.add_argument("--steps", type=int, default=None, help="QAD steps per family (default: the demo's)")
    p.add_argument("--eval-samples", type=int, default=None, dest="eval_samples",
                   help="held-out samples of seq_len tokens (default: the demo's)")
    p.add_argument("--calib-samples", type=int, default=None, dest="calib_samples")
    p.add_argument("--out", default=None, help="run directory (default: runs/llama-vs-quantize-<time>)")
    p.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")
    p.add_argument("--rescore", default=None, metavar="RUN_DIR",
                   help="score the exports of a finished run directory again with llama.cpp (no training)")
    return p.parse_args(argv)


def results_section(res, out: Path, argv) -> str:
    lc = res["llama_cpp"]
    s = res["settings"]
    env = res["environment"]
    day = time.strftime("%Y-%m-%d", time.gmtime())
    L = [BEGIN, "## llama.cpp: our GGUF exports vs llama-quantize (benchmarks/llama_cpp_vs_quantize.py)", ""]
    L.append(f"**Setup.** {day}, `{' '.join(['benchmarks/llama_cpp_vs_quantize.py'] + list(argv))}` on "
             f"{_cpu_name()} ({env.get('cpus')} cores; torch {env.get('torch')}), llama.cpp 0c1e570 (llama-cpp-python 0.3.36) CPU "
             f"backend with `--no-repack`. Model `{Path(res['model_dir']).name}` "
             f"({res['params'] / 1e6:.1f}M parameters); teacher = the bf16 weights converted to F32 by llama.cpp's "
             f"`convert_hf_to_gguf.py`. QAD: {s['steps']} steps x {s['micro_batch']} x {s['seq_len']} tokens, live "
             f"teacher, constant LR (demo settings). PTQ: {s['calib_samples']} calibration samples (Q4_K: "
             f"the importance matrix from them); llama-imatrix: the training text. Scored by "
             f"`llama-perplexity --kl-divergence` over the held-out articles ({lc['scorer']['ctx']}-token chunks, "
             f"second halves scored: {lc['rows'][0]['chunks']} chunks, "
             f"{lc['rows'][0]['chunks'] * (lc['scorer']['ctx'] - 1 - lc['scorer']['ctx'] // 2)} tokens); the last column is qatfactory's own "
             f"evaluation of the same student in torch ({res['teacher']['tokens']:.0f} held-out tokens, no "
             f"activation quantization).")
    L.append("")
    L.extend(LC.table_lines(lc["rows"], lc["scorer"]["teacher_ppl"]))
    L.append("")
    L.append(f"The run directory (`{out.name}/`: report.md, plots/llama_cpp_kl.png, results.json) is not committed. "
             f"Sizes: a family's files have the same tensor types, so equal tensor data; they differ by metadata "
             f"bytes only. llama-quantize's MXFP4 / NVFP4 take no importance matrix (ggml's FP4 quantizers ignore "
             f"it), and without one our PTQ files of those families are byte-identical to llama-quantize's, hence "
             f"equal numbers.")
    L.append(END)
    return "\n".join(L) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def write_results(section: str, path: Path) -> None:
    txt = path.read_text() if path.exists() else "# Benchmark results\n"
    if BEGIN in txt and END in txt:
        a, b = txt.index(BEGIN), txt.index(END) + len(END)
        txt = txt[:a] + section.rstrip("\n") + txt[b:]
    else:
        txt = txt.rstrip("\n") + "\n\n" + section
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_text(txt)
    os.replace(tmp, path)


def run_demo_cli(dargs) -> dict:
    """``qatfactory demo <dargs>`` as its own process; the results.json of its run directory. The demo's exit
    code 1/2 (a parity gate FAILED / INCOMPLETE) still leaves a finished run whose llama.cpp numbers count."""
    cmd = [sys.executable, "-m", "qatfactory.faces.cli", "demo"] + list(dargs)   # `qatfactory demo ...`
    out = Path(dargs[dargs.index("--rescore" if "--rescore" in dargs else "--out") + 1])
    rc = subprocess.run(cmd, cwd=str(ROOT), check=False).returncode
    if not (out / "results.json").is_file() or rc not in (0, 1, 2):
        raise SystemExit(f"`{' '.join(cmd)}` exited {rc} without a finished run in {out}")
    return json.loads((out / "results.json").read_text())


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.rescore:
        out = Path(a.rescore)
        res = run_demo_cli(["--rescore", str(out), "--vs-llama-quantize"])
        return _finish(res, out, a, argv)
    fams = [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [f for f in fams if f not in FAMILIES]
    if bad or not fams:
        print(f"--families={a.families!r}: unknown {bad}; allowed: {list(FAMILIES)}", file=sys.stderr)
        return 2
    dargs = ["--targets", ",".join(FAMILIES[f] for f in fams), "--vs-llama-quantize"]
    for flag, v in (("--model", a.model), ("--steps", a.steps), ("--eval-samples", a.eval_samples),
                    ("--calib-samples", a.calib_samples)):
        if v is not None:
            dargs += [flag, str(v)]
    out = Path(a.out or f"runs/llama-vs-quantize-{time.strftime('%Y%m%d-%H%M%S')}")
    dargs += ["--out", str(out), "--device", "cpu", "--llama-cpp", "auto"]
    res = run_demo_cli(dargs)
    return _finish(res, out, a, argv)


def _finish(res, out: Path, a, argv) -> int:
    lc = res.get("llama_cpp") or {}
    if lc.get("status") != "ok":
        print(f"llama.cpp numbers not measured: {lc.get('reason')}", file=sys.stderr)
        return 1
    print("\n".join(LC.table_lines(lc["rows"], lc["scorer"]["teacher_ppl"])))
    print(f"\nreport: {out / 'report.md'}   plot: {lc.get('plot')}")
    if not a.no_results:
        write_results(results_section(res, out, argv), ROOT / "benchmarks" / "RESULTS.md")
        print(f"table written to {ROOT / 'benchmarks' / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
