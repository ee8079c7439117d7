"""benchmarks/kv_decorrelation.py: the perturbation reaches only forward B, the FP8 cache only the
*8 forwards, so with eps = 0 the two FP8 forwards are identical and with eps > 0 they differ."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: smollm2_shapes
import kv_decorrelation as D  # noqa: E402
from smollm2_shapes import smollm2_dir  # noqa: E402


def test_fp8_errors_shared_at_eps_0_and_not_beyond(tmp_path):
    model = smollm2_dir(tmp_path / "m", tie=True)
    out = tmp_path / "out"
    assert D.main(["--out", str(out), "--model-path", str(model), "--seq", "64", "--n-eval", "1", "--n-calib", "1",
                   "--eps", "0,0.05", "--threads", "1"]) == 0
    res = json.loads((out / "kv_decorrelation.json").read_text())
    same, moved = res["rows"]
    # eps 0: B is A; the FP8 cache changes the output, identically on both sides
    assert same["kl_a_b"] == 0.0 and same["kl_a8_b8"] == 0.0 and same["e4m3_elements_differ"] == 0.0
    assert same["kl_a_a8"] > 0.0 and same["kl_a_a8"] == same["kl_b_b8"]
    # eps > 0: the forwards differ, E4M3 values move, and the FP8 forwards differ too
    assert moved["kl_a_b"] > 0.0 and moved["kl_a8_b8"] > 0.0 and moved["e4m3_elements_differ"] > 0.0
    assert 0.0 < moved["k_rel_diff_median_last_layer"]
    md = (out / "kv_decorrelation.md").read_text()
    assert "| 0.05 |" in md and "shared part" in md


def test_the_scale_rules_are_each_run_and_the_first_is_the_reference(tmp_path):
    """--scale-rules: three fp8 forwards that differ only in the per-layer scale rule; the first is 0 from itself,
    the rules that move the scale move the output, and the library's own rule is restored afterwards."""
    from qatfactory.formats import kv_fp8
    keep = kv_fp8.amax_over_448
    model = smollm2_dir(tmp_path / "m", tie=True)
    out = tmp_path / "out"
    assert D.main(["--out", str(out), "--model-path", str(model), "--seq", "64", "--n-eval", "1", "--n-calib", "1",
                   "--eps", "0", "--threads", "1", "--scale-rules"]) == 0
    assert kv_fp8.amax_over_448 is keep
    rows = json.loads((out / "kv_decorrelation.json").read_text())["scale_rows"]
    assert [r["rule"] for r in rows] == list(D.SCALE_RULES)
    assert rows[0]["kl_to_first_rule"] == 0.0 and all(r["kl_to_unquantized"] > 0.0 for r in rows)
    assert rows[1]["kl_to_first_rule"] > 0.0 and rows[2]["kl_to_first_rule"] > 0.0
    assert "three rules for the per-layer scale" in (out / "kv_decorrelation.md").read_text()

