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

REPO = Path(__file__).resolve().parents[2]
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


def test_step_profile_of_an_arm(tmp_path, work):
    """--step-profile records three training steps of the arm with benchmarks/step_profile.py (on a CPU its
    CPU ops; on the GPU GPU busy against the wall) into the row; a finished run reused profiles nothing."""
    args = ["--smoke", "--bits", "4", "--steps", "8", "--step-profile", "--no-teacher", "--rows-only", "--export", "off",
            "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    assert B.main(args) == 0
    row = json.loads((tmp_path / "o" / "paretoq_bits.json").read_text())["arms"][0]
    assert row["step_profile"]["steps"] == 3 and row["step_profile"]["cpu_ops_per_step"] > 100
    assert row["step_profile"]["gpu_busy_ms_per_step"] is None           # a CPU has no GPU activity to record
    assert B.main(args) == 0
    again = json.loads((tmp_path / "o" / "paretoq_bits.json").read_text())["arms"][0]
    assert again["step_profile"] is None and again["qat"] == row["qat"]


def test_transition_rebuilds_the_trainers_ptq_start_exactly(tmp_path, work):
    """One step at lr 1e-12 leaves every weight and scale where it was: the diagnostics must then say
    0 bins changed, i.e. their rebuilt PTQ start is the trainer's own, code for code."""
    s = B.setting(type("A", (), {"smoke": True, "device": "cpu"})())
    data = C.wiki_files(work, s["train_bytes"], s["eval_bytes"])
    over = B.arm_overrides(s, data, True, "paretoq_2bit", "int2_seq", "ce", 1, 1e-12, tmp_path / "r", export=False)
    sm = C.run_arm(over)
    d = C.transition(over, sm["student_dir"])
    assert d["bin_change_fraction"] == 0.0 and d["rel_weight_change"] < 1e-9 and d["quantized_weights"] > 0


def test_an_arm_cut_by_its_call_is_saved_early_and_reruns_in_the_same_run_dir(tmp_path, monkeypatch):
    """A GPU job's time limit can cut it anywhere. Cut in the diagnostics: the trained arm is already
    in the JSON (diagnostics 'not finished'). Run again: the finished run is reused, not retrained. Cut in
    the training (no summary.json): the rerun starts it over instead of stopping on the run directory."""
    work = tmp_path / "w"     # its own: the run directory's name is the SEQ smoke arm's
    args = ["--smoke", "--arms", "seq", "--seeds", "1", "--rows-only", "--out", str(tmp_path / "o"), "--work", str(work)]
    real = C.transition

    def cut(*a, **k):
        raise KeyboardInterrupt("the call's time limit")
    monkeypatch.setattr(C, "transition", cut)
    with pytest.raises(KeyboardInterrupt):
        S.main(args + ["--lr", "1e-3"])
    row = json.loads((tmp_path / "o" / "paretoq_seq_vs_lsq.json").read_text())["arms"][0]
    assert row["diagnostics"] == "not finished" and math.isnan(row["bin_change_fraction"])
    assert math.isfinite(row["qat"]["eval/ppl"]) and row["label"] == "2-bit SEQ"
    S.main(["--merge", str(tmp_path / "o"), "--out", str(tmp_path / "m")])
    assert "the job was cut while its diagnostics ran" in (tmp_path / "m" / "paretoq_seq_vs_lsq.md").read_text()
    run_dir = work / "ce-int2_seq-s0"
    stamp = (run_dir / "summary.json").stat().st_mtime_ns
    monkeypatch.setattr(C, "transition", real)
    assert S.main(args + ["--lr", "1e-3"]) == 0
    again = json.loads((tmp_path / "o" / "paretoq_seq_vs_lsq.json").read_text())["arms"][0]
    assert (run_dir / "summary.json").stat().st_mtime_ns == stamp            # not trained again
    assert again["diagnostics"] == "done" and 0.0 <= again["bin_change_fraction"] < 1.0
    assert again["qat"] == row["qat"] and again["curve"] == row["curve"]
    # other overrides in a finished run: not reused, and the trainer refuses the directory as before
    from qatfactory.train.rundir import RunDirError
    with pytest.raises(RunDirError, match="already holds a run"):
        S.main(args + ["--lr", "2e-3"])
    # cut in the training: metrics.jsonl but no summary.json -> resume=auto, the run starts over
    (run_dir / "summary.json").unlink()
    assert S.main(args + ["--lr", "1e-3"]) == 0
    third = json.loads((tmp_path / "o" / "paretoq_seq_vs_lsq.json").read_text())["arms"][0]
    assert (run_dir / "summary.json").is_file() and third["diagnostics"] == "done"
    # a folder of someone else's at the run directory is not taken for a cut run: refused, untouched
    import shutil
    shutil.rmtree(run_dir)
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not a qatfactory run directory"):
        S.main(args + ["--lr", "1e-3"])
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"]


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


# --------------------------------------------------------------------------------- one GPU job per width
def _arm_row(bits, fmt, loss="ce", seed=0, ppl=20.0):
    m = {"eval/ppl": ppl, "eval/kl": 0.1, "eval/ce": math.log(ppl)}
    return {"bits": bits, "format": fmt, "loss": loss, "seed": seed, "steps": 5, "lr": 1e-5, "calib": "max",
            "ptq": m, "qat": m, "rel_weight_change": 0.1, "bin_change_fraction": 0.2, "gate_ok": True}


def _env(date):
    return {"date": date, "device": "NVIDIA H200", "torch": "x", "python": "3"}


def test_bit_sweep_rows_of_one_call_then_merged(tmp_path, work):
    """A call runs one width (--lr-lo instead of the pilot, no teacher row, JSON only); --merge builds the
    table from every call's rows and names the widths still missing."""
    a = tmp_path / "call-1bit"
    assert B.main(["--smoke", "--bits", "1", "--lr-lo", "2e-3", "--no-teacher", "--rows-only", "--out", str(a),
                   "--work", str(work)]) == 0
    ra = json.loads((a / "paretoq_bits.json").read_text())
    assert not (a / "paretoq_bits.md").exists() and not (a / "paretoq_bits.png").exists()
    assert [(r["bits"], r["lr"]) for r in ra["arms"]] == [("1", 2e-3)] and ra["teacher"] == {} and "pilot" not in ra
    assert ra["arms"][0]["gate_ok"] is True and ra["arms"][0]["step_ms"] > 0
    b = tmp_path / "call-4bit"
    b.mkdir()
    rb = dict(ra, env=_env("2026-12-02 10:00 UTC"), teacher={"eval/ppl": 16.6}, arms=[_arm_row("4", "int4_lsq")],
              pilot={"ce": {"candidates": {"2e-05": 3.0, "0.0001": 3.1}, "chosen": 2e-5, "steps": 300}})
    (b / "paretoq_bits.json").write_text(json.dumps(rb))
    out = tmp_path / "merged"
    assert B.main(["--merge", str(b), str(a), "--out", str(out)]) == 0
    res = json.loads((out / "paretoq_bits.json").read_text())
    md = (out / "paretoq_bits.md").read_text()
    assert [r["bits"] for r in res["arms"]] == ["4", "1"] and res["teacher"]["eval/ppl"] == 16.6
    assert "**Not run yet** (no arm in the merged rows): CE 3, 2, 1.58 bits" in md
    assert "| CE | 4 | int4_lsq | Q4_0 |" in md and "| CE | 1 | binary_sign |" in md and "Merged from:" in md
    assert res["pilot"]["ce"]["chosen"] == 2e-5
    assert (out / "paretoq_bits.png").read_bytes()[:4] == b"\x89PNG"
    # a later call's arm of the same width replaces the earlier one
    c = tmp_path / "call-4bit-again"
    c.mkdir()
    (c / "paretoq_bits.json").write_text(json.dumps(dict(rb, arms=[_arm_row("4", "int4_lsq", ppl=18.0)])))
    assert B.main(["--merge", str(b), str(a), str(c), "--out", str(out)]) == 0
    res = json.loads((out / "paretoq_bits.json").read_text())
    assert [r["qat"]["eval/ppl"] for r in res["arms"] if r["bits"] == "4"] == [18.0]
    # --low-setting: a 4-bit arm at the steps and LR below 3 bits, in a run directory of its own; merged
    # beside the design's 4-bit row, not over it
    d = tmp_path / "call-4bit-low"
    assert B.main(["--smoke", "--bits", "4", "--low-setting", "--lr-lo", "2e-3", "--no-teacher", "--rows-only",
                   "--export", "off", "--out", str(d), "--work", str(work)]) == 0
    rd = json.loads((d / "paretoq_bits.json").read_text())["arms"]
    assert [(r["bits"], r["steps"], r["lr"]) for r in rd] == [("4", 6, 2e-3)]
    assert rd[0]["run_dir"].endswith("-low") and rd[0]["diagnostics"] == "done"
    assert B.main(["--merge", str(b), str(a), str(c), str(d), "--out", str(out)]) == 0
    res = json.loads((out / "paretoq_bits.json").read_text())
    assert [(r["steps"], r["lr"]) for r in res["arms"] if r["bits"] == "4"] == [(5, 1e-5), (6, 2e-3)]


def test_seq_vs_lsq_takes_the_bit_sweeps_2bit_seq_row(tmp_path):
    """The bit sweep's 2-bit SEQ arm (CE, seed 0) is the same run as our SEQ seed-0 arm: --merge takes it from a
    paretoq_bits.json folder, says so in the table, and refuses arms trained at different learning rates."""
    base = {"smoke": False, "env": _env("2026-12-06 14:00 UTC"), "data": {"split": "wiki"}, "setting": {}}
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "paretoq_bits.json").write_text(json.dumps(dict(base, teacher={}, arms=[
        _arm_row("4", "int4_lsq"), _arm_row("2", "int2_seq", ppl=30.0), _arm_row("2", "int2_seq", loss="kl")])))
    lsq = tmp_path / "lsq0"
    lsq.mkdir()
    (lsq / "paretoq_seq_vs_lsq.json").write_text(json.dumps(dict(base, lr=1e-5, arms=[
        dict(_arm_row("2", "int2_lsq", ppl=40.0), label="2-bit LSQ", curve=[])])))
    out = tmp_path / "sl"
    assert S.main(["--merge", str(sweep), str(lsq), "--out", str(out)]) == 0
    res = json.loads((out / "paretoq_seq_vs_lsq.json").read_text())
    md = (out / "paretoq_seq_vs_lsq.md").read_text()
    assert [(a["label"], a["loss"], a.get("source")) for a in res["arms"]] == [
        ("2-bit SEQ", "ce", "paretoq_bits.json"), ("2-bit LSQ", "ce", None)]
    assert "| 2-bit SEQ | int2_seq | max | 0 | 30 | 30 |" in md and "| bit sweep |" in md and "| this script |" in md
    assert "Mean QAT PPL: SEQ 30, LSQ 40 (LSQ +33.33% vs SEQ)" in md
    (lsq / "paretoq_seq_vs_lsq.json").write_text(json.dumps(dict(base, lr=2e-5, arms=[
        dict(_arm_row("2", "int2_lsq", ppl=40.0), lr=2e-5, label="2-bit LSQ", curve=[])])))
    with pytest.raises(SystemExit, match="different learning rates"):
        S.main(["--merge", str(sweep), str(lsq), "--out", str(out)])


def _split_rows(d: Path, sp, bits: str, seed: int, top: float) -> None:
    """One (bits, seed) call's split rows at the fractions 0, 0.1, 1: quantized bpt = top - f."""
    d.mkdir()
    rows = [{"bits": bits, "f": f, "seed": seed, "fp_steps": 0, "qat_steps": 10, "bpt_fp": 2.0,
             "bpt_quantized": top - f, "tokens": 1} for f in (0.0, 0.1, 1.0)]
    (d / "paretoq_split.json").write_text(json.dumps(dict(sp, arms=rows)))


def test_seq_vs_lsq_and_split_rows_merged(tmp_path):
    base = {"smoke": False, "env": _env("2026-12-02 11:00 UTC"), "data": {"split": "wiki"}, "lr": 2e-5,
            "setting": {}}
    for name, arms in (("seq0", [("2-bit SEQ", "int2_seq", 0)]), ("lsq0", [("2-bit LSQ", "int2_lsq", 0)]),
                       ("seq1", [("2-bit SEQ", "int2_seq", 1)])):
        d = tmp_path / name
        d.mkdir()
        rows = [dict(_arm_row("2", fmt, seed=sd), label=label, curve=[]) for label, fmt, sd in arms]
        (d / "paretoq_seq_vs_lsq.json").write_text(json.dumps(dict(base, arms=rows)))
    out = tmp_path / "sl"
    assert S.main(["--merge", str(tmp_path / "seq0"), str(tmp_path / "lsq0"), str(tmp_path / "seq1"),
                   "--out", str(out)]) == 0
    md = (out / "paretoq_seq_vs_lsq.md").read_text()
    assert "**Not run yet**: 2-bit LSQ seed 1" in md and "Mean QAT PPL: SEQ 20" in md
    sp = {"smoke": False, "env": _env("2026-12-02 12:00 UTC"), "data": {"split": "wiki"},
          "setting": {"budget": 10, "micro": 2, "seq": 8, "fractions": [0.0, 0.1, 1.0], "seeds": 2}}
    for bits in ("4", "2"):
        _split_rows(tmp_path / f"split{bits}", sp, bits, 0, 2.5)
    out = tmp_path / "split"
    assert P.main(["--merge", str(tmp_path / "split4"), str(tmp_path / "split2"), "--out", str(out)]) == 0
    res = json.loads((out / "paretoq_split.json").read_text())
    md = (out / "paretoq_split.md").read_text()
    assert res["best_fraction"] == {"4": 1.0, "2": 1.0}
    assert "**Not run yet (or not complete)**: 4-bit seed 1 (every fraction), 2-bit seed 1 (every fraction)." in md
    # the design has two seeds: a mean of one says so, and so does the best f drawn from such means
    assert "| 4 | 2.5 (seed 0 only) | 2.4 (seed 0 only) | 1.5 (seed 0 only) | 1 (f=0, 0.1, 1 from fewer seeds) |" in md
    # a minimum over some of the fractions is named as such, not as the design's optimum
    rows = [r for r in json.loads((tmp_path / "split2" / "paretoq_split.json").read_text())["arms"] if r["f"] != 0.1]
    (tmp_path / "split2" / "paretoq_split.json").write_text(json.dumps(dict(sp, arms=rows)))
    assert P.main(["--merge", str(tmp_path / "split4"), str(tmp_path / "split2"), "--out", str(out)]) == 0
    md = (out / "paretoq_split.md").read_text()
    assert "| 2 | 2.5 (seed 0 only) | nan | 1.5 (seed 0 only) | 1 (of the 2 of 3 fractions run; f=0, 1 from fewer seeds) |" in md
    assert "2-bit seed 0 (f = 0.1)" in md                  # a job with a fraction missing names the fraction
    # with both seeds in, the means are plain numbers and the best f needs no qualifier
    for bits in ("4", "2"):
        _split_rows(tmp_path / f"split{bits}s1", sp, bits, 1, 2.7)
    assert P.main(["--merge", str(tmp_path / "split4"), str(tmp_path / "split4s1"), "--out", str(out)]) == 0
    md = (out / "paretoq_split.md").read_text()
    assert "| 4 | 2.6 | 2.5 | 1.6 | 1 |" in md
