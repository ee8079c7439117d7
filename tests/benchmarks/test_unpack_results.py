"""tools/gpu/unpack_results.py: one GPU call's methods.tgz into a results folder, as committed."""
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))
import unpack_results as U  # noqa: E402


def _tgz(path: Path, files: dict, links: dict = None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        for name, to in (links or {}).items():
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname = tarfile.SYMTYPE, to
            tf.addfile(ti)
    return path


def _call(tmp_path):
    bar = "\r".join(f"train:  {i}%|#| {i}/100 [00:01<00:01]" for i in range(100))
    log = ("[paretoq] ce 2-bit\n" + bar + f"\nmethod=qat steps=100\nstudent: /tmp/qf-m2/paretoq2/{U.WORK_SUB}/ce-2bit/student\n"
           f"File \"{U.REPO}/qatfactory/train/rundir.py\", line 1\n/tmp/site/torchao/x.py: warning\n")
    row = {"arms": [{"run_dir": f"/tmp/qf-methods/paretoq2/{U.WORK_SUB}/ce-2bit-int2_seq-s0", "qat": {"eval/ppl": 50.9}}]}
    return _tgz(tmp_path / "methods.tgz", {
        "./methods.log": "[methods] paretoq2 (timeout 540s): --out /tmp/qf-methods/paretoq2\n",
        "./methods-paretoq2.tail": log,
        "./paretoq2/paretoq2.log": log,
        "./paretoq2/paretoq_bits.json": json.dumps(row)})


def test_a_call_is_unpacked_short_and_without_the_devices_paths(tmp_path, capsys):
    src = _call(tmp_path)
    dest = tmp_path / "results"
    assert U.main(["--dest", str(dest), "--every", "30", f"call_a={src}"]) == 0
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["call_a/methods.log", "call_a/paretoq2/paretoq2.log", "call_a/paretoq2/paretoq_bits.json"]
    log = (dest / "call_a/paretoq2/paretoq2.log").read_text()
    bars = [ln for ln in log.splitlines() if ln.startswith("train:")]
    assert [b.split("|")[-1].split()[0] for b in bars] == ["29/100", "59/100", "89/100", "99/100"]
    assert "student: $WORK/paretoq2/$JOB_WORK_DIR/ce-2bit/student" in log
    assert "$REPO/qatfactory/train/rundir.py" in log and "$SITE/torchao/x.py" in log and "/tmp/" not in log
    row = json.loads((dest / "call_a/paretoq2/paretoq_bits.json").read_text())
    assert row["arms"][0]["run_dir"] == "$WORK/paretoq2/$JOB_WORK_DIR/ce-2bit-int2_seq-s0"
    assert "--out $WORK/paretoq2" in (dest / "call_a/methods.log").read_text()
    assert str(dest / "call_a" / "paretoq2") in capsys.readouterr().out      # the folder to --merge


def test_nothing_is_overwritten_and_a_leftover_path_fails(tmp_path, capsys):
    src = _call(tmp_path)
    dest = tmp_path / "results"
    (dest / "call_a").mkdir(parents=True)
    (dest / "call_a" / "mine.txt").write_text("kept")
    with pytest.raises(SystemExit, match="exists; nothing was written"):
        U.main(["--dest", str(dest), f"call_a={src}"])
    assert [p.name for p in (dest / "call_a").iterdir()] == ["mine.txt"]
    assert [p.name for p in dest.iterdir()] == ["call_a"]                   # no temporary folder left
    # the device runs a copy of this checkout at the same path: anything else under the folder above it is a
    # path of this machine's that must not be committed (by default)
    above = str(U.REPO.parent).rstrip("/") + "/"
    other = _tgz(tmp_path / "o.tgz", {"./x/x.log": f"from {above}.device/3/y\n"})
    assert U.main(["--dest", str(dest), f"call_b={other}"]) == 1
    assert f"still holds {above!r}" in capsys.readouterr().err


def test_a_link_or_an_escaping_member_is_refused(tmp_path):
    dest = tmp_path / "results"
    bad = _tgz(tmp_path / "bad.tgz", {"./a.log": "x"}, links={"./evil": "/etc/passwd"})
    with pytest.raises(tarfile.TarError):
        U.main(["--dest", str(dest), f"call_a={bad}"])
    up = _tgz(tmp_path / "up.tgz", {"../../escape.log": "x"})
    with pytest.raises(tarfile.TarError):
        U.main(["--dest", str(dest), f"call_b={up}"])
    assert not (tmp_path / "escape.log").exists() and list(dest.iterdir()) == []
    with pytest.raises(SystemExit, match="not NAME=SRC"):
        U.main(["--dest", str(dest), f"../x={up}"])
