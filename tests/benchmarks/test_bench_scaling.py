"""benchmarks/gpu/scaling.sh smoke: the multi-GPU scaling script end to end on CPU (gloo) with
tiny shapes of both of its models, so it cannot rot while no multi-GPU machine runs it: a Llama under
ZeRO-2 on one rank and a random Qwen3-MoE (written as a local HF directory by the script) under ZeRO-3
on two ranks with the torch.profiler launch, then the report. Nothing about speed is asserted."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scaling_script_smoke_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(LOCAL="1", OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), PY=sys.executable,
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    p = subprocess.run(["bash", "benchmarks/gpu/scaling.sh", "smoke"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(l) for l in (tmp_path / "out" / "scaling" / "scaling.jsonl").read_text().splitlines()]
    assert [(r["model"], r["zero"], r["world"], r["profiled"], r["sp"]) for r in recs] == \
        [("tiny", 2, 1, False, 1), ("tiny_moe", 3, 2, True, 1), ("tiny", 3, 2, False, 2)], recs
    for r in recs:
        assert r["rc"] == 0 and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["timed_steps"] == 2, r
    prof = recs[1]["profile"]
    assert prof["steps"] == 2 and prof["tokens_per_step"] == 2 * 32
    assert prof["per_step_ms"]["all_gather"] > 0 and "c10d::_allgather_base_" in prof["table"]
    moe = json.loads(next((tmp_path / "work").glob("qwen3moe-*/config.json")).read_text())
    assert moe["model_type"] == "qwen3_moe" and moe.get("num_local_experts", moe.get("num_experts")) == 4
    tables = (tmp_path / "out" / "scaling" / "tables.md").read_text()
    assert "### tiny (2 layers), ZeRO-2, strong scaling" in tables
    assert "### tiny_moe (2 layers), ZeRO-3, strong scaling" in tables and "| 2 | 1 x 1 | 2 |" in tables
    # one sequence over both ranks: one sequence in flight, so a global batch of 2 is 2 accumulation steps
    assert "### tiny (2 layers), ZeRO-3, strong scaling, 32 tokens/sequence, each sequence over all GPUs (Ulysses)" \
        in tables and "| 2 | 1 x 2 | 2 |" in tables


def test_the_long_sequence_arms_compose():
    # the one-GPU long-context rows (scaling.sh long-1gpu-*): live top-4096 QAD and a plain bf16 SFT step at 128K
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import scaling

    from qatfactory.train.config import compose
    base = ["run", "--model", "llama1b", "--zero", "2", "--worlds", "1", "--modes", "strong", "--seq", "131072",
            "--global-batch", "1", "--gas", "1", "--out", "/nonexistent"]
    got = {}
    for label, extra in (("qad", ["--set", "method.loss.kind=topk_kl", "--set", "method.loss.top_k=4096"]),
                         ("sft", ["--method", "qat", "--format", "bf16"])):
        a = scaling.parser().parse_args(base + extra + ["--label", label])
        a.zero_stage = 2
        got[label] = compose(scaling.point_overrides(a, "strong", 1), check_files=False)
    q, s = got["qad"], got["sft"]
    assert q.method.loss.kind == "topk_kl" and q.method.loss.top_k == 4096 and q.data.seq_len == 131072
    assert q.model.tiny.hidden_size == 2048 and q.train.micro_batch == 1 and q.train.grad_accum == 1
    assert s.method.name == "qat" and s.quant.weight_format == "none" and not s.method.eval_teacher

