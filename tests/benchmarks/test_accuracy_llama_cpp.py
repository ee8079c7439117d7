"""benchmarks/accuracy/llama_cpp_arms.py (Q4_K_M served by llama.cpp: our PTQ / QAD exports against llama-quantize
without and with llama-imatrix) in smoke mode, end to end: a random 2-layer model of SmolLM2's widths and tokenizer,
`qatfactory train` + `qatfactory export` for our arms, llama.cpp's converter, llama-quantize and llama-imatrix for
the peers, every file scored by llama-cpp-python in its own process; plus the scorer's arithmetic against torch,
the behaviour rules, and the merge of two calls' JSONs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ACC = REPO / "benchmarks" / "accuracy"
sys.path.insert(0, str(ACC))
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
import behaviour as B  # noqa: E402
import llama_cpp_arms as A  # noqa: E402
import llama_cpp_score as S  # noqa: E402


def _env(**extra):
    # this worker may have run a trainer in its own process: its process-group variables must not reach a child
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from smollm2_shapes import require_llama_cpp
    require_llama_cpp()
    out = tmp_path_factory.mktemp("q4km")
    r = subprocess.run([sys.executable, str(ACC / "llama_cpp_arms.py"), "--smoke", "--out", str(out),
                        "--score-teacher-as-arm"], env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out, json.loads((out / f"{A.TAG}.json").read_text())


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_every_arm_is_a_gguf_of_equal_size_scored_by_llama_cpp(smoke):
    out, res = smoke
    arms = res["arms"]
    assert set(A.ARMS) <= set(arms)
    files = [arms[k]["file"] for k in A.ARMS]
    # equal budget in bytes: the same tensor types, so the same tensor data, in every arm's file
    assert len({f["data_bytes"] for f in files}) == 1 and len({json.dumps(f["types"]) for f in files}) == 1
    assert files[0]["types"]["Q4_K"] > 0 and files[0]["token_embd.weight"] == "Q8_0"
    assert 4.5 < files[0]["bpw"] < 9 and res["teacher"]["bpw"] == 32.0
    for k in A.ARMS:
        for held in A.HELD:
            s = arms[k]["scores"][held]
            assert math.isfinite(s["kl"]) and s["kl"] > 0 and 0 < s["top1"] < 1 and math.isfinite(s["ppl"]), (k, s)
            assert s["tokens"] == res["scoring"]["sets"][held]["tokens_scored"]
    # the teacher scored as an arm in the same runtime: the scorer adds nothing of its own
    again = arms["teacher_again"]["scores"]
    for held in A.HELD:
        assert again[held]["kl"] == 0 and again[held]["top1"] == 1 and again[held]["ppl"] == again[held]["ppl_teacher"]
    # the importance matrix changed llama-quantize's file (made from the calibration text our PTQ used)
    assert arms["lq"]["scores"]["wiki_ho"]["kl"] != arms["lq_imatrix"]["scores"]["wiki_ho"]["kl"]
    assert res["calibration_text"]["windows"] == res["preset"]["calib_samples"]
    assert arms["qad"]["steps"] == res["preset"]["steps"] and arms["qad"]["tokens"] > 0
    assert "method=qad" in arms["qad"]["command"] and "format=q4_k" in arms["qad"]["command"]


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_behaviour_and_table(smoke):
    out, res = smoke
    n = len(B.all_prompts())
    assert len(res["teacher"]["answers"]) == n and res["teacher"]["behaviour"]["length_ratio"] == 1
    for k in A.ARMS:
        b = res["arms"][k]["behaviour"]
        assert len(res["arms"][k]["answers"]) == n and b["length_ratio"] > 0 and 0 <= b["format_kept"] <= 1
    assert res["arms"]["teacher_again"]["behaviour"]["same_answer"] == 1
    md = (out / f"{A.TAG}.md").read_text()
    assert "SMOKE" in md and "tools/imatrix/README.md" in md and "tools/quantize/README.md" in md
    for k in A.ARMS:
        assert f"| {res['arms'][k]['label']} |" in md


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_merge_takes_later_arms_and_refuses_other_tokens(smoke, tmp_path):
    out, res = smoke
    a = dict(res, arms={k: v for k, v in res["arms"].items() if k != "qad"})
    b = dict(res, arms={"qad": res["arms"]["qad"]})
    for name, d in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    assert A.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m" / f"{A.TAG}.json").read_text())
    assert set(A.ARMS) <= set(m["arms"])
    other = json.loads(json.dumps(b))
    other["scoring"]["sets"]["wiki_ho"]["token_sha256"] = "0" * 64
    (tmp_path / "o.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other held-out tokens"):
        A.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "o.json"), "--out", str(tmp_path / "m2")])


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_qad_run_must_be_a_q4_k_qad_run(smoke):
    out, res = smoke
    ptq_run = Path(res["arms"]["ptq"]["run"])
    with pytest.raises(SystemExit, match="method/weight_format"):
        A.check_qad_run(ptq_run)
    info = A.check_qad_run(Path(res["arms"]["qad"]["run"]))
    # what --qad-run reports of a run trained elsewhere: its steps and its own wall time
    assert info["steps"] == res["preset"]["steps"] and info["train_s"] > 0


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_rescore_scores_the_earlier_files_again_and_gets_the_same_numbers(smoke, tmp_path):
    out, res = smoke
    work = out / f"work-{A.TAG}"
    lq = work / "llama-quantize" / "Q4_K_M.gguf"
    before = lq.stat().st_mtime_ns
    r = subprocess.run([sys.executable, str(ACC / "llama_cpp_arms.py"), "--smoke", "--out", str(tmp_path), "--work",
                        str(work), "--arms", "lq", "--rescore", "--no-behaviour"], env=_env(OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    again = json.loads((tmp_path / f"{A.TAG}.json").read_text())["arms"]["lq"]
    # not quantized again, and llama.cpp gives the same file the same numbers on the same tokens
    assert again["rescored"] and lq.stat().st_mtime_ns == before
    assert again["scores"] == res["arms"]["lq"]["scores"]


def test_window_scores_equal_torch_on_random_logits():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(300, 1000, generator=g) * 3, torch.randn(300, 1000, generator=g) * 3
    y = torch.randint(0, 1000, (300,), generator=g)
    r = S.window_scores(t.numpy(), s.numpy(), y.numpy())
    lt, ls = t.double().log_softmax(-1), s.double().log_softmax(-1)
    kl = torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="sum").item()
    assert r["tokens"] == 300 and math.isclose(r["kl"], kl, rel_tol=1e-9)
    assert math.isclose(r["nll"], -ls[torch.arange(300), y].sum().item(), rel_tol=1e-9)
    assert math.isclose(r["nll_teacher"], -lt[torch.arange(300), y].sum().item(), rel_tol=1e-9)
    assert r["top1"] == (t.argmax(-1) == s.argmax(-1)).sum().item()
    same = S.window_scores(t.numpy(), t.numpy(), y.numpy())
    assert same["kl"] == 0 and same["top1"] == 300
    assert np.isfinite(S.log_softmax64(np.array([[1e4, 0.0]], dtype=np.float32))).all()


@pytest.mark.parametrize("rule,good,bad", [
    ("one_word", "Paris.", "The capital is Paris."),
    ("yes_no", "Yes.", "Yes, the sun is a star."),
    ("numbered_3", "1. Apple\n2. Pear\n3. Plum", "Here are three:\n1. Apple\n2. Pear\n3. Plum"),
    ("json_answer", '```json\n{"answer": 5}\n```', '{"answer": 5, "why": "sum"}'),
    ("upper_hello", "HELLO", "Hello"),
    ("number_only", "7", "There are 7 days."),
    ("three_lines", "a\nb\nc", "a\nb"),
    ("starts_sure", "Sure: Mars", "Mars"),
    ("max_ten_words", "Plants make food from light.", " ".join(["word"] * 11)),
    ("comma_pair", "Red, blue", "Red, blue, yellow"),
    ("count_1_5", "1 2 3 4 5", "1, 2, 3, 4, 5"),
    ("one_sentence", "Gravity pulls masses together.", "Gravity pulls. It is a force."),
])
def test_behaviour_rules(rule, good, bad):
    assert B.adheres(rule, good) and not B.adheres(rule, bad)


def test_behaviour_summary_ratios():
    n = len(B.all_prompts())
    teacher = [{"text": "x", "tokens": 10}] * n
    short = [{"text": "x", "tokens": 8}] * n
    s = B.summary(short, teacher)
    assert math.isclose(s["length_ratio"], 0.8) and math.isclose(s["long_length_ratio"], 0.8)
    assert s["same_answer"] == 1 and s["format_same_as_teacher"] == 1
    with pytest.raises(ValueError):
        B.summary(short[:-1], teacher)
