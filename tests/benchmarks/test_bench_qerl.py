"""benchmarks/papers/qerl.py --smoke: the warm-up (saved once, reused by a later call), calibration, the
four arms split over two calls and merged into one table, the GSM8K-319 evaluation path and the report
run end to end on a random tiny model (plumbing only: the smoke measures nothing about QeRL); the
calibration refuses a model that is never right, and --merge refuses parts that started from
different warm-ups."""
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_thread():
    # a tiny model on a shared 2-core machine runs ~10x faster on one thread (no OpenMP spin-waits)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def qerl():
    sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
    try:
        import qerl as q
    finally:
        sys.path.pop(0)
    return q


def test_qerl_smoke_split_over_two_calls_and_merged(tmp_path, one_thread, qerl):
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    assert qerl.main(["--smoke", "--out", str(a), "--arms", "bf16_lora,nvfp4_lora"]) == 0
    assert "Missing arms: nvfp4_lora_aqn seed 0, bf16_lora_aqn seed 0." in (a / "qerl.md").read_text()
    # the second call: same settings, other arms; its warm-up is rebuilt bit for bit (seeded, deterministic)
    assert qerl.main(["--smoke", "--out", str(b), "--arms", "nvfp4_lora_aqn,bf16_lora_aqn"]) == 0
    ra, rb = (json.loads((d / "qerl.json").read_text()) for d in (a, b))
    assert ra["warmup"]["sha256"] == rb["warmup"]["sha256"] and ra["warmup"]["reused"] is False
    assert ra["warmup"]["steps"] == 2 and ra["warmup"]["loss_first"] > 0
    assert {r["warmup_sha256"] for r in ra["results"] + rb["results"]} == {ra["warmup"]["sha256"]}
    # the smoke's random model is never right: recorded, allowed only because it is the smoke
    assert ra["calibration"]["no_signal"] is True and sorted(ra["calibration"]["pass_rates"]) in (["0"], ["0", "1"])
    assert qerl.main(["--merge", str(a / "qerl.json"), str(b / "qerl.json"), "--out", str(m)]) == 0
    rep = json.loads((m / "qerl.json").read_text())
    arms = {r["arm"]: r for r in rep["results"]}
    assert sorted(arms) == sorted(qerl.ARMS)
    for name, r in arms.items():
        assert len(r["curve"]["reward"]) == 2 and r["entropy_step0"] > 0 and r["gsm8k/items"] == 2
        assert r["format"] == ("bf16" if name.startswith("bf16") else "nvfp4_w4a16")
        sig = r["curve"]["aqn/sigma"]
        assert sig == ([0.0, pytest.approx(1e-2)] if r["aqn"] else [None, None]), (name, sig)
    # same prompts, same sampling seed, same warmed-up model: the two arms of one format start from
    # the same policy, even from two calls
    assert arms["nvfp4_lora"]["entropy_step0"] == arms["nvfp4_lora_aqn"]["entropy_step0"]
    assert arms["bf16_lora"]["entropy_step0"] == arms["bf16_lora_aqn"]["entropy_step0"]
    assert arms["bf16_lora"]["entropy_step0"] != arms["nvfp4_lora"]["entropy_step0"]
    md = (m / "qerl.md").read_text()
    assert "SMOKE" in md and "Every arm ran." in md and "Warm-up (shared by every arm): 2 steps" in md
    assert sum(line.startswith("| ") and "_lora" in line for line in md.splitlines()) == 4
    assert (m / "qerl.png").stat().st_size > 1000
    # a later call into the same --out reuses the warm-up and skips the arms it already has
    assert qerl.main(["--smoke", "--out", str(a), "--arms", "bf16_lora"]) == 0
    again = json.loads((a / "qerl.json").read_text())
    assert again["warmup"]["reused"] is True and len(again["results"]) == 2
    # ... but not with other settings
    assert qerl.main(["--smoke", "--out", str(a), "--steps", "3"]) == 3


def test_qerl_merge_refuses_parts_from_different_warmups(tmp_path, one_thread, qerl, capsys):
    a = tmp_path / "a"
    assert qerl.main(["--smoke", "--out", str(a), "--arms", "bf16_lora"]) == 0
    rec = json.loads((a / "qerl.json").read_text())
    rec["warmup"]["sha256"] = "0" * 64
    rec["results"][0]["arm"] = "nvfp4_lora"
    (tmp_path / "b.json").write_text(json.dumps(rec))
    capsys.readouterr()
    assert qerl.main(["--merge", str(a / "qerl.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")]) == 3
    err = capsys.readouterr().err
    assert "do not belong in one table" in err and "warm-up weights sha256" in err
    assert qerl.main(["--merge", str(a / "qerl.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m"),
                      "--allow-mismatch"]) == 0
    assert "MERGED DESPITE MISMATCHES" in (tmp_path / "m" / "qerl.md").read_text()
    # a changed warm-up directory is not reused silently
    from safetensors.torch import load_file, save_file
    f = a / "runs" / "warmup" / "model.safetensors"
    sd = load_file(str(f))
    k = sorted(sd)[0]
    sd[k] = sd[k] + 1
    save_file(sd, str(f), metadata={"format": "pt"})
    capsys.readouterr()
    assert qerl.main(["--smoke", "--out", str(a), "--arms", "bf16_lora"]) == 3
    assert "it was changed after it was written" in capsys.readouterr().err


def test_qerl_calibration_refuses_a_model_that_is_never_right(tmp_path, one_thread, qerl, capsys):
    assert qerl.main(["--smoke", "--no-allow-no-signal", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "no arithmetic level gave a single correct completion" in err and "--warmup-steps" in err
    rec = json.loads((tmp_path / "qerl.json").read_text())
    assert "error" in rec["calibration"] and rec["results"] == []
    assert not (tmp_path / "runs" / "bf16_lora-seed0").exists()      # no arm spent a step


def test_an_arm_cut_by_a_time_limit_is_set_aside_on_the_rerun_never_deleted(tmp_path, qerl):
    """2026-12-06 on the GPU: the NVFP4-LoRA arm was cut at step 24 of 25; the rerun stopped at once on
    'run_dir already holds a run'. The cut run is ours (its run record), so it is renamed and the arm starts
    fresh; a folder that is not a run directory stops the rerun and stays as it was."""
    from qatfactory import _fsutil
    rd = tmp_path / "runs" / "nvfp4_lora-seed0"
    rd.mkdir(parents=True)
    (rd / _fsutil.RUN_RECORD).write_text(json.dumps({"qatfactory_run": 1}))
    (rd / "metrics.jsonl").write_text("{}\n")
    assert _fsutil.kind_of(rd) == "run"
    qerl._set_aside_unfinished(rd)
    assert not rd.exists()
    (aside,) = [p for p in rd.parent.iterdir() if p.name.startswith("nvfp4_lora-seed0.cut-")]
    assert (aside / "metrics.jsonl").read_text() == "{}\n"
    qerl._set_aside_unfinished(rd)                      # nothing there: nothing happens
    rd.mkdir()
    (rd / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="is not a qatfactory run directory"):
        qerl._set_aside_unfinished(rd)
    assert (rd / "notes.txt").read_text() == "mine"
