"""ParetoQ run-set C2: the full-precision / QAT budget split from scratch, on a tiny byte-level Llama.

For a fixed budget B, a fraction f of it is QAT: the first (1 - f) B steps train in full precision
(``train.quant_start = 1 - f``), then the scales are initialised from the trained weights, quantization
switches on and a fresh cosine starts at the fine-tune LR. f = 0 is PTQ of the full-precision model (a fair
PTQ: MSE-searched scales); f = 1 is QAT from scratch on the full-precision schedule. ParetoQ: the optimum is
near f = 10 %; Apple's 2509.22935: ~10-15 % at this compute.

    python benchmarks/papers/paretoq_split.py --out benchmarks/results/paretoq_split_h100_20261207      # GPU
    python benchmarks/papers/paretoq_split.py --smoke --out /tmp/pq-split                # CPU, measures nothing

Design (paretoq.md C2): byte vocabulary (256 + BOS/EOS/PAD), 6 layers, d 384, 6 heads, FFN 1,024 (10.6M
non-embedding parameters), context 512; Wikipedia training split as UTF-8 bytes; B = 1,200 steps x 64 x 512
tokens; peak LR 2e-3 cosine (FP phase), 2e-4 fresh cosine (QAT phase); f in {0, .05, .1, .2, .4, 1} x
{4-bit LSQ, 2-bit SEQ} x 2 seeds; metric: held-out bits per token (= per byte, up to the EOS between
articles) of the quantized model, and of the FP model at the switch. Every arm is one trainer run.
Writes ``paretoq_split.json``, ``.md`` and ``.png``.

One GPU job per bit width and seed (benchmarks/gpu/methods.sh jobs paretoq_split4s0, _split2s0,
_split4s1, _split2s1): ``--bits 4 --seed-list 0 --rows-only --out D`` writes D/paretoq_split.json only; then,
anywhere, ``--merge D1 D2 ... --out benchmarks/results/paretoq_split_h100_20261207`` builds the table from every arm present.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paretoq_common as C  # noqa: E402

BITS = {"4": ("paretoq_4bit", "int4_lsq"), "2": ("paretoq_2bit", "int2_seq")}
LN2 = math.log(2.0)


def setting(args) -> Dict[str, Any]:
    if args.smoke:
        return dict(budget=args.budget or 8, micro=2, seq=64, eval_samples=4, lr=3e-3, qlr=1e-3, fractions=[0.0, 0.5, 1.0],
                    seeds=args.seeds or 1, dims=dict(hidden=64, inter=128, layers=2, heads=4),
                    train_bytes=40_000, eval_bytes=6_000, device="cpu")
    # the whole packaged Wikipedia split is 4.7 MB of bytes, so B = 1,200 x 64 x 512 = 39M tokens is ~8 epochs
    # (the design counted ~3 over a 13 MB corpus with Austen/Shakespeare, not packaged here); --budget lowers it
    return dict(budget=args.budget or 1200, micro=64, seq=512, eval_samples=96, lr=2e-3, qlr=2e-4,
                fractions=[0.0, 0.05, 0.1, 0.2, 0.4, 1.0], seeds=args.seeds or 2,
                dims=dict(hidden=384, inter=1024, layers=6, heads=6), train_bytes=None, eval_bytes=None,
                device=args.device)


def arm(s, data, bits: str, f: float, seed: int, work: Path, smoke: bool) -> Dict[str, Any]:
    recipe, fmt = BITS[bits]
    d = s["dims"]
    run_dir = work / f"{bits}bit-f{f:g}-s{seed}"
    o = ["model=tiny_llama", "model.dtype=float32", f"model.init_seed={seed}", f"model.tiny.hidden_size={d['hidden']}",
         f"model.tiny.intermediate_size={d['inter']}", f"model.tiny.num_hidden_layers={d['layers']}",
         f"model.tiny.num_attention_heads={d['heads']}", f"model.tiny.num_key_value_heads={d['heads']}",
         f"model.tiny.max_position_embeddings={max(512, s['seq'])}",
         f"format={recipe}", "method=qat", "method.eval_teacher=false",
         "data=files", f"data.train=[{data['train']}]", f"data.eval=[{data['eval']}]", f"data.seq_len={s['seq']}",
         f"data.eval_samples={s['eval_samples']}", "train.eval_samples=0",
         f"train.max_steps={s['budget']}", f"train.lr={s['lr']:g}", f"train.micro_batch={s['micro']}",
         "export=none"] + C.common_train(s["device"], run_dir, seed, smoke) + ["train.save_student=false"]
    o += C.layout_rules(fmt, C.llama_in_features(d["hidden"], d["inter"]))
    if f <= 0.0:       # PTQ of the full-precision result, with MSE-searched scales
        o += ["train.quant_start=1.0", "quant.calib_method=mse"]
    elif f < 1.0:      # ParetoQ: FP, then QAT from it with a fresh, lower cosine
        o += [f"train.quant_start={1.0 - f:g}", f"train.quant_lr={s['qlr']:g}"]
    t0 = time.time()
    sm = C.run_arm(o)
    q, fp = C.eval_at(sm, quant_on=True), C.eval_at(sm, quant_on=False)
    s0 = round((1.0 - f) * s["budget"]) if f < 1.0 else 0
    return {"bits": bits, "format": fmt, "f": f, "seed": seed, "fp_steps": s0, "qat_steps": s["budget"] - s0,
            "bpt_quantized": q.get("eval/ce", float("nan")) / LN2,
            "bpt_fp": fp.get("eval/ce", float("nan")) / LN2 if fp and fp.get("step", 0) > 0 else float("nan"),
            "tokens": sm.get("tokens"), "seconds": time.time() - t0, "step_ms": C.step_ms(run_dir)}


def merge(paths: List[Path]) -> Dict[str, Any]:
    """One result from several calls' paretoq_split.json: every arm (bits, f, seed; a later file's
    replaces an earlier one)."""
    out: Dict[str, Any] = {"merged_from": []}
    arms: Dict[tuple, Dict[str, Any]] = {}
    for p in paths:
        f = p / "paretoq_split.json" if p.is_dir() else p
        r = json.loads(f.read_text())
        out["merged_from"].append({"file": str(f), "env": r.get("env"),
                                   "arms": sorted({(a["bits"], f"s{a['seed']}") for a in r["arms"]})})
        for k in ("smoke", "env", "setting", "data"):
            out.setdefault(k, r.get(k))
        for a in r["arms"]:
            arms[(a["bits"], a["f"], a["seed"])] = a
    out["arms"] = sorted(arms.values(), key=lambda a: (a["seed"], -int(a["bits"]), a["f"]))
    return out


def _best(f, m: Dict[float, float], res: Dict[str, Any], thin: Sequence[float] = ()) -> str:
    """The best fraction, qualified when not every fraction of the design has a mean yet (a minimum over a
    subset is not the optimum the design asks for) and when some means stand on fewer seeds than the design's."""
    n = len(res["setting"]["fractions"])
    if f is None:
        return "-"
    why = [] if len(m) == n else [f"of the {len(m)} of {n} fractions run"]
    if thin:
        why.append("f=" + ", ".join(f"{x:g}" for x in thin) + " from fewer seeds")
    return f"{f:g}" + (f" ({'; '.join(why)})" if why else "")


def _cell(v: float, seeds: List[int], n_seeds: int) -> Any:
    """A mean as a number, or with the seeds it stands on when the design has more."""
    if len(seeds) >= n_seeds:
        return v
    return f"{v:.4g} (seed {', '.join(map(str, seeds))} only)"


def report(out: Path, res: Dict[str, Any]) -> None:
    rows = [[r["bits"], r["f"], r["seed"], r["fp_steps"], r["qat_steps"], r["bpt_fp"], r["bpt_quantized"]]
            for r in res["arms"]]
    best, mean, seeds_of = {}, {}, {}
    n_seeds = int(res["setting"].get("seeds") or 1)
    for bits in sorted({r["bits"] for r in res["arms"]}, reverse=True):
        m, sd = {}, {}
        for f in res["setting"]["fractions"]:
            got = [r for r in res["arms"] if r["bits"] == bits and r["f"] == f]
            if got:
                m[f] = statistics.fmean(r["bpt_quantized"] for r in got)
                sd[f] = sorted(r["seed"] for r in got)
        mean[bits], seeds_of[bits] = m, sd
        best[bits] = min(m, key=m.get) if m else None
    res["mean_bpt"] = {b: {str(k): v for k, v in m.items()} for b, m in mean.items()}
    res["best_fraction"] = best
    text = [f"# Full-precision / QAT split from scratch ({'SMOKE: a few steps; measures nothing' if res['smoke'] else 'tiny byte-level Llama'})",
            "", f"{res['env']['date']}, {res['env']['device']}; budget {res['setting']['budget']} steps x "
            f"{res['setting']['micro']} x {res['setting']['seq']} tokens; held-out {res['data']['split']}. "
            f"bits per token = held-out CE / ln 2 (byte tokens: bits per byte up to the EOS between articles).", "",
            C.md_table(["bits", "QAT fraction f", "seed", "FP steps", "QAT steps", "FP model bpt", "quantized bpt"], rows),
            "", "Mean quantized bits per token over seeds:", "",
            C.md_table(["bits"] + [f"f={f:g}" for f in res["setting"]["fractions"]] + ["best f"],
                       [[b] + [_cell(mean[b][f], seeds_of[b][f], n_seeds) if f in mean[b] else float("nan")
                               for f in res["setting"]["fractions"]]
                        + [_best(best[b], mean[b], res, [f for f in mean[b] if len(seeds_of[b][f]) < n_seeds])]
                        for b in mean]),
            "", "ParetoQ reports the optimum near f = 0.1 (MobileLLM); this table is the measurement, not that claim."]
    have = {(r["bits"], r["f"], r["seed"]) for r in res["arms"]}
    gone = []
    for sd in range(int(res["setting"].get("seeds") or 1)):
        for b in BITS:
            miss = [f for f in res["setting"]["fractions"] if (b, f, sd) not in have]
            if miss:
                which = "every fraction" if len(miss) == len(res["setting"]["fractions"]) else \
                    "f = " + ", ".join(f"{f:g}" for f in miss)
                gone.append(f"{b}-bit seed {sd} ({which})")
    if gone and not res.get("smoke"):
        text += ["", "**Not run yet (or not complete)**: " + ", ".join(gone) + "."]
    text += C.merged_note(res)
    C.write_text(out / "paretoq_split.md", "\n".join(text) + "\n")

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        fr = res["setting"]["fractions"]
        for bits, m in mean.items():
            ax.plot([fr.index(f) for f in m], list(m.values()), "o-", label=f"{bits}-bit, quantized (mean of seeds)")
            fp = [(fr.index(r["f"]), r["bpt_fp"]) for r in res["arms"] if r["bits"] == bits and r["bpt_fp"] == r["bpt_fp"]]
            if fp:
                ax.scatter(*zip(*fp), marker="x", color="gray", label=f"FP model at the switch ({bits}-bit arms)")
        ax.set_xticks(range(len(fr)), [f"{f:g}" for f in fr])
        ax.set_xlabel("QAT fraction f of the budget")
        ax.set_ylabel("held-out bits per token")
        ax.legend(fontsize=7)
        ax.set_title("ParetoQ 90/10 split" + (" (SMOKE, measures nothing)" if res["smoke"] else ""), fontsize=10)
    C.plot(out / "paretoq_split.png", draw)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--bits", default="4,2")
    ap.add_argument("--budget", type=int, default=None, help="steps per arm (default 1,200; smoke 8)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prepare-only", action="store_true", help="write the data files into --work, then stop")
    ap.add_argument("--seed-list", default=None, help="comma-separated seeds to run (default: 0 .. seeds - 1)")
    ap.add_argument("--fractions", default=None, help="comma-separated QAT fractions to run (default: the design's "
                    "0, 0.05, 0.1, 0.2, 0.4, 1; a subset lets one width and seed take two GPU jobs)")
    ap.add_argument("--rows-only", action="store_true", help="write the JSON only; --merge builds the table")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="DIR",
                    help="no runs: the table from these directories' (or files') paretoq_split.json")
    args = ap.parse_args(argv)
    if args.merge:
        res = merge(args.merge)
        report(args.out, res)
        C.write_json(args.out / "paretoq_split.json", res)
        print((args.out / "paretoq_split.md").read_text())
        return 0
    s = setting(args)
    run_fracs = [float(x) for x in args.fractions.split(",")] if args.fractions else s["fractions"]
    bad = [f for f in run_fracs if not 0.0 <= f <= 1.0]
    if bad:
        raise SystemExit(f"--fractions: {bad} are not QAT fractions in [0, 1]")
    work = args.work or args.out / "work"
    data = C.wiki_files(work, s["train_bytes"], s["eval_bytes"])   # cached in --work: carry it to a GPU box
    if args.prepare_only:
        print(data)
        return 0
    res: Dict[str, Any] = {"smoke": args.smoke, "env": C.environment(), "setting": s, "data": data, "arms": []}
    seeds = [int(x) for x in args.seed_list.split(",")] if args.seed_list else list(range(s["seeds"]))
    for seed in seeds:
        for bits in args.bits.split(","):
            for f in run_fracs:
                C.say(f"{bits}-bit f={f:g} seed {seed}")
                res["arms"].append(arm(s, data, bits, f, seed, work, args.smoke))
                C.write_json(args.out / "paretoq_split.json", res)
    if args.rows_only:
        C.write_json(args.out / "paretoq_split.json", res)
        C.say(f"rows written: {args.out / 'paretoq_split.json'}")
        return 0
    report(args.out, res)
    C.write_json(args.out / "paretoq_split.json", res)
    print((args.out / "paretoq_split.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
