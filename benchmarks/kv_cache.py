"""The KV cache in the loop (issue 22), one command: held-out KL and perplexity of PTQ and QAD students
with a bf16 vs an FP8 vs an NVFP4 KV cache, at two sequence lengths, plus the engine checks a GPU can run.

    python benchmarks/kv_cache.py --out runs/kv                 # the H200 run (SmolLM2-135M-Instruct)
    python benchmarks/kv_cache.py --smoke --out /tmp/kv         # CPU plumbing check (tiny random model)

On the GPU machine (the wheels staged as for benchmarks/gpu/engines.sh, our stack in /tmp/site):

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/kv_cache.py --out $OUT --work /tmp/qf-kv --vllm-site /tmp/vsite

Per sequence length (default 2048 and 8192; SmolLM2 has an 8K context) and KV arm (``none`` = the
model-dtype cache, ``fp8_e4m3`` = vLLM's FP8 write rule with calibrated per-layer k/v scales,
``nvfp4_kv`` = NVFP4 KV, servable by vLLM on Blackwell only): one trainer run (``method=qad``, weights
``--format``, default nvfp4_w4a16, ``quant.kv_format=<arm>``), whose first evaluation (after
calibration, before any step) is the PTQ student and whose last is the QAD student, both on the same
held-out Wikipedia sequences against the bf16 teacher. The fp8 arm's QAD student is exported
(vLLM ModelOpt, the parity gate run on it).

Engine checks (need a CUDA device; reported as not run otherwise, never as passed):

* ``vllm_op``: vLLM's own ``reshape_and_cache_flash`` op with ``kv_cache_dtype="fp8"`` on bf16 K/V with
  a calibrated scale: its cache bytes against ``fp8_e4m3``'s (formats/kv_fp8.py) byte for byte.
* ``torch_cuda``: what SGLang's write does, ``cache_k.div_(k_scale).to(float8_e4m3fn)`` on the GPU,
  against ``fp8_e4m3_sglang``; and whether torch's CUDA cast saturates (the rule says: NaN above 464).
* ``vllm_serve`` (with ``--vllm-site``): vLLM serves the fp8 export with its declared FP8 cache
  (``--kv-cache-dtype auto`` -> fp8); KL(student trained for it || vLLM) on the held-out tokens, on
  vLLM's top-K partition (benchmarks/gpu/engines.py), next to KL(the same student without the KV
  emulation || vLLM): the emulation matches when the first is the smaller.

``--smoke``: a random 2-layer Llama with a BPE tokenizer trained on the packaged text, sequences of
32 and 48 tokens, two steps per arm on CPU: every code path (data, calibration with the KV pass,
three arms x two lengths, export + gate, report, plot) in seconds; it **measures nothing about KV
caches**. Writes ``kv_cache.json``, ``kv_cache.md`` and ``kv_cache.png`` into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
GPU = REPO / "benchmarks" / "gpu"
ARMS = ("none", "fp8_e4m3", "nvfp4_kv")


def say(msg: str) -> None:
    print(f"[kv {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/kv_cache.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--work", default=None, help="runs, students, exports (default: <out>/work)")
    p.add_argument("--smoke", action="store_true", help="tiny random model on CPU: plumbing only")
    p.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 2048,8192; smoke 32,48)")
    p.add_argument("--kv", default=",".join(ARMS), help=f"comma-separated KV arms from {list(ARMS)}")
    p.add_argument("--format", default="nvfp4_w4a16", help="weight/activation recipe (recipes/format)")
    p.add_argument("--steps", type=int, default=None, help="QAD steps per arm (default 60; smoke 2)")
    p.add_argument("--micro", type=int, default=None, help="sequences per step (default: 4 at 2K, 1 at 8K: 60 steps then use ~0.5M of the ~1M packaged training tokens)")
    p.add_argument("--eval-seqs", type=int, default=None, help="held-out sequences (default 12 at 2K, 3 at 8K)")
    p.add_argument("--calib", type=int, default=8, help="calibration sequences")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--no-export", action="store_true", help="skip the fp8 arm's export + parity gate")
    p.add_argument("--vllm-site", default=None, help="vLLM's Python path: run the vllm_serve check with it")
    p.add_argument("--topk", type=int, default=128)
    a = p.parse_args(argv)
    a.seqs = [int(s) for s in (a.seqs or ("32,48" if a.smoke else "2048,8192")).split(",") if s.strip()]
    a.kv = [k.strip() for k in a.kv.split(",") if k.strip()]
    bad = [k for k in a.kv if k not in ARMS]
    if bad:
        raise SystemExit(f"--kv: unknown arm(s) {bad}; allowed: {list(ARMS)}")
    a.steps = a.steps or (2 if a.smoke else 60)
    a.work = Path(a.work or Path(a.out) / "work")
    return a


def _sizes(a, seq: int):
    micro = a.micro or (2 if a.smoke else 4 if seq <= 2048 else 1)
    ev = a.eval_seqs or (2 if a.smoke else 12 if seq <= 2048 else 3)
    return micro, ev


def prepare(a, seq: int) -> Dict[str, Any]:
    """Model dir and data files (engines.py's: SmolLM2 from the carried GGUF, the Wikipedia split)."""
    sys.path.insert(0, str(GPU))
    import engines
    micro, ev = _sizes(a, seq)
    ns = argparse.Namespace(work=str(a.work), smoke=a.smoke, steps=a.steps, seq=seq, micro=micro, eval_seqs=ev,
                            calib=a.calib)
    return engines.prepare_model_and_data(ns)


def overrides(a, prep, seq: int, kv: str, run_dir: Path, export: bool) -> List[str]:
    d = prep["data"]
    micro, ev = _sizes(a, seq)
    dev = "cpu" if a.smoke else "cuda"
    o = ["model=local", f"model.path={prep['model_dir']}", f"model.dtype={'float32' if a.smoke else 'bfloat16'}",
         f"format={a.format}", "method=qad", "train=default" if a.smoke else "train=gpu_1x", "data=files",
         f"data.train=[{d['train']}]", f"data.eval=[{d['eval']}]", f"data.seq_len={seq}", f"data.eval_samples={ev}",
         f"train.eval_samples={ev}", f"train.max_steps={a.steps}", f"train.micro_batch={micro}", "train.grad_accum=1",
         f"train.lr={a.lr:g}", "train.schedule=constant", "train.warmup_steps=0", "train.eval_every=0",
         "train.save_every=0", "train.save_final=false", "train.save_student=true", f"train.progress={str(not a.smoke).lower()}",
         "train.plots=false", "train.tensorboard=false", "train.optimizer=adamw_torch", f"train.device={dev}",
         f"train.precision={'fp32' if a.smoke else 'bf16'}", "train.seed=0", f"method.calib_samples={a.calib}",
         f"run_dir={run_dir}", "export=vllm" if export else "export=none"]
    if kv != "none":
        o.append(f"quant.kv_format={kv}")
    return o


def run_arm(a, prep, seq: int, kv: str) -> Dict[str, Any]:
    from qatfactory.ship import train_and_ship as run     # the trainer, then export + gate (export=vllm)
    from qatfactory.train.config import compose
    rd = a.work / f"seq{seq}-{kv}"
    done = rd / "kv_arm.json"
    if done.exists():           # trained in an earlier device call on the same machine: reuse, never retrain
        res = json.loads(done.read_text())
        say(f"seq {seq} kv {kv}: reused from {done}")
        return res
    export = kv == "fp8_e4m3" and not a.no_export
    over = overrides(a, prep, seq, kv, rd, export)
    t0 = time.time()
    s = run(compose(over))
    eng = s.pop("engine", None)
    if eng is not None and hasattr(eng, "destroy"):
        eng.destroy()
    first, last = s.get("eval_first") or {}, s.get("eval_last") or {}
    res = {"seq": seq, "kv": kv, "run_dir": str(rd), "wall_s": time.time() - t0, "steps": s.get("steps"),
           "command": "python -m qatfactory.train " + " ".join(over),
           "ptq": {k[5:]: first.get(k) for k in ("eval/kl", "eval/ppl", "eval/top1", "eval/tokens")},
           "qad": {k[5:]: last.get(k) for k in ("eval/kl", "eval/ppl", "eval/top1", "eval/tokens")},
           "student_dir": s.get("student_dir")}
    for k in ("export_dir", "verify", "verify_ok"):
        if k in s:
            res[k] = s[k]
    say(f"seq {seq} kv {kv}: PTQ KL {res['ptq']['kl']:.5f} ppl {res['ptq']['ppl']:.3f} -> QAD KL "
        f"{res['qad']['kl']:.5f} ppl {res['qad']['ppl']:.3f} ({res['wall_s']:.0f} s)")
    tmp = done.with_name(".kv_arm.json.tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    os.replace(tmp, done)
    return res


# ============================================================================ engine checks
def engine_checks(a) -> Dict[str, Any]:
    import torch
    out: Dict[str, Any] = {}
    if not torch.cuda.is_available():
        why = "not run: no CUDA device"
        return {"vllm_op": {"run": False, "why": why}, "torch_cuda": {"run": False, "why": why}}
    from qatfactory.formats.kv import get_kv_format
    g = torch.Generator().manual_seed(0)
    T, H, D = 257, 8, 64
    k = (torch.randn(T, H, D, generator=g) * torch.linspace(0.3, 3.0, D)).to(torch.bfloat16)
    v = (torch.randn(T, H, D, generator=g) * 0.7).to(torch.bfloat16)
    f = get_kv_format("fp8_e4m3")
    ks, vs = f.scale(k.float().abs().amax()), f.scale(v.float().abs().amax())
    # SGLang's write on the GPU (plain torch): an in-place scalar division of the bf16 tensor, then the cast
    fs = get_kv_format("fp8_e4m3_sglang")
    kc = k.cuda().clone()
    kc.div_(float(ks))
    got = kc.to(torch.float8_e4m3fn).view(torch.uint8).cpu()
    want = fs.encode(k, ks)
    big = torch.tensor([448.0, 460.0, 464.0, 470.0, 500.0, -500.0], device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    out["torch_cuda"] = {"run": True, "bytes": got.numel(), "differ": int((got != want).sum()),
                         "cast_of_448_460_464_470_500_-500": big.cpu().tolist(),
                         "expected_cast": [0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0xFF]}
    try:
        from vllm import _custom_ops as ops  # noqa: F401  (needs vLLM importable in this interpreter)
    except Exception as e:
        out["vllm_op"] = {"run": False, "why": f"not run: vLLM's ops not importable here ({type(e).__name__}: {e}); "
                                               f"run with vLLM's Python path"}
        return out
    nb, bs = 32, 16
    kcache = torch.zeros(nb, bs, H, D, dtype=torch.uint8, device="cuda")
    vcache = torch.zeros_like(kcache)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int64)
    ops.reshape_and_cache_flash(k.cuda(), v.cuda(), kcache, vcache, slots.cuda(), "fp8", ks.cuda(), vs.cuda())
    kb = kcache.reshape(-1, H, D)[slots].cpu()
    vb = vcache.reshape(-1, H, D)[slots].cpu()
    out["vllm_op"] = {"run": True, "bytes": 2 * kb.numel(), "differ_k": int((kb != f.encode(k, ks)).sum()),
                      "differ_v": int((vb != f.encode(v, vs)).sum())}
    return out


def vllm_serve(a, results: List[Dict[str, Any]], prep_by_seq: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """vLLM serves the fp8 export (its declared FP8 cache); KL of the student with and without the KV
    emulation to vLLM's prompt log-probabilities."""
    import torch
    if a.vllm_site is None:
        return {"run": False, "why": "not run: give --vllm-site (vLLM's Python path) on a GPU machine"}
    if not torch.cuda.is_available():
        return {"run": False, "why": "not run: no CUDA device"}
    sys.path.insert(0, str(GPU))
    import engines
    from qatfactory import quantize as Q
    from qatfactory.nn import kv_cache as KV
    out: Dict[str, Any] = {"run": True, "cells": {}}
    for r in results:
        if r["kv"] != "fp8_e4m3" or not r.get("export_dir") or not r.get("student_dir"):
            continue
        seq = r["seq"]
        w = a.work / f"vllm-seq{seq}"
        w.mkdir(parents=True, exist_ok=True)
        toks = engines.heldout_ids(prep_by_seq[seq], argparse.Namespace(eval_seqs=_sizes(a, seq)[1], seq=seq,
                                                                        prompts=1, prompt_len=8))
        (w / "tokens.json").write_text(json.dumps(toks))
        env = dict(os.environ, PYTHONPATH=a.vllm_site)
        cmd = [sys.executable, str(GPU / "engines.py"), "vllm-one", "--model", r["export_dir"], "--tokens",
               str(w / "tokens.json"), "--out", str(w / "vllm.json"), "--topk", str(a.topk)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        (w / "vllm.log").write_text(p.stdout[-20000:] + "\n--- stderr\n" + p.stderr[-40000:])
        vr = json.loads((w / "vllm.json").read_text()) if (w / "vllm.json").exists() else {"loaded": False}
        cell: Dict[str, Any] = {"loaded": vr.get("loaded"), "mode": vr.get("mode"), "vllm": vr.get("vllm"),
                                 "kv_cache_dtype": vr.get("kv_cache_dtype"), "error": vr.get("error")}
        if vr.get("loaded"):
            import numpy as np
            z = np.load(w / "vllm.npz")
            ids = torch.tensor(toks["heldout"])
            m = Q.load_student(r["student_dir"], dtype=torch.bfloat16).cuda().eval()
            kls = {}
            for label in ("student (KV emulated)", "student (bf16 KV)"):
                with torch.no_grad():
                    lp = torch.log_softmax(m(input_ids=ids.cuda()).logits.float(), -1)[:, :-1].cpu()
                kl, rest = engines.coarse_kl(lp, torch.from_numpy(z["ix"]), torch.from_numpy(z["lp"]))
                kls[label] = {"kl": float(kl.mean()), "p_outside_topk": float(rest.mean()),
                              "top1_agree": float((lp.argmax(-1).numpy() == z["ix"][..., 0]).mean())}
                say(f"vllm_serve seq {seq}: KL({label} || vLLM fp8 cache) {kls[label]['kl']:.5f}")
                KV.detach(m)
            cell["kl"] = kls
        out["cells"][str(seq)] = cell
    return out


# ============================================================================ report
def _f(x, p=5):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"


def markdown(rep: Dict[str, Any]) -> str:
    head = ("SMOKE (random tiny model on CPU, 2 steps): checks the plumbing, measures nothing about KV caches"
            if rep["smoke"] else f"{rep['model']}, weights {rep['format']}, {rep['steps']} QAD steps (lr {rep['lr']:g})")
    L = [f"# KV cache in the loop ({rep['date']})", "", head, "",
         "| seq | KV cache | PTQ KL | PTQ ppl | QAD KL | QAD ppl | QAD KL vs bf16 KV |", "|---|---|---|---|---|---|---|"]
    base = {r["seq"]: r for r in rep["results"] if r["kv"] == "none"}
    for r in rep["results"]:
        b = base.get(r["seq"])
        d = (r["qad"]["kl"] - b["qad"]["kl"]) if b and r["qad"]["kl"] is not None and b["qad"]["kl"] is not None else None
        L.append(f"| {r['seq']} | {r['kv']} | {_f(r['ptq']['kl'])} | {_f(r['ptq']['ppl'], 3)} | {_f(r['qad']['kl'])} | "
                 f"{_f(r['qad']['ppl'], 3)} | {'' if r['kv'] == 'none' else _f(d)} |")
    L += ["", "Engine checks:", ""]
    for k, v in rep["engine_checks"].items():
        L.append(f"* {k}: {json.dumps(v)}")
    L.append(f"* vllm_serve: {json.dumps(rep['vllm_serve'], default=str)}")
    for r in rep["results"]:
        if "verify" in r:
            L.append(f"* export seq {r['seq']} {r['kv']}: parity gate {r['verify'].get('verdict')} "
                     f"({r['verify'].get('checks')} checks) {r.get('export_dir')}")
    L += ["", "Commands:", ""] + [f"    {r['command']}" for r in rep["results"]]
    return "\n".join(L) + "\n"


def plot(rep: Dict[str, Any], path: Path) -> Optional[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seqs = sorted({r["seq"] for r in rep["results"]})
    fig, axes = plt.subplots(1, len(seqs), figsize=(4.5 * len(seqs), 3.4), squeeze=False)
    for ax, seq in zip(axes[0], seqs):
        rs = [r for r in rep["results"] if r["seq"] == seq]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["ptq"]["kl"] or 0 for r in rs], 0.4, label="PTQ")
        ax.bar([x + 0.2 for x in xs], [r["qad"]["kl"] or 0 for r in rs], 0.4, label="QAD")
        ax.set_xticks(list(xs), [r["kv"] for r in rs])
        ax.set_title(f"seq {seq}" + (" (SMOKE)" if rep["smoke"] else ""))
        ax.set_ylabel("held-out KL to the bf16 teacher")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: Optional[List[str]] = None) -> int:
    a = parse(list(sys.argv[1:] if argv is None else argv))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    results, preps = [], {}
    for seq in a.seqs:
        preps[seq] = prepare(a, seq)
        for kv in a.kv:
            results.append(run_arm(a, preps[seq], seq, kv))
    rep = {"smoke": a.smoke, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "format": a.format,
           "steps": a.steps, "lr": a.lr, "model": "tiny random Llama" if a.smoke else "SmolLM2-135M-Instruct",
           "results": results}
    rep["engine_checks"] = engine_checks(a)
    say(f"engine checks: {json.dumps(rep['engine_checks'], default=str)}")
    rep["vllm_serve"] = vllm_serve(a, results, preps)
    (out / "kv_cache.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / "kv_cache.md").write_text(markdown(rep))
    rep["plot"] = plot(rep, out / "kv_cache.png")
    say(f"wrote {out / 'kv_cache.md'}")
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
