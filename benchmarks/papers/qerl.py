"""QeRL (arXiv 2510.11696) at small scale, one command: GRPO/DAPO with LoRA on a BF16 vs an NVFP4 base,
with and without adaptive quantization noise (AQN), after a supervised warm-up shared by every arm.

    python benchmarks/papers/qerl.py --out runs/qerl                       # the H200 run, four arms
    python benchmarks/papers/qerl.py --out runs/qerl --arms bf16_lora,nvfp4_lora     # part of it (one call)
    python benchmarks/papers/qerl.py --merge a/qerl.json b/qerl.json --out runs/all  # one table from parts
    python benchmarks/papers/qerl.py --phase warmup --device cpu --out /tmp/w ...    # warm-up + calibration only
    python benchmarks/papers/qerl.py --smoke --out /tmp/qerl               # CPU plumbing check (tiny random model)

Arms (same seed set, same learning rate; methods.md 3.2): ``bf16_lora`` (base = the warmed-up SmolLM2
in bf16), ``nvfp4_lora`` (base = NVFP4 fake quant of that model, PTQ, frozen at its serving weights),
``nvfp4_lora_aqn``, ``bf16_lora_aqn`` (separates "noise" from "quantization"). Algorithm: the QeRL
code's DAPO-style loss (token-level, clip 0.2 / 0.28, no KL, no dynamic sampling, truncated
completions masked), one update per rollout, G = 8, 32 prompts per step, temperature 1.0, LoRA r 16 /
alpha 16 on all seven projections, AQN sigma 1e-2 -> 5e-4 over 10 stages (code indexing), resampled
every step.

Warm-up (ours, not the paper's: QeRL starts from Qwen2.5-Instruct models that already follow its
format and has no SFT stage). SmolLM2-135M-Instruct never writes the answer format, so on the H200 its
pass rate was 0 already at the easiest level and DAPO had nothing to learn from (RESULTS.md). ``--warmup-steps N``
fine-tunes the bf16 model once, before anything is quantized, on N x ``--warmup-batch`` worked
solutions in the exact format the reward checks (train/rl/warmup.py): drawn by the task generator from
its own "arith-warmup" streams and filtered against every RL prompt and held-out item of seeds 0-3
(and any seed asked for) at every level. The warmed-up model is saved once (``<out>/warmup``, with its
SHA-256) and every arm starts from it: the bf16 arms as it is, the NVFP4 arms from its PTQ. It is
reused by a later call with the same settings (same digest checked), so the arms can be split over
separate GPU jobs; ``--merge`` refuses parts whose warm-up digests or levels differ.

Task: the generated arithmetic word problems (train/rl/rewards.py) at the level whose pass rate of the
warmed-up bf16 model (T = 1, ``--calib-prompts`` training prompts, one sample each) is the first in
``--band`` (default 20-60 %: a group of 8 then has mixed rewards with probability >= 0.83); a level
where nothing is ever right fails the run with a clear message (NoSignal) instead of spending the
GPU job on an all-zero run. Reward 0.2 format + 2.0 exact numeric match in the
``<think>..</think><answer>N</answer>`` format (system prompt attached).

Reported: the warm-up's loss (first -> last steps) and its effect (format and pass rate, greedy and
T = 1, on held-out prompts, before and after), the calibration, then per arm and seed: policy entropy
at step 0 on the held-out prompts (one sampled completion each at T = 1 from a fixed seed; and along
the greedy path), entropy and reward curves per step, held-out accuracy of the task (greedy and
sampled pass@1) at the start and the end, GSM8K-319 greedy accuracy at the end (items 1000-1318 of the
packaged test split; expected flat), median step time and rollout tokens/s against bf16_lora. Writes
``qerl.json`` (after every arm, so a call that times out keeps the arms it finished; a later call with
the same settings adds to it and skips those arms), ``qerl.md`` and ``qerl.png`` into --out; the arms'
own run directories go under ``<out>/runs/``.

``--smoke``: a random 2-layer Llama with the byte tokenizer on CPU, a 2-step warm-up, the shaped say-7
reward, two steps per arm: it exercises every code path (warm-up save and reuse, calibration, four
arms, GSM8K eval, report) in seconds and **measures nothing about QeRL**.
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
from typing import Dict, List, Optional

# deterministic cuBLAS for the warm-up (read when cuBLAS starts; before torch is imported)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ARMS = {  # name -> (format recipe, AQN on)
    "bf16_lora": ("bf16", False),
    "nvfp4_lora": ("nvfp4_w4a16", False),
    "nvfp4_lora_aqn": ("nvfp4_w4a16", True),
    "bf16_lora_aqn": ("bf16", True),
}
EXCLUDE_SEEDS = (0, 1, 2, 3)     # the warm-up never shows a question of these seeds' RL pools / held-out sets
WARMUP_STEPS, WARMUP_BATCH = 24, 8   # measured on CPU: format 1.0, a level in the band (RESULTS.md)
STATE = "qerl.json"


class Refused(Exception):
    """A clear, expected stop (exit code 3): nothing to learn from, or parts that do not belong together."""


# ----------------------------------------------------------------------------- settings
def common(args) -> List[str]:
    if args.smoke:
        return ["model=tiny_llama", "model.tiny.initializer_range=0.3", "train=cpu_tiny", "method=dapo",
                "method.rl.task=say7", "method.rl.max_new_tokens=4", "method.rl.mask_truncated=false",
                "method.rl.lora_rank=4", "method.rl.prompts_per_step=2", "method.rl.group_size=4",
                "method.rl.n_eval=4", "train.micro_batch=8", f"train.max_steps={args.steps or 2}",
                "train.lr=2e-2", "train.eval_every=0", "method.rl.dynamic_sampling=false",
                "method.rl.aqn.stages=3", "method.rl.aqn.sigma_start=1e-2", "method.rl.aqn.sigma_end=1e-3"]
    steps = args.steps or 30
    if args.device == "cpu":
        from qatfactory.cpu import compute_dtype
        dev = ["train=cpu_tiny", f"model.dtype={compute_dtype('cpu')['dtype']}"]
    else:
        dev = ["train=gpu_1x", "train.grad_ckpt=false"]
    return ["model=smollm2_135m", *dev, "method=dapo", "train.optimizer=adamw_torch",
            "method.rl.task=arith", f"method.rl.max_new_tokens={args.max_new_tokens}",
            "method.rl.prompts_per_step=32", "method.rl.group_size=8", f"method.rl.n_eval={args.n_eval}",
            "method.rl.dynamic_sampling=false", "method.rl.lora_rank=16", "method.rl.lora_alpha=16",
            "train.micro_batch=64", "train.grad_accum=1", f"train.max_steps={steps}",
            f"train.lr={args.lr}", "train.schedule=constant", f"train.eval_every={args.eval_every}",
            "train.save_student=false", "method.rl.aqn.stages=10", "method.rl.aqn.sigma_start=1e-2",
            "method.rl.aqn.sigma_end=5e-4", "method.rl.aqn.indexing=code", "method.rl.aqn.resample=step",
            "train.progress=true"]


def settings(args) -> Dict:
    """What makes two calls' arms comparable (arms, seeds and --out may differ)."""
    return {"smoke": args.smoke, "device": args.device, "steps": args.steps or (2 if args.smoke else 30),
            "lr": args.lr, "max_new_tokens": args.max_new_tokens, "n_eval": args.n_eval,
            "eval_every": args.eval_every, "band": list(args.band), "calib_prompts": args.calib_prompts,
            "gsm8k_items": args.gsm8k_items, "warmup": warmup_spec(args)}


def warmup_spec(args) -> Dict:
    return {"steps": args.warmup_steps, "batch": args.warmup_batch, "lr": args.warmup_lr,
            "levels": list(args.warmup_levels), "seed": args.warmup_seed,
            "exclude_seeds": sorted(set(EXCLUDE_SEEDS) | set(args.seed_list))}


def _device(cfg):
    import torch
    return torch.device("cuda" if cfg.train.device == "cuda" else "cpu")


# ----------------------------------------------------------------------------- the warm-up
def warm_up(args, base: List[str], out: Path) -> Optional[Dict]:
    """Warm the bf16 model up once (or reuse ``<out>/warmup`` when it was made with these settings
    from the same source weights and still has its digest); None when --warmup-steps is 0."""
    if args.warmup_steps <= 0:
        return None
    import torch
    from qatfactory.train.rl.rewards import arith_questions, arith_warmup, make_task
    from qatfactory.train.rl import warmup as W
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    cfg = compose(base + ["format=bf16", f"run_dir={out / 'runs' / 'warmup-cfg'}"])
    dev = _device(cfg)
    r = cfg.method.rl
    model, tok, source_dir = build_model(cfg, dev)
    model.to(dev)
    spec = dict(warmup_spec(args), answer_format=r.answer_format, chat_template=r.chat_template,
                n_train=r.n_train, n_eval=r.n_eval, calib_prompts=args.calib_prompts,
                source_sha256=W.weights_sha256(model))
    wdir = out / "runs" / "warmup"      # two folders down: methods.sh brings back only the reports
    rec = W.read_record(wdir)
    if rec is not None and rec.get("spec") == spec:
        del model
        from transformers import AutoModelForCausalLM
        again = AutoModelForCausalLM.from_pretrained(str(wdir), dtype=getattr(torch, cfg.model.dtype))
        sha = W.weights_sha256(again)
        if sha != rec["sha256"]:
            raise Refused(f"{wdir}: the saved warm-up's weights have SHA-256 {sha[:16]}.., its record says "
                          f"{rec['sha256'][:16]}..: it was changed after it was written; delete it to redo it")
        print(f"[qerl] warm-up reused from {wdir} (sha256 {sha[:16]}..)", flush=True)
        return dict(rec, dir=str(wdir), reused=True)
    task = make_task("arith", r.answer_format, 0, n_train=1, n_eval=1, seed=0)
    exclude = arith_questions(spec["exclude_seeds"], r.n_train, r.n_eval) | \
        arith_questions([cfg.train.seed], args.calib_prompts, 1)
    items = arith_warmup(args.warmup_steps * args.warmup_batch, list(args.warmup_levels) or None, args.warmup_seed,
                         exclude)
    print(f"[qerl] warm-up: {args.warmup_steps} steps x {args.warmup_batch} worked solutions "
          f"({len(exclude)} RL questions excluded)", flush=True)
    info = W.sft_warmup(model, tok, task, items, args.warmup_steps, args.warmup_lr, args.warmup_batch,
                        r.chat_template, args.warmup_seed, deterministic=True, progress=not args.smoke)
    rec = dict(info, spec=spec, sha256=W.weights_sha256(model), excluded_questions=len(exclude),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
               device=str(dev))
    W.save_model_dir(model, tok, source_dir, wdir, rec)
    print(f"[qerl] warm-up loss {info['loss_first']:.3f} -> {info['loss_last']:.3f} in {info['time_s']:.1f}s "
          f"({info['step_s']:.2f}s/step, {info['compute_dtype']}), sha256 {rec['sha256'][:16]}..", flush=True)
    del model
    return dict(rec, dir=str(wdir), reused=False)


def _measure(model, tok, task, items, r, temperature: float, seed: int) -> Dict[str, float]:
    """Format and pass rate of one completion per item (greedy at temperature 0), and its cost."""
    import torch
    from qatfactory.train.rl.rollout import SamplingConfig, generate
    from qatfactory.train.rl.warmup import prompt_ids
    dev = next(model.parameters()).device
    ps = prompt_ids(tok, task, items, r.chat_template)
    g = torch.Generator(device=dev).manual_seed(seed)
    t0 = time.time()
    roll = generate(model, ps, int(tok.eos_token_id), int(tok.pad_token_id if tok.pad_token_id is not None
                                                          else tok.eos_token_id),
                    SamplingConfig(r.max_new_tokens, temperature, 1.0), g, tokenizer=tok)
    dt = time.time() - t0
    sc = [task.score(t, it) for t, it in zip(roll.texts, items)]
    n = max(len(items), 1)
    real = torch.arange(roll.tokens.shape[1])[None, :] < roll.lengths[:, None]
    return {"format": sum(s["format"] for s in sc) / n, "pass": sum(s["correct"] for s in sc) / n,
            "entropy": float((roll.entropy * real).sum() / real.sum().clamp(min=1)),
            "completion_tokens": roll.n_tokens() / n, "truncated": float(roll.truncated.float().mean()),
            "decode_steps": int(roll.tokens.shape[1]), "rollout_s": dt, "tokens_per_s": roll.n_tokens() / max(dt, 1e-9),
            "example": roll.texts[0][:160] if roll.texts else ""}


def warmup_effect(args, base: List[str], wdir: str, levels: List[int]) -> Dict:
    """Format compliance and pass rate before and after the warm-up, greedy and at T = 1, on the first
    --warmup-eval held-out prompts of each level (never seen by the warm-up); "after" also for the
    warmed-up model's NVFP4 PTQ at its serving weights (the base the quantized arms start from)."""
    from qatfactory.train.rl.rewards import make_task
    from qatfactory.nn import adapter as AD
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    from qatfactory.train.rl.policy import quantize_base
    from qatfactory.train.rl.warmup import prompt_ids
    res: Dict = {"prompts": args.warmup_eval, "levels": levels}
    for when, over in (("before", ["format=bf16"]), ("after", [f"model.path={wdir}", "format=bf16"]),
                       ("after_nvfp4", [f"model.path={wdir}", "format=nvfp4_w4a16"])):
        cfg = compose(base + over + [f"run_dir={out_dummy()}"])
        r = cfg.method.rl
        dev = _device(cfg)
        model, tok, _ = build_model(cfg, dev)
        model.to(dev).eval()
        ctx = _Null()
        if when == "after_nvfp4":
            pool = make_task("arith", r.answer_format, levels[-1], n_train=cfg.method.calib_samples, n_eval=1, seed=0)
            model = quantize_base(model, cfg.quant, cfg.method, prompt_ids(tok, pool, pool.train, r.chat_template), dev,
                                  True)
            ctx = AD.serving_weights(model)
        with ctx:
            for lv in levels:
                task = make_task("arith", r.answer_format, lv, n_train=1, n_eval=args.warmup_eval, seed=0)
                for name, temp in (("greedy", 0.0), ("t1", 1.0)):
                    m = _measure(model, tok, task, task.eval, r, temp, 4242 + lv)
                    res[f"{when}/level{lv}/{name}"] = m
                    print(f"[qerl] {when} warm-up, level {lv}, {name}: format {m['format']:.3f} pass {m['pass']:.3f} "
                          f"entropy {m['entropy']:.3f} ({m['completion_tokens']:.1f} tokens, {m['decode_steps']} decode steps, "
                          f"{m['tokens_per_s']:.0f} tok/s)", flush=True)
        del model
    return res


def out_dummy() -> str:
    """A run_dir for configs that never start a run (compose wants one)."""
    return "/nonexistent/qerl-config-only"


# ----------------------------------------------------------------------------- calibration
def calibrate(args, base: List[str]) -> Dict:
    """Pick the arithmetic level whose pass rate of the (warmed-up) bf16 model at T=1 is in the band;
    NoSignal when no level has a single correct completion (unless --allow-no-signal)."""
    import torch
    from qatfactory.train.rl.rewards import make_task, pick_level
    from qatfactory.train.rl.rollout import SamplingConfig, generate
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    from qatfactory.train.rl.warmup import prompt_ids
    cfg = compose(base + ["format=bf16", f"run_dir={out_dummy()}"])
    dev = _device(cfg)
    model, tok, _ = build_model(cfg, dev)
    model.to(dev).eval()
    n = 4 if args.smoke else args.calib_prompts
    levels = [0, 1] if args.smoke else None
    r = cfg.method.rl
    formats: Dict[int, float] = {}

    def rate(level: int) -> float:
        task = make_task("arith", r.answer_format, level, n_train=n, n_eval=1, seed=cfg.train.seed)
        ps = prompt_ids(tok, task, task.train, r.chat_template)
        g = torch.Generator(device=dev).manual_seed(1234 + level)
        roll = generate(model, ps, int(tok.eos_token_id), int(tok.pad_token_id or tok.eos_token_id),
                        SamplingConfig(r.max_new_tokens, 1.0, 1.0), g, tokenizer=tok)
        sc = [task.score(t, it) for t, it in zip(roll.texts, task.train)]
        formats[level] = sum(s["format"] for s in sc) / n
        p = sum(s["correct"] for s in sc) / n
        print(f"[qerl] calibration level {level}: pass {p:.3f} format {formats[level]:.3f} at T=1 ({n} prompts)",
              flush=True)
        return p

    lo, hi = args.band
    try:
        level, rates = pick_level(rate, lo, hi, levels, require_signal=not args.allow_no_signal)
    finally:
        del model
    return {"level": level, "pass_rates": rates, "format_rates": formats, "prompts": n, "temperature": 1.0,
            "band": [lo, hi], "in_band": lo <= rates[level] <= hi, "no_signal": not any(v > 0 for v in rates.values())}


# ----------------------------------------------------------------------------- the arms
def gsm8k_eval(summary, args, base: List[str], quantized: bool) -> Dict[str, float]:
    """Greedy GSM8K accuracy of the trained policy on items 1000.. of the packaged test split."""
    from qatfactory.train.rl.rewards import make_task
    from qatfactory.nn import adapter as AD
    from qatfactory.train.config import compose
    from qatfactory.train.rl.policy import evaluate
    from qatfactory.train.rl.warmup import prompt_ids as _prompt_ids
    n = 2 if args.smoke else args.gsm8k_items
    if n <= 0:
        return {"gsm8k/accuracy": None, "gsm8k/format": None, "gsm8k/items": 0}
    cfg = compose(base)
    r = cfg.method.rl
    lm = summary["engine"].module.lm
    tok = summary["_tok"]
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


def _set_aside_unfinished(rd: Path) -> None:
    """An arm reaches run_arm only when qerl.json does not list it, so a run directory already there is
    one a time limit cut (the RL loop cannot resume). It is renamed, never deleted, so the rerun starts
    fresh; anything that is not a qatfactory run directory stops the run, untouched."""
    from qatfactory import _fsutil
    if not rd.exists() and not rd.is_symlink():
        return
    if _fsutil.kind_of(rd) not in ("run", "empty"):
        raise SystemExit(f"qerl: {rd} exists and is not a qatfactory run directory; remove it or choose "
                         f"another --out")
    aside = rd.with_name(f"{rd.name}.cut-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(rd, aside)
    print(f"[qerl] {rd.name}: an unfinished earlier run (cut by a time limit) moved to {aside.name}", flush=True)


def run_arm(name: str, seed: int, args, base: List[str], out: Path, warm: Optional[Dict]) -> Dict:
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    from qatfactory.train.runlog import read_metrics
    fmt, aqn = ARMS[name]
    rd = out / "runs" / f"{name}-seed{seed}"
    _set_aside_unfinished(rd)
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
           "warmup_sha256": warm["sha256"] if warm else None,
           "entropy_step0": evals[0]["eval/entropy"] if evals else None,
           "entropy_greedy_step0": evals[0]["eval/entropy_greedy"] if evals else None,
           "curve": {k: [r.get(k) for r in steps] for k in ("reward", "correct", "format", "entropy",
                                                              "rollout_entropy", "aqn/sigma", "aqn/sigma_eff",
                                                              "frac_zero_std", "completion_len", "step_ms")},
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


# ----------------------------------------------------------------------------- state, report, merge
def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def missing_arms(state: Dict) -> List[str]:
    seeds = sorted({r["seed"] for r in state["results"]} | set(state.get("seeds", [])) or {0})
    have = {(r["arm"], r["seed"]) for r in state["results"]}
    return [f"{a} seed {s}" for s in seeds for a in ARMS if (a, s) not in have]


def report(state: Dict, out: Path) -> str:
    by: Dict[str, List[Dict]] = {}
    for r in state["results"]:
        by.setdefault(r["arm"], []).append(r)
    calib, warm, st = state.get("calibration") or {}, state.get("warmup"), state["settings"]
    ref_step = _mean([r["step_ms_median"] for r in by.get("bf16_lora", [])])
    ref_tok = _mean([r["rollout_tokens_per_s_median"] for r in by.get("bf16_lora", [])])
    head = ("SMOKE (random tiny model on CPU, shaped say-7 reward): checks the plumbing, measures nothing about QeRL"
            if st["smoke"] else f"SmolLM2-135M-Instruct on {st['device']}, DAPO-style loss, "
                                + (f"{st['steps']} RL steps, " if state["results"] else "warm-up and calibration only, ")
                                + f"arithmetic task level {calib.get('level')}")
    lines = [f"# QeRL small-scale reproduction ({state.get('date') or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", head, ""]
    if warm:
        lines.append(f"Warm-up (shared by every arm): {warm['steps']} steps x {warm['batch']} worked solutions, lr "
                     f"{warm['lr']}, loss {warm['loss_first']:.3f} -> {warm['loss_last']:.3f}, "
                     f"{warm['time_s']:.0f} s on {warm.get('device')}, weights sha256 {warm['sha256'][:16]}..")
    else:
        lines.append("No warm-up (--warmup-steps 0).")
    if calib:
        lines.append(f"Calibration at T=1 on {calib.get('prompts')} prompts: pass rates {calib.get('pass_rates')}, "
                     f"format {calib.get('format_rates')}; band {calib.get('band')}: level {calib.get('level')}"
                     + ("" if calib.get("in_band", True) else " (NOT in the band: the nearest)")
                     + (" -- NO LEVEL HAD ANY CORRECT COMPLETION" if calib.get("no_signal") else ""))
    eff = (warm or {}).get("effect")
    if eff:
        lines += ["", "| warm-up effect (held-out prompts) | format greedy | pass greedy | format T=1 | pass T=1 | "
                      "tokens/completion (T=1) | token entropy (T=1) |", "|---|---|---|---|---|---|---|"]
        for lv in eff["levels"]:
            for when, label in (("before", "before"), ("after", "after"), ("after_nvfp4", "after, NVFP4 PTQ")):
                g, s = eff.get(f"{when}/level{lv}/greedy"), eff.get(f"{when}/level{lv}/t1")
                if g and s:
                    lines.append(f"| level {lv}, {label} ({eff['prompts']} prompts) | {g['format']:.3f} | {g['pass']:.3f} | "
                                 f"{s['format']:.3f} | {s['pass']:.3f} | {s['completion_tokens']:.1f} | "
                                 f"{s.get('entropy', float('nan')):.3f} |")
    if not state["results"]:
        text = "\n".join(lines + ["", "No arm has run yet."]) + "\n"
        (out / "qerl.md").write_text(text)
        return text
    lines += ["", "| arm | seeds | entropy@0 (sampled) | entropy@0 (greedy path) | reward (mean over steps) | "
              "held-out acc start -> end | sampled pass@1 end | GSM8K end | step ms | vs bf16 | rollout tok/s | vs bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ARMS:
        rs = by.get(name, [])
        if not rs:
            continue
        stp, tk = _mean([r["step_ms_median"] for r in rs]), _mean([r["rollout_tokens_per_s_median"] for r in rs])
        acc0 = _mean([r["eval"][0]["eval/accuracy"] for r in rs if r["eval"]])
        acc1 = _mean([r["final"]["eval/accuracy"] for r in rs if r["final"]])
        lines.append(f"| {name} | {len(rs)} | {_mean([r['entropy_step0'] for r in rs]):.4f} | "
                     f"{_mean([r['entropy_greedy_step0'] for r in rs]):.4f} | {_mean([r['reward_auc'] for r in rs]):.4f} | "
                     f"{acc0:.3f} -> {acc1:.3f} | {_mean([r['final']['eval/pass1_sampled'] for r in rs if r['final']]):.3f} | "
                     f"{_mean([r['gsm8k/accuracy'] for r in rs]):.3f} | {stp:.0f} | {stp / ref_step:.2f}x | {tk:.0f} | "
                     f"{tk / ref_tok:.2f}x |")
    miss = missing_arms(state)
    lines += ["", f"Missing arms: {', '.join(miss)}." if miss else "Every arm ran."]
    if state.get("mismatch"):
        lines.append(f"MERGED DESPITE MISMATCHES (--allow-mismatch): {'; '.join(state['mismatch'])}")
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
    if by:
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "qerl.png", dpi=100)
    plt.close(fig)


def _comparable(a: Dict, b: Dict) -> List[str]:
    """Why two calls' arms do not belong in one table ([] when they do)."""
    why = [f"settings.{k}: {a['settings'].get(k)!r} vs {b['settings'].get(k)!r}"
           for k in sorted(set(a["settings"]) | set(b["settings"])) if a["settings"].get(k) != b["settings"].get(k)]
    wa, wb = (a.get("warmup") or {}).get("sha256"), (b.get("warmup") or {}).get("sha256")
    if wa != wb:
        why.append(f"warm-up weights sha256 {str(wa)[:16]} vs {str(wb)[:16]} (the arms start from different models)")
    la, lb = (a.get("calibration") or {}).get("level"), (b.get("calibration") or {}).get("level")
    if la != lb:
        why.append(f"arithmetic level {la} vs {lb}")
    return why


def merge(files: List[str], out: Path, allow_mismatch: bool) -> Dict:
    states = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise Refused(f"--merge: {f} is not a file (a qerl.json written by this script)")
        s = json.loads(p.read_text())
        if not isinstance(s, dict) or "settings" not in s or "results" not in s:
            raise Refused(f"--merge: {f} is not a qerl.json of this script (no settings / results)")
        states.append(s)
    problems = [f"{files[0]} vs {f}: {w}" for f, s in zip(files[1:], states[1:]) for w in _comparable(states[0], s)]
    if problems and not allow_mismatch:
        raise Refused("--merge: these parts do not belong in one table:\n  " + "\n  ".join(problems)
                      + "\n(--allow-mismatch merges anyway and says so in the report)")
    seen, results = set(), []
    for f, s in zip(files, states):
        for r in s["results"]:
            k = (r["arm"], r["seed"])
            if k in seen:
                print(f"[qerl] --merge: {r['arm']} seed {r['seed']} again in {f}; keeping the first", flush=True)
                continue
            seen.add(k)
            results.append(r)
    merged = dict(states[0], results=results, merged_from=list(files), mismatch=problems,
                  seeds=sorted({sd for s in states for sd in s.get("seeds", [])}),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return merged


# ----------------------------------------------------------------------------- main
def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on a random tiny model")
    ap.add_argument("--out", default="runs/qerl")
    ap.add_argument("--phase", choices=("all", "warmup"), default="all",
                    help="warmup: stop after the warm-up, the calibration and the before/after evaluation")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (2 where time allows)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (a part of the run: see --merge)")
    ap.add_argument("--steps", type=int, default=0, help="RL steps per arm (default 30; smoke 2)")
    ap.add_argument("--lr", type=float, default=1e-4, help="one learning rate for every arm")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n-eval", type=int, default=256, help="held-out prompts (start/end evaluation, entropy@0)")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: start/end)")
    ap.add_argument("--gsm8k-items", type=int, default=319, help="GSM8K held-out items at the end (0: skip)")
    ap.add_argument("--level", type=int, default=-1, help="arithmetic level; -1 = calibrate")
    ap.add_argument("--band", type=_floats, default=[0.2, 0.6], help="calibration band lo,hi (pass rate at T=1)")
    ap.add_argument("--calib-prompts", type=int, default=128)
    ap.add_argument("--allow-no-signal", action=argparse.BooleanOptionalAction, default=None,
                    help="go on when no level has any correct completion (default: only with --smoke)")
    ap.add_argument("--warmup-steps", type=int, default=None, help=f"supervised warm-up steps (default {WARMUP_STEPS}; "
                                                                   f"smoke 2; 0: none)")
    ap.add_argument("--warmup-batch", type=int, default=None, help=f"worked solutions per warm-up step (default {WARMUP_BATCH})")
    ap.add_argument("--warmup-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-levels", type=_ints, default=[], help="arith levels of the warm-up data (default all)")
    ap.add_argument("--warmup-seed", type=int, default=0)
    ap.add_argument("--warmup-eval", type=int, default=64, help="held-out prompts of the before/after evaluation")
    ap.add_argument("--effect-levels", type=lambda v: [x.strip() for x in v.split(",") if x.strip()], default=["cal"],
                    help="levels of the before/after evaluation: ints and/or 'cal' (the calibrated one)")
    ap.add_argument("--merge", nargs="+", metavar="QERL_JSON", help="build one table and plot from parts' qerl.json")
    ap.add_argument("--allow-mismatch", action="store_true", help="--merge parts whose settings or warm-ups differ")
    args = ap.parse_args(argv)
    if args.warmup_steps is None:
        args.warmup_steps = 2 if args.smoke else WARMUP_STEPS
    if args.warmup_batch is None:
        args.warmup_batch = 2 if args.smoke else WARMUP_BATCH
    if args.allow_no_signal is None:
        args.allow_no_signal = args.smoke
    if args.smoke:
        args.device, args.warmup_eval = "cpu", 2
    if len(args.band) != 2 or not 0 <= args.band[0] <= args.band[1] <= 1:
        ap.error(f"--band {args.band}: two pass rates lo,hi with 0 <= lo <= hi <= 1")
    args.seed_list = _ints(args.seeds)
    args.arm_list = [a for a in args.arms.split(",") if a]
    bad = [a for a in args.arm_list if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {bad}; allowed: {list(ARMS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.merge:
            state = merge(args.merge, out, args.allow_mismatch)
            _write_json(out / STATE, state)
            print(report(state, out), flush=True)
            return 0
        return _run(args, out)
    except Refused as e:
        print(f"[qerl] refused: {e}", file=sys.stderr, flush=True)
        return 3


def _run(args, out: Path) -> int:
    from qatfactory.train.rl.rewards import NoSignal
    base = common(args)
    st = settings(args)
    state = {"smoke": args.smoke, "settings": st, "seeds": args.seed_list, "results": [], "argv": sys.argv[1:],
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    old = json.loads((out / STATE).read_text()) if (out / STATE).is_file() else None
    if old is not None:
        if old.get("settings") != st:
            why = [k for k in sorted(set(st) | set(old.get("settings", {}))) if st.get(k) != old.get("settings", {}).get(k)]
            raise Refused(f"{out / STATE} holds arms run with other settings ({', '.join(why)}); use another --out")
        oc = old.get("calibration") or {}
        if args.level >= 0 and "level" in oc and oc["level"] != args.level:
            raise Refused(f"{out / STATE} holds arms at arithmetic level {oc['level']}, --level asks for {args.level}; "
                          f"use another --out")
        state.update(results=old["results"], seeds=sorted(set(old.get("seeds", [])) | set(args.seed_list)),
                     calibration=oc if "level" in oc else None)
    warm = warm_up(args, base, out)
    if warm is not None:
        if old is not None and (old.get("warmup") or {}).get("sha256") not in (None, warm["sha256"]):
            raise Refused(f"{out / STATE} holds arms warmed up to sha256 {old['warmup']['sha256'][:16]}.., this warm-up "
                          f"is {warm['sha256'][:16]}..; use another --out")
        warm = dict(warm, effect=((old or {}).get("warmup") or {}).get("effect"))
        state["warmup"] = warm
        base_w = base + [f"model.path={warm['dir']}"]
    else:
        base_w = base
    if args.level >= 0 and not state.get("calibration"):
        state["calibration"] = {"level": args.level, "pass_rates": {}, "given": True}
    elif not state.get("calibration"):
        try:
            state["calibration"] = calibrate(args, base_w)
        except NoSignal as e:
            state["calibration"] = {"error": str(e)}
            _write_json(out / STATE, state)
            raise Refused(str(e)) from None
    calib = state["calibration"]
    print(f"[qerl] arithmetic level {calib['level']} (pass rates {calib['pass_rates']})", flush=True)
    if warm is not None and not warm.get("effect"):
        levels = [0] if args.smoke else sorted({calib["level"] if x == "cal" else int(x) for x in args.effect_levels})
        warm["effect"] = warmup_effect(args, base, warm["dir"], levels)
    _write_json(out / STATE, state)
    if args.phase == "warmup":
        print(report(state, out), flush=True)
        return 0
    if not args.smoke:
        base_w = base_w + [f"method.rl.task_level={calib['level']}"]
    done = {(r["arm"], r["seed"]) for r in state["results"]}
    for seed in args.seed_list:
        for a in args.arm_list:
            if (a, seed) in done:
                print(f"[qerl] arm {a} seed {seed}: already in {out / STATE}", flush=True)
                continue
            print(f"[qerl] arm {a} seed {seed}", flush=True)
            state["results"].append(run_arm(a, seed, args, base_w, out, warm))
            _write_json(out / STATE, state)
            report(state, out)
    text = report(state, out)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
