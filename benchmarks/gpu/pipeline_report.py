"""The GPU pipeline's report (benchmarks/gpu/pipeline.py): ``pipeline.json`` (every number) and
``pipeline.md`` (tables), rewritten after every stage so a run cut short still reports what it
measured; ``pipeline_curves.png`` (losses); ``pipeline_launches.log`` (head and tail of each
subprocess log).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from supervise import NCCL_ENV, REC_LOCK, T0, write_atomic


class Report:
    def __init__(self, a):
        self.a, self.out = a, Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: Dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(T0)),
                                     "smoke": a.smoke, "budget_s": a.budget, "argv": sys.argv[1:],
                                     "environment": environment(), "part1": {"status": "not run"},
                                     "part2": {"status": "not run"}}

    def save(self, final: bool = False) -> None:
        with REC_LOCK:
            self.data["elapsed_s"] = time.time() - T0
            self.data["final"] = final
            write_atomic(self.out / "pipeline.json", json.dumps(self.data, indent=1, default=str))
            write_atomic(self.out / "pipeline.md", markdown(self.data))


def environment() -> Dict[str, Any]:
    env: Dict[str, Any] = {"python": platform.python_version(), "host_cpus": os.cpu_count()}
    for pkg in ("torch", "deepspeed", "transformers", "gguf", "compressed-tensors", "safetensors"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        if torch.cuda.is_available():
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            env["cuda"] = torch.version.cuda
    except Exception:
        pass
    env.update({k: os.environ.get(k) for k in list(NCCL_ENV) + ["TORCH_CUDA_ARCH_LIST"] if os.environ.get(k)})
    return env


def _f(v, fmt: str = ".1f", dash: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return dash
    return format(v, fmt)


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def _peaks(p: Optional[Dict[str, float]]) -> str:
    if not p:
        return "-"
    return ", ".join(f"GPU{k} {v / 1024:.1f}" for k, v in sorted(p.items()))


def _export_rows(rows: List[Dict[str, Any]], label: str) -> List[str]:
    L = []
    for e in rows:
        size = f"{e['bytes'] / 2**20:.1f} MiB" if "bytes" in e else "-"
        extra = ""
        if e.get("failures"):
            extra = "; ".join(e["failures"][:3])
        elif e.get("error"):
            extra = e["error"].strip().splitlines()[-1][:160] if e["error"].strip() else ""
        ch = e.get("checks") or {}
        checks = f"{ch.get('ok', 0)} ok / {ch.get('FAIL', 0)} fail / {ch.get('INCOMPLETE', 0)} not run" if ch else "-"
        L.append(f"| {label} | {e['engine']} / {e['flavour']} | {_f(e.get('export_s'))} s | {size} | **{e['status']}** | "
                 f"{checks} | {_f(e.get('verify_s'))} s | {extra} |")
    return L


def markdown(d: Dict[str, Any]) -> str:
    env = d["environment"]
    L = ["# GPU pipeline: ZeRO-3 resume acceptance (part 1) and the SmolLM2 recipe (part 2)\n"]
    L.append(f"Started {d['started']}; elapsed {d.get('elapsed_s', 0):.0f} s of a {d['budget_s']:.0f} s budget"
             + (" (**smoke run on CPU: numbers check the script only**)" if d["smoke"] else "") + ".  ")
    L.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    v = d.get("verdict")
    if v:
        L.append(f"**Verdict: {'OK' if v['ok'] else 'PROBLEMS'}**" + "".join(f"\n- problem: {x}" for x in v["problems"])
                 + "".join(f"\n- skipped: {x}" for x in v["skipped"]) + "\n")

    P = d["part1"]
    L.append("## Part 1: ZeRO-3 QAD, checkpoint, resume, export, verify\n")
    L.append(f"Status: **{P.get('status')}**.  ")
    if "steps" in P:
        L.append(f"Random Llama-shaped model ({P['model_layers']} layers; GPU run: hidden 2048, vocab 32000, untied), "
                 f"QAD with a live bf16 teacher, `format=nvfp4_w4a16`, `train=gpu_multi` (ZeRO-3, grad checkpointing), "
                 f"optimizer {P['optimizer']}, {P['world']} ranks x micro-batch {P['micro_batch_per_rank']} x "
                 f"{P['seq_len']} tokens = {P['tokens_per_step']} tokens/step; {P['steps']} steps, checkpoint at step "
                 f"{P['ckpt_step']}; launch 2 resumes from it in another run directory.\n")
        L.append("| launch | rc | wall | launch -> first step | ms/step (median) | tokens/s | rank-0 torch peak | "
                 "peak per rank (nvidia-smi, GiB) |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---|")
        for k in ("run1", "run2"):
            r = P.get(k)
            if not r:
                continue
            L.append(f"| {k} | {r['rc']}{' (timeout)' if r.get('timed_out') else ''} | {_f(r.get('wall_s'))} s | "
                     f"{_f(r.get('launch_to_first_step_s'))} s | {_f(r.get('ms_per_step_median'))} | "
                     f"{_f(r.get('tokens_per_s_median'), '.0f')} | {_f(r.get('rank0_torch_peak_gib'), '.2f')} GiB | "
                     f"{_peaks(r.get('gpu_peak_mib_per_rank'))} |")
        L.append("")
        c = P.get("checkpoint")
        if c:
            L.append(f"Checkpoint at step {c['step']}: {_gib(c['bytes'])} in {c['files']} files; save time "
                     f"{_f(c.get('save_s'), '.2f')} s from its temporary directory appearing to its rename (polled "
                     f"every 0.2 s), {_f(c.get('mtime_span_s'), '.2f')} s between the first and the last file "
                     f"written.\n")
        rs = P.get("resume")
        if rs:
            if rs.get("max_abs_diff") is None:
                L.append(f"Resume comparison: steps missing from a log: {rs.get('missing_steps')}.\n")
            else:
                L.append(f"Resume: steps {rs['steps'][0]}..{rs['steps'][-1]}, max |loss(uninterrupted) - "
                         f"loss(resumed)| = **{rs['max_abs_diff']:.3g}** (relative {rs['max_rel_diff']:.3g}); "
                         f"bit-equal: {rs['bit_equal']}.\n")
                L.append("| step | uninterrupted | resumed | abs diff |\n|---:|---:|---:|---:|")
                for s, x, y, dd in zip(rs["steps"], rs["uninterrupted"], rs["resumed"], rs["abs_diff"]):
                    L.append(f"| {s} | {x:.6f} | {y:.6f} | {dd:.3g} |")
                L.append("")
        for k in ("run1", "run2"):
            r = P.get(k)
            if r and r.get("error_tail"):
                L.append(f"{k} failed; log tail:\n\n```\n{r['error_tail'][-2500:]}\n```\n")
        if P.get("exports"):
            L.append("| student | engine / flavour | export (CLI wall, incl. load+convert) | size | verify | checks | "
                     "verify wall | notes |")
            L.append("|---|---|---:|---:|---|---|---:|---|")
            L += _export_rows(P["exports"], "run2 final")
            L.append("")

    Q = d["part2"]
    L.append("## Part 2: SmolLM2-135M-Instruct (packaged GGUF) -> QAD on Wikipedia -> export -> verify\n")
    L.append(f"Status: **{Q.get('status')}**.  ")
    prep = Q.get("prep") or {}
    sm = (prep.get("assets") or {}).get("smollm2")
    if sm:
        L.append(f"GGUF: sha256 `{sm.get('sha256')}` matches the provenance record: {sm.get('sha256_ok')} "
                 f"(parts: {', '.join(Path(p).name + ' from ' + str(Path(p).parent) for p in (sm.get('parts') or {}).values()) or sm.get('reused')}); "
                 f"HF directory built by `assets.prepare_model_dir` in {_f(prep.get('model_dir_s'))} s.  ")
    if Q.get("data"):
        dd = Q["data"]
        L.append(f"Data: {dd.get('split_rule')}; files hold {dd.get('articles')} articles "
                 f"(training files cover {dd.get('steps_covered_by_files')} steps, later steps repeat epochs).  ")
    if "steps" in Q:
        L.append(f"QAD: `train={Q.get('train', 'gpu_multi')}` (ZeRO-{Q.get('zero', 3)}), {Q['world']} ranks x {Q['micro_batch_per_rank']} x accum "
                 f"{Q['grad_accum']} x {Q['seq_len']} = {Q['tokens_per_step']} tokens/step, {Q['steps']} steps, lr "
                 f"{Q['lr']:g} constant, {Q['optimizer']}; evaluation: `qatfactory.train.heldout.HeldOut` (full-vocabulary "
                 f"forward KL to the bf16 teacher) on {Q.get('eval_tokens_target')} held-out tokens.\n")
    T = Q.get("teacher")
    if T or Q.get("formats"):
        L.append("| format | model | KL to teacher (nats/token) | perplexity | top-1 agreement | bits/weight |")
        L.append("|---|---|---:|---:|---:|---:|")
        if T:
            L.append(f"| - | teacher bf16 | {T['kl']:.4f} | {T['ppl']:.3f} | {T['top1']:.3f} | 16 |")
        for fmt, F in (Q.get("formats") or {}).items():
            for st in ("ptq", "qad"):
                m = F.get(st)
                if m:
                    bits = (F.get("ptq") or {}).get("bits", {}).get("bits_quantized")
                    L.append(f"| {fmt} | {st.upper()} | {m['kl']:.4f} | {m['ppl']:.3f} | {m['top1']:.3f} | "
                             f"{_f(bits, '.3f')} |")
        L.append("")
        L.append("| format | status | rc | wall | launch -> first step | ms/step | tokens/s | rank-0 torch peak | "
                 "peak per rank (GiB) | trainer eval KL first -> last |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---|---|")
        for fmt, F in (Q.get("formats") or {}).items():
            r = F.get("train") or {}
            tr = r.get("trainer") or {}
            kl0 = (tr.get("eval_first") or {}).get("eval/kl")
            kl1 = (tr.get("eval_last") or {}).get("eval/kl")
            L.append(f"| {fmt} | {F.get('status')} | {r.get('rc', '-')} | {_f(r.get('wall_s'))} s | "
                     f"{_f(r.get('launch_to_first_step_s'))} s | {_f(r.get('ms_per_step_median'))} | "
                     f"{_f(r.get('tokens_per_s_median'), '.0f')} | {_f(r.get('rank0_torch_peak_gib'), '.2f')} GiB | "
                     f"{_peaks(r.get('gpu_peak_mib_per_rank'))} | {_f(kl0, '.4f')} -> {_f(kl1, '.4f')} |")
        L.append("")
        ex = [(fmt, e) for fmt, F in (Q.get("formats") or {}).items() for e in F.get("exports", [])]
        if ex:
            L.append("| student | engine / flavour | export (CLI wall, incl. load+convert) | size | verify | checks | "
                     "verify wall | notes |")
            L.append("|---|---|---:|---:|---|---|---:|---|")
            for fmt, e in ex:
                L += _export_rows([e], f"QAD {fmt}")
            L.append("")
        for fmt, F in (Q.get("formats") or {}).items():
            r = F.get("train") or {}
            if r.get("error_tail"):
                L.append(f"{fmt} training failed; log tail:\n\n```\n{r['error_tail'][-2500:]}\n```\n")
            if F.get("eval_error"):
                L.append(f"{fmt} evaluation error: `{F['eval_error']}`\n")
    G = Q.get("gsm8k")
    if G:
        L.append("GSM8K (greedy, chat template, last number vs the reference): " + "; ".join(
            f"{k} {v['correct']}/{v['problems']}" if "correct" in v else f"{k} {v.get('status', v)}"
            for k, v in G.items() if isinstance(v, dict)) + (f"; error {G['error']}" if "error" in G else "") + ".\n")
    L.append("## Commands\n")
    cmds = []
    for k in ("run1", "run2"):
        if (P.get(k) or {}).get("command"):
            cmds.append(P[k]["command"])
    for e in P.get("exports") or []:
        cmds += [e[c] for c in ("export_command", "verify_command") if c in e]
    for fmt, F in (Q.get("formats") or {}).items():
        if (F.get("train") or {}).get("command"):
            cmds.append(F["train"]["command"])
        for e in F.get("exports") or []:
            cmds += [e[c] for c in ("export_command", "verify_command") if c in e]
    L.append("```sh\n" + "\n".join(cmds) + "\n```\n")
    return "\n".join(L)


def plot(d: Dict[str, Any], out: Path) -> Optional[Path]:
    try:     # optional: without matplotlib the report has no plot; Agg must be chosen before pyplot loads
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    P = d["part1"]
    runs1 = {k: (P.get(k) or {}).get("losses") or {} for k in ("run1", "run2")}
    fmts = {f: F for f, F in (d["part2"].get("formats") or {}).items() if (F.get("train") or {}).get("losses")}
    panels = (["part1"] if any(runs1.values()) else []) + (["part2"] if fmts else [])
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 0.5, 3.8), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    if "part1" in ax:
        a = ax["part1"]
        for k, style in (("run1", "-"), ("run2", "--")):
            ls = runs1[k]
            if ls:
                xs = sorted(int(s) for s in ls)
                a.plot(xs, [ls[str(s)] for s in xs], style, marker="o", ms=3,
                       label={"run1": "uninterrupted", "run2": "resumed"}[k])
        a.set_title("part 1: QAD loss, uninterrupted vs resumed", fontsize=9)
        a.set_xlabel("step")
        a.legend(fontsize=8)
    if "part2" in ax:
        a = ax["part2"]
        for fmt, F in fmts.items():
            ls = F["train"]["losses"]
            xs = sorted(int(s) for s in ls)
            line, = a.plot(xs, [ls[str(s)] for s in xs], lw=1, label=f"{fmt}: QAD training KL")
            c = line.get_color()
            if F.get("ptq"):
                a.axhline(F["ptq"]["kl"], ls=":", lw=1, color=c, label=f"{fmt}: PTQ held-out KL")
            if F.get("qad"):
                a.plot([xs[-1]], [F["qad"]["kl"]], "o", color=c, ms=6, label=f"{fmt}: QAD held-out KL")
        a.set_title("part 2: SmolLM2-135M QAD, KL to the teacher (nats/token)", fontsize=9)
        a.set_xlabel("step")
        a.legend(fontsize=7)
    fig.tight_layout()
    p = out / "pipeline_curves.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p


def collect_logs(work: Path, out: Path, head: int = 60, tail: int = 400) -> None:
    """Every subprocess log, head and tail, in one file (what comes back is limited to a few files)."""
    parts = []
    for f in sorted((work / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime):
        lines = f.read_text(errors="replace").splitlines()
        if len(lines) > head + tail:
            lines = lines[:head] + [f"... [{len(lines) - head - tail} lines left out] ..."] + lines[-tail:]
        parts.append(f"===== {f.name} =====\n" + "\n".join(line[:2000] for line in lines))
    text = "\n\n".join(parts)
    if len(text) > 12 * 2**20:
        text = text[-12 * 2**20:]
    write_atomic(out / "pipeline_launches.log", text)
