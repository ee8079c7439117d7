"""The experiment trackers a run reports to (``train.report_to``, as Hugging Face's ``report_to``): TensorBoard,
Weights & Biases, MLflow, each only when installed; metrics.jsonl is written either way.

Names are the ones a Hugging Face Trainer's tracker callbacks write (transformers' ``rewrite_logs``): a
training value ``x`` is ``train/x``, an evaluation stays ``eval/x``, and the learning rate is
``train/learning_rate``. A QAD run through ``qatfactory train`` and one through
``qatfactory.integrations.transformers`` then show ``train/loss``, ``train/learning_rate`` and ``train/kl``
side by side in one dashboard. metrics.jsonl keeps the loop's own keys (``loss``, ``lr``, ``eval/kl``).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

TRACKERS = ("tensorboard", "wandb", "mlflow")
# the module that must be importable for each (torch.utils.tensorboard needs the tensorboard package)
_MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_RENAME = {"lr": "learning_rate"}


def installed(name: str) -> bool:
    return importlib.util.find_spec(_MODULE[name]) is not None


def check(report_to: Optional[Sequence[str]]) -> None:
    """Refuse a ``train.report_to`` that names an unknown tracker or one that is not installed (before the run)."""
    if report_to is None:
        return
    names = list(report_to)
    if names in (["all"], ["none"]):
        return
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"train.report_to={names}: {n!r} is not a tracker; allowed: a list of {list(TRACKERS)}, "
                             f"[all] (those installed) or [none]")
        if not installed(n):
            raise ValueError(f"train.report_to={names}: {n} is not installed (pip install {_MODULE[n]}); allowed: "
                             f"the installed ones {[t for t in TRACKERS if installed(t)]}, [all] or [none]")


def resolve(report_to: Optional[Sequence[str]], tensorboard: Optional[bool]) -> List[str]:
    """The trackers of a run. ``report_to`` None: TensorBoard when installed unless ``train.tensorboard=false``
    (what the loop did before trackers could be named); ``[all]``: every installed one; ``[none]``: none."""
    if report_to is None:
        return ["tensorboard"] if tensorboard is not False and installed("tensorboard") else []
    names = list(report_to)
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [t for t in TRACKERS if installed(t)]
    return names


def tracker_key(key: str) -> str:
    """A record's key as the Hugging Face trackers name it: ``train/<name>`` or ``eval/<name>``."""
    if key.startswith("eval/"):
        return key
    return f"train/{_RENAME.get(key, key)}"


class Trackers:
    """Open trackers of one run (rank 0): ``log(record)`` sends its numbers at ``record["step"]``."""

    def __init__(self, names: Sequence[str], run_dir: Path, config: Optional[Dict[str, Any]] = None):
        self.sinks = []
        for n in names:
            self.sinks.append((n, getattr(self, f"_open_{n}")(Path(run_dir), config or {})))

    @staticmethod
    def _open_tensorboard(run_dir: Path, config):
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (optional: tensorboard)
        return SummaryWriter(str(run_dir / "tb"))

    @staticmethod
    def _open_wandb(run_dir: Path, config):
        import wandb  # noqa: PLC0415 (optional: wandb)
        # WANDB_PROJECT / WANDB_MODE and the rest of wandb's own variables apply, as with the HF Trainer
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "qatfactory"), name=run_dir.name,
                          dir=str(run_dir), config=config, reinit=True)

    @staticmethod
    def _open_mlflow(run_dir: Path, config):
        import mlflow  # noqa: PLC0415 (optional: mlflow)
        run = mlflow.start_run(run_name=run_dir.name, nested=mlflow.active_run() is not None)
        flat = {k: str(v)[:500] for k, v in _flatten(config).items()}
        for i in range(0, len(flat), 100):         # MLflow takes at most 100 parameters a call
            mlflow.log_params(dict(list(flat.items())[i:i + 100]))
        return run

    def log(self, rec: Dict[str, Any]) -> None:
        step = int(rec["step"])
        vals = {tracker_key(k): float(v) for k, v in rec.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not vals:
            return
        for name, sink in self.sinks:
            if name == "tensorboard":
                for k, v in vals.items():
                    sink.add_scalar(k, v, step)
            elif name == "wandb":
                sink.log(vals, step=step)
            else:
                import mlflow  # noqa: PLC0415 (optional: mlflow)
                mlflow.log_metrics(vals, step=step)

    def close(self) -> None:
        for name, sink in self.sinks:
            if name == "tensorboard":
                sink.close()
            elif name == "wandb":
                sink.finish()
            else:
                import mlflow  # noqa: PLC0415 (optional: mlflow)
                mlflow.end_run()
        self.sinks = []


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
