"""`qatfactory export` / `qatfactory verify EXPORT --against STUDENT` on a save_student directory:
the real load_student -> convert path, exit codes, the table, the JSON result."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_exporters_helpers import VOCAB, source_dir, tiny_config

from qatfactory.faces.export import main
from qatfactory.exitcodes import BAD_INPUT, FAIL, INCOMPLETE, USAGE


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from qatfactory.quantize import QuantConfig, calibrate, prepare, save_student

    torch.manual_seed(1)
    cfg = tiny_config("qwen3")
    mt = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **cfg), dtype=torch.bfloat16)
    prepare(model, QuantConfig(weight_format="nvfp4", act_format="nvfp4_act"))
    calibrate(model, [torch.randint(0, VOCAB, (1, 12))])
    d = tmp_path_factory.mktemp("cli") / "student"
    save_student(model, str(d))
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the base model's tokenizer beside the student
        shutil.copy(source_dir() / f, d / f)
    return d


def test_cli_export_verify_roundtrip(student_dir, tmp_path, capsys):
    out = tmp_path / "vllm"
    assert main(["export", str(student_dir), "--engine", "vllm", "--flavour", "modelopt", "--out", str(out)]) == 0
    assert (out / "hf_quant_config.json").is_file() and (out / "tokenizer.json").is_file()
    rep = tmp_path / "report.json"
    assert main(["verify", str(out), "--against", str(student_dir), "--json", str(rep)]) == 0
    text = capsys.readouterr().out
    assert "verdict: PASS" in text and "model.layers.0.self_attn.q_proj" in text
    r = json.loads(rep.read_text())
    assert r["ok"] and r["verdict"] == "PASS" and r["engine"] == "vllm"
    assert any(c["check"] == "weights" for c in r["checks"])

    # an existing output needs --force (exit 4, BAD_INPUT)
    capsys.readouterr()
    assert main(["export", str(student_dir), "--engine", "sglang", "--flavour", "ct", "--out", str(out)]) == BAD_INPUT
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(student_dir), "--engine", "sglang", "--flavour", "ct", "--out", str(out),
                 "--force"]) == 0
    assert not (out / "hf_quant_config.json").exists()
    assert main(["verify", str(out), "--against", str(student_dir), "--quiet"]) == 0
    # an opt-out is never a pass: exit 2 (INCOMPLETE), and the table says why
    capsys.readouterr()
    assert main(["verify", str(out), "--against", str(student_dir), "--no-logits", "--quiet"]) == INCOMPLETE
    text = capsys.readouterr().out
    assert "verdict: INCOMPLETE" in text and "opted out" in text

    # the gate exits non-zero when the export no longer matches the student
    from safetensors.torch import load_file, save_file
    sd = load_file(str(out / "model.safetensors"))
    k = "model.layers.0.self_attn.o_proj.weight_scale"
    sd[k] = (sd[k].view(torch.uint8) + 1).view(torch.float8_e4m3fn)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["verify", str(out), "--against", str(student_dir), "--quiet"]) == FAIL
    text = capsys.readouterr().out
    assert "verdict: FAIL" in text and "o_proj" in text


def test_cli_gguf(student_dir, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert main(["export", str(student_dir), "--engine", "llama_cpp", "--out", str(out), "--verify"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert main(["export", str(student_dir), "--engine", "tgi", "--out", str(out)]) == USAGE
    capsys.readouterr()
    assert main(["export", str(student_dir), "--engine", "llama_cpp", "--out", str(tmp_path / "x"),
                 "--dense-dtype", "f32", "--verify"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    # f16 cannot hold every bf16 value (tiny ones go subnormal): the exporter refuses before writing
    # anything (the gate would FAIL such a file: test_verify_tamper's dense-dtype cases)
    assert main(["export", str(student_dir), "--engine", "llama_cpp", "--out", str(tmp_path / "h"),
                 "--dense-dtype", "f16", "--verify"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert "dense_dtype='f16'" in err and "change in the cast" in err and "'auto'" in err
    assert not (tmp_path / "h").exists()
    # no such export / not an export: BAD_INPUT with the reason
    assert main(["verify", str(tmp_path / "nope"), "--against", str(student_dir)]) == BAD_INPUT
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty"), "--against", str(student_dir)]) == BAD_INPUT
    assert "not a qatfactory export" in capsys.readouterr().err
    # GGUF without llama.cpp's runtime, by choice: INCOMPLETE, never PASS
    assert main(["verify", str(out), "--against", str(student_dir), "--no-llama-cpp"]) == INCOMPLETE


def test_export_verify_moves_a_failing_export_aside(student_dir, tmp_path, capsys, monkeypatch):
    """`export --verify` goes through ship(): one flipped weight byte on its way to disk, the gate FAILs
    (exit 1), the export is moved to OUT.FAILED with FAILED.json naming the tensor; nothing is left at OUT."""
    import qatfactory.exporters.vllm as V
    real = V.save_sharded

    def tampered(tensors, out, **kw):
        k = next(n for n in sorted(tensors) if n.endswith("o_proj.weight"))
        t = tensors[k].clone()
        t.view(torch.uint8).reshape(-1)[0] ^= 0x11
        return real({**tensors, k: t}, out, **kw)
    monkeypatch.setattr(V, "save_sharded", tampered)
    out = tmp_path / "vllm"
    assert main(["export", str(student_dir), "--engine", "vllm", "--out", str(out), "--verify"]) == FAIL
    text = capsys.readouterr().out
    assert "verdict: FAIL" in text and str(tmp_path / "vllm.FAILED") in text
    assert not out.exists()
    rec = json.loads((tmp_path / "vllm.FAILED" / "FAILED.json").read_text())
    assert rec["verdict"] == "FAIL" and any("o_proj" in r for r in rec["reasons"])


def test_export_verify_with_a_foreign_failed_dir_still_moves_the_export_aside(student_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """OUT.FAILED exists and is somebody else's: the failing export still leaves OUT (to a fresh
    OUT.FAILED-XXXXXXXX with FAILED.json), the verdict table is printed, and the foreign folder is untouched."""
    import qatfactory.exporters.vllm as V
    real = V.save_sharded

    def tampered(tensors, out, **kw):
        k = next(n for n in sorted(tensors) if n.endswith("o_proj.weight"))
        t = tensors[k].clone()
        t.view(torch.uint8).reshape(-1)[0] ^= 0x11
        return real({**tensors, k: t}, out, **kw)
    monkeypatch.setattr(V, "save_sharded", tampered)
    out = tmp_path / "vllm"
    theirs = tmp_path / "vllm.FAILED"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main(["export", str(student_dir), "--engine", "vllm", "--out", str(out), "--verify"]) == FAIL
    text = capsys.readouterr().out
    assert "verdict: FAIL" in text and "o_proj" in text
    assert not out.exists()
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"] and (theirs / "notes.txt").read_text() == "mine"
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("vllm.FAILED-")]
    assert len(moved) == 1 and str(moved[0]) in text
    assert json.loads((moved[0] / "FAILED.json").read_text())["verdict"] == "FAIL"


def test_verify_json_never_replaces_a_file_that_is_not_a_report(student_dir, tmp_path, capsys):
    out = tmp_path / "vllm"
    assert main(["export", str(student_dir), "--engine", "vllm", "--out", str(out)]) == 0
    record = student_dir / "qatfactory_quant.json"
    before = record.read_bytes()
    listing = sorted(p.name for p in student_dir.iterdir())
    capsys.readouterr()
    # the student's own record, and any new file inside the student or the export: refused, one line
    for path, code in ((record, USAGE), (student_dir / "report.json", USAGE), (out / "report.json", USAGE)):
        assert main(["verify", str(out), "--against", str(student_dir), "--json", str(path)]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--json" in err[0]
    assert record.read_bytes() == before and sorted(p.name for p in student_dir.iterdir()) == listing
    assert not (out / "report.json").exists()
    # a user's file elsewhere: BAD_INPUT, unchanged
    mine = tmp_path / "mine.json"
    mine.write_text('{"a": 1}')
    assert main(["verify", str(out), "--against", str(student_dir), "--json", str(mine)]) == BAD_INPUT
    assert "not a qatfactory verify report" in capsys.readouterr().err and mine.read_text() == '{"a": 1}'
    # a report of ours is replaced
    rep = tmp_path / "report.json"
    assert main(["verify", str(out), "--against", str(student_dir), "--json", str(rep), "--quiet"]) == 0
    assert main(["verify", str(out), "--against", str(student_dir), "--json", str(rep), "--quiet"]) == 0
    assert json.loads(rep.read_text())["verdict"] == "PASS"


def test_export_folders_and_files_honour_the_umask(student_dir, tmp_path):
    """A server running as another user reads an export when the umask allows it: folder 0777 & ~umask,
    files 0666 & ~umask (not mkdtemp's 0700 / mkstemp's 0600)."""
    import os
    old = os.umask(0o022)
    try:
        out = tmp_path / "vllm"
        assert main(["export", str(student_dir), "--engine", "vllm", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes and all(m == 0o644 for m in modes.values()), modes
    # the student folder (save_student, the same atomic write) under the umask the fixture ran with
    from qatfactory._fsutil import umask
    assert student_dir.stat().st_mode & 0o777 == 0o777 & ~umask()
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask() for p in student_dir.iterdir() if p.is_file())
