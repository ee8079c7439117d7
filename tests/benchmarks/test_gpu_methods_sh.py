"""benchmarks/gpu/methods.sh's PACK=1 (what one call to the GPU machine brings back is at most 8 files): everything the
call writes comes back as one methods.tgz, and nothing already in $OUT is touched."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args, **env):
    e = dict(os.environ, PY=sys.executable, LOCAL="1", OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **env)
    return subprocess.run(["bash", "benchmarks/gpu/methods.sh", *args], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=120)


def test_pack_brings_one_file_back_and_leaves_what_was_there(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    r = _run(tmp_path, "stash", "nosuchjob", "qerl_merge", PACK="1")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["methods.tgz", "mine.txt"]
    assert (out / "mine.txt").read_text() == "a user's file"
    with tarfile.open(out / "methods.tgz") as tf:
        names = {n.lstrip("./") for n in tf.getnames()}
        log = tf.extractfile("./methods.log").read().decode()
        job = tf.extractfile("./qerl_merge/qerl_merge.log").read().decode()
    assert {"methods.log", "qerl_merge/qerl_merge.log"} <= names
    assert "unknown job nosuchjob" in log and "qerl_merge rc=3" in log
    assert "is not a file" in job                      # the job's own refusal came back inside the tar


def test_without_pack_the_files_land_in_out(tmp_path):
    r = _run(tmp_path, "stash", "nosuchjob")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert not (out / "methods.tgz").exists()
    assert "unknown job nosuchjob" in (out / "methods.log").read_text()
