"""Run logs: JSONL (always), the trackers of train.report_to (trackers.py), a progress bar, PNG plots and a summary."""
from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from . import trackers


def memory_gb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # Linux: KiB


class RunLogger:
    """Rank 0 writes; other ranks hold a silent logger. ``report_to`` (train.report_to): the trackers beside
    metrics.jsonl (trackers.py; None: TensorBoard when installed, unless ``tensorboard`` is False);
    ``config``: the run's settings, which wandb and MLflow record with the run."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: Optional[bool] = None, progress: bool = True,
                 total: int = 0, start: int = 0, report_to: Optional[Sequence[str]] = None,
                 config: Optional[Dict] = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        self.bar = None
        if not enabled:
            return
        names = trackers.resolve(report_to, tensorboard)
        try:
            self.tb = trackers.Trackers(names, run_dir, config)
        except ImportError:
            if report_to is not None:
                raise
            names = []
        if report_to is None and tensorboard and "tensorboard" not in names:
            # only a run that asked for TensorBoard hears that it is missing: metrics.jsonl has it all
            print("[qatfactory] tensorboard is not installed: logging to metrics.jsonl only "
                  "(pip install tensorboard for TensorBoard logs)", flush=True)
        if progress and total > start:
            self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps the resumed run will redo (and a line torn by a kill,
        which is named and dropped)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for i, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            rec = _parse(line)
            if rec is None:
                print(f"[qatfactory] {self.path}:{i}: not a JSON record (torn by an interrupted write?); dropped",
                      flush=True)
                continue
            if rec.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(l + "\n" for l in keep))
        os.replace(tmp, self.path)

    def log(self, rec: Dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            self.tb.log(rec)

    def progress(self, n: int, **post) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in post.items()},
                                 refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def _parse(line: str):
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def read_metrics(run_dir) -> List[Dict]:
    """The records of metrics.jsonl; a line that does not parse (torn by a kill) is skipped."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    return [r for r in (_parse(l) for l in p.read_text(errors="replace").splitlines() if l.strip()) if r is not None]


def plot_curves(run_dir, groups: Optional[Dict[str, Sequence[str]]] = None) -> List[Path]:
    """PNG plots (plots/<group>.png) of the logged curves; ``groups``: group -> keys (the method's
    Method.plots; default: training loss / lr / throughput and the eval metrics). A key no record
    holds is left out; five panels a row. Returns the written paths."""
    import matplotlib  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (heavy: matplotlib; Agg is chosen at the first plot)
    recs = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    if groups is None:
        groups = {"train": ["loss", "lr", "tokens_per_s"], "eval": ["eval/kl", "eval/ce", "eval/top1"]}
    for name, keys in groups.items():
        keys = [k for k in keys if any(k in r for r in recs)]
        if not keys:
            continue
        cols = min(len(keys), 5)
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, k in zip(axes.flat, keys):
            pts = [(r["step"], r[k]) for r in recs if k in r and r[k] is not None and math.isfinite(r[k])]
            if pts:
                ax.plot(*zip(*pts), marker="o" if k.startswith("eval/") else None, ms=3)
            ax.set_title(k)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.tight_layout()
        p = out_dir / f"{name}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    return written


def summary_text(summary: Dict, keys: Sequence[str] = ("kl", "ce", "ppl", "top1")) -> str:
    """The printed end of a run: what ran, the first and last evaluation of each ``eval/<key>``, and
    where the run's outputs are."""
    lines = [f"run: {summary['run_dir']}",
             f"method={summary['method']} format={summary['format']} steps={summary['steps']} "
             f"tokens={summary['tokens']} time={summary['time_s']:.1f}s"]
    first, last = summary.get("eval_first"), summary.get("eval_last")
    if first:
        lines.append(f"{'':20s}{'start':>12s}{'end':>12s}")
        for k in keys:
            a = first.get(f"eval/{k}")
            b = (last or {}).get(f"eval/{k}")
            fa = "-" if a is None else f"{a:.5g}"
            fb = "-" if b is None else f"{b:.5g}"
            lines.append(f"{'eval/' + k:20s}{fa:>12s}{fb:>12s}")
    for k, label in (("student_dir", "student"), ("adapter_dir", "adapter_dir"), ("scale_file", "scale_file"),
                     ("merge_kl_to_trained", "merge_kl_to_trained")):
        if summary.get(k) is not None:
            lines.append(f"{label}: {summary[k]}")
    return "\n".join(lines)
