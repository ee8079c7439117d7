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


# examples/hf_trainer_qad.py runs below on two ranks (the launch a user makes); one process adds nothing
@pytest.mark.parametrize("name, method", [("trl_sft_qat.py", "qat")])
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


def test_hf_example_on_two_gloo_ranks_with_deepspeed_zero2(tmp_path):
    """`deepspeed --num_gpus 2 examples/hf_trainer_qad.py ... --deepspeed examples/ds_zero2.json` (DeepSpeed's own
    launcher, which hands each process --local_rank) on CPU: two gloo ranks, ZeRO-2."""
    needed("deepspeed")
    sys.path.insert(0, str(ROOT / "examples"))
    import tiny_model
    model = tiny_model.make(tmp_path / "model")      # made once: two ranks would write the same folder
    from rank_launch import clean_env, free_port
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                        str(free_port()), str(ROOT / "examples" / "hf_trainer_qad.py"), "--tiny", "--model", model,
                        "--out", str(out), "--deepspeed", str(ROOT / "examples" / "ds_zero2.json")],
                       env=clean_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-5000:]
    assert log.count("trained on 2 rank(s) with DeepSpeed") == 2, log[-3000:]
    # the student and the export come from rank 0 alone
    assert log.count(f"parity gate: PASS -> {out / 'export-vllm'}") == 1, log[-3000:]
    # 32 samples, 2 per rank and step, 2 ranks: a step is an eighth of an epoch (one rank would make it a sixteenth)
    assert "'epoch': '0.125'" in log and "'kl':" in log, log[-2000:]
    # DeepSpeed's shared-memory collective is not JIT-compiled (minutes on a fresh machine): gloo runs them
    assert "shm_comm_op built" not in log
    assert (out / "student" / "qatfactory_quant.json").is_file() and (out / "export-vllm" / "tokenizer.json").is_file()


def test_trl_grpo_example_on_an_nvfp4_base_with_lora_and_aqn(tmp_path):
    """TRL's GRPOTrainer with its own loss on our frozen NVFP4 base + LoRA, AQN on the rollouts (stage 0 adds
    nothing, then sigma_start decaying to sigma_end), the merged student shipped through the gate."""
    needed("trl")
    out = tmp_path / "run"
    rc, log = run_example("trl_grpo_nvfp4.py", out)
    assert rc == 0, log[-4000:]
    assert f"parity gate: PASS -> {out / 'export-vllm'}" in log, log[-3000:]
    for s in ("'aqn/sigma': '0'", "'aqn/sigma': '0.01'", "'aqn/sigma': '0.0005'", "'reward':"):
        assert s in log, (s, log[-3000:])
    # LoRA learned something: a step with a gradient (completions of different lengths earn different rewards)
    assert any(g not in ("'0'",) for g in __import__("re").findall(r"'grad_norm': ('[^']*')", log)), log[-3000:]
