"""The QAT/QAD trainer under DeepSpeed: ``run(compose([...]))`` or ``python -m qatfactory.train k=v ...``."""
from .config import RunConfig, compose, validate

__all__ = ["RunConfig", "compose", "validate", "run"]


def run(cfg, eval_only: bool = False):
    """Train as the RunConfig says; returns the summary dict (see engine.run)."""
    from .engine import run as _run
    return _run(cfg, eval_only=eval_only)
