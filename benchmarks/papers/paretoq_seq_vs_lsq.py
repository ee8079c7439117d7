"""ParetoQ run-set C1, 2-bit arm pair: SEQ {+-1/4, +-3/4} (ParetoQ's choice at 2 bits, max|W| init) against
LSQ {-2, -1, 0, 1} (the integer grid; its init is an MSE search per row, since the max/Qp rule with Qp = 1
would leave the -2 level unused), same steps, LR and data, two seeds.

    python benchmarks/papers/paretoq_seq_vs_lsq.py --out benchmarks/results/paretoq_seq_vs_lsq_h100_20261206   # GPU: SmolLM2
    python benchmarks/papers/paretoq_seq_vs_lsq.py --smoke --out /tmp/pq-seq                    # CPU, measures nothing

ParetoQ's claim: SEQ beats LSQ at 2 bits; at this budget the difference may be a few % of PPL, hence the seeds.
Writes ``paretoq_seq_vs_lsq.json``, ``.md`` and ``.png``.

One GPU job per arm and seed (benchmarks/gpu/methods.sh jobs paretoq_seqlsq_seq0, _lsq0, _seq1, _lsq1):
``--arms seq --seed-list 0 --rows-only --out D`` writes D/paretoq_seq_vs_lsq.json only; then, anywhere,
``--merge D1 D2 ... --out benchmarks/results/paretoq_seq_vs_lsq_h100_20261206`` builds the table from every arm present.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paretoq_bits as B  # noqa: E402
import paretoq_common as C  # noqa: E402

ARMS = [("2-bit SEQ", "paretoq_2bit", "int2_seq", "max"), ("2-bit LSQ", "paretoq_2bit", "int2_lsq", "mse")]
ARM_KEYS = {"seq": "2-bit SEQ", "lsq": "2-bit LSQ"}


def merge(paths: List[Path]) -> Dict[str, Any]:
    """One result from several calls' paretoq_seq_vs_lsq.json: every arm (label, seed; a later file's
    replaces an earlier one)."""
    out: Dict[str, Any] = {"merged_from": []}
    arms: Dict[tuple, Dict[str, Any]] = {}
    for p in paths:
        f = p / "paretoq_seq_vs_lsq.json" if p.is_dir() else p
        if p.is_dir() and not f.exists() and (p / "paretoq_bits.json").exists():
            f = p / "paretoq_bits.json"
        r = json.loads(f.read_text())
        if f.name == "paretoq_bits.json":
            r = _from_bit_sweep(r)
        out["merged_from"].append({"file": str(f), "env": r.get("env"),
                                   "arms": [(a["label"], a["seed"]) for a in r["arms"]]})
        for k in ("smoke", "env", "setting", "data", "lr"):
            out.setdefault(k, r.get(k))
        for a in r["arms"]:
            arms[(a["label"], a["seed"])] = a
    lrs = sorted({a["lr"] for a in arms.values()})
    if len(lrs) > 1:
        raise SystemExit(f"--merge: the arms ran at different learning rates {lrs}; a comparison needs one")
    if arms:
        out["lr"] = lrs[0]
    labels = [a[0] for a in ARMS]
    out["arms"] = sorted(arms.values(), key=lambda a: (a["seed"], labels.index(a["label"])))
    return out


def _from_bit_sweep(r: Dict[str, Any]) -> Dict[str, Any]:
    """The 2-bit SEQ arms of a paretoq_bits.json (CE) as this script's rows. paretoq_bits trains that arm with the
    same overrides as ours (recipe paretoq_2bit, int2_seq, max|W| init, CE, 1,500 steps, seed 0) and only adds an
    export after training, so its row is a run of our SEQ arm: one device job fewer. Each row says where it came
    from (``source``)."""
    rows = []
    for a in r["arms"]:
        if a["bits"] == "2" and a["format"] == "int2_seq" and a["loss"] == "ce":
            rows.append({**a, "label": "2-bit SEQ", "source": "paretoq_bits.json"})
    return {"smoke": r.get("smoke"), "env": r.get("env"), "setting": r.get("setting"), "data": r.get("data"),
            "lr": rows[0]["lr"] if rows else None, "arms": rows}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lr", type=float, default=None, help="default: the first 2-bit candidate of paretoq_bits (2e-5)")
    ap.add_argument("--loss", choices=["ce", "kl"], default="ce")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-path", default=None, help="a local HF model directory (default: packaged SmolLM2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per arm (a probe; default: the design's 1,500)")
    ap.add_argument("--seed-list", default=None, help="comma-separated seeds to run (default: 0 .. --seeds - 1)")
    ap.add_argument("--arms", default="seq,lsq", help="which arms: seq, lsq or both (default)")
    ap.add_argument("--rows-only", action="store_true", help="write the JSON only; --merge builds the table")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="DIR",
                    help="no runs: the table from these directories' (or files') paretoq_seq_vs_lsq.json")
    args = ap.parse_args(argv)
    if args.merge:
        res = merge(args.merge)
        report(args.out, res)
        C.write_json(args.out / "paretoq_seq_vs_lsq.json", res)
        print((args.out / "paretoq_seq_vs_lsq.md").read_text())
        return 0
    want = [ARM_KEYS[a.strip()] for a in args.arms.split(",") if a.strip()]
    seeds = [int(x) for x in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
    s = B.setup(args)
    if args.steps:
        s["steps_lo"] = args.steps
    work = args.work or args.out / "work"
    data = C.wiki_files(work, s["train_bytes"], s["eval_bytes"])
    lr = args.lr or s["lr_lo"][0]
    res: Dict[str, Any] = {"smoke": args.smoke, "env": C.environment(), "setting": s, "data": data, "lr": lr, "arms": []}
    for seed in seeds:
        for label, recipe, fmt, calib in ARMS:
            if label not in want:
                continue
            C.say(f"{label} seed {seed}")
            # the format recipe sets the learnable strategy; the weight format and the init are the arm's.
            # Export off: this script compares training; paretoq_bits.py exports every grid
            _arm(s, data, args.smoke, work, recipe, fmt, args.loss, s["steps_lo"], lr, seed, calib, label,
                 save=lambda row: C.save_row(args.out / "paretoq_seq_vs_lsq.json", res, row))
    C.write_json(args.out / "paretoq_seq_vs_lsq.json", res)
    if args.rows_only:
        C.say(f"rows written: {args.out / 'paretoq_seq_vs_lsq.json'}")
        return 0
    report(args.out, res)
    C.write_json(args.out / "paretoq_seq_vs_lsq.json", res)
    print((args.out / "paretoq_seq_vs_lsq.md").read_text())
    return 0


def _arm(s, data, smoke, work, recipe, fmt, loss, steps, lr, seed, calib, label, save=None) -> Dict[str, Any]:
    """One arm's row, saved (save) as soon as the training has ended and again with the diagnostics."""
    run_dir = work / f"{loss}-{fmt}-s{seed}"
    over = B.arm_overrides(s, data, smoke, recipe, fmt, loss, steps, lr, run_dir, seed, calib, export=False)
    over += [f"quant.weight_format={fmt}", f"model.init_seed={seed}"] if smoke else [f"quant.weight_format={fmt}"]
    sm = C.run_arm(over)
    first, last = C.eval_at(sm, last=False), C.eval_at(sm)
    row = {"format": fmt, "calib": calib, "seed": seed, "steps": steps, "lr": lr, "step_ms": C.step_ms(run_dir),
           "ptq": {k: first.get(k) for k in ("eval/ppl", "eval/kl")}, "qat": {k: last.get(k) for k in ("eval/ppl", "eval/kl")},
           "curve": [(h["step"], h.get("eval/ppl")) for h in sm["eval_history"]], "label": label}
    return C.with_diagnostics(row, over, sm["student_dir"], save)


def report(out: Path, res: Dict[str, Any]) -> None:
    rows = [[r["label"], r["format"], r["calib"], r["seed"], r["ptq"]["eval/ppl"], r["qat"]["eval/ppl"],
             r["qat"]["eval/kl"], r["rel_weight_change"], r["bin_change_fraction"],
             "bit sweep" if r.get("source") else "this script"] for r in res["arms"]]
    mean = {}
    nan = float("nan")
    for label, *_ in ARMS:
        rr = [r for r in res["arms"] if r["label"] == label]
        mean[label] = {k: statistics.fmean(r["qat"][k] for r in rr) if rr else nan for k in ("eval/ppl", "eval/kl")}
    a, b = mean["2-bit SEQ"], mean["2-bit LSQ"]
    gap = 100.0 * (b["eval/ppl"] / a["eval/ppl"] - 1.0)
    have = {(r["label"], r["seed"]) for r in res["arms"]}
    seeds = sorted({r["seed"] for r in res["arms"]} | set(range(2)))
    gone = [f"{label} seed {sd}" for sd in seeds for label, *_ in ARMS if (label, sd) not in have]
    text = [f"# 2-bit SEQ vs 2-bit LSQ ({'SMOKE: tiny random model, a few steps; measures nothing' if res['smoke'] else 'SmolLM2-135M-Instruct'})",
            "", f"{res['env']['date']}, {res['env']['device']}; LR {res['lr']:g}, {res['arms'][0]['steps']} steps; held-out "
            f"{res['data']['split']}.", "",
            C.md_table(["arm", "format", "init", "seed", "PTQ PPL", "QAT PPL", "QAT KL", "rel dW", "bins changed", "run by"],
                       rows),
            "", f"Mean QAT PPL: SEQ {a['eval/ppl']:.4g}, LSQ {b['eval/ppl']:.4g} (LSQ {gap:+.2f}% vs SEQ); "
            f"KL SEQ {a['eval/kl']:.4g}, LSQ {b['eval/kl']:.4g}."]
    if gone and not res.get("smoke"):
        text += ["", "**Not run yet**: " + ", ".join(gone) + " (the design: both arms x 2 seeds)."]
    text += C.cut_note(res["arms"])
    text += C.merged_note(res)
    res["mean"] = mean
    res["lsq_vs_seq_ppl_percent"] = gap
    C.write_text(out / "paretoq_seq_vs_lsq.md", "\n".join(text) + "\n")

    def draw(fig):
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for i, (label, *_) in enumerate(ARMS):
            rr = [r for r in res["arms"] if r["label"] == label]
            if not rr:
                continue
            ax1.scatter([i] * len(rr), [r["qat"]["eval/ppl"] for r in rr], label=label)
            ax2.bar([i], [statistics.fmean(r["bin_change_fraction"] for r in rr)], 0.5, label=label)
        ax1.set_xticks(range(len(ARMS)), [a[0] for a in ARMS])
        ax1.set_ylabel("held-out PPL after QAT (per seed)")
        ax2.set_xticks(range(len(ARMS)), [a[0] for a in ARMS])
        ax2.set_ylabel("fraction of weights out of their PTQ bin")
        fig.suptitle("2-bit SEQ vs LSQ" + (" (SMOKE, measures nothing)" if res["smoke"] else ""), fontsize=10)
    C.plot(out / "paretoq_seq_vs_lsq.png", draw)


if __name__ == "__main__":
    sys.exit(main())
