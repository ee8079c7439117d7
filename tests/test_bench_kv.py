"""benchmarks/kv_cache.py --smoke: data, calibration with the KV pass, the three KV arms through the
trainer, the fp8 arm's export + parity gate, report and plot, end to end on a random tiny model
(plumbing only: the smoke measures nothing about KV caches). The engine checks need a GPU and must say
that they did not run."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _keep_env(monkeypatch, name):
    """Whatever the test does to os.environ[name], the value before it is back afterwards."""
    old = os.environ.get(name)
    monkeypatch.setenv(name, "" if old is None else old)     # records the value before (or its absence)
    if old is None:
        monkeypatch.delenv(name)


def test_kv_cache_benchmark_smoke(tmp_path, one_thread, monkeypatch):
    # the smoke sets QATFACTORY_CACHE in this process (benchmarks/gpu/engines.py); restored after the test,
    # or the tests after it look for llama.cpp's runtime in this test's temporary cache
    _keep_env(monkeypatch, "QATFACTORY_CACHE")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kv_cache
    finally:
        sys.path.pop(0)
    assert kv_cache.main(["--smoke", "--seqs", "32", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "kv_cache.json").read_text())
    assert rep["smoke"] is True
    arms = {r["kv"]: r for r in rep["results"]}
    assert sorted(arms) == sorted(kv_cache.ARMS) and all(r["seq"] == 32 and r["steps"] == 2 for r in arms.values())
    for r in arms.values():
        for phase in ("ptq", "qad"):
            assert r[phase]["kl"] > 0 and r[phase]["ppl"] > 1 and r[phase]["tokens"] > 0
        assert ("quant.kv_format=" + r["kv"] in r["command"]) == (r["kv"] != "none")
    # the same held-out tokens and calibration: quantizing the cache moves the PTQ student away
    assert arms["fp8_e4m3"]["ptq"]["kl"] != arms["none"]["ptq"]["kl"]
    assert arms["nvfp4_kv"]["ptq"]["kl"] > arms["none"]["ptq"]["kl"]
    assert arms["fp8_e4m3"]["verify"]["verdict"] == "PASS" and "verify" not in arms["none"]
    ex = json.loads((Path(arms["fp8_e4m3"]["export_dir"]) / "qatfactory.json").read_text())
    assert ex["kv_cache"]["format"] == "fp8_e4m3" and ex["kv_cache"]["attention"] == "fa3"
    assert ex["kv_cache"]["serve_flags"] == "--kv-cache-dtype fp8 --attention-backend FLASH_ATTN"
    # the attention rule the fp8 arm trained with (auto = fa3) is in its command and its run directory's name
    assert "quant.kv_attention=fa3" in arms["fp8_e4m3"]["command"] and arms["fp8_e4m3"]["run_dir"].endswith("-fa3")
    if not torch.cuda.is_available():
        assert rep["engine_checks"]["vllm_op"]["run"] is False and "no CUDA device" in rep["engine_checks"]["vllm_op"]["why"]
        assert rep["vllm_serve"]["run"] is False
    md = (tmp_path / "kv_cache.md").read_text()
    assert md.count("| 32 |") == 3 and "SMOKE" in md and "not run" in md
    assert (tmp_path / "kv_cache.png").stat().st_size > 1000


def test_served_run_labels_make_file_names_and_the_bf16_control_is_on_by_default():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kv_cache
    finally:
        sys.path.pop(0)
    assert kv_cache._slug("FLASH_ATTN, bf16 cache") == "FLASH_ATTN-bf16-cache"
    assert kv_cache._slug("TRITON_ATTN") == "TRITON_ATTN"
    assert kv_cache.parse(["--out", "o"]).vllm_bf16_control is True
    assert kv_cache.parse(["--out", "o", "--no-vllm-bf16-control"]).vllm_bf16_control is False


def test_kl_by_position_buckets_and_the_served_table_shows_them():
    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kv_cache
    finally:
        sys.path.pop(0)
    kl = torch.zeros(2, 600)
    kl[:, :128] = 1.0
    kl[0, 128:512] = 2.0          # the other row stays 0: that bucket's mean is 1.0
    kl[:, 512:] = 4.0
    by = kv_cache.kl_by_position(kl)
    assert by == {"0-127": 1.0, "128-511": 1.0, "512-599": 4.0}
    assert list(kv_cache.kl_by_position(torch.ones(1, 100))) == ["0-99"]
    cell = {"trained_with": "fa3", "backends": {"FLASH_ATTN": {"backend_in_log": "FLASH_ATTN"}},
            "kl": {"FLASH_ATTN": {"student (bf16 KV)": {"kl": 0.5, "kl_by_position": by}}}}
    rep = {"smoke": True, "date": "d", "results": [], "engine_checks": {}, "vllm_serve": {"cells": {"600": cell}}}
    md = kv_cache.markdown(rep)
    assert "| student's forward | 0-127 | 128-511 | 512-599 |" in md
    assert "| FLASH_ATTN | student (bf16 KV) | 1.00000 | 1.00000 | 4.00000 |" in md
