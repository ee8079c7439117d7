"""A one-process run whose inherited MASTER_PORT is taken still trains: a parent that ran a trainer in its own
process (a notebook, a test runner) keeps that process group's store listening on the port it left in the
environment, and every `qatfactory train` it starts afterwards inherits RANK=0, WORLD_SIZE=1 and that port."""
import os
import socket
import subprocess
import sys


def test_an_inherited_busy_port_does_not_stop_a_one_process_run(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "qatfactory.faces.cli", "train", "model=tiny_llama", "train=cpu_tiny",
                            "train.max_steps=1", "train.eval_every=0", "data.synthetic=4", "data.seq_len=16",
                            "data.eval_samples=1", f"run_dir={tmp_path / 'run'}"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
