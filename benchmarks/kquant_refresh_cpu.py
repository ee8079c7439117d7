"""The demo's Q4_K_M QAD on CPU with the k-quant scale search every K optimizer steps
(``quant.kquant_refresh_every``): seconds per step and the trained result, K in {1, 4, 16}.

    .venv/bin/python benchmarks/kquant_refresh_cpu.py [--k 1,4,16] [--repeat 2] [--threads N] [--out DIR]

Each run is the demo's ``q4_k`` target as ``qatfactory demo`` runs it, built from the library pieces the
demo is built from (qatfactory/train/demo_recipe.py: the demo's Settings, its q4_k target and
``train_config``; qatfactory/train/heldout.py: the data files and the evaluation): SmolLM2-135M-Instruct
from the packaged asset, the seeded Wikipedia split, 24 steps of 2 x 256 tokens, lr 3e-5 constant, live
teacher, compute dtype as the demo picks it, with ``quant.kquant_refresh_every=K`` set on its RunConfig;
then the demo's own evaluation of the trained student (``HeldOut.evaluate``: full-vocabulary KL to the
teacher, perplexity, top-1 agreement on the 8 held-out samples), ``convert`` + ``qatfactory.faces.ship.ship``
to llama.cpp with the parity gate, and llama.cpp's own
``llama-perplexity --kl-divergence`` of the exported GGUF against the teacher (llama_compare.py, as the
demo scores it). One PTQ row (prepare + calibrate, no training) is the starting point.

Every run is its own process (``--worker``), the arms interleaved and the order reversed on every other
repeat (1, 4, 16, 16, 4, 1, ...), all with the same intra-op thread count (``--threads``; default: what
the demo's rule, ``cpu.choose_threads``, gives at the start). Reported per K: seconds per optimizer step
(the trainer's own ``step_ms``; mean over the run's steps, per run, then the median and range over the
repeats; step 1 apart: it pays one-time set-up), the trainer's wall time, and the trained result (which
is deterministic: every repeat must give the same GGUF bytes, checked by sha256). Writes
``<out>/kquant_refresh_cpu.json`` and prints a Markdown table. A script, not a test: speed is never asserted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _setup(threads: int, steps=None, seed=None):
    """(settings, model dir, tokenizer-side data record, held-out evaluator, train/eval samples, dtype): the
    demo's, built the way run_demo builds them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qatfactory import assets, cpu
    from qatfactory.train.data import DataConfig, load_data
    from qatfactory.train.demo_recipe import Settings
    from qatfactory.train.heldout import HeldOut, prepare_data
    torch.set_num_threads(threads)
    s = Settings(targets=["q4_k"])
    if seed is not None:
        s.seed = int(seed)              # another data split and order (--seed); the demo's otherwise
    if steps:
        s.steps = int(steps)            # a smoke run (--steps); the demo's 24 otherwise
    comp = cpu.compute_dtype("cpu", None)
    s.dtype = comp["dtype"]
    tdt = getattr(torch, s.dtype)
    model_dir = assets.prepare_model_dir("smollm2")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    data = prepare_data(tok, s, assets.cache_dir())
    dcfg = DataConfig(train=[data["train"]], eval=[data["eval"]], eval_samples=s.eval_samples, seq_len=s.seq_len)
    teacher = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=tdt)
    vocab = teacher.get_output_embeddings().weight.shape[0]
    train_s, eval_s = load_data(dcfg, tok, vocab, s.seed)
    if len(eval_s) > s.eval_samples:
        eval_s = eval_s.slice(0, s.eval_samples)
    held = HeldOut(eval_s, max(s.micro_batch, 4), "cpu")
    held.fill_teacher(teacher, tdt)
    teacher_eval = held.evaluate(teacher)
    del teacher
    return s, model_dir, data, held, train_s, teacher_eval, comp


def _score(sc_d, gguf_path, label):
    from qatfactory.faces import llama_compare as LC
    sc = LC.Scorer(**sc_d)
    return LC.score(sc, gguf_path, label)


def _sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def worker(arm: str, threads: int, out: Path, scorer: dict, steps=None, seed=None) -> dict:
    """One run: arm 'ptq' or 'K<n>'."""
    import torch
    from transformers import AutoModelForCausalLM

    from qatfactory import quantize as Q
    from qatfactory.nn import kquant_refresh
    from qatfactory.train.config import validate
    from qatfactory.train.demo_recipe import TARGETS, train_config
    from qatfactory.train.loop import run as train
    t_all = time.time()
    s, model_dir, data, held, train_s, teacher_eval, comp = _setup(threads, steps, seed)
    tg = TARGETS["q4_k"]
    rec = {"arm": arm, "threads": torch.get_num_threads(), "dtype": s.dtype, "load_start": os.getloadavg()[0]}
    if arm == "ptq":
        qcfg = Q.QuantConfig.preset(tg.preset)
        m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, s.dtype))
        Q.prepare(m, qcfg)
        calib = [train_s.select([i]) for i in range(min(s.calib_samples, len(train_s)))]
        Q.calibrate(m, [{"input_ids": b["input_ids"], "attention_mask": b["attn"]} for b in calib], qcfg.calib_method)
        rec["torch"] = held.evaluate(m)
        lm = m
    else:
        K = int(arm[1:])
        rdir = out / f"run-{arm}-{int(time.time())}"
        cfg, _ = train_config(tg, s, model_dir, data, rdir, out / "teacher-cache", "cpu")
        cfg.quant.kquant_refresh_every = K
        cfg = validate(cfg)
        kquant_refresh.reset_stats()
        summary = train(cfg)
        summary.pop("engine")
        lm = summary.pop("student").model
        steps = [json.loads(x) for x in (rdir / "metrics.jsonl").read_text().splitlines() if '"step_ms"' in x]
        rec["step_ms"] = [r["step_ms"] for r in steps]
        rec["loss"] = [r["loss"] for r in steps]
        rec["train_s"] = summary["time_s"]
        rec["kq_stats"] = kquant_refresh.stats()
        rec["torch"] = held.evaluate(lm)
    rec["gate"], edir = _ship_gguf(lm, model_dir, out / "exports" / f"q4_k-{arm}-llama_cpp-gguf")
    gg = edir / "model.gguf"
    rec["gguf_sha256"] = _sha(gg)
    if scorer:
        r = _score(scorer, gg, arm)
        rec["llama_cpp"] = {k: r[k] for k in ("kl", "ppl", "ppl_base", "top1", "tokens")}
    rec["load_end"] = os.getloadavg()[0]
    rec["wall_s"] = time.time() - t_all
    rec["teacher_torch"] = teacher_eval
    return rec


def _ship_gguf(lm, model_dir: Path, edir: Path):
    """(gate verdict or the refusal, export dir): convert + ship to llama.cpp with the parity gate, as the demo
    ships its q4_k student (a gate that does not PASS moves the export to .FAILED; its table sits beside it)."""
    from qatfactory import quantize as Q
    from qatfactory.faces.ship import ship
    conv = Q.convert(lm)            # a CPU run: the packed tensors are on the CPU already
    if conv.source_dir is None:
        conv.source_dir = str(model_dir)
    try:
        sh = ship(conv, "llama_cpp", "gguf", edir, verify=True, force=True)
    except Exception as ex:   # noqa: BLE001 - the refusal is the row's gate cell
        return f"{type(ex).__name__}: {ex}", edir
    if sh.report is None:
        return None, Path(sh.path)
    (edir.parent / f"{edir.name}.verify.txt").write_text(sh.report.table())
    return sh.report.verdict, Path(sh.path)


def _run_worker(arm: str, threads: int, out: Path, scorer: dict, steps=None, seed=None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", arm, "--threads", str(threads),
           "--out", str(out), "--scorer", json.dumps(scorer)] + (["--steps", str(steps)] if steps else []) \
        + (["--seed", str(seed)] if seed is not None else [])
    r = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"worker {arm} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _make_scorer(out: Path, threads: int, seed=None) -> dict:
    from transformers import AutoTokenizer

    from qatfactory import assets
    from qatfactory.faces import llama_compare as LC
    from qatfactory.train.demo_recipe import Settings
    from qatfactory.train.heldout import prepare_data
    s = Settings(targets=["q4_k"])
    if seed is not None:
        s.seed = int(seed)
    model_dir = assets.prepare_model_dir("smollm2")
    data = prepare_data(AutoTokenizer.from_pretrained(str(model_dir)), s, assets.cache_dir())
    texts = [json.loads(line)["text"] for line in Path(data["eval"]).read_text().splitlines() if line.strip()]
    sc = LC.make_scorer(model_dir, texts, out / "llama_cpp", cache=assets.cache_dir(), ctx=s.seq_len, threads=threads)
    return LC.scorer_dict(sc)


def _versions() -> dict:
    from importlib import metadata
    v = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "deepspeed", "gguf", "llama_cpp_python"):
        try:
            v[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "qatfactory"], capture_output=True,
                           text=True).stdout.strip()
    v["qatfactory"] = rev.stdout.strip() + ("+dirty" if dirty else "")
    return v


def _table(res: dict, ks) -> str:
    lines = ["| run | s/step (median of runs; range) | steps 2-24: s/step | trainer wall s | searches / kept "
             "| torch KL | torch ppl | top-1 | llama.cpp KL | llama.cpp ppl | llama.cpp top-1 | gate | GGUF identical "
             "across repeats |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    p = res.get("ptq")
    if p:
        lc = p.get("llama_cpp", {})
        lines.append(f"| PTQ (no training) | | | | | {p['torch']['kl']:.4f} | {p['torch']['ppl']:.3f} | "
                     f"{p['torch']['top1']:.4f} | {lc.get('kl', float('nan')):.4f} | {lc.get('ppl', float('nan')):.3f} | "
                     f"{lc.get('top1', float('nan')):.4f} | {p['gate']} | |")
    for k in ks:
        runs = res.get(f"K{k}", [])
        if not runs:
            continue
        means = [statistics.mean(r["step_ms"]) / 1000 for r in runs]
        rest = [statistics.mean(r["step_ms"][1:]) / 1000 for r in runs]
        walls = [r["train_s"] for r in runs]
        r0 = runs[0]
        lc = r0.get("llama_cpp", {})
        same = len({r["gguf_sha256"] for r in runs}) == 1
        st = r0["kq_stats"]
        lines.append(f"| QAD K={k} | {statistics.median(means):.2f} ({min(means):.2f}-{max(means):.2f}) | "
                     f"{statistics.median(rest):.2f} ({min(rest):.2f}-{max(rest):.2f}) | "
                     f"{statistics.median(walls):.0f} ({min(walls):.0f}-{max(walls):.0f}) | {st['searches']} / {st['kept']} | "
                     f"{r0['torch']['kl']:.4f} | {r0['torch']['ppl']:.3f} | {r0['torch']['top1']:.4f} | "
                     f"{lc.get('kl', float('nan')):.4f} | {lc.get('ppl', float('nan')):.3f} | "
                     f"{lc.get('top1', float('nan')):.4f} | {r0['gate']} | {'yes' if same else 'NO'} ({len(runs)} runs) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="1,4,16", help="refresh periods to compare (comma-separated)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per K (interleaved, order reversed every other repeat)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the demo's rule at start)")
    ap.add_argument("--out", default=None, help="work and result directory (default runs/kquant-refresh-<time>)")
    ap.add_argument("--no-ptq", action="store_true", help="skip the PTQ row")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's own KL / perplexity")
    ap.add_argument("--steps", type=int, default=None, help="QAD steps (default: the demo's 24; fewer for a smoke run)")
    ap.add_argument("--seed", type=int, default=None, help="the data split's and training's seed (default: the demo's)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--scorer", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out or f"runs/kquant-refresh-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, out, json.loads(args.scorer), args.steps, args.seed),
                         default=str))
        return
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads
    why = "--threads"
    if threads is None:
        from qatfactory import cpu
        th = cpu.choose_threads()
        threads, why = th["threads"], th["why"]
    ks = [int(k) for k in args.k.split(",") if k]
    t0 = time.time()
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, {_cpu_name()}, {os.cpu_count()} CPUs (shared with other work), "
          f"load average {os.getloadavg()[0]:.2f}; {threads} intra-op thread(s) ({why})", flush=True)
    scorer = {} if args.no_llama_cpp else _make_scorer(out, max(1, os.cpu_count() or 1), args.seed)
    res: dict = {"versions": _versions(), "cpu": _cpu_name(), "threads": threads, "threads_why": why, "steps": args.steps,
                 "seed": args.seed,
                 "date": time.strftime("%Y-%m-%d %H:%M %Z"), "scorer": scorer}
    if not args.no_ptq:
        res["ptq"] = _run_worker("ptq", threads, out, scorer, args.steps, args.seed)
        print(f"#   PTQ: torch KL {res['ptq']['torch']['kl']:.4f}, gate {res['ptq']['gate']}", flush=True)
    for rep in range(args.repeat):
        order = ks if rep % 2 == 0 else list(reversed(ks))
        for k in order:
            r = _run_worker(f"K{k}", threads, out, scorer, args.steps, args.seed)
            res.setdefault(f"K{k}", []).append(r)
            print(f"#   rep {rep + 1}/{args.repeat} K={k}: {statistics.mean(r['step_ms']) / 1000:.2f} s/step, "
                  f"trainer {r['train_s']:.0f} s, torch KL {r['torch']['kl']:.4f}, "
                  f"llama.cpp KL {r.get('llama_cpp', {}).get('kl', float('nan')):.4f}, gate {r['gate']}, "
                  f"load {r['load_start']:.1f}-{r['load_end']:.1f}", flush=True)
            (out / "kquant_refresh_cpu.json").write_text(json.dumps(res, indent=1, default=str))
    res["seconds"] = time.time() - t0
    (out / "kquant_refresh_cpu.json").write_text(json.dumps(res, indent=1, default=str))
    print()
    print(_table(res, ks))
    loads = [x for k in ks for r in res.get(f"K{k}", []) for x in (r["load_start"], r["load_end"])]
    print(f"\nload average (1 min) at the runs' starts and ends: {min(loads):.1f} .. {max(loads):.1f}; "
          f"versions {res['versions']}; {res['seconds'] / 60:.1f} min in all; {out / 'kquant_refresh_cpu.json'}")


if __name__ == "__main__":
    main()
