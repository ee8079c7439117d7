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
    """What `accelerate launch --num_processes 2` / `torchrun --nproc_per_node 2` start: two processes of the
    example with the launcher's variables, examples/ds_zero2.json as its DeepSpeed config, on CPU (gloo)."""
    needed("deepspeed")
    sys.path.insert(0, str(ROOT / "examples"))
    import tiny_model
    model = tiny_model.make(tmp_path / "model")      # made once: two ranks would write the same folder
    from rank_launch import clean_env, free_port
    base = clean_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                      "LOCAL_WORLD_SIZE": "2"})
    out, procs = tmp_path / "run", []
    for r in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "hf_trainer_qad.py"), "--tiny", "--model", model, "--out", str(out),
             "--deepspeed", str(ROOT / "examples" / "ds_zero2.json")],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=tmp_path))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"parity gate: PASS -> {out / 'export-vllm'}" in logs[0] and "parity gate" not in logs[1]
    # 32 samples, 2 per rank and step, 2 ranks: a step is an eighth of an epoch (one rank would make it a
    # sixteenth); the student and the export come from rank 0 only
    assert "'epoch': '0.125'" in logs[0] and "trained on 2 rank(s) with DeepSpeed" in logs[0], logs[0][-2000:]
    assert "'kl':" in logs[0]                                 # QAD's loss is the KL to the teacher, logged as such
    # DeepSpeed's shared-memory collective is not JIT-compiled (minutes on a fresh machine): gloo runs them
    assert not any("shm_comm_op built" in x for x in logs)
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
