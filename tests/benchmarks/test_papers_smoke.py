"""benchmarks/papers/{qad_vs_qat, format_modes, seqlen, lora_memory}.py in their smoke mode (a tiny random Llama on
CPU, a few trainer steps per arm: they measure nothing, they run every code path of the H200 runs): tables (md +
json), PNG plots, verdicts computed by the rule from the numbers in the table, provenance, the memory
decomposition's counted parts against closed forms (and, on a GPU, against the allocator's peak)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
import papers_common as C  # noqa: E402


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("papers-work")


def _outputs(out: Path, stem: str):
    res = json.loads((out / f"{stem}.json").read_text())
    md = (out / f"{stem}.md").read_text()
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SMOKE" in md and "measures nothing" in md and "## Verdicts" in md
    p = res["provenance"]
    assert set(C.PROVENANCE_FIELDS) <= set(p)
    for name, rec in p["data"]["packages"].items():
        assert len(rec["file_sha256"]) == 64 and rec["package"], name
    for split, path in p["data"]["files"].items():
        from qatfactory.assets import sha256_file
        assert p["data"]["sha256"][split] == sha256_file(Path(path))
    for v in res["verdicts"]:                       # each verdict is the rule applied to the values it lists
        again = C.verdict(v["claim"], v["metric"], v["a"], v["a_values"], v["b"], v["b_values"], v["expected_sign"])
        assert again["verdict"] == v["verdict"] and v["verdict"] in C.VERDICTS
        assert f"**{v['verdict']}**" in md
    return res, md


def test_qad_vs_qat_smoke(tmp_path, work, one_thread):
    import qad_vs_qat as A
    arms = ["qad_real", "qat_random"]          # one of each loss and data kind (the others: the same code)
    assert A.main(["--smoke", "--arms", ",".join(arms), "--out", str(tmp_path), "--work", str(work / "a")]) == 0
    res, md = _outputs(tmp_path, "qad_vs_qat")
    done = [r for r in res["arms"] if r["status"] == "done"]
    assert sorted((r["arm"], r["seed"]) for r in done) == sorted((a, s) for a in arms for s in (0, 1))
    for r in done:
        c = r["curves"]                             # CE and KL curves for every arm, QAT included
        assert len(c["step"]) >= 2 and all(math.isfinite(x) for x in c["ce"] + c["kl"])
        assert r["eval"]["wiki_ho"]["kl"] > 0 and set(r["eval"]) == set(A.HELD)
    assert res["teacher"]["wiki_ho"]["kl"] == pytest.approx(0.0, abs=1e-9)
    v = {x["claim"]: x for x in res["verdicts"]}
    assert v["QAD beats PTQ"]["seeds"] == 2 and "diff" in v["QAD beats PTQ"]
    assert v["QAT drifts from the teacher, QAD stays close"]["verdict"] == "inconclusive"   # qat_real not run
    assert "| qat_real | not run |" in md and "| ptq |" in md


def test_format_modes_smoke(tmp_path, work, one_thread):
    import format_modes as B
    assert B.main(["--smoke", "--seeds", "1", "--out", str(tmp_path), "--work", str(work / "b1")]) == 0
    res, md = _outputs(tmp_path, "format_modes")
    for r in res["arms"]:
        assert set(r["eval"]) == {"w4a4", "w4a16"}
        # at W4A16 the activations are not quantized: a W4A4-trained student is closer to the teacher there
        assert r["eval"]["w4a16"]["wiki_ho"]["kl"] < r["eval"]["w4a4"]["wiki_ho"]["kl"]
    assert set(res["ptq"]) == {"nvfp4_w4a4", "nvfp4_w4a16", "mxfp4_w4a4", "mxfp4_w4a16"}
    assert all(v["verdict"] == "inconclusive" for v in res["verdicts"])     # one seed: never a call
    assert "one seed" in md


def test_seqlen_smoke(tmp_path, work, one_thread):
    import seqlen as S
    assert S.main(["--smoke", "--seeds", "1", "--out", str(tmp_path), "--work", str(work / "b2")]) == 0
    res, md = _outputs(tmp_path, "seqlen")
    p = res["preset"]
    for r in res["arms"]:
        assert r["tokens"] == p["steps"] * p["tokens_per_step"]        # the same tokens for every length
        b = r["eval"]["austen_ho"]["kl_by_position"]
        assert list(b) == ["0-15", "16-63", "64-126"]
    assert "AUS KL pos 64-126" in md


def test_lora_memory_smoke_and_counted_parts(tmp_path, work, one_thread):
    import lora_memory as L
    assert L.main(["--smoke", "--seeds", "1", "--out", str(tmp_path), "--work", str(work / "b3")]) == 0
    res, md = _outputs(tmp_path, "lora_memory")
    mem = {(m["arm"], m["config"]): m for m in res["memory"]}
    assert len(mem) == 6 and all(m["status"] == "done" for m in mem.values())
    t = res["preset"]["mem"]
    # the smoke's tiny Llama (papers_common.model_overrides): hidden 64, FFN 128, 2 layers, 4 heads of 16, 2 KV heads,
    # vocabulary 259, tied; per layer q 64x64, k 32x64, v 32x64, o 64x64, gate/up 128x64, down 64x128
    lin = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)
    full_params = lin + 259 * 64 + 2 * 2 * 64 + 64          # + embedding, two norms a layer, the final norm
    full_tensors = 1 + 2 * 9 + 1
    for cfg in (t[0]["name"], t[1]["name"]):
        f = mem[("full_qad", cfg)]
        assert f["trainable_params"] == full_params == 90_624
        assert f["counted"]["optimizer"] == 8 * full_params + 4 * full_tensors   # fp32 moments + a step scalar each
        assert f["counted"]["grads"] == 4 * full_params and f["counted"]["masters"] == 0   # fp32 on a CPU: no masters
        for arm in ("lora_r16", "lora_r256"):
            r = int(arm.split("r")[-1])
            n = 2 * r * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))   # r x (in + out) per projection
            m = mem[(arm, cfg)]
            assert m["trainable_params"] == n, arm
            assert m["counted"]["optimizer"] == 8 * n + 4 * (2 * 7 * 2)          # A and B of 7 projections x 2 layers
            assert m["counted"]["grads"] == 4 * n
            # the same two weight copies (student + teacher) as full QAD, plus the fp32 adapters
            assert m["counted"]["weights"] - f["counted"]["weights"] == 4 * n
    # activation checkpointing with one sequence saves less than two sequences without it
    assert mem[("full_qad", "i")]["counted"]["activations_saved"] < mem[("full_qad", "ii")]["counted"]["activations_saved"]
    assert "## Peak memory, MiB" in md and "| lora_r256 |" in md


@pytest.mark.cuda
@pytest.mark.xfail(strict=True, reason=(
    "H100, 2026-12-06 (twice): on the smoke model 'other' is 31.7 of 34.8 MiB, not yet attributed. Not the GEMM "
    "workspaces (made before the baseline, it stayed); on SmolLM2 'other' is 0.1-5.4 % of the peak. A candidate "
    "not yet checked: a fixed transient workspace in the backward (the step profile shows cuDNN's SDPA backward). "
    "benchmarks/gpu/mem_trace.py lists the probe's allocations >= 1 MiB; strict: a fix makes this fail loudly"))
def test_memory_decomposition_sums_to_the_allocator_peak_on_gpu(tmp_path):
    """On a GPU the parts and `other` add up to torch.cuda.max_memory_allocated, and the parts that were
    not measured by the allocator account for most of it (|other| small)."""
    import types

    import lora_memory as L
    a = types.SimpleNamespace(smoke=True, model_path=None, device="cuda")
    p = L.preset(True)
    data = C.data_files(tmp_path, ("wiki_train", "austen_train", "wiki_ho"), p["limits"])
    for arm in L.ARMS:
        r = L.probe(a, p, data, arm, p["mem"][1])
        assert sum(r["parts"].values()) + r["other"] == r["measured_peak"]
        assert all(v >= 0 for v in r["parts"].values())
        assert abs(r["other"]) <= 0.5 * r["measured_peak"], r


def test_prior_keeps_an_earlier_runs_finished_rows_and_refuses_another_setup(tmp_path, work, one_thread):
    """--prior: a second call runs only what the first did not finish (here: seed 1), keeps seed 0's rows as they
    were (marked, and named in the report), and refuses a prior that measured something else before any work."""
    import seqlen as S
    first, second = tmp_path / "first", tmp_path / "second"
    assert S.main(["--smoke", "--seeds", "1", "--out", str(first), "--work", str(work / "prior")]) == 0
    r1 = json.loads((first / "seqlen.json").read_text())
    assert S.main(["--smoke", "--seeds", "2", "--out", str(second), "--work", str(work / "prior"),
                   "--prior", str(first / "seqlen.json")]) == 0
    res, md = _outputs(second, "seqlen")
    by = {(r["arm"], r["seed"]): r for r in res["arms"]}
    assert len(by) == 2 * len(r1["arms"]) and all(r["status"] == "done" for r in by.values())
    for r in r1["arms"]:
        kept = by[(r["arm"], 0)]
        assert kept["prior"]["path"] == str(first / "seqlen.json") and kept["prior"]["date"] == r1["provenance"]["date"]
        assert kept["eval"] == r["eval"] and kept["seconds"] == r["seconds"]
        assert "prior" not in by[(r["arm"], 1)]
    assert res["provenance"]["prior"]["path"] == str(first / "seqlen.json")
    assert "Kept from an earlier run" in md and f"{r1['arms'][0]['arm']} s0" in md.split("Kept from an earlier run")[1]

    third = tmp_path / "third"
    with pytest.raises(SystemExit, match=r"it measured something else \(preset differ"):
        S.main(["--smoke", "--seeds", "2", "--steps", "1", "--out", str(third), "--work", str(work / "prior"),
                "--prior", str(first / "seqlen.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read it as a result JSON"):
        S.main(["--smoke", "--out", str(third), "--work", str(work / "prior"), "--prior", str(bad)])
    assert not (third / "seqlen.json").exists()


def test_prior_keeps_lora_memory_probes(tmp_path, work, one_thread):
    import lora_memory as L
    first, second = tmp_path / "first", tmp_path / "second"
    assert L.main(["--smoke", "--seeds", "1", "--no-quality", "--out", str(first), "--work", str(work / "b3p")]) == 0
    assert L.main(["--smoke", "--seeds", "1", "--no-quality", "--out", str(second), "--work", str(work / "b3p"),
                   "--prior", str(first / "lora_memory.json")]) == 0
    r1 = json.loads((first / "lora_memory.json").read_text())
    r2 = json.loads((second / "lora_memory.json").read_text())
    assert len(r2["memory"]) == 6 and all(m["prior"]["date"] == r1["provenance"]["date"] for m in r2["memory"])
    assert [m["counted"] for m in r2["memory"]] == [m["counted"] for m in r1["memory"]]
    md = (second / "lora_memory.md").read_text()
    assert md.count(" (prior) |") == 6 and "(prior) = kept from an earlier run" in md


def test_other_is_the_peak_less_the_six_parts_even_where_a_row_stored_a_seventh():
    """Rows of the H100 run of 2026-12-06 11:04 UTC carry a 'gemm_workspace' part (a workspace made before the
    baseline) and an 'other' that subtracted it too; the table recomputes 'other' from the six parts."""
    import lora_memory as L
    mib = 2**20
    parts = {k: 100 * mib for k in L.PARTS}
    stored = {"measured_peak": 590 * mib, "parts": dict(parts, gemm_workspace=64 * mib), "other": -74 * mib}
    assert L._other(stored) == -10 * mib
    assert L._other({"measured_peak": 590 * mib, "parts": parts, "other": -10 * mib}) == -10 * mib
    assert L._other({"measured_peak": None, "parts": None, "other": None}) is None      # a CPU row


def test_mem_trace_lists_large_allocations_with_their_python_frames(monkeypatch):
    """benchmarks/gpu/mem_trace.py (run on a GPU only) reads torch's allocator snapshot: checked here on a
    snapshot-shaped dict, so the diagnostic does not fail on its first GPU call."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import mem_trace as M
    f = [{"filename": "/x/torch/nn/functional.py", "line": 12, "name": "linear"},
         {"filename": "??", "line": 0, "name": "at::native::mm"},
         {"filename": "/y/lora_memory.py", "line": 170, "name": "probe"}]
    snap = {"device_traces": [[
        {"action": "segment_alloc", "addr": 1, "size": 32 * 2**20, "stream": 0, "frames": f},
        {"action": "alloc", "addr": 1, "size": 32 * 2**20, "stream": 0, "frames": f},
        {"action": "alloc", "addr": 2, "size": 4096, "stream": 0, "frames": f},
        {"action": "alloc", "addr": 3, "size": 3 * 2**20, "stream": 7, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 32 * 2**20, "stream": 0, "frames": f}]]}
    big = M.big_allocations(snap, 2**20)
    assert [(b["action"], b["mib"], b["freed_before_the_end"]) for b in big] == [
        ("segment_alloc", 32.0, True), ("alloc", 32.0, True), ("alloc", 3.0, False)]
    assert big[0]["frames"] == ["functional.py:12 linear", "lora_memory.py:170 probe"] and big[2]["frames"] == []
    assert big[2]["stream"] == 7
