"""Start N rank processes of `qatfactory train` on CPU (gloo) with the environment the deepspeed
launcher would set (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*): one interpreter per rank and no
launcher process (the multi-rank trainer tests; test_train_resume_ranks.py does the same for a fixed world)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

# a rank: `qatfactory train <overrides>`, or (with a script) python code run after the environment is set
TRAIN = "import sys\nfrom qatfactory.faces.cli import main\nrc = main(['train'] + sys.argv[1:])\n" \
        "print('finished', rc, flush=True)\nsys.exit(rc)\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "NODE_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def launch(tmp: Path, tag: str, world: int, args: Sequence[str], code: str = TRAIN,
           timeout: int = 420) -> Tuple[List[int], str]:
    """``world`` rank processes running ``code`` with ``args``; (exit codes, the logs' tails)."""
    port = free_port()
    base = clean_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)})
    procs, logs = [], []
    for r in range(world):
        log = open(tmp / f"{tag}-rank{r}.log", "w")
        logs.append(log)
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    rcs = []
    try:
        for p in procs:
            rcs.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    text = "\n".join(f"===== {tag} rank {r} =====\n" + (tmp / f"{tag}-rank{r}.log").read_text()[-4000:]
                     for r in range(world))
    return rcs, text


def losses(run_dir) -> Dict[int, float]:
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}
