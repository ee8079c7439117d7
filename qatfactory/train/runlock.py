"""One process at a time in a run directory: an flock on ``<run_dir>/.qatfactory_run.lock``.

Two ``qatfactory train ... run_dir=R resume=auto`` on one folder would both write checkpoints and
metrics.jsonl into it. Rank 0 takes an exclusive, non-blocking ``fcntl.flock`` on the lock file before
it decides anything about the directory and holds it for the whole run (the trainer and, through
:func:`held`, the export after it). A second process is refused at once, naming the holder's process id
(written into the file). The kernel drops the lock when the holder's file is closed, so a killed run
leaves no stale lock: the file may stay, the lock does not.

The file is removed when the lock is given back. Removing a lock file is safe only if nobody can lock
the removed inode afterwards, so a taker checks, after its flock succeeded, that the path still names
the file it locked, and tries again when it does not.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Tuple

from .._fsutil import RUN_LOCK
from ..exitcodes import BadInputError


class RunLockedError(BadInputError):
    """Another process runs in this run directory."""


# resolved run directory -> (open lock file, whether this process created the directory for it)
_HELD: Dict[str, Tuple[int, bool]] = {}
_DEPTH = 0


def _holder(p: Path) -> str:
    try:
        who = p.read_text().strip()
    except OSError:
        who = ""
    return who or "another process (it has not written its id yet)"


def acquire(run_dir) -> None:
    """Lock ``run_dir`` for this process (created when missing); re-entrant within one process.
    RunLockedError (exit code 4) naming the holder when another process has it."""
    d = Path(run_dir)
    key = os.path.realpath(d)
    if key in _HELD:
        return
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    p = d / RUN_LOCK
    for _ in range(100):
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(f"run_dir={str(d)!r} is in use: {_holder(p)} holds its lock ({p}); two runs never "
                                 f"write into one run directory at once. Wait for it to finish, or choose another "
                                 f"run_dir. Nothing was changed") from None
        try:
            same = os.stat(p, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
            _HELD[key] = (fd, created)
            return
        os.close(fd)            # the holder removed the file between our open and our lock: take the new one
    raise RunLockedError(f"run_dir={str(d)!r}: its lock file {p} keeps changing; another process is starting and "
                         f"stopping runs in it")


def release(run_dir) -> None:
    """Give the lock back (remove the file, then close it); a directory this process created for the lock
    and that holds nothing else is removed too (a refused run leaves nothing behind)."""
    d = Path(run_dir)
    got = _HELD.pop(os.path.realpath(d), None)
    if got is None:
        return
    fd, created = got
    try:
        os.unlink(d / RUN_LOCK)
    except FileNotFoundError:
        pass
    os.close(fd)
    if created:
        try:
            os.rmdir(d)
        except OSError:
            pass        # the run wrote into it: kept


def release_all() -> None:
    for key in list(_HELD):
        fd, _ = _HELD.pop(key)
        try:
            os.unlink(Path(key) / RUN_LOCK)
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def held() -> Iterator[None]:
    """Locks taken inside are given back when the outermost ``held`` block ends (the trainer's run, or the
    run and the export that ships it)."""
    global _DEPTH
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            release_all()
