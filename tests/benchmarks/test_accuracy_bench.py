"""benchmarks/accuracy/{qad_recipe, peer_modelopt}.py in smoke mode (a tiny random Llama on CPU, a few steps; they
measure nothing, they run every code path of the GPU runs: our PTQ calibrations, our QAD/QAT arms through the
trainer, Model Optimizer's mtq.quantize + QADTrainer, the shared evaluator), and the merge of several processes'
JSONs into one table, including a process cut by its time limit."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "accuracy"))
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
import qad_recipe as R  # noqa: E402

pytestmark = pytest.mark.slow


def _env(**extra):
    # this worker may have run a trainer in its own process: its process-group variables (and the port its
    # store still listens on) must not reach a child, whose own launcher (accelerate, DeepSpeed) would reuse them
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    # each script in its own process, as the GPU entry runs them: the trainer initialises torch.distributed,
    # after which Hugging Face's Trainer (Model Optimizer's QADTrainer) would wrap the frozen teacher in DDP
    import os
    import subprocess
    out = tmp_path_factory.mktemp("accuracy")
    env = _env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for script, args in (("qad_recipe", ["--lrs", "1e-3", "--ptq", "--tag", "a", "--work", str(out / "w1")]),
                         ("peer_modelopt", ["--tag", "mo", "--work", str(out / "w2")])):
        r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "accuracy" / f"{script}.py"), "--smoke",
                            "--out", str(out), "--steps", "2", *args], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{script}: {r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return out


def test_every_arm_runs_and_reports_finite_scores(smoke):
    a = json.loads((smoke / "a.json").read_text())
    assert set(a["ptq"]) == set(R.CALIBS)
    for cm, r in a["ptq"].items():
        assert "error" not in r, (cm, r)
        assert math.isfinite(r["wiki_ho"]["kl"]) and r["wiki_ho"]["kl"] > 0
    (arm,) = a["arms"]
    assert arm["status"] == "done" and arm["lr"] == 1e-3
    assert arm["curve"]["step"] and all(math.isfinite(k) for k in arm["curve"]["kl"])
    mo = json.loads((smoke / "mo.json").read_text())
    assert mo["cpu_stand_in"]  # Model Optimizer's FP4 quantizers need CUDA: the table says what ran instead
    (marm,) = mo["arms"]
    assert marm["status"] == "done" and math.isfinite(marm["eval"]["wiki_ho"]["kl"])
    assert "SMOKE" in (smoke / "a.md").read_text()


def test_merge_puts_every_process_in_one_table_and_keeps_a_cut_process_curve(smoke, tmp_path):
    a = json.loads((smoke / "a.json").read_text())
    # a process killed by its time limit: its JSON has no row, its run folder has the trainer's logged evals
    cut = dict(a, arms=[], ptq={}, runs_dir=str(tmp_path / "runs"))
    run = tmp_path / "runs" / "qad_lr0.5_cosine_dynamic-s0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "eval/kl": k, "eval/ce": 3.0})
                                                 for s, k in ((0, 0.9), (2, 0.7))) + "\n")
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    out = tmp_path / "merged"
    assert R.main(["--merge", str(smoke / "a.json"), str(smoke / "mo.json"), str(tmp_path / "cut.json"),
                   "--out", str(out)]) == 0
    m = json.loads((out / "qad_recipe.json").read_text())
    names = {r["arm"] for r in m["arms"]}
    assert {"qad_lr0.001_cosine_dynamic", "modelopt_qad_lr1e-05", "qad_lr0.5_cosine_dynamic"} <= names
    cut_row = next(r for r in m["arms"] if r["arm"] == "qad_lr0.5_cosine_dynamic")
    assert cut_row["status"].startswith("cut at step 2") and cut_row["curve"]["kl"] == [0.9, 0.7]
    assert any(k.startswith("modelopt") for k in m["ptq"]) and "max" in m["ptq"]
    assert (out / "qad_recipe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_refuses_a_json_measured_on_other_data(smoke, tmp_path):
    a = json.loads((smoke / "a.json").read_text())
    other = json.loads(json.dumps(a))
    other["provenance"]["data"]["sha256"]["wiki_ho"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other data"):
        R.main(["--merge", str(smoke / "a.json"), str(tmp_path / "other.json"), "--out", str(tmp_path / "m")])
