"""Run-set A (QAD report, arXiv 2601.20088; shared/reference/reproductions.md 4.A): PTQ vs QAT (CE loss) vs QAD
(forward KL) on real text and on random tokens, NVFP4 W4A4, with held-out CE *and* KL curves for every arm.

    python benchmarks/papers/qad_vs_qat.py --out benchmarks/results               # GPU preset (SmolLM2-135M)
    python benchmarks/papers/qad_vs_qat.py --smoke --out /tmp/papers             # CPU, tiny random model, seconds

Arms (every trained arm at each seed; seeds change the data order and, for random tokens, the tokens):
``ptq`` (calibrated once, no training), ``qat_real`` (CE on the train split), ``qad_real`` (KL to the teacher on
the train split), ``qad_random`` (KL on uniformly random token ids: fresh ids every step), ``qat_random`` (the
control: CE on random ids). Same steps, tokens, LR and schedule for every trained arm. Training text: the
Wikipedia training articles + the five Austen training novels (reproductions.md 3.2, Shakespeare left out).
Held out: WIKI-HO, AUS-HO (Persuasion) and GSM-TEXT windows, the same for every arm; the curves are the
trainer's own held-out evaluations (WIKI-HO) every ``eval_every`` steps. Every W4A4 run calibrates its static NVFP4
activation scales on its own first training windows, so the random-token arms calibrate on random tokens (what
a run without real data would do); PTQ is calibrated on real text.

Paper claims tested (verdict rule in papers_common): QAT's KL to the teacher is above QAD's; QAT's CE is at or
below QAD's; QAD beats PTQ; QAT on random tokens ends further from the teacher than QAD on random tokens.
QAD-random vs PTQ is reported (the paper: "about PTQ level, without collapse"), not voted on.

Writes ``qad_vs_qat.md`` / ``.json`` / ``.png`` into --out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import papers_common as C  # noqa: E402

TAG = "qad_vs_qat"
ARMS = [
    {"name": "qat_real", "method": "qat", "data": "real", "kind": "train"},
    {"name": "qad_real", "method": "qad", "data": "real", "kind": "train"},
    {"name": "qad_random", "method": "qad", "data": "random", "kind": "train"},
    {"name": "qat_random", "method": "qat", "data": "random", "kind": "train"},
]
FORMAT = "nvfp4_w4a4"
HELD = ("wiki_ho", "austen_ho", "gsm_text")


def preset(smoke: bool) -> Dict[str, Any]:
    if smoke:
        return dict(steps=3, micro=2, seq=32, lr=1e-3, eval_every=2, trainer_eval=2, eval_seq=64, eval_windows=2,
                    limits={"wiki_train": 30_000, "austen_train": 20_000, "wiki_ho": 3_000, "austen_ho": 3_000,
                            "gsm_text": 3_000}, warmup=0)
    # 0.33M tokens per arm (80 x 8 x 512): sized so that the four scripts, run at once on one H200 by
    # benchmarks/gpu/papers.sh, fit in a 10-minute GPU job (--steps raises it when there is time)
    return dict(steps=80, micro=8, seq=512, lr=5e-5, eval_every=20, trainer_eval=8, eval_seq=1024, eval_windows=12,
                limits={"wiki_train": 800_000, "austen_train": 800_000}, warmup=5)


def arm_overrides(a, p, data, arm, seed, run_dir) -> List[str]:
    f = data["files"]
    o = C.model_overrides(a.smoke, a.model_path, a.device) + [f"format={FORMAT}", f"method={arm['method']}",
                                                             "method.eval_teacher=true"]
    if arm["data"] == "real":
        o += ["data=files", f"data.train=[{f['wiki_train']},{f['austen_train']}]"]
    else:
        o += ["data=synthetic", f"data.synthetic={p['steps'] * p['micro']}", "data.synthetic_kind=uniform"]
    o += [f"data.eval=[{f['wiki_ho']}]", f"data.seq_len={p['seq']}", f"data.eval_samples={p['trainer_eval']}"]
    o += C.train_overrides(a.device, run_dir, seed, p["steps"], p["lr"], p["micro"], 1, p["eval_every"], a.smoke,
                           p["warmup"])
    return o


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.base_args(ap)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--arms", default=",".join(x["name"] for x in ARMS), help="a subset of the trained arms")
    a = ap.parse_args(argv)
    arms = [x for x in ARMS if x["name"] in a.arms.split(",")]
    bad = sorted(set(a.arms.split(",")) - {x["name"] for x in ARMS})
    if bad or not arms:
        ap.error(f"--arms {bad or a.arms!r}: allowed {[x['name'] for x in ARMS]}")
    a.device = C.resolve_device(a)
    p = preset(a.smoke)
    if a.steps:
        p["steps"] = a.steps
    if a.lr:
        p["lr"] = a.lr
    work = a.work or a.out / f"work-{TAG}"
    budget = C.Budget(a.budget_s)
    runs = C.runs_dir(work)
    data = C.data_files(work, ("wiki_train", "austen_train") + HELD, p["limits"])
    seeds = list(range(a.seeds))
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "format": FORMAT,
                           "provenance": C.provenance(C.model_record(a.smoke, a.model_path), data, seeds, a.device)}
    prior = C.load_prior(a.prior, res)
    import torch
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    teacher, tok, vocab = C.load_teacher(a.smoke, a.model_path, a.device)
    ev = C.Evaluator(teacher, tok, {k: data["files"][k] for k in HELD}, {"*": p["eval_seq"]}, p["eval_windows"],
                     a.device)
    res["teacher"] = ev.evaluate(teacher)
    # PTQ: what the trainer's first evaluation of a W4A4 run sees (calibrated on the first training windows)
    from qatfactory.train.config import compose
    cfg0 = compose(arm_overrides(a, p, data, ARMS[1], 0, work / "ptq"))
    ptq = C.deploy(C.load_teacher(a.smoke, a.model_path, a.device)[0], cfg0.quant,
                   C.calib_batches(cfg0, tok, vocab, a.device), cfg0.quant.calib_method)
    res["ptq"] = ev.evaluate(ptq)
    C.free(ptq)

    def one(arm, seed):
        run_dir = runs / f"{arm['name']}-s{seed}"
        s = C.run_arm(arm_overrides(a, p, data, arm, seed, run_dir))
        r = {"curves": C.curves(s), "train_loss": C.train_losses(run_dir), "step_ms": C.step_ms(run_dir),
             "tokens": s.get("tokens")}
        r["eval"] = C.student_eval(run_dir, ev, dtype, a.device)
        return r

    return C.run_and_report(arms, seeds, budget, one, res, verdicts, report, a.out, TAG, prior)


def _v(results, arm, split, key):
    return C.values(results, arm, lambda r: r["eval"][split][key])


def verdicts(res) -> List[Dict[str, Any]]:
    R = res.get("arms", [])
    ptq_kl = [res["ptq"]["wiki_ho"]["kl"]]
    return [
        C.verdict("QAT drifts from the teacher, QAD stays close", "WIKI-HO KL", "qad_real", _v(R, "qad_real", "wiki_ho", "kl"),
                  "qat_real", _v(R, "qat_real", "wiki_ho", "kl"), +1),
        C.verdict("QAT matches the teacher's CE at least as well as QAD", "WIKI-HO CE", "qat_real",
                  _v(R, "qat_real", "wiki_ho", "ce"), "qad_real", _v(R, "qad_real", "wiki_ho", "ce"), +1),
        C.verdict("QAD beats PTQ", "WIKI-HO KL", "qad_real", _v(R, "qad_real", "wiki_ho", "kl"), "ptq", ptq_kl, +1),
        C.verdict("out of domain, QAD stays closer than QAT", "GSM-TEXT KL", "qad_real",
                  _v(R, "qad_real", "gsm_text", "kl"), "qat_real", _v(R, "qat_real", "gsm_text", "kl"), +1,
                  source="reproductions.md expectation"),
        C.verdict("random tokens: the CE loss collapses, the KL loss does not", "WIKI-HO KL", "qad_random",
                  _v(R, "qad_random", "wiki_ho", "kl"), "qat_random", _v(R, "qat_random", "wiki_ho", "kl"), +1),
    ]


def report(out: Path, res: Dict[str, Any]) -> None:
    R = res.get("arms", [])
    rows = []
    t = res["teacher"]
    rows.append(["teacher", "-", t["wiki_ho"]["ce"], 0.0, 1.0, 0.0, 0.0, "-"])
    pt = res["ptq"]
    rows.append(["ptq", "-", pt["wiki_ho"]["ce"], pt["wiki_ho"]["kl"], pt["wiki_ho"]["top1"], pt["austen_ho"]["kl"],
                 pt["gsm_text"]["kl"], "-"])
    for arm in ARMS:
        n = arm["name"]
        done = [r for r in R if r.get("arm") == n and r.get("status") == "done"]
        if not done:
            rows.append([n, "not run", *(["-"] * 6)])
            continue

        def m(split, key):
            v = _v(R, n, split, key)
            return f"{C.mean_or_nan(v):.4g} ({'/'.join(f'{x:.4g}' for x in v)})"
        rows.append([n, len(done), m("wiki_ho", "ce"), m("wiki_ho", "kl"), m("wiki_ho", "top1"), m("austen_ho", "kl"),
                     m("gsm_text", "kl"), f"{C.mean_or_nan([r['step_ms'] for r in done if r.get('step_ms')]):.0f}"])
    p = res["preset"]
    lines = C.header("QAD vs QAT vs PTQ on real and random tokens, NVFP4 W4A4 (QAD report)", res)
    lines += [f"Every trained arm: {p['steps']} steps x {p['micro']} x {p['seq']} tokens, LR {p['lr']:g} cosine "
              f"({p['warmup']} warmup), AdamW (0.9, 0.999). Held-out: {p['eval_windows']} windows of {p['eval_seq']} "
              f"tokens per set, full-vocabulary KL(teacher || student) in nats/token; mean over seeds (per seed).", "",
              C.md_table(["arm", "seeds", "WIKI CE", "WIKI KL", "WIKI top-1", "AUS KL", "GSM-TEXT KL", "ms/step"], rows),
              "", "## Verdicts", ""] + C.verdict_lines(res.get("verdicts", []))
    if pt and R:
        qr = _v(R, "qad_random", "wiki_ho", "kl")
        if qr:
            lines += ["", f"QAD on random tokens vs PTQ (reported, not voted on): WIKI-HO KL {C.mean_or_nan(qr):.4g} "
                          f"vs {pt['wiki_ho']['kl']:.4g} (the paper: about PTQ level, no collapse)."]
    lines += C.status_lines(R)
    C.write_text(out / f"{TAG}.md", "\n".join(lines) + "\n")
    C.write_json(out / f"{TAG}.json", res)

    def draw(fig):
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for i, arm in enumerate(ARMS):
            for r in [r for r in R if r.get("arm") == arm["name"] and r.get("status") == "done"]:
                c = r["curves"]
                ls = "-" if r["seed"] == 0 else "--"
                lab = f"{arm['name']} s{r['seed']}"
                ax1.plot(c["step"], c["ce"], ls, color=f"C{i}", label=lab)
                ax2.plot(c["step"], c["kl"], ls, color=f"C{i}", label=lab)
        ax1.axhline(t["wiki_ho"]["ce"], color="k", lw=0.8, label="teacher")
        ax2.axhline(pt["wiki_ho"]["kl"], color="gray", lw=0.8, ls=":", label="PTQ (eval windows of the table)")
        ax1.set_title("held-out CE (trainer's WIKI-HO eval)", fontsize=9)
        ax2.set_title("held-out KL to the teacher", fontsize=9)
        ax2.set_yscale("log")
        for ax in (ax1, ax2):
            ax.set_xlabel("step")
            ax.legend(fontsize=6)
        fig.suptitle("QAD vs QAT, NVFP4 W4A4" + (" (SMOKE, measures nothing)" if res["smoke"] else ""), fontsize=10)
    C.plot(out / f"{TAG}.png", draw)


if __name__ == "__main__":
    sys.exit(main())
