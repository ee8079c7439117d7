"""benchmarks/papers/qerl.py --smoke: calibration, the four arms, the GSM8K-319 evaluation path and the
report run end to end on a random tiny model (plumbing only: the smoke measures nothing about QeRL)."""
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_thread():
    # a tiny model on a shared 2-core machine runs ~10x faster on one thread (no OpenMP spin-waits)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_qerl_smoke(tmp_path, one_thread):
    sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
    try:
        import qerl
    finally:
        sys.path.pop(0)
    assert qerl.main(["--smoke", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "qerl.json").read_text())
    assert rep["smoke"] is True and sorted(rep["calibration"]["pass_rates"]) in (["0"], ["0", "1"])
    arms = {r["arm"]: r for r in rep["results"]}
    assert sorted(arms) == sorted(qerl.ARMS)
    for name, r in arms.items():
        assert len(r["curve"]["reward"]) == 2 and r["entropy_step0"] > 0 and r["gsm8k/items"] == 2
        assert r["format"] == ("bf16" if name.startswith("bf16") else "nvfp4_w4a16")
        sig = r["curve"]["aqn/sigma"]
        assert sig == ([0.0, pytest.approx(1e-2)] if r["aqn"] else [None, None]), (name, sig)
    # same prompts, same sampling seed: the two arms of one format start from the same policy
    assert arms["nvfp4_lora"]["entropy_step0"] == arms["nvfp4_lora_aqn"]["entropy_step0"]
    assert arms["bf16_lora"]["entropy_step0"] == arms["bf16_lora_aqn"]["entropy_step0"]
    assert arms["bf16_lora"]["entropy_step0"] != arms["nvfp4_lora"]["entropy_step0"]
    md = (tmp_path / "qerl.md").read_text()
    assert "SMOKE" in md and md.count("\n| ") == 5
    assert (tmp_path / "qerl.png").stat().st_size > 1000
