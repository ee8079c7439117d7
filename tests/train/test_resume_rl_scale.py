"""GRPO and scale-adapter runs resume bit for bit on CPU over two gloo ranks under ZeRO-2, as every
method of the one loop does: an uninterrupted 2-rank run of 4 steps against a 2-rank run killed with
SIGKILL right after its step-2 checkpoint, then resumed with resume=auto. Every logged number of the
resumed steps (rewards, clip fractions, entropies, losses, scale statistics; timings aside), the held-out
evaluation at the end and the trained bytes (the PEFT adapter, the scale file) must be equal."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

import method_bits as MB
from test_train_resume_ranks import WORLD, _launch

KILL_AT = 2
STEPS = ["train.max_steps=4", "train.save_every=2", "train.keep_last=5", "train.zero_stage=2", "train.plots=false",
         "train.tensorboard=false", "train.eval_every=2"]
GRPO = ["method=grpo", "format=nvfp4_w4a16", "train=cpu_tiny", "method.rl.task=say7", "method.rl.max_new_tokens=4",
        "method.rl.mask_truncated=false", "method.rl.lora_rank=4", "method.rl.n_eval=4",
        "model.tiny.initializer_range=0.3", "train.lr=2e-2", "method.rl.prompts_per_step=2", "method.rl.group_size=4",
        "train.micro_batch=2", "method.rl.num_iterations=2", "method.rl.aqn.enabled=true", "method.rl.aqn.stages=3"]
SCALE = ["method=scale_adapter", "train=cpu_tiny", "data.text_split=lines", "data.seq_len=16", "data.eval_samples=4",
         "train.lr=3e-2", "train.micro_batch=2"]


def _tensors(path):
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _records(run_dir):
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "lr" in r:        # a step record (evaluations carry no lr)
            out[r["step"]] = {k: v for k, v in r.items() if k not in MB.TIMING}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["grpo", "scale_adapter"])
def test_killed_and_resumed_two_ranks_equals_uninterrupted(tmp_path, arm):
    if arm == "grpo":
        over, product = GRPO + STEPS, Path("adapter") / "adapter_model.safetensors"
    else:
        b = MB.native_base(tmp_path)
        over = SCALE + STEPS + [f"model.path={b / 'base'}", f"data.train=[{b / 'data.txt'}]"]
        product = Path("scales.safetensors")
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    rcs, log = _launch(tmp_path, "ref", over + [f"run_dir={ref}"])
    assert rcs == [0, 0], log
    rcs, log = _launch(tmp_path, "killed", over + [f"run_dir={killed}"], kill_at=KILL_AT)
    assert rcs == [-signal.SIGKILL] * WORLD, log
    assert [p.name for p in sorted((killed / "checkpoints").iterdir())] == [f"step-{KILL_AT:06d}"]
    assert not (killed / product).exists()
    rcs, log = _launch(tmp_path, "resumed", over + [f"run_dir={killed}", "resume=auto"])
    assert rcs == [0, 0], log
    assert f"at step {KILL_AT}" in log

    a, b = _records(ref), _records(killed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in (3, 4):
        assert b[s] == a[s], (s, a[s], b[s])
    key = "reward" if arm == "grpo" else "loss"
    assert len({a[s][key] for s in a}) > 1                # the steps differ: not a constant
    (ta, ma), (tb, mb) = _tensors(ref / product), _tensors(killed / product)
    ma, mb = ({k: v for k, v in m.items() if k != "created"} for m in (ma or {}, mb or {}))
    assert ma == mb and sorted(ta) == sorted(tb) and ta                 # the header's order is the writer's hash order
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    sr, sk = (json.loads((d / "summary.json").read_text()) for d in (ref, killed))
    assert sk["eval_last"] == sr["eval_last"] and sk["world_size"] == WORLD and sk["steps"] == 4


@pytest.mark.parametrize("arm", ["grpo", "scale_adapter"])
def test_eval_only_of_a_checkpoint_reproduces_the_runs_last_evaluation(tmp_path, arm):
    # `qatfactory eval --checkpoint`: the run's final checkpoint evaluated alone gives the numbers the run
    # logged at its end, and writes only its own result file
    from qatfactory.faces.cli import eval_main
    from qatfactory.train import compose, run
    over = [a for a in (GRPO if arm == "grpo" else SCALE) + ["train.max_steps=2", "train.plots=false"]]
    if arm == "scale_adapter":
        b = MB.native_base(tmp_path)
        over += [f"model.path={b / 'base'}", f"data.train=[{b / 'data.txt'}]"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = run(compose(over + [f"run_dir={tmp_path / 'r'}"]))
        s.pop("engine").destroy()
        ck = tmp_path / "r" / "checkpoints" / "step-000002"
        before = sorted(p.name for p in (tmp_path / "r").iterdir())
        assert eval_main(["--checkpoint", str(ck)]) == 0
    finally:
        torch.set_num_threads(n)
    e = json.loads((tmp_path / "r" / "eval-step-000002.json").read_text())
    keys = [k for k in s["eval_last"] if k.startswith("eval/")]
    assert keys and {k: e["eval_last"][k] for k in keys} == {k: s["eval_last"][k] for k in keys}
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(before + ["eval-step-000002.json"])
