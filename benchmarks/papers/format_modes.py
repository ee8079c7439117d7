"""Run-set B1 (QATFactory, arXiv 2609.39223; shared/reference/reproductions.md 4.B1): for a W4A4 deployment, does
one train weight-only (W4A16) or with activations quantized too (W4A4)? The paper: NVFP4 trains best
weight-only, MXFP4 best with activations quantized. {NVFP4, MXFP4} x {train W4A16, train W4A4}, QAD, every
arm **evaluated at W4A4** (and at W4A16 for the record), plus PTQ at W4A4 per format.

    python benchmarks/papers/format_modes.py --out benchmarks/results             # GPU preset (SmolLM2-135M)
    python benchmarks/papers/format_modes.py --smoke --out /tmp/papers           # CPU, tiny random model

Evaluating a student at the other precision: its latent weights are put into a plain model, which is then
quantized to the other recipe exactly as the trainer would (prepare, calibrate: max weight scales, static
NVFP4 activation amax over the trainer's first calibration windows); a student evaluated at its own
precision is loaded as saved. Training text: Wikipedia training articles + the five Austen training novels.

Writes ``format_modes.md`` / ``.json`` / ``.png`` into --out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import papers_common as C  # noqa: E402

TAG = "format_modes"
FORMATS = {"nvfp4": ("nvfp4_w4a16", "nvfp4_w4a4"), "mxfp4": ("mxfp4_w4a16", "mxfp4_w4a4")}
ARMS = [{"name": f"{f}_train_{m}", "fmt": f, "train": m, "kind": "train"} for f in FORMATS for m in ("w4a16", "w4a4")]
HELD = ("wiki_ho", "austen_ho")


def preset(smoke: bool) -> Dict[str, Any]:
    if smoke:
        return dict(steps=3, micro=2, seq=32, lr=1e-3, eval_seq=64, eval_windows=2, warmup=0,
                    limits={"wiki_train": 30_000, "austen_train": 20_000, "wiki_ho": 3_000, "austen_ho": 3_000})
    # 80 x 8 x 512 tokens per arm: the 10-minute budget of benchmarks/gpu/papers.sh (the design: 600 x 8 x 1,024)
    return dict(steps=80, micro=8, seq=512, lr=5e-5, eval_seq=1024, eval_windows=12, warmup=5,
                limits={"wiki_train": 800_000, "austen_train": 800_000})


def recipe(fmt: str, mode: str) -> str:
    return FORMATS[fmt][0 if mode == "w4a16" else 1]


def arm_overrides(a, p, data, fmt, mode, seed, run_dir) -> List[str]:
    f = data["files"]
    o = C.model_overrides(a.smoke, a.model_path, a.device) + [
        f"format={recipe(fmt, mode)}", "method=qad", "data=files", f"data.train=[{f['wiki_train']},{f['austen_train']}]",
        f"data.eval=[{f['wiki_ho']}]", f"data.seq_len={p['seq']}", "data.eval_samples=4"]
    return o + C.train_overrides(a.device, run_dir, seed, p["steps"], p["lr"], p["micro"], 1, 0, a.smoke, p["warmup"])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.base_args(ap)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    a = ap.parse_args(argv)
    a.device = C.resolve_device(a)
    p = preset(a.smoke)
    p.update({k: v for k, v in (("steps", a.steps), ("lr", a.lr)) if v})
    work = a.work or a.out / f"work-{TAG}"
    budget = C.Budget(a.budget_s)
    runs = C.runs_dir(work)
    data = C.data_files(work, ("wiki_train", "austen_train") + HELD, p["limits"])
    seeds = list(range(a.seeds))
    fmts = [x for x in a.formats.split(",") if x]
    bad = [x for x in fmts if x not in FORMATS]
    if bad:
        ap.error(f"--formats {bad}: allowed {sorted(FORMATS)}")
    arms = [x for x in ARMS if x["fmt"] in fmts]
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "formats": fmts,
                           "provenance": C.provenance(C.model_record(a.smoke, a.model_path), data, seeds, a.device)}
    prior = C.load_prior(a.prior, res)
    import torch

    from qatfactory.train.config import compose
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    teacher, tok, vocab = C.load_teacher(a.smoke, a.model_path, a.device)
    ev = C.Evaluator(teacher, tok, {k: data["files"][k] for k in HELD}, {"*": p["eval_seq"]}, p["eval_windows"],
                     a.device)
    res["teacher"] = ev.evaluate(teacher)
    res["ptq"] = {}
    for fmt in fmts:
        for mode in ("w4a4", "w4a16"):
            cfg = compose(arm_overrides(a, p, data, fmt, mode, 0, work / "ptq"))
            m = C.deploy(C.load_teacher(a.smoke, a.model_path, a.device)[0], cfg.quant,
                         C.calib_batches(cfg, tok, vocab, a.device), cfg.quant.calib_method)
            res["ptq"][f"{fmt}_{mode}"] = ev.evaluate(m)
            C.free(m)

    def one(arm, seed):
        fmt, mode = arm["fmt"], arm["train"]
        run_dir = runs / f"{arm['name']}-s{seed}"
        C.run_arm(arm_overrides(a, p, data, fmt, mode, seed, run_dir))
        r: Dict[str, Any] = {"step_ms": C.step_ms(run_dir), "eval": {}}
        for ev_mode in ("w4a4", "w4a16"):
            if ev_mode == mode:
                r["eval"][ev_mode] = C.student_eval(run_dir, ev, dtype, a.device)
            else:
                cfg = compose(arm_overrides(a, p, data, fmt, ev_mode, seed, run_dir))
                m = C.deploy(C.plain_from_student(str(run_dir / "student"), dtype, a.device), cfg.quant,
                             C.calib_batches(cfg, tok, vocab, a.device), cfg.quant.calib_method)
                r["eval"][ev_mode] = ev.evaluate(m)
                C.free(m)
        return r

    return C.run_and_report(arms, seeds, budget, one, res, verdicts, report, a.out, TAG, prior)


def _kl(results, arm, ev_mode="w4a4", split="wiki_ho"):
    return C.values(results, arm, lambda r: r["eval"][ev_mode][split]["kl"])


def verdicts(res) -> List[Dict[str, Any]]:
    R, out = res.get("arms", []), []
    if "nvfp4" in res["formats"]:
        out.append(C.verdict("NVFP4 for W4A4 serving: train weight-only (W4A16)", "WIKI-HO KL at W4A4",
                             "nvfp4_train_w4a16", _kl(R, "nvfp4_train_w4a16"), "nvfp4_train_w4a4",
                             _kl(R, "nvfp4_train_w4a4"), +1))
    if "mxfp4" in res["formats"]:
        out.append(C.verdict("MXFP4 for W4A4 serving: train with activations quantized (W4A4)", "WIKI-HO KL at W4A4",
                             "mxfp4_train_w4a4", _kl(R, "mxfp4_train_w4a4"), "mxfp4_train_w4a16",
                             _kl(R, "mxfp4_train_w4a16"), +1))
    for fmt in res["formats"]:
        best = f"{fmt}_train_w4a4"
        out.append(C.verdict(f"{fmt.upper()}: QAD (W4A4-trained) beats PTQ at W4A4", "WIKI-HO KL at W4A4", best,
                             _kl(R, best), "ptq", [res["ptq"][f"{fmt}_w4a4"]["wiki_ho"]["kl"]], +1))
    return out


def report(out: Path, res: Dict[str, Any]) -> None:
    R = res.get("arms", [])
    rows = []
    for fmt in res["formats"]:
        for mode in ("w4a4", "w4a16"):
            pt = res["ptq"][f"{fmt}_{mode}"]
            rows.append([f"{fmt} PTQ", "-", mode.upper(), pt["wiki_ho"]["kl"], pt["wiki_ho"]["top1"],
                         pt["wiki_ho"]["ppl"], pt["austen_ho"]["kl"]])
        for mode in ("w4a16", "w4a4"):
            n = f"{fmt}_train_{mode}"
            for ev_mode in ("w4a4", "w4a16"):
                v = _kl(R, n, ev_mode)
                if not v:
                    rows.append([n, mode.upper(), ev_mode.upper(), "not run", "-", "-", "-"])
                    continue

                def m(split, key):
                    x = C.values(R, n, lambda r: r["eval"][ev_mode][split][key])
                    return f"{C.mean_or_nan(x):.4g} ({'/'.join(f'{y:.4g}' for y in x)})"
                rows.append([n, mode.upper(), ev_mode.upper(), m("wiki_ho", "kl"), m("wiki_ho", "top1"),
                             m("wiki_ho", "ppl"), m("austen_ho", "kl")])
    p = res["preset"]
    t = res["teacher"]["wiki_ho"]
    lines = C.header("Train W4A16 or W4A4 for a W4A4 deployment, NVFP4 and MXFP4 (QATFactory)", res)
    lines += [f"QAD, {p['steps']} steps x {p['micro']} x {p['seq']} tokens, LR {p['lr']:g} cosine. Teacher WIKI-HO PPL "
              f"{t['ppl']:.4g}. KL(teacher || student), nats/token, {p['eval_windows']} windows of {p['eval_seq']} "
              f"tokens per set; mean over seeds (per seed). **The W4A4 rows are the deployment.**", "",
              C.md_table(["arm", "trained", "evaluated", "WIKI KL", "WIKI top-1", "WIKI PPL", "AUS KL"], rows),
              "", "## Verdicts", ""] + C.verdict_lines(res.get("verdicts", []))
    lines += C.status_lines(R)
    C.write_text(out / f"{TAG}.md", "\n".join(lines) + "\n")
    C.write_json(out / f"{TAG}.json", res)

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        labels, pos, xs = [], [], 0.0
        for i, fmt in enumerate(res["formats"]):
            for j, mode in enumerate(("w4a16", "w4a4")):
                n = f"{fmt}_train_{mode}"
                v = _kl(R, n)
                ax.bar(xs, C.mean_or_nan(v), color=f"C{j}", label=f"trained {mode.upper()}" if i == 0 else None)
                ax.plot([xs] * len(v), v, "k.", ms=4)
                labels.append(f"{fmt}\ntrain {mode}")
                pos.append(xs)
                xs += 1
            ax.bar(xs, res["ptq"][f"{fmt}_w4a4"]["wiki_ho"]["kl"], color="gray", label="PTQ" if i == 0 else None)
            labels.append(f"{fmt}\nPTQ")
            pos.append(xs)
            xs += 1.5
        ax.set_xticks(pos, labels, fontsize=7)
        ax.set_ylabel("WIKI-HO KL at W4A4 (nats/token)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title("every arm evaluated at W4A4; dots = seeds" +
                     (" (SMOKE, measures nothing)" if res["smoke"] else ""), fontsize=9)
    C.plot(out / f"{TAG}.png", draw)


if __name__ == "__main__":
    sys.exit(main())
