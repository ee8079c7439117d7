"""Directories written atomically, and replaced only when they are provably ours.

A leaf module (the standard library, exitcodes and _inputs only; safetensors imported where used), so every layer may import it: exporters, quantize's
save_student, the trainer's checkpoints and run directories.

"Provably ours" means the directory holds the record its writer leaves in it:

    export   qatfactory.json with "qatfactory_export"   (exporters.base.export)
    student  qatfactory_quant.json                       (quantize.save_student)
    run      qatfactory_run.json with "qatfactory_run"   (the trainer's run directory)
    warmup   qatfactory_warmup.json                      (train.rl.warmup.save_model_dir)
    teacher_cache  meta.json with "qatfactory_teacher_cache" (distill.teachers.precompute_topk; caches
             written before that key have "renormalisation", which only that writer puts there)
    asset    qatfactory_provenance.json                  (assets.prepare_model_dir / prepare_tokenizer_dir)
    adapter  qatfactory_adapter.json with "qatfactory_adapter" (nn.adapter.save_peft_adapter; a PEFT
             adapter_config.json alone is anybody's)

or is empty. Anything else is somebody else's and is never deleted or replaced.

A write goes to ``.<name>.tmp-<writer>-XXXXXXXX`` beside the target and is renamed into place; a
replace renames the old target to ``.<name>.old-<writer>-XXXXXXXX`` first and deletes it after the
swap, so a kill at any moment leaves either the old or the new directory complete. :func:`recover`
(called before each write) puts an ``.old-*`` back when the swap was cut between its two renames and
removes the leftovers of interrupted writes. ``<writer>`` is the writing process's id and a tag of its
host: a leftover whose writer still runs (two jobs preparing the same model at once) or was written on
another host (a shared file system, where this process cannot tell) is another writer's work in
progress and is left alone. Names without a writer (older versions, checkpoint folders) are tidied
as before.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

from ._inputs import read_json
from .exitcodes import BAD_INPUT, CorruptFileError, UnsafeFileError

EXPORT_RECORD = "qatfactory.json"
STUDENT_RECORD = "qatfactory_quant.json"
RUN_RECORD = "qatfactory_run.json"
WARMUP_RECORD = "qatfactory_warmup.json"
TEACHER_CACHE_RECORD = "meta.json"
TEACHER_CACHE_KEY = "qatfactory_teacher_cache"
ASSET_RECORD = "qatfactory_provenance.json"
ADAPTER_RECORD = "qatfactory_adapter.json"
# the lock a running `qatfactory train` holds in its run directory (train/runlock.py)
RUN_LOCK = ".qatfactory_run.lock"
KINDS = ("export", "student", "run", "warmup", "teacher_cache", "asset", "adapter")


class NotOursError(FileExistsError):
    """A directory that qatfactory did not write (or one it must not replace) is in the way.
    Exit code 4 (BAD_INPUT): nothing was changed."""

    exit_code = BAD_INPUT


def load_safetensors(path, device: str = "cpu"):
    """safetensors.torch.load_file with the file named in the error: a truncated or garbled file
    raises CorruptFileError (exit code 4) instead of safetensors' bare 'incomplete metadata'."""
    from safetensors.torch import load_file  # noqa: PLC0415 (leaf: stdlib only)
    p = Path(path)
    if not p.is_file():
        raise CorruptFileError(f"{p}: file not found")
    try:
        return load_file(str(p), device=device)
    except Exception as e:  # SafetensorError, OSError, ValueError from a damaged header
        raise CorruptFileError(f"{p}: not a readable safetensors file ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else 'no detail'}); the file is truncated "
                               f"or damaged: write it again") from None


def umask() -> int:
    """The process's umask, read without changing it (os.umask can only be read by setting it, which
    would race with other threads creating files); 0o022 when the kernel does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def honour_umask(path, is_dir: bool) -> None:
    """Give a directory made by mkdtemp (0700) or a file made by mkstemp (0600) the mode an ordinary
    mkdir / open would have given it, so a server running as another user (or a teammate on shared
    storage) can read what qatfactory writes whenever the user's umask lets it."""
    os.chmod(path, (0o777 if is_dir else 0o666) & ~umask())


def honour_umask_tree(root) -> None:
    """honour_umask on ``root`` and everything under it (a writer's temporary files may come from
    mkstemp too); an executable keeps its execute bits, links are left alone."""
    um = umask()
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~um)
        for n in filenames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                os.chmod(p, (0o777 if os.stat(p).st_mode & 0o111 else 0o666) & ~um)


def own_file(folder, name: str, what: str) -> Path:
    """``folder / name`` when it is a regular file of that folder: not a symbolic link and not resolving
    anywhere else. A reused file (a checkpoint's gathered state, a teacher cache's shard) replaced by a
    link to somebody else's file is refused, never followed (UnsafeFileError, exit code 4)."""
    d = Path(folder)
    p = d / name
    if p.is_symlink():
        raise UnsafeFileError(f"{p}: {what} is a symbolic link (to {os.readlink(p)}); what a run reuses must lie "
                              f"in {d} itself. Refused, not followed")
    real, root = os.path.realpath(p), os.path.realpath(d)
    if os.path.dirname(real) != root:
        raise UnsafeFileError(f"{p}: {what} resolves to {real}, outside {d}; refused, not followed")
    return p


def _has_json_key(p: Path, key: str) -> bool:
    try:
        d = read_json(p, finite=False)
    except (OSError, ValueError):      # CorruptFileError too: a damaged record is not ours
        return False
    return isinstance(d, dict) and key in d


def kind_of(path) -> Optional[str]:
    """'missing', 'empty', one of KINDS, or None (exists, not ours: leave it alone).
    A symlink is never ours (replacing it would act on whatever it points at)."""
    p = Path(path)
    if p.is_symlink():
        return None
    if not p.exists():
        return "missing"
    if not p.is_dir():
        return None
    if not any(p.iterdir()):
        return "empty"
    if (p / EXPORT_RECORD).is_file() and not (p / EXPORT_RECORD).is_symlink() and \
            _has_json_key(p / EXPORT_RECORD, "qatfactory_export"):
        return "export"
    if (p / STUDENT_RECORD).is_file() and not (p / STUDENT_RECORD).is_symlink():
        return "student"
    if (p / RUN_RECORD).is_file() and not (p / RUN_RECORD).is_symlink() and \
            _has_json_key(p / RUN_RECORD, "qatfactory_run"):
        return "run"
    if (p / WARMUP_RECORD).is_file() and not (p / WARMUP_RECORD).is_symlink():
        return "warmup"
    rec = p / TEACHER_CACHE_RECORD
    if rec.is_file() and not rec.is_symlink() and \
            (_has_json_key(rec, TEACHER_CACHE_KEY) or _has_json_key(rec, "renormalisation")):
        return "teacher_cache"
    if (p / ASSET_RECORD).is_file() and not (p / ASSET_RECORD).is_symlink():
        return "asset"
    if (p / ADAPTER_RECORD).is_file() and not (p / ADAPTER_RECORD).is_symlink() and \
            _has_json_key(p / ADAPTER_RECORD, "qatfactory_adapter"):
        return "adapter"
    return None


_DESCRIBE = {"export": "a qatfactory export", "student": "a qatfactory student directory (save_student)",
             "run": "a qatfactory run directory (checkpoints, student, metrics)",
             "warmup": "a qatfactory RL warm-up model directory",
             "teacher_cache": "a qatfactory top-k teacher cache (meta.json + shards)",
             "asset": "a model or tokenizer directory qatfactory made from a packaged asset",
             "adapter": "a LoRA adapter directory qatfactory wrote (save_peft_adapter)",
             None: "not written by qatfactory"}


def _inside(a: Path, b: Path) -> bool:
    """True when a is b or lies under b (both resolved)."""
    try:
        a.relative_to(b)
        return True
    except ValueError:
        return False


def check_replaceable(target, kinds: Sequence[str], what: str, protect: Iterable = ()) -> str:
    """Raise NotOursError unless ``target`` is missing, empty, or of one of ``kinds``; and unless it
    neither is nor contains any path of ``protect`` (the source a write is made from). Returns
    the kind found. Never changes anything."""
    t = Path(target)
    k = kind_of(t)
    rt = Path(os.path.realpath(t))
    for p in protect:
        if p is None:
            continue
        rp = Path(os.path.realpath(p))
        if _inside(rp, rt):
            raise NotOursError(f"{what}: {t} is or contains {p}, the source this {what} is made from; "
                               f"it is never replaced. Choose another output directory")
    if k in ("missing", "empty") or k in kinds:
        return k
    if Path(t).is_symlink():
        raise NotOursError(f"{what}: {t} is a symbolic link; it is not replaced. Remove it or choose another "
                           f"output directory")
    if t.exists() and not t.is_dir():
        raise NotOursError(f"{what}: {t} is a file, not a directory; it is not replaced. Remove it or choose "
                           f"another output directory")
    allowed = " or ".join(_DESCRIBE[x] for x in kinds)
    raise NotOursError(f"{what}: {t} is not empty and is {_DESCRIBE.get(k, _DESCRIBE[None])}; only an empty "
                       f"directory or {allowed} may be replaced. Nothing was changed: remove it yourself or "
                       f"choose another output directory")


_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def writer_tag() -> str:
    """``<pid>h<host tag>``: who writes a temporary directory, put in its name (see the module docstring)."""
    return f"{os.getpid()}h{_HOST}"


def _writer_alive(name: str) -> bool:
    """True when a leftover's name says its writer may still be writing: it runs on this host, or the
    leftover came from another host (its process cannot be asked)."""
    m = re.search(r"-(\d+)h([0-9a-f]{6})-[A-Za-z0-9_]{8}$", name)
    if not m:
        return False
    pid, host = int(m.group(1)), m.group(2)
    if host != _HOST:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(target: Path, tag: str) -> List[Path]:
    pat = re.compile(r"^\." + re.escape(target.name) + r"\." + tag + r"-(\d+h[0-9a-f]{6}-)?[A-Za-z0-9_]{8}$")
    parent = target.parent
    if not parent.is_dir():
        return []
    return sorted((p for p in parent.iterdir() if pat.match(p.name) and p.is_dir() and not p.is_symlink()
                   and not _writer_alive(p.name)),
                  key=lambda p: p.stat().st_mtime)


def make_tmp_dir(target, tag: str = "tmp") -> Path:
    """An empty ``.<name>.<tag>-<writer>-XXXXXXXX`` directory beside ``target``."""
    target = Path(target)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-{writer_tag()}-", dir=target.parent))


def recover(target, say=None) -> List[str]:
    """Tidy what an interrupted write of ``target`` left beside it; returns what was done.

    * target missing and an ``.old-*`` present: the swap stopped between its two renames; the newest
      ``.old-*`` is the last complete version and is renamed back.
    * ``.tmp-*``: an unfinished write, deleted.
    * ``.old-*`` with the target present: a finished swap whose clean-up was cut, deleted.
    A leftover whose writer may still be writing (its process runs, or it was named on another host) is
    none of these: it is left alone."""
    target = Path(target)
    say = say or (lambda m: print(f"[qatfactory] {m}", file=sys.stderr, flush=True))
    done: List[str] = []
    olds = _leftovers(target, "old")
    if olds and not target.exists() and not target.is_symlink():
        os.rename(olds[-1], target)
        done.append(f"restored {target} from {olds[-1].name} (a replace was interrupted)")
        olds = olds[:-1]
    for p in _leftovers(target, "tmp") + olds:
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed {p} (left by an interrupted write of {target.name})")
    for m in done:
        say(m)
    return done


def fsync_dir(path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def swap_in(tmp, target) -> None:
    """Rename the finished ``tmp`` to ``target``; an existing target is moved aside first and deleted
    after the swap (both renames stay inside one directory, so each is atomic)."""
    tmp, target = Path(tmp), Path(target)
    if target.exists() or target.is_symlink():
        old = make_tmp_dir(target, "old")
        os.rmdir(old)
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)      # put the previous version back
            raise
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
        fsync_dir(target.parent)


@contextmanager
def atomic_dir(target, replace: bool = False, kinds: Sequence[str] = ("export",), what: str = "write",
               protect: Iterable = (), keep_if: Optional[Callable[[Path], bool]] = None) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success swap it in; on error delete it.

    An existing target is replaced only with ``replace=True`` and only when it is empty or of one of
    ``kinds`` (checked before and again right before the swap); otherwise NotOursError.
    ``keep_if(target)`` true right before the swap (another process finished the same write while this one
    ran, e.g. two jobs preparing one model directory): the target is kept as it is, which a reader of it
    may already be using, and this write is dropped."""
    target = Path(target)
    protect = list(protect)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    k = check_replaceable(target, kinds, what, protect)
    if k != "missing" and not replace:
        raise NotOursError(f"{what}: {target} already exists; pass force=True (CLI: --force) to replace it")
    tmp = make_tmp_dir(target)
    try:
        yield tmp
        if keep_if is not None and keep_if(target):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        k = check_replaceable(target, kinds, what, protect)
        if k != "missing" and not replace:
            raise NotOursError(f"{what}: {target} appeared while writing; not replacing it without force")
        honour_umask_tree(tmp)          # mkdtemp made it 0700, mkstemp its files 0600
        swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path, text: str) -> None:
    """Write a small file through a temporary file and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        honour_umask(tmp, False)        # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
