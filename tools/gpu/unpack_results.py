"""A device call's results into benchmarks/results/, as they are committed: one folder per call.

    python tools/gpu/unpack_results.py --dest benchmarks/results/paretoq_runs_h100_20261206_07/20261206_bits_4_3_1 \\
        call_a=FILES_AT_A/methods.tgz call_b=FILES_AT_B/methods.tgz call_c=FILES_AT_C

Each NAME=SRC is a methods.tgz (or kv.tgz, any .tgz a call packed) or a call's files_at folder. What it does:
* extracts into DEST/NAME (a new folder: an existing one is refused, nothing is overwritten), refusing tar
  members that are links, absolute or outside the folder (tarfile's 'data' filter);
* leaves out `methods-<job>.tail` (methods.sh's copy of each job's log for the console);
* keeps progress bars short: tqdm redraws a bar with carriage returns, so a log holds every redraw; each bar
  keeps every --every-th redraw and its last one;
* replaces the device's paths by names (a job's work folder under /tmp/qf-<x>/<job> -> $WORK/<job>/$JOB_WORK_DIR,
  /tmp/qf-<x> -> $WORK, /tmp/site -> $SITE, /root/out -> $OUT, the device's repository root, the same path as
  this checkout's, -> $REPO), and fails if any --forbid string (default: the folder above this checkout) is
  left in a text file;
* prints each job folder (a folder with a *.json of rows) for the `--merge` of the papers' scripts.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
WORK_SUB = "work"           # a job's runs and data: the papers' scripts' default --work, <out>/work
TEXT = {".json", ".md", ".log", ".txt", ".jsonl", ".csv", ".yaml"}
BAR = re.compile(r"^[^\n]{0,80}?:?\s*\d+%\|")          # a tqdm line: 'train:  45%|####  | 540/1200 ...'


def sanitize(text: str, repo_root: str) -> str:
    text = re.sub(r"/tmp/qf-[A-Za-z0-9_.-]+/([A-Za-z0-9_.-]+)/" + WORK_SUB + "/", r"$WORK/\1/$JOB_WORK_DIR/", text)
    text = re.sub(r"/tmp/qf-[A-Za-z0-9_.-]+", "$WORK", text)
    text = text.replace("/tmp/site", "$SITE").replace("/root/out", "$OUT")
    if repo_root:
        text = text.replace(repo_root.rstrip("/"), "$REPO")
    return text


def condense_bars(text: str, every: int) -> str:
    """Every redraw of a progress bar is a piece of its own (carriage returns, or newlines once a log was
    re-read as text): of each run of consecutive redraws keep every every-th and the last."""
    kept: List[str] = []
    run: List[str] = []
    for p in re.split(r"\r\n|\r|\n", text):
        if BAR.match(p):
            run.append(p)
            continue
        kept += _thin(run, every)
        run = []
        kept.append(p)
    kept += _thin(run, every)
    return "\n".join(kept)


def _thin(run: Sequence[str], every: int) -> List[str]:
    if not run:
        return []
    keep = [p for i, p in enumerate(run[:-1]) if (i + 1) % every == 0]
    return keep + [run[-1]]


def _members(tf: tarfile.TarFile) -> Iterable[tarfile.TarInfo]:
    for m in tf.getmembers():
        if Path(m.name).name.startswith("methods-") and m.name.endswith(".tail"):
            continue
        yield m


def unpack_one(name: str, src: Path, dest: Path, repo_root: str, every: int) -> Path:
    target = dest / name
    if target.exists() or target.is_symlink():
        raise SystemExit(f"unpack: {target} exists; nothing was written (choose another NAME or --dest)")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest))
    try:
        if src.is_dir():
            for f in sorted(src.rglob("*")):
                if f.is_file() and not f.is_symlink() and not (f.name.startswith("methods-") and f.suffix == ".tail"):
                    to = tmp / f.relative_to(src)
                    to.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, to)
        elif tarfile.is_tarfile(src):
            with tarfile.open(src) as tf:
                tf.extractall(tmp, members=list(_members(tf)), filter="data")
        else:
            raise SystemExit(f"unpack: {src} is neither a folder nor a tar file")
        for f in tmp.rglob("*"):
            if f.is_file() and f.suffix in TEXT:
                with open(f, encoding="utf-8", errors="replace", newline="") as fh:
                    t = fh.read()
                f.write_text(sanitize(condense_bars(t, every) if f.suffix in (".log", ".txt") else t, repo_root))
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)     # ours: made above, never the user's
        raise
    return target


def leftovers(root: Path, forbid: Sequence[str]) -> List[Tuple[Path, str]]:
    bad = []
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in TEXT:
            t = f.read_text(errors="replace")
            bad += [(f, s) for s in forbid if s in t]
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calls", nargs="+", metavar="NAME=SRC", help="a folder name and a .tgz or a files_at folder")
    ap.add_argument("--dest", required=True, type=Path)
    ap.add_argument("--repo-root", default=str(REPO), help="the repository's path on the device machine (the "
                    "device runs a copy of this checkout at the same path)")
    ap.add_argument("--every", type=int, default=150, help="keep every N-th redraw of a progress bar (and its last)")
    ap.add_argument("--forbid", action="append", default=None,
                    help="a string no text file may keep (default: the folder above this checkout, with its slash)")
    a = ap.parse_args(argv)
    forbid = a.forbid or [str(REPO.parent).rstrip("/") + "/"]
    pairs = []
    for c in a.calls:
        name, sep, src = c.partition("=")
        if not sep or not name or "/" in name or name in (".", ".."):
            raise SystemExit(f"unpack: {c!r} is not NAME=SRC (NAME a plain folder name)")
        if not Path(src).exists():
            raise SystemExit(f"unpack: {src} does not exist")
        pairs.append((name, Path(src)))
    done = [unpack_one(n, s, a.dest, a.repo_root, a.every) for n, s in pairs]
    bad = [x for d in done for x in leftovers(d, forbid)]
    for f, s in bad:
        print(f"unpack: {f} still holds {s!r}", file=sys.stderr)
    jobs = sorted({j.parent for d in done for j in d.rglob("*.json")})
    print("job folders (for --merge):")
    for j in jobs:
        print(f"  {j}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
