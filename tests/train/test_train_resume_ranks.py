"""Quantized resume is bit-exact on CPU over two gloo ranks.

NVFP4 W4A4 with a learnable (LSQ) weight scale, a live and a cached teacher, ZeRO-0 and ZeRO-2: an
uninterrupted 2-rank run of 6 steps against a 2-rank run that is killed with SIGKILL right after its
step-2 checkpoint is written (every rank kills itself as the save returns), then resumed with
resume=auto in two fresh processes. The resumed steps' losses, the final student (weights,
learnable scales, activation amax) and the final RNG states must be equal bit for bit.

The ranks are started directly (RANK / WORLD_SIZE / MASTER_* in the environment, what the
deepspeed launcher sets) by rank_launch.launch, each a new process forked from an interpreter that has
only imported the libraries (rank_launch.py says why that is no shared state)."""
from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path

import pytest
import torch
from rank_launch import launch

WORLD = 2
COMMON = ["format=nvfp4_w4a4", "quant.scale_strategy=learnable", "train=cpu_tiny", "model.dtype=float32",
          "model.tiny.initializer_range=0.3", "data.synthetic=24", "data.seq_len=32", "data.eval_samples=4",
          "train.eval_every=3", "train.max_steps=6", "train.save_every=2", "train.keep_last=5", "train.lr=1e-3",
          "train.micro_batch=1", "train.save_student=true", "train.plots=false", "train.tensorboard=false",
          "method.calib_samples=2"]
KILL_AT = 2

RANK = textwrap.dedent("""
    import os, signal, sys
    kill_at = int(sys.argv[1])
    if kill_at:
        import qatfactory.train.checkpoint as C
        real = C.save
        def save(engine, run_dir, step, *a, **k):
            out = real(engine, run_dir, step, *a, **k)
            if step == kill_at:                   # the checkpoint is complete on disk: kill -9 now
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        C.save = save
    from qatfactory.faces.cli import main
    rc = main(["train"] + sys.argv[2:])
    print("finished", rc, flush=True)
    sys.exit(rc)
""")


def _launch(tmp: Path, tag: str, overrides, kill_at: int = 0):
    """Two rank processes of one run; returns their exit codes and logs."""
    return launch(tmp, tag, WORLD, [str(kill_at), *overrides], code=RANK)


def _losses(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _student(run_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(run_dir) / "student" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("teacher,zero", [("live", 0), ("cached", 0), ("live", 2), ("cached", 2)])
def test_killed_and_resumed_two_ranks_equals_uninterrupted(tmp_path, teacher, zero):
    over = COMMON + ["method=qad" if teacher == "live" else "method=qad_cached", f"train.zero_stage={zero}"]
    if teacher == "cached":
        over.append("method.topk=32")
    ref, killed = tmp_path / "ref", tmp_path / "killed"

    rcs, log = _launch(tmp_path, "ref", over + [f"run_dir={ref}"])
    assert rcs == [0, 0], log
    rcs, log = _launch(tmp_path, "killed", over + [f"run_dir={killed}"], kill_at=KILL_AT)
    assert rcs == [-signal.SIGKILL] * WORLD, log
    assert "finished" not in log
    assert [p.name for p in sorted((killed / "checkpoints").iterdir())] == [f"step-{KILL_AT:06d}"]
    assert not (killed / "student").exists() and not (killed / "summary.json").exists()

    rcs, log = _launch(tmp_path, "resumed", over + [f"run_dir={killed}", "resume=auto"])
    assert rcs == [0, 0], log
    assert f"resumed from {killed / 'checkpoints' / f'step-{KILL_AT:06d}'} at step {KILL_AT}" in log

    a, b = _losses(ref), _losses(killed)
    assert sorted(a) == list(range(1, 7)) and sorted(b) == list(range(1, 7))
    for s in range(KILL_AT + 1, 7):                       # the resumed steps, bit for bit
        assert b[s] == a[s], (s, a, b)
    assert len(set(a.values())) == 6                      # six different batches, not a constant
    sa, sb = _student(ref), _student(killed)
    assert sorted(sa) == sorted(sb)
    scales = [k for k in sa if k.endswith("weight_quant.scale")]
    assert scales, sorted(sa)[:20]                        # the LSQ scales are part of the state ...
    from qatfactory.train.checkpoint import safe_torch_load
    m2, m6 = (safe_torch_load(ref / "checkpoints" / f"step-{s:06d}" / "ds" / "mp_rank_00_model_states.pt")["module"]
              for s in (2, 6))
    moved = [k for k in scales if not torch.equal(m2["lm." + k], m6["lm." + k])]
    assert len(moved) == len(scales), (len(moved), len(scales))     # ... and they learn
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    from safetensors.torch import load_file
    for r in range(WORLD):
        ra = load_file(str(ref / "checkpoints" / "step-000006" / f"rng-rank{r}.safetensors"))
        rb = load_file(str(killed / "checkpoints" / "step-000006" / f"rng-rank{r}.safetensors"))
        assert all(torch.equal(ra[k], rb[k]) for k in ra), r
    sr, sk = (json.loads((d / "summary.json").read_text()) for d in (ref, killed))
    assert sr["world_size"] == sk["world_size"] == WORLD
    assert sk["eval_last"] == sr["eval_last"]

