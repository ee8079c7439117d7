"""Keep the commands' output ours: drop the known lines third-party libraries print on every import.

Our entry points (``qatfactory ...``, ``python -m qatfactory.train``, the demo) call :func:`install` before
they import torch's neighbours. Each rule is scoped to one library's logger or warning and one message, so
anything else those libraries say (a real warning, an error) still reaches the user:

* torchao tries to load its CUDA / CUTLASS extensions at import and logs one "Failed to load" line per
  ``.so`` on a machine or torch build they were not made for (the pure-PyTorch paths we use need none);
* torchao's int8 matmul module says at import that Triton is missing (a CPU install has none; we do not use it);
* torchao registers its enums as pytree constants, which torch now logs as deprecated, once per enum;
* DeepSpeed logs "Setting accelerator to CPU" at import on every machine without a GPU;
* Model Optimizer warns at import that the installed transformers is newer than the one it was tested with
  (the gate's checks of its decoders run in ``make test`` with the pinned versions);
* transformers draws a "Loading weights" progress bar for every tiny model the gate rebuilds.
"""
from __future__ import annotations

import logging
import os
import subprocess
import warnings
from typing import Iterable, Optional

# (logger name, the start of each message dropped)
_LOG_RULES = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    "DeepSpeed": ("Setting accelerator to CPU.",),
}


class _DropMessages(logging.Filter):
    def __init__(self, starts: Iterable[str]):
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not msg.startswith(self.starts)


_installed = False


def install() -> None:
    """Idempotent. Call it before torch, transformers and DeepSpeed are imported: the filters sit on the
    libraries' named loggers (logging keeps them when a library later sets its own level and handlers), the
    progress-bar setting is read at import."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, starts in _LOG_RULES.items():
        logging.getLogger(name).addFilter(_DropMessages(starts))
    warnings.filterwarnings("ignore", message=r"transformers .* is not tested with current version of modelopt",
                            category=UserWarning)
    # huggingface_hub reads this once at import and transformers' progress bars follow it; a user's own
    # setting wins
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def git_commit(cwd: Optional[str] = None) -> Optional[str]:
    """The commit of the git work tree holding ``cwd``, or None. git runs only when ``cwd`` is inside a work
    tree (asked first with stderr captured), so a run outside a clone prints no "fatal: not a git repository"."""
    try:
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=cwd, capture_output=True,
                                text=True, timeout=10)
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        r = subprocess.run(["git", "describe", "--always"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return r.stdout.strip() or None
