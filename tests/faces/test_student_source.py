"""A student records the model folder it came from, so `qatfactory export STUDENT` ships that model's tokenizer
without --source-dir. The record is checked before use: a folder that moved, became a link, or now holds
another model is not followed (a note says so); --source-dir still overrides."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from qatfactory.faces.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_llm
from tiny_llm import tiny_llama, train_bpe  # noqa: E402


def _model_folder(d: Path, vocab: int = 300) -> Path:
    tok = train_bpe(d, ["The quick brown fox jumps over the lazy dog. Some text of yours."] * 20, vocab)
    tiny_llama(tok, intermediate_size=128, max_position_embeddings=256).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`qatfactory train model=local model.path=<folder with a tokenizer>`: its student."""
    base = tmp_path_factory.mktemp("src")
    model = _model_folder(base / "model")
    text = base / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 100)
    run = base / "run"
    assert main(["train", "model=local", f"model.path={model}", "model.dtype=float32", "train=cpu_tiny",
                 "train.max_steps=2", "data.seq_len=32", f"data.train=[{text}]", f"run_dir={run}"]) == 0
    return model, run / "student"


def _copy(student: Path, dst: Path) -> Path:
    shutil.copytree(student, dst)
    return dst


def test_training_records_the_model_folder(trained):
    model, student = trained
    rec = json.loads((student / "qatfactory_quant.json").read_text())
    assert rec["source_dir"] == str(model.resolve())
    assert not (student / "tokenizer.json").exists()      # the tokenizer stays in the model folder


def test_export_ships_the_recorded_tokenizer_without_source_dir(trained, tmp_path, capsys):
    model, student = trained
    out = tmp_path / "vllm"
    assert main(["export", str(student), "--engine", "vllm", "--out", str(out), "--verify"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").is_file()


def test_a_recorded_folder_that_is_not_that_model_is_not_followed(trained, tmp_path, capsys):
    from qatfactory.faces.export import load_converted
    model, student = trained
    moved = _copy(model, tmp_path / "moved-model")
    st = _copy(student, tmp_path / "student")
    rec = json.loads((st / "qatfactory_quant.json").read_text())

    def record(src):
        rec["source_dir"] = src
        (st / "qatfactory_quant.json").write_text(json.dumps(rec))
        cm = load_converted(str(st))
        return cm.source_dir, capsys.readouterr().err

    assert record(str(moved)) == (str(moved), "")                        # the model, where the record says
    src, err = record(str(tmp_path / "gone"))
    assert src == str(st) and "no longer exists" in err                  # the student's own folder, as before
    os.symlink(moved, tmp_path / "link")
    src, err = record(str(tmp_path / "link"))
    assert src == str(st) and "not a folder" in err                      # a link is never followed
    other = _model_folder(tmp_path / "other", vocab=280)
    src, err = record(str(other))
    assert src == str(st) and "is not the student's" in err and "280" in err
    (moved / "tokenizer.json").unlink()
    (moved / "tokenizer_config.json").unlink()
    src, err = record(str(moved))
    assert src == str(st) and "no tokenizer files" in err
    # --source-dir overrides the record
    rec["source_dir"] = str(tmp_path / "gone")
    (st / "qatfactory_quant.json").write_text(json.dumps(rec))
    assert load_converted(str(st), source_dir=str(other)).source_dir == str(other)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", [5, "relative/model", ["a"]])
def test_a_malformed_record_is_exit_4(trained, tmp_path, capsys, bad):
    _, student = trained
    st = _copy(student, tmp_path / "student")
    rec = json.loads((st / "qatfactory_quant.json").read_text())
    rec["source_dir"] = bad
    (st / "qatfactory_quant.json").write_text(json.dumps(rec))
    assert main(["export", str(st), "--engine", "vllm", "--out", str(tmp_path / "o")]) == 4
    err = capsys.readouterr().err
    assert "qatfactory_quant.json: source_dir" in err and "allowed: null or an absolute folder name" in err
    assert not (tmp_path / "o").exists()


def test_save_student_records_the_folder_the_model_was_loaded_from(tmp_path):
    """The Python path: from_pretrained(folder) -> prepare -> save_student: the same record."""
    from transformers import AutoModelForCausalLM

    from qatfactory.quantize import QuantConfig, calibrate, load_student, prepare, save_student
    model = _model_folder(tmp_path / "model")
    m = AutoModelForCausalLM.from_pretrained(str(model))
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    calibrate(m, None, "max")
    save_student(m, str(tmp_path / "a"))
    assert json.loads((tmp_path / "a" / "qatfactory_quant.json").read_text())["source_dir"] == str(model.resolve())
    # a student saved again from a loaded student keeps no record of the first student's folder
    save_student(load_student(str(tmp_path / "a")), str(tmp_path / "b"))
    assert json.loads((tmp_path / "b" / "qatfactory_quant.json").read_text())["source_dir"] is None


def test_eval_of_a_student_finds_the_recorded_tokenizer(trained, tmp_path, capsys):
    from qatfactory.faces import eval as harness
    model, student = trained
    tok = harness.load_tokenizer(student, {})
    assert tok.name_or_path == str(model.resolve())
    st = _copy(student, tmp_path / "student")
    rec = json.loads((st / "qatfactory_quant.json").read_text())
    rec["source_dir"] = str(tmp_path / "gone")
    (st / "qatfactory_quant.json").write_text(json.dumps(rec))
    with pytest.raises(harness.BadInputError, match="no tokenizer in .*give tokenizer=DIR"):
        harness.load_tokenizer(st, {})
    assert "no longer exists" in capsys.readouterr().err
