"""Nothing lost, nothing followed: exports and students replace only what is provably ours, writes
survive a real kill -9 at the worst moment, options and damaged files get one clear error.

Fault injection runs the real export / save_student in a child process that SIGKILLs itself at a
chosen point (inside the writer, or between the two renames of the swap)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from test_exporters_helpers import build_tokenizer, tiny_config

from qatfactory import _fsutil
from qatfactory.faces.export import load_converted, main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from qatfactory.quantize import QuantConfig, prepare, save_student
    torch.manual_seed(2)
    cfg = tiny_config("llama")
    mt = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg), dtype=torch.bfloat16)
    prepare(model, QuantConfig(weight_format="nvfp4"))
    root = tmp_path_factory.mktemp("safety")
    d = root / "student"
    save_student(model, str(d))
    build_tokenizer(d)
    return d


def _tree(d: Path):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _export(student_dir, out, *extra):
    return main(["export", str(student_dir), "--engine", "vllm", "--flavour", "modelopt", "--out", str(out), *extra])


# ----------------------------------------------------------------------------- data loss
def test_force_never_replaces_a_user_directory(student_dir, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    (user / "sub").mkdir()
    (user / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    before = _tree(user)
    assert _export(student_dir, user, "--force") == 4
    err = capsys.readouterr().err
    assert str(user) in err and "not written by qatfactory" in err and "choose another output directory" in err
    assert _tree(user) == before
    # the API refuses the same way, and so does the dir that holds the student
    from qatfactory.exporters import export
    cm = load_converted(str(student_dir))
    with pytest.raises(FileExistsError, match="not written by qatfactory"):
        export(cm, user, engine="vllm", force=True)
    assert _tree(user) == before
    s_before = _tree(student_dir)
    assert _export(student_dir, student_dir, "--force") == 4
    assert "source this export is made from" in capsys.readouterr().err
    assert _export(student_dir, student_dir.parent, "--force") == 4
    assert _tree(student_dir) == s_before
    with pytest.raises(FileExistsError, match="source this export is made from"):
        export(cm, student_dir.parent, engine="vllm", force=True)
    assert _tree(student_dir) == s_before


def test_force_replaces_an_earlier_export_or_an_empty_dir(student_dir, tmp_path):
    out = tmp_path / "e"
    out.mkdir()                                     # empty: ours to fill
    assert _export(student_dir, out, "--force") == 0
    assert _fsutil.kind_of(out) == "export"
    assert main(["export", str(student_dir), "--engine", "vllm", "--flavour", "compressed-tensors", "--out",
                 str(out), "--force"]) == 0
    assert json.loads((out / "qatfactory.json").read_text())["flavour"] == "compressed-tensors"
    # a qatfactory.json that is not an export record does not make a directory ours
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "qatfactory.json").write_text('{"something": 1}')
    (fake / "keep.txt").write_text("x")
    assert _export(student_dir, fake, "--force") == 4 and (fake / "keep.txt").exists()


def test_save_student_replaces_only_a_student(student_dir, tmp_path):
    from qatfactory.quantize import load_student, save_student
    m = load_student(str(student_dir))
    user = tmp_path / "u"
    user.mkdir()
    (user / "thesis.tex").write_text("x")
    with pytest.raises(FileExistsError, match="not written by qatfactory"):
        save_student(m, str(user))
    assert (user / "thesis.tex").read_text() == "x"
    d = tmp_path / "s"
    save_student(m, str(d))
    save_student(m, str(d))                          # an earlier student: replaced
    assert _fsutil.kind_of(d) == "student" and sorted(p.name for p in tmp_path.iterdir()) == ["s", "u"]


# ----------------------------------------------------------------------------- options, files
def test_export_options_are_checked(student_dir, tmp_path):
    from qatfactory.exporters import export
    from qatfactory.exporters.base import exporter_options
    cm = load_converted(str(student_dir))
    assert exporter_options("vllm") == {"max_shard_bytes": 5 * 2**30}
    assert set(exporter_options("llama_cpp")) >= {"dense_dtype"}
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bogus'\].*max_shard_bytes"):
        export(cm, tmp_path / "a", engine="vllm", bogus=1)
    with pytest.raises(ValueError, match="max_shard_bytes=-5; allowed: an int >= 1"):
        export(cm, tmp_path / "a", engine="vllm", max_shard_bytes=-5)
    with pytest.raises(ValueError, match="max_shard_bytes='big' has the wrong type"):
        export(cm, tmp_path / "a", engine="sglang", max_shard_bytes="big")
    with pytest.raises(ValueError, match="unknown option.*'dense_dtype'"):
        export(cm, tmp_path / "a", engine="llama_cpp", max_shard_bytes=10)
    with pytest.raises(ValueError, match="dense_dtype='f8'; allowed"):
        export(cm, tmp_path / "a", engine="llama_cpp", dense_dtype="f8")
    assert not (tmp_path / "a").exists()
    assert main(["export", str(student_dir), "--engine", "vllm", "--out", str(tmp_path / "b"),
                 "--max-shard-gb", "-1"]) == 4


def test_symlinked_source_files_are_not_followed(student_dir, tmp_path):
    from qatfactory.exporters import export
    src = tmp_path / "src"
    src.mkdir()
    build_tokenizer(src)
    os.remove(src / "generation_config.json")
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.symlink(secret, src / "generation_config.json")
    cm = load_converted(str(student_dir), str(src))
    with pytest.warns(UserWarning, match="generation_config.json is not a regular file"):
        r = export(cm, tmp_path / "e", engine="vllm")
    assert "generation_config.json" not in r.files and not (tmp_path / "e" / "generation_config.json").exists()
    assert (tmp_path / "e" / "tokenizer.json").is_file()
    assert all("host secret" not in p.read_text(errors="replace") for p in (tmp_path / "e").iterdir() if p.is_file()
               and p.suffix in (".json", ".txt"))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_student_safetensors_is_named(student_dir, tmp_path, capsys, damage):
    import shutil
    d = tmp_path / "s"
    shutil.copytree(student_dir, d)
    f = d / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    else:
        f.write_bytes(b"not a safetensors file at all" * 3)
    assert _export(d, tmp_path / "e") == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BAD_INPUT" in err[0] and str(f) in err[0] and "truncated or damaged" in err[0]
    from qatfactory.exitcodes import CorruptFileError
    from qatfactory.quantize import load_student
    with pytest.raises(CorruptFileError, match="model.safetensors"):
        load_student(str(d))


# ----------------------------------------------------------------------------- kill -9
CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from qatfactory.faces.export import load_converted
    from qatfactory.exporters import export
    from qatfactory import _fsutil
    import qatfactory.exporters.vllm as V
    where, student, out = sys.argv[1], sys.argv[2], sys.argv[3]
    cm = load_converted(student)
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "writing":            # the weights are on disk in the temporary dir, config.json is not
        V.write_json = die
    elif where == "swap":             # between the two renames: old moved aside, new not yet in place
        import types
        real = os.rename
        def rename(a, b):
            if ".old-" in str(b):
                real(a, b)
                die()
            return real(a, b)
        _fsutil.os = types.SimpleNamespace(**{{k: getattr(os, k) for k in dir(os) if not k.startswith("__")}})
        _fsutil.os.rename = rename
    elif where == "student":
        import safetensors.torch as st
        from qatfactory.quantize import load_student, save_student
        real_save = st.save_file
        def half(tensors, path, metadata=None):
            real_save(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:
                f.truncate(100)
            die()
        st.save_file = half
        save_student(load_student(student), out)
    export(cm, out, engine="vllm", flavour="compressed-tensors", force=True)
    print("finished")
""")


def _child(where, student, out):
    code = CHILD.format(tests=str(REPO / "tests"))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, where, str(student), str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert "finished" not in p.stdout


@pytest.mark.slow
def test_kill9_during_export_leaves_the_old_export(student_dir, tmp_path, capsys):
    out = tmp_path / "e"
    assert _export(student_dir, out) == 0
    old = _tree(out)
    _child("writing", student_dir, out)
    assert _tree(out) == old                                           # untouched
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".e.tmp-")]
    assert len(left) == 1                                             # the unfinished write, named
    capsys.readouterr()
    assert _export(student_dir, out, "--force") == 0                    # the next run tidies it
    assert f"removed {tmp_path / left[0]}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


@pytest.mark.slow
def test_kill9_between_the_swap_renames_is_recovered(student_dir, tmp_path, capsys):
    out = tmp_path / "e"
    assert _export(student_dir, out) == 0
    old = _tree(out)
    _child("swap", student_dir, out)
    assert not out.exists()                                           # cut between the renames
    olds = [p for p in tmp_path.iterdir() if p.name.startswith(".e.old-")]
    assert len(olds) == 1 and _tree(olds[0]) == old
    # any later write of that target first puts the complete old version back
    assert _fsutil.recover(out) and _tree(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


@pytest.mark.slow
def test_kill9_during_save_student_leaves_the_old_student(student_dir, tmp_path):
    import shutil
    d = tmp_path / "student"
    shutil.copytree(student_dir, d)
    old = _tree(d)
    _child("student", d, d)
    assert _tree(d) == old
    from qatfactory.quantize import load_student
    load_student(str(d))                                             # still loads
    assert any(p.name.startswith(".student.tmp-") for p in tmp_path.iterdir())


def test_recover_leaves_a_running_writers_temporary_directory_alone(tmp_path):
    """Two jobs preparing the same model directory at once (the GPU runs' `par`): the second one's recover
    deleted the first one's unfinished .tmp-* (FileNotFoundError in the first). A leftover whose writer still
    runs here, or was named on another host, is left; one whose writer is gone is removed."""
    target = tmp_path / "model"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        host = _fsutil.writer_tag().split("h", 1)[1]
        other = "0" * 6 if host != "0" * 6 else "1" * 6
        live = tmp_path / f".model.tmp-{sleeper.pid}h{host}-abcd1234"
        gone = tmp_path / f".model.tmp-{int(dead.stdout)}h{host}-abcd1234"
        remote = tmp_path / f".model.tmp-{sleeper.pid}h{other}-abcd1234"
        legacy = tmp_path / ".model.tmp-abcd1234"
        live_old = tmp_path / f".model.old-{sleeper.pid}h{host}-abcd1234"    # mid-swap: target missing
        for d in (live, gone, remote, legacy, live_old):
            (d / "sub").mkdir(parents=True)
        done = _fsutil.recover(target, say=lambda m: None)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, remote.name, live_old.name])
        assert not target.exists()                        # a running swap's old copy is not put back under it
        assert len(done) == 2 and all("removed" in m for m in done)
        # and a write of the target while the other writer runs leaves its directory, then swaps in its own
        with _fsutil.atomic_dir(target, replace=True, kinds=("asset",)) as t:
            assert t.name.startswith(f".model.tmp-{_fsutil.writer_tag()}-")
            (t / _fsutil.ASSET_RECORD).write_text("{}")
        assert (target / _fsutil.ASSET_RECORD).is_file() and live.is_dir() and live_old.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    _fsutil.recover(target, say=lambda m: None)           # the writer is gone now: its leftovers go
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", remote.name])


def test_two_processes_writing_the_same_asset_directory_at_once_both_finish(tmp_path):
    """The race itself, in two processes: each holds its temporary directory open for a while, the second
    starts inside the first's write; both must finish and the target must be one complete directory."""
    code = textwrap.dedent(f"""
        import sys, time
        from qatfactory import _fsutil
        with _fsutil.atomic_dir({str(tmp_path / 'm')!r}, replace=True, kinds=("asset",)) as t:
            (t / "a").write_text(sys.argv[1])
            time.sleep(float(sys.argv[2]))
            (t / _fsutil.ASSET_RECORD).write_text("{{}}")
            (t / "b").write_text(sys.argv[1])
        print("finished", sys.argv[1])
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    first = subprocess.Popen([sys.executable, "-c", code, "one", "3"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    import time
    deadline = time.time() + 30
    while not any(p.name.startswith(".m.tmp-") for p in tmp_path.iterdir()) and time.time() < deadline:
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", code, "two", "0"], capture_output=True, text=True, env=env)
    out1, err1 = first.communicate(timeout=60)
    assert second.returncode == 0, second.stderr[-2000:]
    assert first.returncode == 0, err1[-2000:]
    a, b = (tmp_path / "m" / "a").read_text(), (tmp_path / "m" / "b").read_text()
    assert a == b == "one"                                # the later swap wins, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_write_finished_meanwhile_by_another_process_is_kept_when_keep_if_says_so(tmp_path):
    """prepare_model_dir in two jobs at once: the one that finishes second must not swap its copy over the
    directory the first one is already loading from."""
    target = tmp_path / "m"
    with _fsutil.atomic_dir(target, replace=True, kinds=("asset",), keep_if=lambda t: (t / "done").is_file()) as t:
        (t / "done").write_text("late")
        target.mkdir()                                   # the other process's complete directory appears
        (target / "done").write_text("first")
        (target / _fsutil.ASSET_RECORD).write_text("{}")
    assert (target / "done").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]          # the late copy is gone, nothing else
