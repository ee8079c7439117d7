"""QeRL (arXiv 2510.11696) at small scale, one command: GRPO/DAPO with LoRA on a BF16 vs an NVFP4 base,
with and without adaptive quantization noise (AQN).

    python benchmarks/papers/qerl.py --out runs/qerl              # the H200 run (SmolLM2-135M-Instruct)
    python benchmarks/papers/qerl.py --smoke --out /tmp/qerl      # CPU plumbing check (tiny random model)

Arms (same seed set, same learning rate; methods.md 3.2): ``bf16_lora`` (base = the dequantized
SmolLM2 GGUF), ``nvfp4_lora`` (base = NVFP4 fake quant, frozen at its serving weights),
``nvfp4_lora_aqn``, ``bf16_lora_aqn`` (separates "noise" from "quantization"). Algorithm: the QeRL
code's DAPO-style loss (token-level, clip 0.2 / 0.28, no KL, no dynamic sampling, truncated
completions masked), one update per rollout, G = 8, 32 prompts per step, 192 new tokens,
temperature 1.0, LoRA r 16 / alpha 16 on all seven projections, AQN sigma 1e-2 -> 5e-4 over 10 stages
(code indexing), resampled every step.

Task: the generated arithmetic word problems (distill/rewards.py) at the level whose base pass rate
(T = 1, measured first on the BF16 base) lies in [10%, 50%]: a 135M model scores ~1-2% on GSM8K, so
its groups would carry no signal; reward 0.2 format + 2.0 exact numeric match in the
``<think>..</think><answer>N</answer>`` format (system prompt attached).

Reported per arm and seed: policy entropy at step 0 on a fixed prompt set (the held-out prompts,
one sampled completion each at T = 1 from a fixed seed; and along the greedy path), entropy and
reward curves per step, held-out accuracy of the task (greedy and sampled pass@1) at the end,
GSM8K-319 greedy accuracy at the end (items 1000-1318 of the packaged test split; expected flat),
median step time and rollout tokens/s against bf16_lora. Writes ``qerl.json``, ``qerl.md`` and
``qerl.png`` into --out.

``--smoke``: a random 2-layer Llama with the byte tokenizer on CPU, the shaped say-7 reward, two
steps per arm: it exercises every code path (calibration, four arms, GSM8K eval, report) in
seconds and **measures nothing about QeRL**.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ARMS = {  # name -> (format recipe, AQN on)
    "bf16_lora": ("bf16", False),
    "nvfp4_lora": ("nvfp4_w4a16", False),
    "nvfp4_lora_aqn": ("nvfp4_w4a16", True),
    "bf16_lora_aqn": ("bf16", True),
}


def common(args) -> List[str]:
    if args.smoke:
        return ["model=tiny_llama", "model.tiny.initializer_range=0.3", "train=cpu_tiny", "method=dapo",
                "method.rl.task=say7", "method.rl.max_new_tokens=4", "method.rl.mask_truncated=false",
                "method.rl.lora_rank=4", "method.rl.prompts_per_step=2", "method.rl.group_size=4",
                "method.rl.n_eval=4", "train.micro_batch=8", f"train.max_steps={args.steps or 2}",
                "train.lr=2e-2", "train.eval_every=0", "method.rl.dynamic_sampling=false",
                "method.rl.aqn.stages=3", "method.rl.aqn.sigma_start=1e-2", "method.rl.aqn.sigma_end=1e-3"]
    steps = args.steps or 50
    return ["model=smollm2_135m", "train=gpu_1x", "method=dapo", "train.optimizer=adamw_torch",
            "method.rl.task=arith", f"method.rl.max_new_tokens={args.max_new_tokens}",
            "method.rl.prompts_per_step=32", "method.rl.group_size=8", "method.rl.n_eval=256",
            "method.rl.dynamic_sampling=false", "method.rl.lora_rank=16", "method.rl.lora_alpha=16",
            "train.micro_batch=32", "train.grad_accum=1", "train.grad_ckpt=false", f"train.max_steps={steps}",
            f"train.lr={args.lr}", "train.schedule=constant", f"train.eval_every={max(steps // 5, 1)}",
            "train.save_student=false", "method.rl.aqn.stages=10", "method.rl.aqn.sigma_start=1e-2",
            "method.rl.aqn.sigma_end=5e-4", "method.rl.aqn.indexing=code", "method.rl.aqn.resample=step",
            "train.progress=true"]


def calibrate(args, base: List[str], out: Path) -> Dict:
    """Pick the arithmetic level whose BF16 base pass rate at T=1 is in the band."""
    import torch
    from qatfactory.distill.rewards import make_task, pick_level
    from qatfactory.distill.rollout import SamplingConfig, generate
    from qatfactory.train.config import compose
    from qatfactory.train.engine import build_model
    from qatfactory.train.rl_loop import _prompt_ids
    cfg = compose(base + ["format=bf16", f"run_dir={out / 'calibration'}"])
    dev = torch.device("cuda" if cfg.train.device == "cuda" else "cpu")
    model, tok, _ = build_model(cfg, dev)
    model.to(dev).eval()
    n = 4 if args.smoke else 128
    levels = [0, 1] if args.smoke else None
    r = cfg.method.rl

    def rate(level: int) -> float:
        task = make_task("arith", r.answer_format, level, n_train=n, n_eval=1, seed=cfg.train.seed)
        ps = _prompt_ids(tok, task, task.train, r.chat_template)
        g = torch.Generator(device=dev).manual_seed(1234 + level)
        roll = generate(model, ps, int(tok.eos_token_id), int(tok.pad_token_id or tok.eos_token_id),
                        SamplingConfig(r.max_new_tokens, 1.0, 1.0), g, tokenizer=tok)
        return sum(task.score(t, it)["correct"] for t, it in zip(roll.texts, task.train)) / n

    level, rates = pick_level(rate, 0.1, 0.5, levels)
    del model
    return {"level": level, "pass_rates": rates, "prompts": n, "temperature": 1.0}


def gsm8k_eval(summary, args, base: List[str], quantized: bool) -> Dict[str, float]:
    """Greedy GSM8K accuracy of the trained policy on items 1000.. of the packaged test split."""
    from qatfactory.distill.rewards import make_task
    from qatfactory.nn import adapter as AD
    from qatfactory.train.config import compose
    from qatfactory.train.rl_loop import _prompt_ids, evaluate
    cfg = compose(base)
    r = cfg.method.rl
    lm = summary["engine"].module.lm
    tok = summary["_tok"]
    n = 2 if args.smoke else 319
    task = make_task("gsm8k", r.answer_format, 0, n_train=1, n_eval=n, seed=0)
    ps = _prompt_ids(tok, task, task.eval, r.chat_template)
    dev = next(lm.parameters()).device
    r.max_new_tokens = 4 if args.smoke else 256
    ctx = AD.serving_weights(lm) if quantized else _Null()
    with ctx:
        e = evaluate(lm, tok, task, ps, r, 0, 1, dev, 17, int(tok.eos_token_id),
                     int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id))
    return {"gsm8k/accuracy": e["eval/accuracy"], "gsm8k/format": e["eval/format"], "gsm8k/items": n}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def run_arm(name: str, seed: int, args, base: List[str], out: Path) -> Dict:
    from qatfactory.train.config import compose
    from qatfactory.train.rl_loop import run
    from qatfactory.train.runlog import read_metrics
    fmt, aqn = ARMS[name]
    rd = out / f"{name}-seed{seed}"
    over = base + [f"format={fmt}", f"method.rl.aqn.enabled={str(aqn).lower()}", f"train.seed={seed}",
                   f"method.rl.aqn.seed={seed}", f"run_dir={rd}"]
    cfg = compose(over)
    t0 = time.time()
    s = run(cfg)
    s["_tok"] = _tok_of(cfg)
    recs = read_metrics(rd)
    steps = [r for r in recs if "reward" in r]
    evals = [r for r in recs if "eval/accuracy" in r]
    res = {"arm": name, "seed": seed, "format": fmt, "aqn": aqn, "run_dir": str(rd), "wall_s": time.time() - t0,
           "entropy_step0": evals[0]["eval/entropy"] if evals else None,
           "entropy_greedy_step0": evals[0]["eval/entropy_greedy"] if evals else None,
           "curve": {k: [r.get(k) for r in steps] for k in ("reward", "correct", "format", "entropy",
                                                              "rollout_entropy", "aqn/sigma", "aqn/sigma_eff")},
           "eval": evals, "final": evals[-1] if evals else None,
           "step_ms_median": statistics.median(r["step_ms"] for r in steps[1:] or steps),
           "rollout_tokens_per_s_median": statistics.median(r["rollout_tokens_per_s"] for r in steps[1:] or steps),
           "reward_auc": sum(r["reward"] for r in steps) / max(len(steps), 1)}
    rel = [r["aqn/sigma_over_gain_median"] for r in steps if "aqn/sigma_over_gain_median" in r]
    if rel:
        res["sigma_over_gain_median_max"] = max(rel)
    res.update(gsm8k_eval(s, args, over, fmt != "bf16"))
    s.pop("engine").destroy()
    return res


def _tok_of(cfg):
    """The run's tokenizer (as engine.build_model loads it)."""
    from qatfactory import assets
    from qatfactory.train.data import load_tokenizer
    path = cfg.model.path or (str(assets.prepare_model_dir(cfg.model.asset)) if cfg.model.asset else None)
    return load_tokenizer(cfg.model.tokenizer or path)


def report(results: List[Dict], calib: Dict, args, out: Path) -> str:
    by: Dict[str, List[Dict]] = {}
    for r in results:
        by.setdefault(r["arm"], []).append(r)

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    ref_step = mean([r["step_ms_median"] for r in by.get("bf16_lora", [])])
    ref_tok = mean([r["rollout_tokens_per_s_median"] for r in by.get("bf16_lora", [])])
    head = ("SMOKE (random tiny model on CPU, shaped say-7 reward): checks the plumbing, measures nothing about QeRL"
            if args.smoke else "SmolLM2-135M-Instruct, DAPO-style loss, arithmetic task level "
                               f"{calib.get('level')} (base pass rates {calib.get('pass_rates')})")
    lines = [f"# QeRL small-scale reproduction ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "", head, "",
             "| arm | seeds | entropy@0 (sampled) | entropy@0 (greedy path) | reward (mean over steps) | "
             "held-out acc start -> end | sampled pass@1 end | GSM8K end | step ms | vs bf16 | rollout tok/s | vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ARMS:
        rs = by.get(name, [])
        if not rs:
            continue
        st, tk = mean([r["step_ms_median"] for r in rs]), mean([r["rollout_tokens_per_s_median"] for r in rs])
        acc0 = mean([r["eval"][0]["eval/accuracy"] for r in rs if r["eval"]])
        acc1 = mean([r["final"]["eval/accuracy"] for r in rs if r["final"]])
        lines.append(f"| {name} | {len(rs)} | {mean([r['entropy_step0'] for r in rs]):.4f} | "
                     f"{mean([r['entropy_greedy_step0'] for r in rs]):.4f} | {mean([r['reward_auc'] for r in rs]):.4f} | "
                     f"{acc0:.3f} -> {acc1:.3f} | {mean([r['final']['eval/pass1_sampled'] for r in rs if r['final']]):.3f} | "
                     f"{mean([r['gsm8k/accuracy'] for r in rs]):.3f} | {st:.0f} | {st / ref_step:.2f}x | {tk:.0f} | "
                     f"{tk / ref_tok:.2f}x |")
    text = "\n".join(lines) + "\n"
    (out / "qerl.md").write_text(text)
    plot(by, out)
    return text


def plot(by: Dict[str, List[Dict]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ["reward", "correct", "entropy", "rollout_entropy"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.3), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for name, rs in by.items():
            for r in rs:
                ys = [y for y in r["curve"][k] if y is not None and math.isfinite(y)]
                ax.plot(range(1, len(ys) + 1), ys, label=f"{name} s{r['seed']}", lw=1.2)
        ax.set_title(k)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "qerl.png", dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on a random tiny model")
    ap.add_argument("--out", default="runs/qerl")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (2 where time allows)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=0, help="RL steps per arm (default 50; smoke 2)")
    ap.add_argument("--lr", type=float, default=1e-4, help="one learning rate for every arm")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--level", type=int, default=-1, help="arithmetic level; -1 = calibrate")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {bad}; allowed: {list(ARMS)}")
    base = common(args)
    if args.level >= 0:
        calib = {"level": args.level, "pass_rates": {}, "given": True}
    else:
        calib = calibrate(args, base, out)
    print(f"[qerl] arithmetic level {calib['level']} (pass rates {calib['pass_rates']})", flush=True)
    if not args.smoke:
        base = base + [f"method.rl.task_level={calib['level']}"]
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for a in arms:
            print(f"[qerl] arm {a} seed {seed}", flush=True)
            results.append(run_arm(a, seed, args, base, out))
    text = report(results, calib, args, out)
    tmp = out / ".qerl.json.tmp"
    tmp.write_text(json.dumps({"smoke": args.smoke, "calibration": calib, "args": vars(args), "results": results},
                              indent=1, default=str))
    os.replace(tmp, out / "qerl.json")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
