"""What a run reuses and where it runs: one process per run directory (an flock held for the whole run,
gone with its process), a resume asked to stop before its checkpoint's step is refused, reused files
(a checkpoint's gathered state, a teacher cache's shards) are never symbolic links or files outside their
folder, and a teacher cache is reused only for the teacher, data and settings it was written for."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from test_train_safety import Q, _copy, _train, _tree, done_run  # noqa: F401 (done_run: a fixture)

from qatfactory._fsutil import RUN_LOCK

REPO = Path(__file__).resolve().parents[1]


def _one_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("qatfactory train:")]
    assert len(lines) == 1, out[-2000:]
    return lines[0]


# ----------------------------------------------------------------------------- one process per run dir
def test_a_run_dir_in_use_is_refused_and_the_lock_dies_with_its_process(done_run, tmp_path, capsys):  # noqa: F811
    d = _copy(done_run, tmp_path / "run")
    before = _tree(d)
    # another process holds the run directory (what a running `qatfactory train` on it does)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from qatfactory.train import runlock\n"
                               f"runlock.acquire({str(d)!r})\nprint('locked', flush=True)\ntime.sleep(120)\n"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, out = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=5")
        line = _one_line(out)
        assert rc == 4 and "is in use" in line and f"process {holder.pid} " in line and str(d) in line
        assert {k: v for k, v in _tree(d).items() if k != RUN_LOCK} == before       # nothing else written
        os.kill(holder.pid, signal.SIGKILL)                 # kill -9: no clean-up ran in the holder
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    # the lock went with the process (its file may stay): the same command now runs, and gives the lock back
    rc, out = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=5")
    assert rc == 0, out[-2000:]
    assert not (d / RUN_LOCK).exists()


def test_the_lock_is_held_during_the_run_and_a_refused_run_leaves_nothing(tmp_path, capsys, monkeypatch):
    from qatfactory.train import engine, runlock
    seen = {}
    real = engine.build_model

    def spy(cfg, dev):
        # inside the run: another process asking for the directory is refused (flock is per open file)
        r = subprocess.run([sys.executable, "-c", "from qatfactory.train import runlock\n"
                            f"runlock.acquire({str(tmp_path / 'r')!r})"], cwd=REPO, capture_output=True, text=True)
        seen["rc"], seen["err"] = r.returncode, r.stderr
        return real(cfg, dev)
    monkeypatch.setattr(engine, "build_model", spy)
    rc, out = _train(capsys, *Q, f"run_dir={tmp_path / 'r'}", "train.max_steps=1")
    assert rc == 0, out[-2000:]
    assert seen["rc"] != 0 and "RunLockedError" in seen["err"] and f"process {os.getpid()} " in seen["err"]
    assert not (tmp_path / "r" / RUN_LOCK).exists() and not runlock._HELD
    # refused before anything ran (an export target that is not ours): no directory, no lock file
    user = tmp_path / "out"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    rc, out = _train(capsys, *Q, "export=vllm", f"export.out_dir={user}", f"run_dir={tmp_path / 'new'}")
    assert rc == 4 and not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- resume below the checkpoint
def test_resume_with_max_steps_below_the_checkpoint_is_refused(done_run, tmp_path, capsys):  # noqa: F811
    d = _copy(done_run, tmp_path / "run")
    before = _tree(d)
    rc, out = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=2")
    line = _one_line(out)
    assert rc == 3 and "train.max_steps=2" in line and "4" in line and "step-000004" in line
    assert _tree(d) == before
