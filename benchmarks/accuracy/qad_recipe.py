"""Which QAD recipe brings a small model closest to its teacher: PTQ calibrations, then QAD (and QAT) arms over
learning rate, schedule and scale strategy, each with its held-out KL-vs-tokens curve.

    python benchmarks/accuracy/qad_recipe.py --out runs/recipe --lrs 1e-5,1e-4 --steps 400     # one process
    python benchmarks/accuracy/qad_recipe.py --smoke --out /tmp/recipe                            # CPU, seconds
    python benchmarks/accuracy/qad_recipe.py --merge runs/a/qad_recipe-*.json --out runs/recipe  # one table + PNG

benchmarks/gpu/accuracy.sh runs several of these processes at once on one GPU (a 135M model leaves most of it
idle), one learning rate each, then merges them.

Why a sweep: the method recipe's learning rate (5e-6, constant) is the QAD report's setting for a 30B model at
its batch; a 135M student at a 4K-token batch moves far less per step at that rate, and held-out KL then falls
only slowly below PTQ. Everything else is held equal across arms: the data order (seed), the tokens per step,
the teacher, the held-out windows, the calibration that starts every trained arm.

Scores are the trainer-independent evaluator of benchmarks/papers/papers_common.py: full-vocabulary forward
KL(teacher || student) in fp32, CE, top-1 agreement over held-out Wikipedia articles (never trained on) and
*Persuasion* (out of the training novels). These are torch numbers on the student (the gate proves each export
equal to it); benchmarks/accuracy/llama_cpp_arms.py scores Q4_K_M files in llama.cpp itself.

Writes ``<tag>.json`` / ``<tag>.md`` (and with --merge ``qad_recipe.md`` / ``.json`` / ``.png``) into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "papers"))
import papers_common as C  # noqa: E402

TAG = "qad_recipe"
HELD = ("wiki_ho", "austen_ho")
CALIBS = ("max", "mse", "four_over_six")


def preset(smoke: bool) -> Dict[str, Any]:
    if smoke:
        return dict(steps=4, micro=2, seq=32, eval_every=2, trainer_eval=2, eval_seq=64, eval_windows=2, warmup=0,
                    limits={"wiki_train": 30_000, "austen_train": 20_000, "wiki_ho": 3_000, "austen_ho": 3_000})
    # 8 x 512 tokens a step; 16 held-out windows of 1,024 tokens per set (~32K predicted tokens)
    return dict(steps=800, micro=8, seq=512, eval_every=100, trainer_eval=8, eval_seq=1024, eval_windows=16,
                warmup=20, limits={"wiki_train": 4_000_000, "austen_train": 4_000_000})


def arm_list(a) -> List[Dict[str, Any]]:
    arms = []
    for method in a.methods.split(","):
        for lr in (float(x) for x in a.lrs.split(",")):
            arms.append({"name": f"{method}_lr{lr:g}_{a.schedule}_{a.scales}", "kind": method, "method": method,
                         "lr": lr, "schedule": a.schedule, "scales": a.scales})
    return arms


def overrides(a, p, data, arm, seed, run_dir) -> List[str]:
    f = data["files"]
    o = C.model_overrides(a.smoke, a.model_path, a.device) + [
        f"format={a.format}", f"method={arm['method']}", "method.eval_teacher=true",
        f"quant.calib_method={a.calib}", f"quant.scale_strategy={arm['scales']}",
        "data=files", f"data.train=[{f['wiki_train']},{f['austen_train']}]", f"data.eval=[{f['wiki_ho']}]",
        f"data.seq_len={p['seq']}", f"data.eval_samples={p['trainer_eval']}"]
    if arm["method"] == "qad":
        o.append(f"method.loss.temperature={a.temperature:g}")
    o += C.train_overrides(a.device, run_dir, seed, p["steps"], arm["lr"], p["micro"], 1, p["eval_every"], a.smoke,
                           p["warmup"])
    if arm["schedule"] == "constant":
        o.append("train.schedule=constant")
    return o


def curve_from_metrics(run_dir: Path) -> Dict[str, List[float]]:
    """The held-out evaluations the trainer logged (also for a run cut before its summary)."""
    st, kl, ce = [], [], []
    p = Path(run_dir) / "metrics.jsonl"
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "eval/kl" in r and "step" in r:
                st.append(r["step"])
                kl.append(r["eval/kl"])
                ce.append(r.get("eval/ce"))
    return {"step": st, "kl": kl, "ce": ce}


def run(a) -> int:
    a.device = C.resolve_device(a)
    p = preset(a.smoke)
    if a.steps:
        p["steps"] = a.steps
        p["eval_every"] = max(1, a.steps // 8)
    work = a.work or a.out / f"work-{a.tag}"
    runs = C.runs_dir(work)
    data = C.data_files(work, ("wiki_train", "austen_train") + HELD, p["limits"])
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "format": a.format, "calib": a.calib, "runs_dir": str(runs),
                           "tokens_per_step": p["micro"] * p["seq"],
                           "provenance": C.provenance(C.model_record(a.smoke, a.model_path), data, [a.seed], a.device)}
    import torch
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    teacher, tok, vocab = C.load_teacher(a.smoke, a.model_path, a.device)
    ev = C.Evaluator(teacher, tok, {k: data["files"][k] for k in HELD}, {"*": p["eval_seq"]}, p["eval_windows"],
                     a.device)
    res["teacher"] = ev.evaluate(teacher)
    res["ptq"] = {}
    if a.ptq:
        from qatfactory.train.config import compose
        calib = None
        for cm in CALIBS:
            # a searched calibration (mse, four_over_six) fixes the block scales, which only frozen scales keep;
            # a PTQ export is frozen either way
            arm0 = {"method": "qad", "lr": 1e-5, "schedule": "constant",
                    "scales": "dynamic" if cm == "max" else "frozen"}
            cfg0 = compose(overrides(a, p, data, arm0, a.seed, work / "ptq") + [f"quant.calib_method={cm}"])
            calib = calib or C.calib_batches(cfg0, tok, vocab, a.device)
            try:
                m = C.deploy(C.load_teacher(a.smoke, a.model_path, a.device)[0], cfg0.quant, calib, cm)
                res["ptq"][cm] = ev.evaluate(m)
                C.free(m)
            except Exception as e:  # noqa: BLE001 - a calibration the format refuses is a row saying why
                res["ptq"][cm] = {"error": f"{type(e).__name__}: {e}"[:200]}
            C.say(a.tag, f"PTQ {cm}: {res['ptq'][cm].get('wiki_ho', res['ptq'][cm])}")

    def one(arm, seed):
        run_dir = runs / f"{arm['name']}-s{seed}"
        try:
            s = C.run_arm(overrides(a, p, data, arm, seed, run_dir))
        finally:
            # what the trainer logged survives a failure mid-run: the curve is kept either way
            res.setdefault("partial_curves", {})[arm["name"]] = curve_from_metrics(run_dir)
        r = {"curve": curve_from_metrics(run_dir), "step_ms": C.step_ms(run_dir), "tokens": s.get("tokens"),
             "lr": arm["lr"], "method": arm["method"], "schedule": arm["schedule"], "scales": arm["scales"]}
        r["eval"] = C.student_eval(run_dir, ev, dtype, a.device)
        return r

    return C.run_and_report(arm_list(a), [a.seed], C.Budget(a.budget_s), one, res, lambda r: [],
                            lambda out, r: report(out, r, a.tag), a.out, a.tag)


def _f(x, nd=4):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}g}"


def rows_of(res: Dict[str, Any]) -> List[List[Any]]:
    t = res["teacher"]
    rows = [["teacher (bf16)", "-", "-", _f(t["wiki_ho"]["ce"]), 0, 1, 0, "-", "-"]]
    for cm, r in (res.get("ptq") or {}).items():
        if "error" in r:
            rows.append([f"PTQ {cm}", "-", "-", r["error"], "", "", "", "", ""])
            continue
        rows.append([f"PTQ {cm}", "-", "-", _f(r["wiki_ho"]["ce"]), _f(r["wiki_ho"]["kl"]), _f(r["wiki_ho"]["top1"]),
                     _f(r["austen_ho"]["kl"]), "-", "-"])
    for r in res.get("arms", []):
        if r.get("status") != "done":
            rows.append([r["arm"], "-", "-", r.get("status"), "", "", "", "", ""])
            continue
        e = r["eval"]
        rows.append([r["arm"], f"{r['lr']:g}", f"{(r.get('tokens') or 0) / 1e6:.2f}M", _f(e["wiki_ho"]["ce"]),
                     _f(e["wiki_ho"]["kl"]), _f(e["wiki_ho"]["top1"]), _f(e["austen_ho"]["kl"]),
                     _f(r.get("step_ms"), 3), f"{r.get('seconds', 0) / 60:.1f}"])
    return rows


def report(out: Path, res: Dict[str, Any], tag: str = TAG) -> None:
    p = res["preset"]
    lines = C.header(f"QAD recipe sweep, {res['format']} (torch evaluation of the student)", res)
    lines += [f"Trained arms: {p['steps']} steps x {p['micro']} x {p['seq']} tokens, AdamW (0.9, 0.999), wd 0, "
              f"clip 1, {p['warmup']} warm-up steps, calibration `{res.get('calib')}` before training. Held out: "
              f"{p['eval_windows']} windows of {p['eval_seq']} tokens per set; KL(teacher || student) in nats/token.",
              "", C.md_table(["arm", "LR", "tokens", "WIKI CE", "WIKI KL", "WIKI top-1", "AUS KL", "ms/step",
                              "wall min"], rows_of(res))]
    if res.get("merged_from"):
        lines += ["", f"Merged from {len(res['merged_from'])} processes' JSONs (the header's command is the first's): "
                      + ", ".join(Path(x).parent.name + "/" + Path(x).name for x in res["merged_from"]) + "."]
    lines += ["", "ms/step and wall minutes are measured with every process of the same call sharing one GPU: "
                  "they compare arms of one call, not tools."]
    lines += C.status_lines(res.get("arms", []))
    lines += [f"- {r['arm']}: {r['cut']}" for r in res.get("arms", []) if r.get("cut")]
    C.write_text(out / f"{tag}.md", "\n".join(lines) + "\n")
    C.write_json(out / f"{tag}.json", res)
    draw_curves(out / f"{tag}.png", [res])


def draw_curves(path: Path, results: List[Dict[str, Any]]) -> None:
    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        i = 0
        for res in results:
            tps = res.get("tokens_per_step", 1)
            for r in res.get("arms", []):
                c = r.get("curve") or (res.get("partial_curves") or {}).get(r["arm"])
                if not c or not c.get("step"):
                    continue
                ax.plot([s * tps / 1e6 for s in c["step"]], c["kl"], "-o", ms=3, color=f"C{i % 10}", label=r["arm"])
                i += 1
        ptq = {}
        for res in results:
            ptq.update({k: v for k, v in (res.get("ptq") or {}).items() if "wiki_ho" in v})
        for j, (cm, v) in enumerate(sorted(ptq.items())):
            ax.axhline(v["wiki_ho"]["kl"], color="gray", lw=0.8, ls=[":", "--", "-."][j % 3], label=f"PTQ {cm}")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("held-out KL to the teacher (trainer's eval windows)")
        ax.legend(fontsize=6)
        smoke = any(r.get("smoke") for r in results)
        fig.suptitle(f"QAD recipe sweep, {results[0]['format']}" + (" (SMOKE, measures nothing)" if smoke else ""),
                     fontsize=10)
    C.plot(path, draw)


def merge(paths: List[Path], out: Path) -> int:
    """One table and one plot from several processes' JSONs (one learning rate each): the PTQ rows are taken
    from the first JSON that has them; every other JSON must have measured the same teacher on the same
    held-out files, else the merge stops naming the file."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    if not docs:
        raise SystemExit("--merge: no JSON given")
    base = docs[0]
    ref = (base["provenance"]["data"].get("sha256"), base["format"], json.dumps(base["preset"], sort_keys=True))
    for p, d in zip(paths, docs):
        mine = (d["provenance"]["data"].get("sha256"), d["format"], json.dumps(d["preset"], sort_keys=True))
        if mine != ref:
            raise SystemExit(f"--merge: {p} measured other data, format or preset than {paths[0]}; not merged")
    merged = dict(base)
    merged["ptq"] = {k: v for d in docs for k, v in (d.get("ptq") or {}).items() if "error" not in v}
    # an arm that failed in one call and finished in another keeps only its finished row
    finished = {r["arm"] for d in docs for r in d.get("arms", []) if r.get("status") == "done"}
    merged["arms"] = [r for d in docs for r in d.get("arms", [])
                      if r.get("status") == "done" or r["arm"] not in finished]
    merged["partial_curves"] = {k: v for d in docs for k, v in (d.get("partial_curves") or {}).items()}
    # a process cut by its time limit wrote no row for the arm it was training; its logged curve still counts
    done = {r["arm"] for r in merged["arms"]}
    for d in docs:
        for m in sorted(Path(d.get("runs_dir") or "/nonexistent").glob("*/metrics.jsonl")):
            arm = m.parent.name.rsplit("-s", 1)[0]
            c = curve_from_metrics(m.parent)
            if arm not in done and c["step"]:
                merged["partial_curves"][arm] = c
                merged["arms"].append({"arm": arm, "seed": d["provenance"]["seeds"][0], "curve": c,
                                       "status": f"cut at step {c['step'][-1]} (time limit): curve only"})
    merged["merged_from"] = [str(p) for p in paths]
    report(out, merged, TAG)
    print((out / f"{TAG}.md").read_text())
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.base_args(ap)
    ap.add_argument("--format", default="nvfp4_w4a16", help="a recipes/format name")
    ap.add_argument("--methods", default="qad", help="qad and/or qat, comma-separated")
    ap.add_argument("--lrs", default="5e-6,2e-5,1e-4", help="learning rates, comma-separated")
    ap.add_argument("--schedule", default="cosine", choices=("cosine", "constant"))
    ap.add_argument("--scales", default="dynamic", choices=("dynamic", "frozen"),
                    help="weight scales recomputed every step (dynamic) or kept from calibration (frozen)")
    ap.add_argument("--calib", default="max", choices=CALIBS, help="the calibration every trained arm starts from")
    ap.add_argument("--temperature", type=float, default=1.0, help="KL temperature of the QAD loss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ptq", action="store_true", help="also the PTQ rows (each calibration method)")
    ap.add_argument("--tag", default=TAG, help="output file stem (several processes write beside each other)")
    ap.add_argument("--merge", nargs="*", type=Path, default=None, help="merge these JSONs into one table")
    a = ap.parse_args(argv)
    if a.merge is not None:
        return merge(a.merge, a.out)
    bad = [m for m in a.methods.split(",") if m not in ("qad", "qat")]
    if bad:
        ap.error(f"--methods {bad}: allowed qad, qat")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
