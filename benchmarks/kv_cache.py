"""The KV cache in the loop, one command: held-out KL and perplexity of PTQ and QAD students
with a bf16 vs an FP8 vs an NVFP4 KV cache, at two sequence lengths, plus the engine checks a GPU can run.

    python benchmarks/kv_cache.py --out runs/kv                 # the H200 run (SmolLM2-135M-Instruct)
    python benchmarks/kv_cache.py --smoke --out /tmp/kv         # CPU plumbing check (tiny random model)

On the GPU machine (the wheels staged as for benchmarks/gpu/engines.sh, our stack in /tmp/site):

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/kv_cache.py --out $OUT --work /tmp/qf-kv --vllm-site /tmp/vsite
    # the FP8-attention check (one 2K fp8 arm trained with the fa3 emulation, vLLM served with both backends):
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/kv_cache.py --out $OUT/kv --work /tmp/qf-kv --vllm-site /tmp/vsite \
        --seqs 2048 --kv fp8_e4m3 --steps 30

An arm's run directory carries its attention rule (``seq2048-fp8_e4m3-fa3``): an arm trained with another
emulation (the cache-only ``seq2048-fp8_e4m3`` of 2026-12-01) is never reused for it.

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
* ``vllm_q_cast``: vLLM's ``scaled_fp8_quant`` (the op behind the FP8 attention's query cast) on a bf16 query
  with q_scale 1.0 (what vLLM uses without a checkpoint q_scale) and 0.37, against formats/kv_attention.py's
  ``query_values`` byte for byte (needs vLLM importable, as ``vllm_op``).
* ``torch_cuda``: what SGLang's write does, ``cache_k.div_(k_scale).to(float8_e4m3fn)`` on the GPU,
  against ``fp8_e4m3_sglang``; and whether torch's CUDA cast saturates (the rule says: NaN above 464).
* ``vllm_serve`` (with ``--vllm-site``): vLLM serves the fp8 export with its declared FP8 cache
  (``--kv-cache-dtype auto`` -> fp8), once per ``--vllm-backends`` entry (default FLASH_ATTN, vLLM's
  choice on Hopper = FlashAttention 3, and TRITON_ATTN; ``engines.py vllm-one --attention-backend``).
  The fp8 arm trains with ``--kv-attention`` (default auto = none, the cache write only, since 2026-12-06;
  fa3 / triton: vLLM's FP8 attention arithmetic, formats/kv_attention.py). Its student is then scored
  against every backend's prompt log-probs with each emulation switched in (``nn.kv_cache.set_attention``):
  fa3, triton, cache only (``none``: the cache-only emulation, without the FP8 attention) and a bf16 cache
  (no KV emulation); KL on vLLM's top-K partition (benchmarks/gpu/engines.py). The emulation matches a
  backend when its own rule gives the smallest KL there, near the weight-only cells' KL without a KV cache
  (0.0017 on 2026-12-01).

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
BACKENDS = {"FLASH_ATTN": "fa3", "TRITON_ATTN": "triton"}     # vLLM --attention-backend -> our attention rule


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
    p.add_argument("--vllm-ops-only", action="store_true", dest="vllm_ops_only",
                   help="internal: run only the checks against vLLM's ops (under vLLM's Python path) into --out")
    p.add_argument("--kv-attention", default="auto", dest="kv_attention",
                   help="quant.kv_attention of the fp8 arm: auto (= none), fa3, triton or none (cache write only)")
    p.add_argument("--no-vllm-bf16-control", dest="vllm_bf16_control", action="store_false",
                   help="skip serving the fp8 export a second time per backend with vLLM's cache in bf16")
    p.add_argument("--vllm-backends", default=",".join(BACKENDS), dest="vllm_backends",
                   help=f"vLLM attention backends to serve the fp8 export with, from {list(BACKENDS)}")
    p.add_argument("--topk", type=int, default=128)
    a = p.parse_args(argv)
    a.seqs = [int(s) for s in (a.seqs or ("32,48" if a.smoke else "2048,8192")).split(",") if s.strip()]
    a.kv = [k.strip() for k in a.kv.split(",") if k.strip()]
    bad = [k for k in a.kv if k not in ARMS]
    if bad:
        raise SystemExit(f"--kv: unknown arm(s) {bad}; allowed: {list(ARMS)}")
    a.vllm_backends = [b.strip() for b in a.vllm_backends.split(",") if b.strip()]
    bad = [b for b in a.vllm_backends if b not in BACKENDS]
    if bad:
        raise SystemExit(f"--vllm-backends: unknown {bad}; allowed: {list(BACKENDS)}")
    if a.kv_attention not in ("auto", "none", *BACKENDS.values()):
        raise SystemExit(f"--kv-attention={a.kv_attention!r}; allowed: auto, none, {', '.join(BACKENDS.values())}")
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
        o += [f"quant.kv_format={kv}", f"quant.kv_attention={attention_of(a, kv)}"]
    return o


def attention_of(a, kv: str) -> str:
    """The arm's resolved kv_attention (the FP8 attention rules run on fp8_e4m3 only)."""
    from qatfactory.formats.kv_attention import default_attention
    if kv == "none":
        return "none"
    if kv != "fp8_e4m3":
        return default_attention(kv)
    return default_attention(kv) if a.kv_attention == "auto" else a.kv_attention


def run_arm(a, prep, seq: int, kv: str) -> Dict[str, Any]:
    from qatfactory.faces.ship import train_and_ship as run     # the trainer, then export + gate (export=vllm)
    from qatfactory.train.config import compose
    att = attention_of(a, kv)
    # the attention rule is part of the arm's name: an arm trained with another emulation is never reused
    rd = a.work / (f"seq{seq}-{kv}" + (f"-{att}" if att != "none" else ""))
    done = rd / "kv_arm.json"
    if done.exists():           # trained by an earlier run on the same machine: reuse, never retrain
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
    res = {"seq": seq, "kv": kv, "attention": att, "run_dir": str(rd), "wall_s": time.time() - t0, "steps": s.get("steps"),
           "command": "python -m qatfactory.train " + " ".join(over),
           "ptq": {k[5:]: first.get(k) for k in ("eval/kl", "eval/ppl", "eval/top1", "eval/tokens")},
           "qad": {k[5:]: last.get(k) for k in ("eval/kl", "eval/ppl", "eval/top1", "eval/tokens")},
           "student_dir": s.get("student_dir")}
    for k in ("export_dir", "verify", "verify_ok"):
        if k in s:
            res[k] = s[k]
    say(f"seq {seq} kv {kv} (attention {att}): PTQ KL {res['ptq']['kl']:.5f} ppl {res['ptq']['ppl']:.3f} -> QAD KL "
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
        if a.vllm_site and not a.vllm_ops_only:     # vLLM's own Python path, in a child process
            return _vllm_ops_in_child(a, out)
        out["vllm_op"] = {"run": False, "why": f"not run: vLLM's ops not importable here ({type(e).__name__}: {e}); "
                                               f"run with vLLM's Python path (--vllm-site)"}
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
    # the query cast of vLLM's FP8 attention (attention.py: QuantFP8 static per-tensor with _q_scale, 1.0 without a
    # checkpoint q_scale) with vLLM's own op, on the 2-D [tokens, heads*head_dim] query, against formats/kv_attention.py
    from qatfactory.formats import codecs as C
    from qatfactory.formats.kv_attention import query_values
    q = (torch.randn(T, H * D, generator=g) * torch.linspace(0.01, 500.0, H * D)).to(torch.bfloat16)
    got = {}
    for qs in (1.0, 0.37):
        q8, _ = ops.scaled_fp8_quant(q.cuda(), torch.tensor([qs], dtype=torch.float32, device="cuda"), group_shape=(-1, -1))
        want_b = C.e4m3_encode(query_values(q, qs))
        got[str(qs)] = int((q8.view(torch.uint8).cpu() != want_b).sum())
    out["vllm_q_cast"] = {"run": True, "bytes": q.numel(), "differ_by_q_scale": got,
                          "saturated": int((q.float().abs() > 448).sum())}
    return out


def _vllm_ops_in_child(a, out: Dict[str, Any]) -> Dict[str, Any]:
    """engine_checks' vLLM part run by this file under vLLM's Python path (plus this repository for the rules)."""
    d = a.work / "vllm-ops"
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([a.vllm_site, str(REPO)]))
    p = subprocess.run([sys.executable, __file__, "--vllm-ops-only", "--out", str(d), "--work", str(a.work)],
                       env=env, capture_output=True, text=True, timeout=300)
    (d / "vllm_ops.log").write_text(p.stdout[-10000:] + "\n--- stderr\n" + p.stderr[-20000:])
    f = d / "vllm_ops.json"
    child = json.loads(f.read_text()) if f.exists() else {}
    for k in ("vllm_op", "vllm_q_cast"):
        out[k] = child.get(k) or {"run": False, "why": f"not run: the vLLM child failed (rc {p.returncode}; "
                                                        f"{d / 'vllm_ops.log'}): {p.stderr[-300:]}"}
    return out


def served_scales_vs_export(served: Dict[str, Dict[str, Any]], export_dir) -> Dict[str, Any]:
    """The k/v scales vLLM's attention layers hold after loading (engines._attention_scales, per module name)
    against the export's ``*.self_attn.{k,v}_proj.{k,v}_scale`` tensors, layer by layer (the layer index read
    from both names). Exact float equality is the claim. vLLM 0.24 holds the scales in the model's dtype
    (KVCacheScaleParameter), so a float32 scale that is no bf16 value comes back moved (H100, 2026-12-06: up to
    0.32%); qatfactory's scales are bf16 values since. A run with an unquantized cache never loads them (vLLM
    keeps 1.0): ``scales_used`` is then False and the comparison says nothing."""
    import re

    from safetensors import safe_open
    want: Dict[int, Dict[str, float]] = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                m = re.search(r"layers\.(\d+)\.self_attn\.([kv])_proj\.([kv])_scale$", key)
                if m and m.group(2) == m.group(3):
                    want.setdefault(int(m.group(1)), {})[m.group(2)] = float(h.get_tensor(key).float().reshape(-1)[0])
    got: Dict[int, Dict[str, Any]] = {}
    for name, rec in (served or {}).items():
        m = re.search(r"layers\.(\d+)\.", name)
        if m and "k" in rec:
            got[int(m.group(1))] = rec
    rows, worst = [], 0.0
    for i in sorted(set(want) | set(got)):
        w, g = want.get(i, {}), got.get(i, {})
        for kv in ("k", "v"):
            wv, gv = w.get(kv), g.get(kv)
            ok = wv is not None and gv is not None and wv == gv
            if wv is not None and gv is not None and wv:
                worst = max(worst, abs(gv - wv) / abs(wv))
            if not ok:
                rows.append({"layer": i, "scale": kv, "export": wv, "served": gv})
    dtypes = sorted({str(g.get("kv_cache_dtype")) for g in got.values()})
    return {"scales_used": any(d.startswith(("fp8", "nvfp4")) for d in dtypes),
            "layers_in_export": len(want), "layers_served": len(got), "all_equal": bool(want) and not rows,
            "n_mismatches": len(rows), "mismatches": rows[:12], "max_rel_diff": worst,
            "served_q_scales": sorted({g.get("q") for g in got.values()}),
            "served_kv_cache_dtypes": dtypes}


def vllm_serve(a, results: List[Dict[str, Any]], prep_by_seq: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """vLLM serves the fp8 export (its declared FP8 cache) with each backend of --vllm-backends; the student is
    scored against each with every emulation switched in (fa3, triton, cache only, bf16 cache)."""
    import re

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
        w = a.work / f"vllm-seq{seq}-{r.get('attention', 'none')}"
        w.mkdir(parents=True, exist_ok=True)
        toks = engines.heldout_ids(prep_by_seq[seq], argparse.Namespace(eval_seqs=_sizes(a, seq)[1], seq=seq,
                                                                        prompts=1, prompt_len=8))
        (w / "tokens.json").write_text(json.dumps(toks))
        env = dict(os.environ, PYTHONPATH=a.vllm_site)
        cell: Dict[str, Any] = {"trained_with": r.get("attention"), "backends": {}, "kl": {}}
        served = {}
        # each backend twice: with the fp8 cache the export declares, and (the control, --vllm-bf16-control)
        # the same export and tokens with vLLM's cache kept in bf16: what is left there is not the KV cache's
        runs = [(b, b, None) for b in a.vllm_backends]
        if a.vllm_bf16_control:
            runs += [(f"{b}, bf16 cache", b, "bfloat16") for b in a.vllm_backends]
        for b, backend, cache_dtype in runs:
            res_json = w / f"vllm-{_slug(b)}.json"
            cmd = [sys.executable, str(GPU / "engines.py"), "vllm-one", "--model", r["export_dir"], "--tokens",
                   str(w / "tokens.json"), "--out", str(res_json), "--topk", str(a.topk), "--attention-backend", backend]
            if cache_dtype:
                cmd += ["--kv-cache-dtype", cache_dtype]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            log = p.stdout[-20000:] + "\n--- stderr\n" + p.stderr[-40000:]
            (w / f"vllm-{_slug(b)}.log").write_text(log)
            vr = json.loads(res_json.read_text()) if res_json.exists() else {"loaded": False}
            used = re.findall(r"Using (\w+) attention backend", log)
            cell["backends"][b] = {"loaded": vr.get("loaded"), "mode": vr.get("mode"), "vllm": vr.get("vllm"),
                                   "kv_cache_dtype": vr.get("kv_cache_dtype"), "backend_in_log": used[-1] if used else None,
                                   "fa_version": (re.findall(r"Using FlashAttention version (\d)", log) or [None])[-1],
                                   "q_scale_warning": "does not provide a q scaling factor" in log,
                                   "error": vr.get("error"), "init_errors": [e[:300] for e in vr.get("init_errors") or []],
                                   "scales_vs_export": (served_scales_vs_export(vr["attention_scales"], r["export_dir"])
                                                        if vr.get("attention_scales") else None)}
            if vr.get("loaded"):
                import numpy as np
                z = np.load(res_json.with_suffix(".npz"))
                served[b] = (torch.from_numpy(z["ix"]).cuda(), torch.from_numpy(z["lp"]).cuda())
            say(f"vllm_serve seq {seq}: {b} loaded={vr.get('loaded')} backend in log {cell['backends'][b]['backend_in_log']}")
        if served:
            ids = torch.tensor(toks["heldout"])
            # the last variant is the same student in fp32 with bf16 K/V: its KL is what bf16 arithmetic
            # alone (ours or vLLM's) leaves at this length, the floor the others are read against
            variants = [(f"student ({att} emulation)", att, torch.bfloat16) for att in BACKENDS.values()] + [
                ("student (cache-only emulation)", "none", torch.bfloat16), ("student (bf16 KV)", None, torch.bfloat16),
                ("student (bf16 KV, fp32 compute)", None, torch.float32)]
            m, m_dtype, trained_lp = None, None, None
            for label, att, dtype in variants:
                if m_dtype != dtype:
                    del m
                    torch.cuda.empty_cache()
                    m, m_dtype = Q.load_student(r["student_dir"], dtype=dtype).cuda().eval(), dtype
                if att is None:
                    KV.detach(m)
                else:
                    KV.set_attention(m, att)
                with torch.no_grad():
                    lp = torch.log_softmax(m(input_ids=ids.cuda()).logits.float(), -1)[:, :-1]
                for b, (ix, zlp) in served.items():
                    kl, rest = engines.coarse_kl(lp, ix, zlp)
                    cell["kl"].setdefault(b, {})[label] = {
                        "kl": float(kl.mean()), "p_outside_topk": float(rest.mean()),
                        "top1_agree": float((lp.argmax(-1) == ix[..., 0]).float().mean()),
                        "kl_by_position": kl_by_position(kl)}
                    say(f"vllm_serve seq {seq}: KL({label} || vLLM {b}) {cell['kl'][b][label]['kl']:.5f} "
                        f"by position {cell['kl'][b][label]['kl_by_position']}")
                if label == f"student ({cell['trained_with']} emulation)" or (
                        cell["trained_with"] in (None, "none") and label == "student (cache-only emulation)"):
                    trained_lp = lp                      # the forward the student was trained with
                else:
                    del lp
            del m
            torch.cuda.empty_cache()
            # the teacher (the unquantized model the student was distilled from, bf16 as the student's
            # forward) against the served model and against the student, on the same tokens
            from transformers import AutoModelForCausalLM
            t = AutoModelForCausalLM.from_pretrained(prep_by_seq[seq]["model_dir"], dtype=torch.bfloat16).cuda().eval()
            with torch.no_grad():
                tlp = torch.log_softmax(t(input_ids=ids.cuda()).logits.float(), -1)[:, :-1]
            del t
            cell["vs_teacher"] = (vs_teacher(tlp, trained_lp, served, a.topk, engines.coarse_kl) if trained_lp is not None
                                  else {"why": f"no student forward is labelled as trained with {cell['trained_with']!r}"})
            say(f"vllm_serve seq {seq}: KL(teacher || .) {json.dumps(cell['vs_teacher'])}")
            del tlp, trained_lp
            torch.cuda.empty_cache()
        out["cells"][str(seq)] = cell
    return out


def vs_teacher(teacher_lp, student_lp, served: Dict[str, Any], topk: int, coarse_kl) -> Dict[str, Any]:
    """The second reading: does the served model stand as far from the teacher as the student that was
    trained for it? KL(teacher || X) on X's top-k partition (coarse_kl), for X = each vLLM run (its top-k
    from the engine) and X = the student's own forward (its top-k taken here, the same coarse-graining).
    Per vLLM run: the KL, and 'minus student' = how much further from the teacher the served model is than
    the student (positive: serving costs quality the student did not pay for). teacher_lp / student_lp: full
    log-probs [sequences, positions, vocab] on the same tokens; served: {run: (top-k ids, top-k log-probs)}."""
    s_lp, s_ix = student_lp.topk(topk, dim=-1)
    st, _ = coarse_kl(teacher_lp, s_ix, s_lp)
    out: Dict[str, Any] = {"student": float(st.mean()), "served": {}}
    for b, (ix, zlp) in served.items():
        kl, _ = coarse_kl(teacher_lp, ix, zlp)
        out["served"][b] = {"kl": float(kl.mean()), "minus_student": float(kl.mean()) - float(st.mean())}
    return out


POSITION_EDGES = (0, 128, 512, 1024, 2048, 4096, 8192)


def kl_by_position(kl, edges=POSITION_EDGES) -> Dict[str, float]:
    """Mean KL per bucket of positions ([sequences, positions] -> {"0-127": ..., "128-511": ...}): a gap
    that grows with the position points at position-dependent arithmetic (RoPE, long-row softmax), one
    that is flat at the weights or the cache."""
    n = kl.shape[-1]
    out: Dict[str, float] = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        if lo >= n:
            break
        out[f"{lo}-{min(hi, n) - 1}"] = float(kl[..., lo:min(hi, n)].mean())
    return out


def _slug(name: str) -> str:
    """A file-name form of a served run's label ("FLASH_ATTN, bf16 cache" -> "FLASH_ATTN-bf16-cache")."""
    return "-".join("".join(c if c.isalnum() or c == "_" else " " for c in name).split())


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
        kvn = r["kv"] + (f" ({r['attention']} attention)" if r.get("attention", "none") != "none" else "")
        L.append(f"| {r['seq']} | {kvn} | {_f(r['ptq']['kl'])} | {_f(r['ptq']['ppl'], 3)} | {_f(r['qad']['kl'])} | "
                 f"{_f(r['qad']['ppl'], 3)} | {'' if r['kv'] == 'none' else _f(d)} |")
    vs = rep["vllm_serve"]
    for seq, cell in (vs.get("cells") or {}).items():
        bs = list(cell.get("kl") or {})
        if not bs:
            continue
        L += ["", f"vLLM serving the fp8 export (seq {seq}, student trained with kv_attention={cell.get('trained_with')}): "
              f"KL(student || vLLM) on vLLM's top-{rep.get('topk', 128)} partition", "",
              "| student's emulation | " + " | ".join(f"vLLM {b} ({cell['backends'][b].get('backend_in_log')})" for b in bs) + " |",
              "|---|" + "---|" * len(bs)]
        for label in next(iter(cell["kl"].values())):
            L.append(f"| {label} | " + " | ".join(_f(cell["kl"][b][label]["kl"]) for b in bs) + " |")
        vt = cell.get("vs_teacher")
        if vt and "student" in vt:
            L += ["", f"Against the teacher (seq {seq}): KL(teacher || X) on X's top-{rep.get('topk', 128)} partition. "
                  f"The student's own forward (kv_attention={cell.get('trained_with')}): {_f(vt['student'])}", "",
                  "| X = vLLM run | KL(teacher \\|\\| X) | minus the student's |", "|---|---|---|"]
            L += [f"| {b} | {_f(v['kl'])} | {_f(v['minus_student'])} |" for b, v in vt["served"].items()]
        sv = {b: cell["backends"][b].get("scales_vs_export") for b in cell.get("backends", {})}
        if any(sv.values()):
            L += ["", f"k/v scales each served attention layer holds vs the export's (seq {seq}):", "",
                  "| vLLM run | cache dtype | scales used | layers | all equal | mismatches | max rel. diff |",
                  "|---|---|---|---|---|---|---|"]
            L += [f"| {b} | {', '.join(v.get('served_kv_cache_dtypes') or [])} | {v.get('scales_used')} | "
                  f"{v.get('layers_served')} of {v.get('layers_in_export')} | {v.get('all_equal')} | "
                  f"{v.get('n_mismatches', str(len(v.get('mismatches') or [])) + '+')} | "
                  f"{_f(v.get('max_rel_diff'))} |" for b, v in sv.items() if v]
        # the same KL by position bucket, one row per (vLLM run, student forward)
        rows = [(b, label, v["kl_by_position"]) for b in bs for label, v in cell["kl"][b].items()
                if v.get("kl_by_position")]
        if rows:
            buckets = list(rows[0][2])
            L += ["", f"By position (seq {seq}):", "", "| vLLM run | student's forward | " + " | ".join(buckets) + " |",
                  "|---|---|" + "---|" * len(buckets)]
            L += [f"| {b} | {label} | " + " | ".join(_f(by.get(k)) for k in buckets) + " |" for b, label, by in rows]
    L += ["", "Engine checks:", ""]
    for k, v in rep["engine_checks"].items():
        L.append(f"* {k}: {json.dumps(v)}")
    L.append(f"* vllm_serve: {json.dumps(vs, default=str)}")
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
    if a.vllm_ops_only:
        (out / "vllm_ops.json").write_text(json.dumps(engine_checks(a), indent=1, default=str))
        return 0
    results, preps = [], {}
    for seq in a.seqs:
        preps[seq] = prepare(a, seq)
        for kv in a.kv:
            results.append(run_arm(a, preps[seq], seq, kv))
    rep = {"smoke": a.smoke, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "format": a.format,
           "steps": a.steps, "lr": a.lr, "topk": a.topk, "kv_attention": a.kv_attention, "model": "tiny random Llama" if a.smoke else "SmolLM2-135M-Instruct",
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
