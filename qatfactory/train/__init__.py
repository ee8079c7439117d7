"""The QAT/QAD trainer under DeepSpeed: ``run(compose([...]))`` or ``python -m qatfactory.train k=v ...``.

``run`` returns the run summary with ``summary["student"]`` (train.methods.Student); it exports
nothing: ``qatfactory.faces.ship.train_and_ship`` (what ``qatfactory train`` runs) also ships it."""
from .config import RunConfig, compose, validate
from .loop import run as _run

__all__ = ["RunConfig", "compose", "validate", "run"]


def run(cfg, eval_only: bool = False):
    """Train as the RunConfig says; returns the summary dict (see loop.run), the student in it."""
    return _run(cfg, eval_only=eval_only)
