"""What a run reuses and where it runs: one process per run directory (an flock held for the whole run,
gone with its process), a resume asked to stop before its checkpoint's step is refused, reused files
(a checkpoint's gathered state, a teacher cache's shards) are never symbolic links or files outside their
folder, and a teacher cache is reused only for the teacher, data and settings it was written for."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_train_safety import Q, _copy, _train, _tree, _with, done_run  # noqa: F401 (done_run: a fixture)

from qatfactory._fsutil import RUN_LOCK
from qatfactory.exitcodes import UnsafeFileError
from qatfactory.train import reshard

REPO = Path(__file__).resolve().parents[2]


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
    # a new run killed right after taking its lock left only the lock file: the folder is still empty to a run
    e = tmp_path / "stale"
    e.mkdir()
    (e / RUN_LOCK).write_text("process 1 on elsewhere\n")
    rc, out = _train(capsys, *Q, f"run_dir={e}", "train.max_steps=1")
    assert rc == 0, out[-2000:]


def test_the_lock_is_held_during_the_run_and_a_refused_run_leaves_nothing(tmp_path, capsys, monkeypatch):
    from qatfactory.train import runlock  # noqa: PLC0415 (runlock's own module state is asserted)
    from qatfactory.train import runtime as engine  # noqa: PLC0415
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


# ----------------------------------------------------------------------------- reused files: links
def test_a_checkpoint_file_replaced_by_a_link_is_refused_on_resume(done_run, tmp_path, capsys):  # noqa: F811
    d = _copy(done_run, tmp_path / "run")
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"somebody else's file")
    g = d / "checkpoints" / "step-000004" / "gathered"
    g.mkdir()
    (g / "state-00000.safetensors").symlink_to(outside)
    before = _tree(d)
    rc, out = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=5")
    line = _one_line(out)
    assert rc == 4 and "state-00000.safetensors" in line and "symbolic link" in line
    assert _tree(d) == before
    # the checkpoints folder itself moved elsewhere and linked back
    d2 = _copy(done_run, tmp_path / "run2")
    (d2 / "checkpoints").rename(tmp_path / "theirs")
    (d2 / "checkpoints").symlink_to(tmp_path / "theirs")
    rc, out = _train(capsys, *Q, f"run_dir={d2}", "resume=auto", "train.max_steps=5")
    line = _one_line(out)
    assert rc == 4 and "checkpoints" in line and "symbolic link" in line
    # the reader itself (a resume on another world size reads gathered/ through it) refuses a link too
    save_file({"fp32/w": torch.zeros(3)}, str(outside))
    g2 = tmp_path / "gathered"
    g2.mkdir()
    idx = {"qatfactory_gathered": reshard.FORMAT, "step": 2, "from_world": 2,
           "files": {"fp32/w": "state-00000.safetensors"}}
    (g2 / "gathered.json").write_text(json.dumps(idx))
    (g2 / "state-00000.safetensors").symlink_to(outside)
    with pytest.raises(UnsafeFileError, match="state-00000.safetensors.*symbolic link"):
        reshard._Reader(g2, reshard.read_index(g2)).full("fp32/w", 3)
    (g2 / "gathered.json").rename(tmp_path / "index.json")
    (g2 / "gathered.json").symlink_to(tmp_path / "index.json")
    with pytest.raises(UnsafeFileError, match="gathered.json.*symbolic link"):
        reshard.read_index(g2)


# ----------------------------------------------------------------------------- teacher caches
CACHED = _with(["method=qad_cached", "format=bf16", "train.max_steps=1"])


def test_a_teacher_cache_is_reused_only_for_its_teacher_data_and_settings(tmp_path, capsys):
    rc, out = _train(capsys, *CACHED, "method.topk=4", f"run_dir={tmp_path / 'a'}")
    assert rc == 0, out[-2000:]
    cache = tmp_path / "a" / "teacher_cache"
    meta = json.loads((cache / "train" / "meta.json").read_text())
    assert meta["k"] == 4 and len(meta["teacher_sha256"]) == 64 and meta["temperature"] == 1.0
    before = _tree(cache)
    # the same teacher and data, other top-k: refused, naming the field and both values
    cases = ((["method.topk=32"], ("k=4", "k=32")),
             # another teacher: the student's own start (the teacher here) from another seed
             (["method.topk=4", "model.init_seed=1"], ("teacher weights", meta["teacher_sha256"][:16])),
             # other data
             (["method.topk=4", "train.seed=3"], ("data", "fingerprint=")),
             (["method.topk=4", "method.cache_dtype=bfloat16"], ("logprob_dtype='float32'", "logprob_dtype='bfloat16'")))
    for i, (over, want) in enumerate(cases):
        rc, out = _train(capsys, *CACHED, *over, f"method.teacher_cache={cache}", f"run_dir={tmp_path / f'b{i}'}")
        line = _one_line(out)
        assert rc == 4 and "teacher cache" in line and all(w in line for w in want), (over, line)
        assert _tree(cache) == before
    # the cache it was written for: reused
    rc, out = _train(capsys, *CACHED, "method.topk=4", f"method.teacher_cache={cache}", f"run_dir={tmp_path / 'c'}")
    assert rc == 0, out[-2000:]
    assert _tree(cache) == before


def test_a_teacher_cache_with_bad_meta_or_linked_shards_is_refused_in_one_line(tmp_path, capsys):
    rc, out = _train(capsys, *CACHED, "method.topk=4", f"run_dir={tmp_path / 'a'}")
    assert rc == 0, out[-2000:]
    cache = tmp_path / "a" / "teacher_cache"
    mp = cache / "train" / "meta.json"
    good = mp.read_text()
    n = 0
    for field, bad, allowed in (("k", "4", "an int >= 1"), ("seq_len", None, "an int >= 1"),
                                ("shards", "shard-00000.safetensors", "a list"),
                                ("fingerprint", 7, "a string"), ("logprob_dtype", "int8", "float32")):
        n += 1
        mp.write_text(json.dumps(dict(json.loads(good), **{field: bad})))
        rc, out = _train(capsys, *CACHED, "method.topk=4", f"method.teacher_cache={cache}",
                         f"run_dir={tmp_path / f'b{n}'}")
        line = _one_line(out)
        assert rc == 4 and str(mp) in line and repr(field) in line and allowed in line, line
        assert "Traceback" not in out
    mp.write_text("[1, 2]")
    rc, out = _train(capsys, *CACHED, "method.topk=4", f"method.teacher_cache={cache}", f"run_dir={tmp_path / 'l'}")
    assert rc == 4 and "JSON object" in _one_line(out)
    mp.write_text(good)
    # a shard replaced by a link to a file outside the cache
    shard = cache / "train" / "shard-00000.safetensors"
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    rc, out = _train(capsys, *CACHED, "method.topk=4", f"method.teacher_cache={cache}", f"run_dir={tmp_path / 's'}")
    line = _one_line(out)
    assert rc == 4 and str(shard) in line and "symbolic link" in line
    shard.unlink()
    outside.rename(shard)
    # a run's own cache folder replaced by a link to a cache elsewhere
    a2 = _copy(tmp_path / "a", tmp_path / "a2")
    shutil.rmtree(a2 / "teacher_cache")
    (a2 / "teacher_cache").symlink_to(cache)
    rc, out = _train(capsys, *CACHED, "method.topk=4", f"run_dir={a2}", "resume=auto", "train.max_steps=2")
    line = _one_line(out)
    assert rc == 4 and str(a2 / "teacher_cache") in line and "symbolic link" in line
