"""`deepspeed --num_gpus 2 -m qatfactory.train` on CPU (gloo): ZeRO-3 over two ranks, with a quantized
student and a ZeRO-3 partitioned live teacher, agrees with one process without ZeRO (same global batch).

The multi-node path as far as one host allows: DeepSpeed's own launcher started once per
"node" from a hostfile of two hosts with one slot each, ``--no_ssh --node_rank N --master_addr
127.0.0.1`` (what each node runs itself where pdsh/ssh fan-out is not used: Kubernetes, a batch
scheduler). Both groups meet over loopback; the world is the same as the one-group launch, and the
losses, evaluation and saved ZeRO partitions must equal it bit for bit. Not exercised here: ssh/pdsh
fan-out from one node, a second host's network and filesystem (the run directory must be on a
filesystem every node sees: each rank writes its own partition into it), NCCL.

The launcher costs ~25 s per group, so the one-group launch is made once for both tests; stages 0-2
are in test_train.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rank_launch import clean_env, free_port
from test_train import _losses, _run

REPO = Path(__file__).resolve().parents[2]
COMMON = ["method=qad", "format=nvfp4_w4a16", "train=cpu_tiny", "data.synthetic=16", "data.seq_len=32",
          "data.eval_samples=4", "train.eval_every=0", "train.max_steps=3", "train.lr=1e-3",
          "model.tiny.initializer_range=0.3"]
Z3 = ["train.zero_stage=3", "train.micro_batch=1"]


def _launcher():
    return shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")


@pytest.fixture(scope="module")
def one_group(tmp_path_factory):
    launcher = _launcher()
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    run_dir = tmp_path_factory.mktemp("launcher") / "z3"
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "qatfactory.train", *COMMON,
           *Z3, f"run_dir={run_dir}"]
    p = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_launcher_zero3_two_ranks_equals_single_process(one_group, tmp_path):
    summ = json.loads((one_group / "summary.json").read_text())
    assert summ["world_size"] == 2
    assert (one_group / "checkpoints" / "step-000003" / "rng-rank1.safetensors").exists()

    single = _run(tmp_path / "one", *COMMON[3:], "method=qad", "format=nvfp4_w4a16", "train.micro_batch=2")
    a, b = _losses(one_group), _losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3]
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-4), (k, a, b)
    assert summ["eval_last"]["eval/kl"] == pytest.approx(single["eval_last"]["eval/kl"], rel=1e-3)


@pytest.mark.slow
def test_two_launcher_groups_from_a_hostfile_equal_one_group(one_group, tmp_path):
    """Two "nodes" (hostfile node-a / node-b, one slot each), each its own `deepspeed --no_ssh
    --node_rank N` on loopback: DeepSpeed's multi-node rank layout, the same run as one group."""
    launcher = _launcher()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    run_dir = tmp_path / "two-nodes"
    port = str(free_port())
    procs, logs = [], []
    for node in (0, 1):
        log = open(tmp_path / f"node{node}.log", "w")
        logs.append(log)
        cmd = [launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
               "127.0.0.1", "--master_port", port, "--module", "qatfactory.train", *COMMON, *Z3,
               f"run_dir={run_dir}"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=log, stderr=subprocess.STDOUT))
    try:
        rcs = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    text = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert rcs == [0, 0], "\n".join(t[-3000:] for t in text)
    for n, t in enumerate(text):      # each launcher started one local process, as global rank n of 2
        assert f"nnodes=2, num_local_procs=1, node_rank={n}" in t, t[-2000:]
        assert "global_rank_mapping=defaultdict(<class 'list'>, {'node-a': [0], 'node-b': [1]})" in t
        assert "dist_world_size=2" in t

    summ = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((one_group / "summary.json").read_text())
    assert summ["world_size"] == 2
    a, b = _losses(one_group), _losses(run_dir)
    assert sorted(b) == [1, 2, 3] and a == b                       # bit for bit
    assert summ["eval_last"] == ref["eval_last"]
    from qatfactory.train.checkpoint import safe_torch_load
    for r in (0, 1):                                               # each rank's ZeRO-3 partition, the same
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        sa, sb = (safe_torch_load(d / "checkpoints" / "step-000003" / "ds" / name)["optimizer_state_dict"]
                  for d in (one_group, run_dir))
        assert all(torch.equal(x, y) for x, y in zip(sa["fp32_flat_groups"], sb["fp32_flat_groups"]))
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["optimizer_state_dict"]["state"][0][k], sb["optimizer_state_dict"]["state"][0][k])
