"""Run-set B2 (QATFactory, arXiv 2609.39223; shared/reference/reproductions.md 4.B2): sequence length at a fixed
token budget. The paper: at the same ~0.3B tokens, 32K training sequences beat 4K by +1.9 points. Here the
mechanism at small scale: QAD (NVFP4 W4A16) on long continuous text, every arm the same tokens per step and
steps, only the window length (and so the batch) differs; held-out KL **bucketed by position** on
*Persuasion* windows as long as the longest arm's, plus WIKI-HO.

    python benchmarks/papers/seqlen.py --out benchmarks/results             # GPU preset (SmolLM2-135M)
    python benchmarks/papers/seqlen.py --smoke --out /tmp/papers           # CPU, tiny random model

Training text: the five Austen training novels only, one document per novel, packed (a window can span the
end of one novel and the start of the next: at most four such windows per epoch). Expected
(reproductions.md): lower late-position KL for the long arm, little change early and on short Wikipedia.

Writes ``seqlen.md`` / ``.json`` / ``.png`` into --out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import papers_common as C  # noqa: E402

TAG = "seqlen"
FORMAT = "nvfp4_w4a16"


def preset(smoke: bool) -> Dict[str, Any]:
    if smoke:
        return dict(steps=3, tokens_per_step=64, seqs=[16, 64], lr=1e-3, eval_seq=128, eval_windows=2,
                    wiki_seq=64, buckets=[0, 16, 64, 127], warmup=0,
                    limits={"austen_train": 40_000, "austen_ho": 5_000, "wiki_ho": 3_000})
    # 60 steps x 8,192 tokens = 0.5M tokens per arm (the design's 600 steps cut to the 10-minute run)
    return dict(steps=60, tokens_per_step=8192, seqs=[256, 1024, 4096], lr=5e-5, eval_seq=4096, eval_windows=6,
                wiki_seq=1024, buckets=[0, 256, 1024, 4095], warmup=5, limits={"austen_train": 2_500_000})


def arm_overrides(a, p, data, seq, seed, run_dir) -> List[str]:
    f = data["files"]
    micro = p["tokens_per_step"] // seq
    o = C.model_overrides(a.smoke, a.model_path, a.device) + [
        f"format={FORMAT}", "method=qad", "data=files", f"data.train=[{f['austen_train']}]",
        f"data.eval=[{f['austen_ho']}]", f"data.seq_len={seq}", "data.eval_samples=2"]
    return o + C.train_overrides(a.device, run_dir, seed, p["steps"], p["lr"], micro, 1, 0, a.smoke, p["warmup"])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.base_args(ap)
    ap.add_argument("--lr", type=float, default=None)
    a = ap.parse_args(argv)
    a.device = C.resolve_device(a)
    p = preset(a.smoke)
    p.update({k: v for k, v in (("steps", a.steps), ("lr", a.lr)) if v})
    if any(p["tokens_per_step"] % s for s in p["seqs"]):
        raise SystemExit(f"tokens_per_step {p['tokens_per_step']} is not a multiple of every length {p['seqs']}")
    work = a.work or a.out / f"work-{TAG}"
    budget = C.Budget(a.budget_s)
    runs = C.runs_dir(work)
    data = C.data_files(work, ("austen_train", "austen_ho", "wiki_ho"), p["limits"])
    seeds = list(range(a.seeds))
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "format": FORMAT,
                           "provenance": C.provenance(C.model_record(a.smoke, a.model_path), data, seeds, a.device)}
    prior = C.load_prior(a.prior, res)
    import torch
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    teacher, tok, _ = C.load_teacher(a.smoke, a.model_path, a.device)
    ev = C.Evaluator(teacher, tok, {"austen_ho": data["files"]["austen_ho"], "wiki_ho": data["files"]["wiki_ho"]},
                     {"austen_ho": p["eval_seq"], "wiki_ho": p["wiki_seq"]}, p["eval_windows"], a.device,
                     buckets={"austen_ho": p["buckets"]}, batch=1 if not a.smoke else 2)
    res["teacher"] = ev.evaluate(teacher)
    arms = [{"name": f"seq{s}", "seq": s, "kind": f"seq{s}"} for s in p["seqs"]]

    def one(arm, seed):
        run_dir = runs / f"{arm['name']}-s{seed}"
        s = C.run_arm(arm_overrides(a, p, data, arm["seq"], seed, run_dir))
        return {"eval": C.student_eval(run_dir, ev, dtype, a.device), "step_ms": C.step_ms(run_dir),
                "tokens": s.get("tokens"), "micro_batch": p["tokens_per_step"] // arm["seq"]}

    return C.run_and_report(arms, seeds, budget, one, res, verdicts, report, a.out, TAG, prior)


def _bucket_names(p) -> List[str]:
    e = p["buckets"]
    return [f"{x}-{y - 1}" for x, y in zip(e[:-1], e[1:])]


def _kl(R, arm, bucket=None, split="austen_ho"):
    if bucket is None:
        return C.values(R, arm, lambda r: r["eval"][split]["kl"])
    return C.values(R, arm, lambda r: r["eval"][split]["kl_by_position"][bucket])


def verdicts(res) -> List[Dict[str, Any]]:
    p, R = res["preset"], res.get("arms", [])
    short, long_ = f"seq{p['seqs'][0]}", f"seq{p['seqs'][-1]}"
    late = _bucket_names(p)[-1]
    return [
        C.verdict("longer training sequences at a fixed token budget: lower late-position KL", f"AUS-HO KL, positions {late}",
                  long_, _kl(R, long_, late), short, _kl(R, short, late), +1),
        C.verdict("longer training sequences at a fixed token budget: lower KL", "AUS-HO KL, all positions",
                  long_, _kl(R, long_), short, _kl(R, short), +1),
    ]


def report(out: Path, res: Dict[str, Any]) -> None:
    p, R = res["preset"], res.get("arms", [])
    bn = _bucket_names(p)
    rows = []
    for s in p["seqs"]:
        n = f"seq{s}"
        done = [r for r in R if r.get("arm") == n and r.get("status") == "done"]
        if not done:
            rows.append([n, f"{p['tokens_per_step'] // s} x {s}", "not run"] + ["-"] * (len(bn) + 2))
            continue

        def m(v):
            return f"{C.mean_or_nan(v):.4g} ({'/'.join(f'{x:.4g}' for x in v)})"
        rows.append([n, f"{p['tokens_per_step'] // s} x {s}", len(done)] + [m(_kl(R, n, b)) for b in bn]
                    + [m(_kl(R, n)), m(_kl(R, n, split="wiki_ho"))])
    lines = C.header("Sequence length at a fixed token budget (QATFactory)", res)
    lines += [f"QAD, {FORMAT}, {p['steps']} steps x {p['tokens_per_step']:,} tokens for every arm, LR {p['lr']:g} cosine, "
              f"trained on the Austen training novels. AUS-HO = {p['eval_windows']} windows of {p['eval_seq']} tokens "
              f"of Persuasion, KL(teacher || student) nats/token by predicted position; WIKI-HO windows of "
              f"{p['wiki_seq']}. Mean over seeds (per seed).", "",
              C.md_table(["arm", "batch x length", "seeds"] + [f"AUS KL pos {b}" for b in bn] + ["AUS KL", "WIKI KL"],
                         rows), "", "## Verdicts", ""] + C.verdict_lines(res.get("verdicts", []))
    lines += C.status_lines(R)
    C.write_text(out / f"{TAG}.md", "\n".join(lines) + "\n")
    C.write_json(out / f"{TAG}.json", res)

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        w = 0.8 / max(len(p["seqs"]), 1)
        for i, s in enumerate(p["seqs"]):
            n = f"seq{s}"
            for j, b in enumerate(bn):
                v = _kl(R, n, b)
                ax.bar(j + i * w, C.mean_or_nan(v), w, color=f"C{i}", label=f"train length {s}" if j == 0 else None)
                ax.plot([j + i * w] * len(v), v, "k.", ms=4)
        ax.set_xticks([j + w * (len(p["seqs"]) - 1) / 2 for j in range(len(bn))], [f"positions {b}" for b in bn])
        ax.set_ylabel("AUS-HO KL (nats/token)")
        ax.legend(fontsize=8)
        ax.set_title("fixed tokens per step; dots = seeds" + (" (SMOKE, measures nothing)" if res["smoke"] else ""),
                     fontsize=9)
    C.plot(out / f"{TAG}.png", draw)


if __name__ == "__main__":
    sys.exit(main())
