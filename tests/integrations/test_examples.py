"""The examples a user copies (examples/*.py) run as written, on a tiny random model (--tiny): each trains a
few steps inside the Trainer it shows, saves the student with its format state and ships an export that
passes the parity gate."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from optional_imports import needed

needed("accelerate")     # transformers' Trainer runs on it (the test extra)

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_example(name, out, *extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--tiny", "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=600, env=env, cwd=out.parent)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("name, method", [("hf_trainer_qad.py", "qad"), ("trl_sft_qat.py", "qat")])
def test_example_trains_saves_and_ships(tmp_path, name, method):
    if name.startswith("trl"):
        needed("trl")
    out = tmp_path / "run"
    rc, log = run_example(name, out)
    assert rc == 0, log[-4000:]
    assert f"parity gate: PASS -> {out / 'export-vllm'}" in log, log[-3000:]
    assert "'loss':" in log                                    # the Trainer logged its steps
    rec = json.loads((out / "student" / "qatfactory_quant.json").read_text())
    assert rec["quant_config"]["name"] == "nvfp4_w4a16"
    exp = json.loads((out / "export-vllm" / "hf_quant_config.json").read_text())
    assert "NVFP4" in json.dumps(exp)
    assert (out / "export-vllm" / "tokenizer.json").is_file()  # the model folder's tokenizer went with it
