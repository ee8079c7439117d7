"""benchmarks/step.py and step_peers.py (issue 17): the peers' plain loops run (a CPU-sized smoke, which
measures nothing), the table and the goal ratios come out of the rows, and the peers train the same
model shape as our rows."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import step  # noqa: E402
import step_peers  # noqa: E402


def test_peer_shapes_are_ours():
    for name, over in step.MODELS.items():
        shape = {o.split("=")[0].split(".")[-1]: o.split("=")[1] for o in over if o.startswith("model.tiny.")}
        want = {k: str(v).lower() for k, v in step_peers.SHAPES[name].items()}
        assert {k: v.lower() for k, v in shape.items()} == want, name


def test_plain_loops_run_and_show_what_bf16_params_lose():
    rows = {}
    for name in ("plain loop, bf16 params", "plain loop, fp32 masters", "ModelOpt W4A16 QAT, bf16 params"):
        p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_peers.py"), "--only", name, "--smoke"],
                           capture_output=True, text=True, cwd=REPO)
        assert p.returncode == 0, p.stderr[-2000:]
        rows[name] = json.loads([l for l in p.stdout.splitlines() if l.startswith("ROW ")][-1][4:])
    bf, fp = rows["plain loop, bf16 params"], rows["plain loop, fp32 masters"]
    assert bf["ms_per_step"] > 0 and fp["ms_per_step"] > 0
    # one AdamW step at lr 5e-6: most bf16 weights round back to themselves, fp32 masters all move
    assert fp["weights_changed_by_step_1"] > 0.9 > bf["weights_changed_by_step_1"]
    # ModelOpt's NVFP4 fake quant is CUDA-only: on a CPU the row says so instead of timing something else
    assert "CUDA only" in rows["ModelOpt W4A16 QAT, bf16 params"]["not_run"]


def test_table_and_goals_from_rows():
    runs = {"QAT W4A16 (CE)": [{"ms_per_step": 10.0, "peak_mem_gib": 2.0}, {"ms_per_step": 12.0, "peak_mem_gib": 2.1}],
            "ModelOpt W4A16 QAT, fp32 masters": [{"ms_per_step": 11.0, "peak_mem_gib": 3.0}],
            "plain loop, fp32 masters": [{"ms_per_step": 8.0, "peak_mem_gib": 1.0, "weights_changed_by_step_1": 0.98}],
            "ModelOpt W4A4 QAT, fp32 masters": [{"error": "x"}]}
    order = [("ours", "QAT W4A16 (CE)"), ("peer", "ModelOpt W4A16 QAT, fp32 masters"),
             ("peer", "plain loop, fp32 masters"), ("peer", "ModelOpt W4A4 QAT, fp32 masters")]
    rows = step.summarize(order, runs)
    assert rows[0]["ms_per_step"] == 11.0 and rows[0]["min_ms"] == 10.0 and rows[0]["max_ms"] == 12.0
    t = step.table(rows)
    assert "| ours: QAT W4A16 (CE) | 11.0 | 10.0..12.0 |" in t and "1.38x" in t and "98.0%" in t
    assert "| QAT W4A16 (CE) vs ModelOpt W4A16 QAT, fp32 masters | 1.00 | <= 1.00 | yes |" in t
    assert "| ModelOpt W4A4 QAT, fp32 masters | failed |" in t


def test_profile_summary_takes_the_union_of_gpu_intervals():
    import step_profile
    ev = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
          {"ph": "X", "cat": "kernel", "name": "fq", "ts": 500, "dur": 1000},      # overlaps: 1.5 ms busy
          {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 4000, "dur": 500},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
          {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 10, "dur": 5},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 20, "dur": 5},
          {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 0}]
    s = step_profile.summarize_trace(ev, steps=2)
    assert s["gpu_busy_ms_per_step"] == 1.0 and s["kernels_per_step"] == 1.5 and s["launches_per_step"] == 1.0
    assert s["window_ms_per_step"] == 2.25 and s["top_kernels"][0]["name"] in ("gemm", "fq")
    assert step_profile.summarize_trace([], steps=1)["gpu_busy_ms_per_step"] is None


def test_report_pairs_before_and_after_and_says_what_did_not_run():
    runs = {"QAT W4A16 (CE)" + step.BEFORE: [{"ms_per_step": 20.0, "peak_mem_gib": 2.0, "round": 0}],
            "QAT W4A4 (CE)" + step.BEFORE_DS: [{"ms_per_step": 30.0, "peak_mem_gib": 2.0, "round": 0}],
            "QAT W4A4 (CE)": [{"ms_per_step": 24.0, "peak_mem_gib": 2.0, "round": 0}],
            "QAT W4A16 (CE)": [{"ms_per_step": 15.0, "peak_mem_gib": 3.0, "round": 0,
                                "profile": {"gpu_busy_ms_per_step": 12.0, "kernels_per_step": 900.0,
                                            "launches_per_step": 950.0, "cpu_ops_per_step": 0.0,
                                            "top_kernels": [{"name": "gemm", "ms_per_step": 6.0}]}}],
            "ModelOpt W4A16 QAT, fp32 masters": [{"not_run": "CUDA only (x)", "round": 0}]}
    order = [("peer", "ModelOpt W4A16 QAT, fp32 masters"), ("ours", "QAT W4A16 (CE)" + step.BEFORE),
             ("ours", "QAT W4A16 (CE)"), ("ours", "QAT W4A4 (CE)" + step.BEFORE_DS), ("ours", "QAT W4A4 (CE)")]
    args = step.argparse.Namespace(model="smoke", batch=2, seq=64, steps=4, warmup=1, format="nvfp4", device="cpu",
                                   repeat=2, profile_steps=2)
    md, rows = step.report(order, runs, ["round 1: 'x' not run (budget)"], args)
    assert [r["variant"] for r in rows][-1] == "ModelOpt W4A16 QAT, fp32 masters"      # ours first
    assert "| QAT W4A16 (CE) | QF_WEIGHT_CACHE=0 and method.loss.fused=false; the launch plan is in both | 20.0 | " \
        "15.0 | 0.75 | 2.0 | 3.0 |" in md
    assert "| QAT W4A4 (CE) | train.lean_step=false train.ds_timers=true | 30.0 | 24.0 | 0.80 |" in md
    assert "| ModelOpt W4A16 QAT, fp32 masters | not run: CUDA only (x) |" in md
    assert "| QAT W4A16 (CE) | 15.0 | 12.0 | 3.0 | 80% | 900 | 950 | gemm (6.0) |" in md
    assert "not run (budget)" in md


def test_every_variant_composes_with_the_fixed_overrides():
    """Each of step.py's rows is a valid trainer config (its overrides come last in step.one, so a lever row
    may override the fixed ones: train.zero_stage=1 wins over the fixed train.zero_stage=0)."""
    from qatfactory.train.config import compose
    fixed = ["train.zero_stage=0", "train.precision=bf16", "train.device=cpu"]
    for name, over in step.variants("nvfp4", before=True).items():
        cfg = compose(step.MODELS["smoke"] + fixed + [o for o in over if not o.startswith("env:")])
        if "ZeRO-1" in name:
            assert cfg.train.zero_stage == 1, name
        if step.BEFORE_DS in name:
            assert not cfg.train.lean_step and cfg.train.ds_timers, name
        if "lean activations" in name:
            assert cfg.train.lean_act, name
    assert not compose(step.MODELS["smoke"] + fixed).train.ds_timers        # the default: no timer syncs
