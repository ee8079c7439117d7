"""The demo's report: report.md, the PNG plots and the closing summary table, from results.json's
numbers (qatfactory/faces/demo.py measures them; nothing here computes a metric)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from .llama_compare import report_lines


def _fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"



def make_plots(results: Dict[str, Any], out: Path) -> List[Path]:
    import matplotlib  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    pdir = out / "plots"
    pdir.mkdir(exist_ok=True)
    keys = list(results["targets"])
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(keys))
    w = 0.38
    for ax, metric, title in ((axes[0], "kl", "held-out KL(teacher || student), nats/token (log)"),
                              (axes[1], "ppl", "held-out perplexity")):
        ptq = [results["targets"][k]["ptq"][metric] for k in keys]
        qad = [results["targets"][k]["qad"][metric] for k in keys]
        ax.bar([i - w / 2 for i in x], ptq, w, label="PTQ", color="#d08770")
        ax.bar([i + w / 2 for i in x], qad, w, label="QAD", color="#5e81ac")
        if metric == "kl":      # the targets differ by 40x: a log axis keeps the smallest readable
            ax.set_yscale("log")
        if metric == "ppl":
            ax.axhline(results["teacher"]["ppl"], color="k", ls="--", lw=1, label=f"teacher ({_short(results)})")
            lo = min(ptq + qad + [results["teacher"]["ppl"]])
            ax.set_ylim(lo * 0.95, max(ptq + qad) * 1.02)
        ax.set_xticks(list(x))
        ax.set_xticklabels([results["targets"][k]["label"] for k in keys], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = pdir / "ptq_vs_qad.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for k in keys:
        curve = results["targets"][k].get("loss_curve") or []
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], label=results["targets"][k]["label"])
        ptq = results["targets"][k]["ptq"]["kl"]
        ax.axhline(ptq, ls=":", lw=1, color=ax.lines[-1].get_color() if ax.lines else "gray")
    ax.set_xlabel("QAD step")
    ax.set_ylabel("training loss (KL to teacher)")
    ax.set_title("QAD training loss (dotted: held-out PTQ KL)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = pdir / "qad_loss.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    return written


def _short(results: Dict[str, Any]) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get((results.get("compute") or {}).get("dtype"), "bf16")


def _verdict(e: Dict[str, Any]) -> str:
    if e.get("error"):
        return "FAIL (" + e["error"][:120] + ")"
    if e.get("verdict") == "INCOMPLETE":
        return "INCOMPLETE (" + ("; ".join(e.get("install") or []) or "a check was not run") + ")"
    return e.get("verdict") or {True: "PASS", False: "FAIL", None: "not run"}[e.get("ok")]


def report_markdown(results: Dict[str, Any], out: Path, plots: List[Path]) -> str:
    s = results["settings"]
    T = results["teacher"]
    L = []
    L.append("# qatfactory demo report\n")
    L.append(f"Model: `{results['model_dir']}` ({results['params'] / 1e6:.1f}M parameters, {_short(results)} teacher). "
             f"Run time {_fmt_s(results['seconds'])} (estimated {_fmt_s(results['estimate_s'])}).\n")
    d = results["data"]
    L.append(f"Data: English Wikipedia lead sections ({d['source'].get('package')}, {d['source'].get('license')}); "
             f"{d['split_rule']}. Used here: {d['articles']['calib']} calibration, {d['articles']['train']} training "
             f"and {d['articles']['eval']} held-out articles, packed into {s['seq_len']}-token samples; held-out "
             f"evaluation on {T['tokens']:.0f} tokens. Wheel sha256 `{d['source'].get('wheel_sha256')}`.\n")
    lrs = ", ".join(f"{r['label']} {r['lr']:g} ({r['teacher']} teacher)" for r in results["targets"].values())
    L.append(f"QAD: {s['steps']} steps x {s['micro_batch']} x {s['seq_len']} tokens per target, AdamW, constant "
             f"learning rate: {lrs}; forward KL to the {_short(results)} teacher, seed {s['seed']}.\n")
    c = results.get("compute") or {}
    if c:
        L.append(f"Compute: {c.get('dtype')} ({c.get('why')}); "
                 + (f"{c['threads']} intra-op thread(s) at the start ({c.get('threads_why')}; per target: "
                    + ", ".join(f"{k} {r.get('threads')}" for k, r in results["targets"].items()) + ")"
                    if c.get("threads") else "on a GPU")
                 + f"; expected {_fmt_s(results['estimate_s'])}, took {_fmt_s(results['seconds'])}.\n")
    L.append("## Held-out accuracy (KL to the teacher: lower is better)\n")
    L.append("| target | model | KL (nats/token) | perplexity | top-1 agreement | bits/weight (quantized linears) "
             "| bits/param (whole model) |")
    L.append("|---|---|---:|---:|---:|---:|---:|")
    L.append(f"| - | teacher {_short(results)} | {T['kl']:.4f} | {T['ppl']:.3f} | {T['top1']:.3f} | 16 | 16 |")
    for k, r in results["targets"].items():
        b = r["bits"]
        for stage in ("ptq", "qad"):
            m = r[stage]
            L.append(f"| {r['label']} | {stage.upper()} | {m['kl']:.4f} | {m['ppl']:.3f} | {m['top1']:.3f} | "
                     f"{b['bits_quantized']:.3f} | {b['bits_all']:.3f} |")
    L.append("")
    for k, r in results["targets"].items():
        p, q = r["ptq"]["kl"], r["qad"]["kl"]
        rel = 100.0 * (p - q) / p if p > 0 else 0.0
        what = f"QAD recovers {rel:.1f}% of the PTQ KL" if q < p else f"QAD does NOT beat PTQ: KL rises {-rel:.1f}%"
        L.append(f"- **{r['label']}**: {what} ({p:.4f} -> {q:.4f}); formats used: "
                 + ", ".join(f"{f} ({n / 1e6:.2f}M weights)" for f, n in sorted(r["bits"]["params_by_format"].items()))
                 + ".")
    beats = all(r["qad"]["kl"] < r["ptq"]["kl"] for r in results["targets"].values())
    L.append(f"\nQAD beats PTQ on held-out KL for every target: **{'yes' if beats else 'NO'}**.\n")
    for p in plots:
        L.append(f"![{p.stem}]({p.relative_to(out)})\n")
    L.extend(report_lines(results.get("llama_cpp"), out))
    L.append("## Exports and the parity gate\n")
    L.append("The gate reloads each export with third-party code (compressed-tensors, gguf-py/libggml, a "
             "transcription of vLLM's ModelOpt decode) and compares bytes, weights and logits with the trained "
             "student (`exporters/verify.py`).\n")
    L.append("| target | engine / flavour | parity gate | size | path |")
    L.append("|---|---|---|---:|---|")
    for k, r in results["targets"].items():
        for e in r["exports"]:
            size = f"{e['bytes'] / 2**20:.1f} MiB" if "bytes" in e else "-"
            L.append(f"| {r['label']} | {e['engine']} / {e['flavour']} | {_verdict(e)} | {size} | `{e['path']}` |")
    L.append("")
    L.append("## Serve them\n")
    L.append("```sh")
    for k, r in results["targets"].items():
        for e in r["exports"]:
            if e.get("serve"):
                L.append(f"# {r['label']} -> {e['engine']} ({e['flavour']})")
                L.append(e["serve"])
    L.append("```\n")
    L.append("## Reproduce one QAD run\n")
    for k, r in results["targets"].items():
        L.append(f"- {r['label']}: trainer run `{r['trainer']['run_dir']}` ({r['trainer']['time_s']:.0f} s); "
                 f"command:\n\n  ```sh\n  {r['train_command']}\n  ```")
    L.append("")
    L.append("Environment: " + ", ".join(f"{k} {v}" for k, v in results["environment"].items()) + ".\n")
    L.append("Raw numbers: `results.json`. Every number above was computed in this run.\n")
    return "\n".join(L)


def summary_lines(results: Dict[str, Any]) -> List[str]:
    lines = [f"{'target':28s}{'KL ptq':>10s}{'KL qad':>10s}{'ppl ptq':>10s}{'ppl qad':>10s}{'bits':>7s}  exports"]
    T = results["teacher"]
    lines.append(f"{'teacher ' + _short(results):28s}{'':>10s}{'':>10s}{T['ppl']:>10.3f}{'':>10s}{16:>7d}")
    for k, r in results["targets"].items():
        ex = ", ".join(f"{e['engine']}/{e['flavour']} {_verdict(e)}" for e in r["exports"])
        lines.append(f"{r['label']:28s}{r['ptq']['kl']:>10.4f}{r['qad']['kl']:>10.4f}{r['ptq']['ppl']:>10.3f}"
                     f"{r['qad']['ppl']:>10.3f}{r['bits']['bits_quantized']:>7.2f}  {ex}")
    lc = results.get("llama_cpp") or {}
    if lc.get("status") == "ok":
        for x in lc["rows"]:
            lines.append(f"  llama.cpp: {x['family']} {x['label']}: KL {x['kl']:.4f}, ppl {x['ppl']:.3f}, "
                         f"{x['bytes'] / 2**20:.1f} MiB")
    elif lc:
        lines.append(f"  llama.cpp numbers not measured: {lc.get('reason')}")
    return lines
