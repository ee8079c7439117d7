"""Our entry points print only ours: third-party import noise is filtered by message, git runs only in a work tree."""
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from qatfactory import _quiet

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_llm import tiny_llama, train_bpe  # noqa: E402


def test_filters_drop_only_the_known_messages(caplog):
    _quiet.install()
    ds = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.INFO):
        ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        ds.warning("a real DeepSpeed warning")
        logging.getLogger("torchao").warning("Failed to load %s: %s", "x.so", "no such file")
        logging.getLogger("torchao").warning("something else torchao says")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["a real DeepSpeed warning", "something else torchao says"]


def test_git_is_asked_only_inside_a_work_tree(tmp_path, capfd):
    assert _quiet.git_commit(str(tmp_path)) is None
    assert capfd.readouterr().err == ""                 # no "fatal: not a git repository"
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    import os
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True, env={**os.environ, **env})
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    assert _quiet.git_commit(str(repo)).startswith(head.strip()[:7])


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from qatfactory.quantize import QuantConfig, calibrate, prepare, save_student
    d = tmp_path_factory.mktemp("quiet")
    tok = train_bpe(d / "tok", ["What is the capital of France? Paris. Which of these is a colour? red."] * 20, 300)
    m = tiny_llama(tok, 128, 512).float()
    prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    calibrate(m, None, "max")
    save_student(m, str(d / "student"))
    tok.save_pretrained(str(d / "student"))
    arc = d / "arc.jsonl"
    arc.write_text(json.dumps({"question": "What is the capital of France?", "answerKey": "A",
                               "choices": {"text": ["Paris", "Berlin"], "label": ["A", "B"]}}) + "\n")
    return d


def test_eval_outside_a_clone_prints_no_git_error(student, tmp_path, capfd, monkeypatch):
    """lm-eval asks git for the current directory's commit; outside a clone git said "fatal: ..." on our stderr."""
    from qatfactory.faces import eval as harness
    monkeypatch.chdir(tmp_path)                          # not a git work tree
    rc = harness.main([str(student / "student"), "tasks=qf_arc_easy", f"data_files=qf_arc_easy:{student / 'arc.jsonl'}",
                       f"out={tmp_path / 'ev'}"])
    out, err = capfd.readouterr()
    assert rc == 0, err[-2000:]
    assert "fatal" not in out + err and (tmp_path / "ev" / "results.json").is_file()
    import lm_eval.evaluator
    assert lm_eval.evaluator.get_git_commit_hash is not _quiet.git_commit     # put back after the run


def test_missing_tensorboard_is_said_only_when_asked(tmp_path, capsys, monkeypatch):
    import builtins

    from qatfactory.train.runlog import RunLogger
    real = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    RunLogger(tmp_path / "a", True, None, progress=False)          # the default: TensorBoard when installed
    RunLogger(tmp_path / "b", True, False, progress=False)
    assert capsys.readouterr().out == ""
    RunLogger(tmp_path / "c", True, True, progress=False)          # train.tensorboard=true: asked for, so said
    assert "tensorboard is not installed" in capsys.readouterr().out
