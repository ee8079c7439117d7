"""`deepspeed --num_gpus 2 -m qatfactory.train` on CPU (gloo): ZeRO-3 over two ranks, with a quantized
student and a ZeRO-3 partitioned live teacher, agrees with one process without ZeRO (same global batch).
The launcher costs ~25 s, so this is the only multi-process test; stages 0-2 are in test_train.py."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import _losses, _run

REPO = Path(__file__).resolve().parents[1]
COMMON = ["method=qad", "format=nvfp4_w4a16", "train=cpu_tiny", "data.synthetic=16", "data.seq_len=32",
          "data.eval_samples=4", "train.eval_every=0", "train.max_steps=3", "train.lr=1e-3",
          "model.tiny.initializer_range=0.3"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_launcher_zero3_two_ranks_equals_single_process(tmp_path):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(_port()), "--module", "qatfactory.train", *COMMON,
           "train.zero_stage=3", "train.micro_batch=1", f"run_dir={tmp_path / 'z3'}"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summ = json.loads((tmp_path / "z3" / "summary.json").read_text())
    assert summ["world_size"] == 2
    assert (tmp_path / "z3" / "checkpoints" / "step-000003" / "rng-rank1.safetensors").exists()

    single = _run(tmp_path / "one", *COMMON[3:], "method=qad", "format=nvfp4_w4a16", "train.micro_batch=2")
    a, b = _losses(tmp_path / "z3"), _losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3]
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-4), (k, a, b)
    assert summ["eval_last"]["eval/kl"] == pytest.approx(single["eval_last"]["eval/kl"], rel=1e-3)
