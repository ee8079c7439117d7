"""benchmarks/papers/paretoq_*.py in their smoke mode (tiny random models on CPU, a few steps: they
measure nothing, they run every code path the GPU runs take): tables, JSON and PNG come out, every
exported grid passes the parity gate, the learning-transition diagnostics rebuild the trainer's own
PTQ start exactly, the split runs the schedule it says."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
import paretoq_bits as B  # noqa: E402
import paretoq_common as C  # noqa: E402
import paretoq_seq_vs_lsq as S  # noqa: E402
import paretoq_split as P  # noqa: E402


def _outputs(out: Path, stem: str):
    res = json.loads((out / f"{stem}.json").read_text())
    md = (out / f"{stem}.md").read_text()
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SMOKE" in md and "measures nothing" in md
    return res, md


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("pq-work")   # the data files are shared by the three scripts


def test_bit_sweep_smoke(tmp_path, work):
    assert B.main(["--smoke", "--bits", "4,1.58", "--out", str(tmp_path), "--work", str(work)]) == 0
    res, md = _outputs(tmp_path, "paretoq_bits")
    assert [r["bits"] for r in res["arms"]] == ["4", "1.58"]
    for r in res["arms"]:
        assert r["gate_ok"] is True                                   # GGUF export + parity gate at the end of the run
        assert 0.0 < r["bin_change_fraction"] < 1.0 and r["rel_weight_change"] > 0
        assert math.isfinite(r["qat"]["eval/ppl"]) and math.isfinite(r["ptq"]["eval/kl"])
    assert res["pilot"]["ce"]["chosen"] in [float(k) for k in res["pilot"]["ce"]["candidates"]]
    assert res["arms"][1]["lr"] == res["pilot"]["ce"]["chosen"]
    assert math.isfinite(res["teacher"]["eval/ppl"]) and "| CE | 1.58 | ternary_seq | TQ2_0 / Q4_0 |" in md


def test_transition_rebuilds_the_trainers_ptq_start_exactly(tmp_path, work):
    """One step at lr 1e-12 leaves every weight and scale where it was: the diagnostics must then say
    0 bins changed, i.e. their rebuilt PTQ start is the trainer's own, code for code."""
    s = B.setting(type("A", (), {"smoke": True, "device": "cpu"})())
    data = C.wiki_files(work, s["train_bytes"], s["eval_bytes"])
    over = B.arm_overrides(s, data, True, "paretoq_2bit", "int2_seq", "ce", 1, 1e-12, tmp_path / "r", export=False)
    sm = C.run_arm(over)
    d = C.transition(over, sm["student_dir"])
    assert d["bin_change_fraction"] == 0.0 and d["rel_weight_change"] < 1e-9 and d["quantized_weights"] > 0


def test_seq_vs_lsq_smoke(tmp_path, work):
    assert S.main(["--smoke", "--seeds", "1", "--out", str(tmp_path), "--work", str(work)]) == 0
    res, md = _outputs(tmp_path, "paretoq_seq_vs_lsq")
    assert [(r["format"], r["calib"]) for r in res["arms"]] == [("int2_seq", "max"), ("int2_lsq", "mse")]
    assert "Mean QAT PPL" in md and math.isfinite(res["lsq_vs_seq_ppl_percent"])


def test_split_smoke(tmp_path, work):
    assert P.main(["--smoke", "--bits", "2", "--out", str(tmp_path), "--work", str(work)]) == 0
    res, md = _outputs(tmp_path, "paretoq_split")
    by_f = {r["f"]: r for r in res["arms"]}
    B_ = res["setting"]["budget"]
    assert [(by_f[f]["fp_steps"], by_f[f]["qat_steps"]) for f in (0.0, 0.5, 1.0)] == [(B_, 0), (B_ // 2, B_ // 2), (0, B_)]
    assert math.isnan(by_f[1.0]["bpt_fp"]) and math.isfinite(by_f[0.5]["bpt_fp"])   # no FP phase in QAT from scratch
    assert all(math.isfinite(r["bpt_quantized"]) for r in res["arms"])
    assert res["best_fraction"]["2"] in (0.0, 0.5, 1.0)


def test_layout_rules_for_rows_the_256_types_cannot_hold():
    smol = C.llama_in_features(576, 1536, 576)
    assert C.layout_rules("int4_lsq", smol) == []                     # Q4_0 holds 576-wide rows
    r = C.layout_rules("int2_seq", smol)
    assert r == ["quant.rules=[{pattern:'re:.*\\.(gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)',weight:int2_seq_q4_0}]"]
    from qatfactory.train.config import compose
    cfg = compose(["format=paretoq_2bit"] + r)
    assert cfg.quant.resolve("model.layers.3.mlp.down_proj") == ("int2_seq", None)
    assert cfg.quant.resolve("model.layers.3.self_attn.q_proj") == ("int2_seq_q4_0", None)


def test_init_error_smoke(tmp_path):
    import paretoq_init_error as I
    assert I.main(["--smoke", "--out", str(tmp_path)]) == 0
    g = json.loads((tmp_path / "paretoq_init_error.json").read_text())["grids"]
    for label, v in g.items():
        assert 0 < v["mse"] <= v["paretoq_init"] < 1.5, (label, v)
    assert g["1 (sign)"]["mse"] == g["1 (sign)"]["paretoq_init"]      # mean|W| is already the MSE optimum
    assert g["2 (SEQ)"]["mse"] < 0.8 * g["2 (SEQ)"]["paretoq_init"]
