"""llama.cpp's own tools, run as a llama.cpp user would: converter, llama-quantize, llama-imatrix,
llama-perplexity (KL divergence to a base model's logits).

The tools are the ones ``scripts/llama_cpp_runtime.py`` builds once from the llama-cpp-python sdist
(commit 0c1e570) into the cache; this module finds that build, runs each tool in a subprocess (its
libggml must not meet libggml-python's) and parses what it prints. Used by the demo's report, by
``benchmarks/llama_cpp_vs_quantize.py`` and by the tests that compare our exports with llama.cpp's.

llama.cpp's tools log through a background thread that is not flushed at exit (common/log.cpp
says so: "logs may be lost if not flushed before the program exits"); on a busy machine the last
lines -- llama-perplexity's summary -- can be missing from a successful run. ``kl`` then runs again
(up to three times) rather than report a number it did not see.

Every compute tool runs with ``--no-repack``: the AMX "extra buffer" kernels that a -march=native
build selects on AMX-capable CPUs trap (SIGILL, ``tilezero``) on machines whose kernel does not grant
the AMX tile state, as on the sandboxes this project is developed on; the plain CPU kernels quantize
activations the same way (Q8_K / Q8_0 by weight type).
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]        # the source checkout: qatfactory/faces/ -> repository root
NO_REPACK = ("--no-repack",)


class ToolUnavailable(RuntimeError):
    """llama.cpp's runtime is not built here (the message says how to build it)."""


def runtime():
    """scripts/llama_cpp_runtime.py as a module, its build checked; ToolUnavailable otherwise."""
    p = ROOT / "scripts" / "llama_cpp_runtime.py"
    if not p.is_file():
        raise ToolUnavailable(f"{p} not found (an installed qatfactory without its source checkout has no llama.cpp "
                              f"build script); clone the repository and run `make llama-cpp`")
    spec = importlib.util.spec_from_file_location("qf_llama_cpp_runtime", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not mod.is_built(mod.target_dir()):
        raise ToolUnavailable(f"llama.cpp's runtime is not built in {mod.target_dir()}; run `make llama-cpp` "
                              f"(python scripts/llama_cpp_runtime.py ensure), a one-time build of a few minutes")
    return mod


def _run(cmd: Sequence[str], what: str, timeout: float, env: Optional[Dict[str, str]] = None,
         cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       env=env or runtime().tool_env(), cwd=cwd)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {r.returncode}): {' '.join(map(str, cmd[:6]))} ...\n{tail}")
    return r


def tool(name: str) -> Path:
    return runtime().tool(name)


def converter_env() -> Dict[str, str]:
    R = runtime()
    src = R.target_dir() / "src"
    env = dict(R.tool_env())
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), str(src)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def convert_hf(hf_dir, out_gguf, outtype: str = "bf16", timeout: float = 1800) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py (the venv's python, llama.cpp's gguf-py first)."""
    src = runtime().target_dir() / "src"
    _run([sys.executable, src / "convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out_gguf), "--outtype",
          outtype], "llama.cpp convert_hf_to_gguf.py", timeout, env=converter_env(), cwd=str(src))
    return Path(out_gguf)


def quantize(in_gguf, out_gguf, ftype: str = "Q4_K_M", imatrix=None, tensor_types: Sequence[str] = (),
             token_embedding_type: Optional[str] = None, output_tensor_type: Optional[str] = None,
             threads: Optional[int] = None, timeout: float = 1800) -> str:
    """llama-quantize; returns its log (stdout + stderr)."""
    cmd: List[str] = [str(tool("llama-quantize"))]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    for t in tensor_types:
        cmd += ["--tensor-type", t]
    if token_embedding_type:
        cmd += ["--token-embedding-type", token_embedding_type]
    if output_tensor_type:
        cmd += ["--output-tensor-type", output_tensor_type]
    cmd += [str(in_gguf), str(out_gguf), ftype, str(threads or max(1, os.cpu_count() or 1))]
    r = _run(cmd, "llama-quantize", timeout)
    return r.stdout + r.stderr


def imatrix(model_gguf, text_file, out, ctx: int = 256, chunks: Optional[int] = None, threads: Optional[int] = None,
            timeout: float = 3600) -> Path:
    """llama-imatrix over a text file (the importance matrix llama-quantize --imatrix reads)."""
    cmd = [tool("llama-imatrix"), "-m", model_gguf, "-f", text_file, "-o", out, "-c", str(ctx), "-b", str(ctx),
           "-t", str(threads or max(1, os.cpu_count() or 1)), *NO_REPACK]
    if chunks:
        cmd += ["--chunks", str(chunks)]
    _run(cmd, "llama-imatrix", timeout)
    return Path(out)


@dataclass
class KLResult:
    ppl: float
    ppl_base: Optional[float]   # the base (teacher) model's perplexity on the same tokens
    kl: float                # mean KLD(base || model) per token, nats
    top1: Optional[float]    # "Same top p": fraction of tokens whose argmax agrees with the base
    tokens: int              # tokens scored: (n_ctx - 1 - n_ctx/2) per chunk
    chunks: int
    log: str


def kl_base(teacher_gguf, text_file, base_out, ctx: int = 256, chunks: Optional[int] = None,
            threads: Optional[int] = None, timeout: float = 3600) -> Optional[float]:
    """Save the teacher's logits over the text (llama-perplexity --kl-divergence-base); returns its ppl
    (None if the log lost its last line; every ``kl`` run reports it again as PPL(base))."""
    cmd = [tool("llama-perplexity"), "-m", teacher_gguf, "-f", text_file, "--kl-divergence-base", base_out,
           "-c", str(ctx), "-b", str(ctx), "-t", str(threads or max(1, os.cpu_count() or 1)), *NO_REPACK]
    if chunks:
        cmd += ["--chunks", str(chunks)]
    r = _run(cmd, "llama-perplexity --kl-divergence-base", timeout)
    if not Path(base_out).is_file():
        raise RuntimeError(f"llama-perplexity --kl-divergence-base wrote no {base_out}")
    try:
        return _final_ppl(r.stdout + r.stderr)
    except RuntimeError:
        return None


def kl(model_gguf, base_file, threads: Optional[int] = None, timeout: float = 3600) -> KLResult:
    """llama-perplexity --kl-divergence against saved base logits: ppl, mean KL, top-1 agreement."""
    cmd = [tool("llama-perplexity"), "-m", model_gguf, "--kl-divergence-base", base_file, "--kl-divergence",
           "-t", str(threads or max(1, os.cpu_count() or 1)), *NO_REPACK]
    for attempt in range(3):
        r = _run(cmd, "llama-perplexity --kl-divergence", timeout)
        log = r.stdout + r.stderr
        if "Mean    KLD" in log or attempt == 2:
            return parse_kl(log)
    raise AssertionError("unreachable")


_NUM = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _final_ppl(log: str) -> float:
    m = re.findall(r"Final estimate: PPL = " + _NUM, log)
    if m:
        return float(m[-1])
    m = re.findall(r"Mean PPL\(Q\)\s*:\s*" + _NUM, log)
    if m:
        return float(m[-1])
    raise RuntimeError("llama-perplexity printed no final perplexity:\n" + "\n".join(log.splitlines()[-10:]))


def parse_kl(log: str) -> KLResult:
    def one(pat):
        m = re.findall(pat, log)
        return float(m[-1]) if m else None
    ppl = one(r"Mean PPL\(Q\)\s*:\s*" + _NUM)
    ppl_base = one(r"Mean PPL\(base\)\s*:\s*" + _NUM)
    klv = one(r"Mean\s+KLD:\s*" + _NUM)
    top = one(r"Same top p:\s*" + _NUM)
    if ppl is None or klv is None:
        raise RuntimeError("llama-perplexity --kl-divergence printed no 'Mean PPL(Q)' / 'Mean KLD' (it prints no "
                           "statistics for fewer than 100 scored tokens: give more held-out text):\n"
                           + "\n".join(log.splitlines()[-15:]))
    m = re.findall(r"(\d+) chunks, n_ctx=(\d+)|calculating KL divergence over (\d+) chunks", log)
    chunks, ctx = 0, 0
    for a, b, c in m:
        if a:
            chunks, ctx = int(a), int(b)
        elif c:
            chunks = int(c)
    # llama-perplexity scores tokens n_ctx/2 .. n_ctx-2 of each chunk (predicting the next one)
    return KLResult(ppl=ppl, ppl_base=ppl_base, kl=klv, top1=None if top is None else top / 100.0,
                    tokens=chunks * (ctx - 1 - ctx // 2), chunks=chunks, log=log)
