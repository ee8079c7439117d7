"""benchmarks/gpu/engines.py (vLLM loads our exports on the H200): the CPU smoke run of its student and
report phases, with the student's own top-K standing in for vLLM's output, so the script cannot rot.
The vLLM phase itself needs CUDA and runs only on the GPU machine (benchmarks/gpu/engines.sh)."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import engines  # noqa: E402


def _keep_env(monkeypatch, name):
    """Whatever the test does to os.environ[name], the value before it is back afterwards."""
    old = os.environ.get(name)
    monkeypatch.setenv(name, "" if old is None else old)     # records the value before (or its absence)
    if old is None:
        monkeypatch.delenv(name)


def test_engines_smoke_students_and_report(tmp_path, monkeypatch):
    # the smoke sets QATFACTORY_CACHE in this process (benchmarks/gpu/engines.py); restored after the test,
    # or the tests after it look for llama.cpp's runtime in this test's temporary cache
    _keep_env(monkeypatch, "QATFACTORY_CACHE")
    cells = "nvfp4-w4a16-modelopt,mxfp4-w4a4-ct,moe-nvfp4-w4a16-ct,llama768-nvfp4-w4a4-modelopt"
    rep = engines.main(["smoke", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--cells", cells,
                        "--steps", "2", "--seq", "64", "--micro", "2", "--eval-seqs", "2", "--prompts", "2",
                        "--prompt-len", "8", "--calib", "2", "--topk", "16", "--sglang-cells", "mxfp4-w4a4-ct"])
    assert rep == 0
    d = json.loads((tmp_path / "out" / "engines.json").read_text())
    assert sorted(d["cells"]) == sorted(cells.split(","))
    for name, r in d["cells"].items():
        s = r["student"]
        # the stand-in is the student itself: KL 0, identical top-1 and greedy continuations
        assert abs(s["kl_vs_vllm"]) < 1e-6 and s["top1_agree"] == 1.0, (name, s)
        assert s["greedy_vs_vllm"]["identical"] == 1.0
        assert s["max_abs_logprob_diff_top8"] == 0.0
    # the W4A4 cell is also compared with its weight-only forward (what a weight-only kernel runs)
    w = d["cells"]["mxfp4-w4a4-ct"]["student weights only"]
    assert w["kl_vs_vllm"] > 0 and "kl_vs_ptq" in w
    # its greedy continuations are scored too (what a weight-only kernel should reproduce), and shown in its row
    assert 0.0 <= w["greedy_vs_vllm"]["token_match"] <= 1.0
    assert "kl_vs_ptq" in d["cells"]["nvfp4-w4a16-modelopt"]["student"]
    assert "kl_vs_ptq" not in d["cells"]["moe-nvfp4-w4a16-ct"]["student"]     # random MoE: no PTQ baseline
    md = (tmp_path / "out" / "engines.md").read_text()
    for name in cells.split(","):
        assert f"| {name} |" in md
    wo_row = next(ln for ln in md.splitlines() if ln.startswith("| mxfp4-w4a4-ct vs its weight-only forward |"))
    assert wo_row.split("|")[8].strip() == f"{w['greedy_vs_vllm']['token_match']:.3f}"     # greedy tokens equal
    # SGLang's stand-in ran one cell: scored the same way, under the row's "sglang", with its own bf16
    sg = d["cells"]["mxfp4-w4a4-ct"]["sglang"]
    assert abs(sg["student"]["kl_vs_sglang"]) < 1e-6 and sg["student"]["greedy_vs_sglang"]["identical"] == 1.0
    assert sg["student weights only"]["kl_vs_sglang"] == w["kl_vs_vllm"]          # the same partition, the same KL
    assert sg["throughput_vs_bf16"] == {"1": 0.5} and d["cells"]["mxfp4-w4a4-ct"]["throughput_vs_bf16"] == {"1": 1.0}
    assert "sglang" not in d["cells"]["nvfp4-w4a16-modelopt"] and "sglang_bf16" in d
    sg_md = md.split("SGLang stand-in")[1]
    assert "| mxfp4-w4a4-ct |" in sg_md and "| nvfp4-w4a16-modelopt |" not in sg_md
    # the random Llama whose linears fit SGLang's Marlin tiles: trained and PTQ'd like SmolLM2, its own bf16 as
    # the throughput reference (200 tok/s in the stand-in, SmolLM2's 100)
    ll = d["cells"]["llama768-nvfp4-w4a4-modelopt"]
    assert "kl_vs_ptq" in ll["student"] and "kl_vs_ptq" in ll["student weights only"]
    assert ll["throughput_vs_bf16"] == {"1": 0.5} and ll["engine_runs_trained_numbers"] in (True, False)
    assert json.loads((tmp_path / "w" / "model-tiny_llama" / "config.json").read_text())["hidden_size"] == 256     # the smoke's size
    exp = Path(d["cells"]["nvfp4-w4a16-modelopt"]["cell"]["export_dir"])
    assert (exp / "hf_quant_config.json").is_file() and (exp / "model.safetensors").is_file()


def test_top1_agree_counts_ties_and_catches_a_real_disagreement():
    import torch
    # position 0: the student ties tokens 1 and 2 and the engine ranks 2 first (agree); position 1: the engine
    # ties 0 and 3 and lists 3 first while the student's argmax is 0 (agree); position 2: a clear disagreement
    p = torch.log_softmax(torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 1.0, 1.0, 2.9], [0.0, 1.0, 3.0, 0.0]]), -1)
    q_ix = np.array([[2, 1, 3], [3, 0, 1], [1, 2, 0]])
    q_lp = np.array([[-1.0, -1.0, -2.0], [-0.5, -0.5, -3.0], [-0.2, -0.3, -4.0]])
    assert engines.top1_agree(p, q_ix, q_lp) == pytest.approx(2 / 3)
    assert engines.top1_agree(p[:2], q_ix[:2], q_lp[:2]) == 1.0
