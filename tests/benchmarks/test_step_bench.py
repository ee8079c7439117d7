"""benchmarks/step.py and step_peers.py: the peers' plain loops run (a CPU-sized smoke, which
measures nothing), the table and the goal ratios come out of the rows, and the peers train the same
model shape as our rows."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def test_peak_is_the_jobs_own_not_an_earlier_jobs_leftover(tmp_path):
    # a worker that still held 9.97 GiB from an earlier job when this one started: the row's peak is what this
    # job added (measured on the H200 2026-12-03: Model Optimizer's jobs left 9.97 GiB in the peer worker)
    runs = {"plain loop, fp32 masters": [
        {"variant": "plain loop, fp32 masters", "ms_per_step": 8.0, "peak_mem_gib": 28.6, "mem_before_gib": 0.0, "round": 0},
        {"variant": "plain loop, fp32 masters", "ms_per_step": 8.2, "peak_mem_gib": 38.5, "mem_before_gib": 9.97, "round": 1}]}
    rows = step.summarize([("peer", "plain loop, fp32 masters")], runs)
    assert abs(rows[0]["peak_mem_gib"] - 28.6) < 1e-9
    # --report re-makes the table from a step.json and keeps the leftover in its notes
    import argparse
    import json
    args = argparse.Namespace(model="llama1b", batch=4, seq=2048, steps=8, warmup=3, format="nvfp4", device="cuda",
                              repeat=2, profile_steps=0)
    (tmp_path / "step.json").write_text(json.dumps({"args": vars(args), "rows": rows, "notes": [], "versions": "; x"}))
    assert step.main(["--report", str(tmp_path / "step.json"), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "step.md").read_text()
    assert "| plain loop, fp32 masters | 8.1 |" in md and "| 28.6 |" in md and "38.5" not in md.split("notes:")[0]
    assert "(round 1): 9.97 GiB" in md


def test_goal_against_eager_experts_says_so():
    runs = {"QAT W4A16 (CE)": [{"ms_per_step": 10.0, "peak_mem_gib": 2.0, "note": "experts grouped_mm"}],
            "ModelOpt W4A16 QAT, fp32 masters": [{"ms_per_step": 80.0, "peak_mem_gib": 3.0,
                                                  "note": "linears 32/32, experts eager (forced by ModelOpt)"}]}
    rows = step.summarize([("ours", "QAT W4A16 (CE)"), ("peer", "ModelOpt W4A16 QAT, fp32 masters")], runs)
    assert "| 0.12 | <= 1.00 | yes (the peer's experts ran eager) |" in step.table(rows)


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
    assert "| QAT W4A16 (CE) | train.weight_cache=false method.loss.fused=false; the launch plan is in both | 20.0 | " \
        "15.0 | 0.75 | 2.0 | 3.0 |" in md
    assert "| QAT W4A4 (CE) | train.lean_step=false train.ds_timers=true | 30.0 | 24.0 | 0.80 |" in md
    assert "| ModelOpt W4A16 QAT, fp32 masters | not run: CUDA only (x) |" in md
    assert "| QAT W4A16 (CE) | 15.0 | 12.0 | 3.0 | 80% | 900 | 950 | gemm (6.0) |" in md
    assert "not run (budget)" in md


def test_peer_models_are_ours_parameter_for_parameter():
    """Every shape, the MoE ones included: the model our trainer builds (engine.tiny_config from
    step.py's overrides) and the one the peers build (step_peers.hf_config, written out there) are the
    same class with the same parameters; their configs differ only in the byte tokenizer's special ids
    and, for the all-sparse MoE, the unused dense intermediate_size."""
    import torch
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import tiny_config
    assert {"moe", "moe_smoke"} <= set(step.MODELS) and set(step.MODELS) == set(step_peers.SHAPES)
    for name, over in step.MODELS.items():
        ours_cls, ours = tiny_config(compose(over).model.tiny)
        peer_cls, peer = step_peers.hf_config(name)
        assert ours_cls is peer_cls, name
        a, b = ours.to_dict(), peer.to_dict()
        differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
        allowed = {"bos_token_id", "eos_token_id", "pad_token_id"}
        if step_peers.is_moe(name):
            allowed.add("intermediate_size")
            for c in (ours, peer):
                assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1      # no dense MLP layer
        assert differ <= allowed, (name, differ)
        with torch.device("meta"):
            pa, pb = ours_cls(ours), peer_cls(peer)
        assert [(n, p.shape) for n, p in pa.named_parameters()] == [(n, p.shape) for n, p in pb.named_parameters()]
    # the MoE table's model is what step.py's docstring says: 64 experts, top-8, 2.70B parameters,
    # 302M of experts per layer, 0.52B active per token
    cls, cfg = step_peers.hf_config("moe")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size) == (64, 8, 768, 2048)
    with torch.device("meta"):
        m = cls(cfg)
    total = sum(p.numel() for p in m.parameters())
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    active = total - experts * (1 - 8 / 64) - m.model.embed_tokens.weight.numel()
    assert round(total / 1e9, 2) == 2.70 and round(experts / 8 / 1e6) == 302 and round(active / 1e9, 2) == 0.52


def test_modelopt_reaches_the_fused_experts_and_says_how():
    """What the MoE rows' note claims, checked on Model Optimizer 0.47 itself on a CPU (its NVFP4
    kernels are CUDA-only, so its quantizers are replaced by recorders for the forward): mtq.quantize
    gives each expert of each fused 3-D tensor an enabled NVFP4 weight quantizer, switches the model to
    the eager experts implementation, and in the forward hands expert e's slice to quantizer e. With
    the expert quantizers disabled the note says NOT COMPARABLE."""
    import torch
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import TensorQuantizer
    model = step_peers.build("moe_smoke", torch.float32, "cpu")
    assert model.config._experts_implementation == "grouped_mm"
    model = mtq.quantize(model, mtq.W4A16_NVFP4_CFG, forward_loop=None)
    cov = step_peers.modelopt_coverage(model)
    assert cov == {"linears": 8, "linears_quantized": 8, "expert_tensors": 4, "expert_tensors_quantized": 4,
                   "experts_implementation": "eager"}
    note, ok = step_peers.coverage_note(cov)
    assert ok and note == ("linears 8/8, expert tensors 4/4 (per-expert NVFP4), experts eager (forced by ModelOpt)")
    seen = {}
    for n, q in model.named_modules():
        if isinstance(q, TensorQuantizer):
            q.forward = lambda x, _n=n: (seen.setdefault(_n, []).append(x.detach().clone()), x)[1]
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    for li, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        hit = [e for e in range(8) if f"model.layers.{li}.mlp.experts.gate_up_proj_weight_quantizers.{e}" in seen]
        assert len(hit) >= 4, hit
        for e in hit:
            pre = f"model.layers.{li}.mlp.experts."
            assert all(torch.equal(x, ex.gate_up_proj[e]) for x in seen[f"{pre}gate_up_proj_weight_quantizers.{e}"])
            assert all(torch.equal(x, ex.down_proj[e]) for x in seen[f"{pre}down_proj_weight_quantizers.{e}"])
        assert torch.equal(seen[f"model.layers.{li}.self_attn.q_proj.weight_quantizer"][0], layer.self_attn.q_proj.weight)
    mtq.disable_quantizer(model, "*experts*")
    note, ok = step_peers.coverage_note(step_peers.modelopt_coverage(model))
    assert not ok and note.startswith("NOT COMPARABLE") and "expert tensors 0/4" in note


def test_a_peer_that_left_weights_unquantized_gets_no_verdict():
    runs = {"QAT W4A16 (CE)": [{"ms_per_step": 10.0, "peak_mem_gib": 2.0, "note": "expert tensors 16/16"}],
            "ModelOpt W4A16 QAT, fp32 masters": [{"ms_per_step": 20.0, "peak_mem_gib": 3.0, "comparable": False,
                                                  "note": "NOT COMPARABLE: not all weights quantized; x"}]}
    rows = step.summarize([("ours", "QAT W4A16 (CE)"), ("peer", "ModelOpt W4A16 QAT, fp32 masters")], runs)
    t = step.table(rows)
    assert "| QAT W4A16 (CE) vs ModelOpt W4A16 QAT, fp32 masters | not comparable (0.50) | <= 1.00 | - |" in t
    assert "| NOT COMPARABLE: not all weights quantized; x |" in t and "| expert tensors 16/16 |" in t


def test_step_bench_runs_the_moe_table_end_to_end_on_a_cpu(tmp_path):
    """benchmarks/step.py --model moe_smoke: our QAT / QAD rows through the trainer on the random
    Qwen3-MoE and the peers' plain loops (grouped_mm and eager experts) on persistent workers, one
    table; Model Optimizer's rows say they need CUDA. Checks the script; the numbers mean nothing."""
    import os
    out = tmp_path / "out"
    # a trainer run earlier in this process left its one-process group's address in the environment
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step.py"), "--device", "cpu", "--model", "moe_smoke",
                        "--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "0", "--repeat", "1",
                        "--variants", "QAT W4A16 (CE)|QAD W4A16 live teacher", "--skip", "grad ckpt|lean activations",
                        "--peers", "plain loop, fp32 masters|ModelOpt W4A16 QAT, fp32", "--profile-steps", "0",
                        "--job-timeout", "240", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (out / "step.md").read_text()
    assert md.startswith("step time, random Qwen3-MoE, CPU smoke shape")
    rows = {r["variant"]: r for r in json.loads((out / "step.json").read_text())["rows"]}
    assert set(rows) == {"QAT W4A16 (CE)", "QAD W4A16 live teacher", "plain loop, fp32 masters",
                         "plain loop, fp32 masters, eager experts", "ModelOpt W4A16 QAT, fp32 masters"}
    for name in ("QAT W4A16 (CE)", "QAD W4A16 live teacher"):
        assert rows[name]["ms_per_step"] > 0, rows[name]
        # the student's 4 fused expert tensors (2 layers x gate_up, down) came out quantized
        assert rows[name]["note"] == "linears 8/8, expert tensors 4/4 (per-expert scale), experts grouped_mm"
    assert rows["plain loop, fp32 masters, eager experts"]["note"] == "experts eager"
    assert rows["plain loop, fp32 masters"]["note"].startswith("experts grouped_mm on bf16 casts")
    assert "CUDA only" in rows["ModelOpt W4A16 QAT, fp32 masters"]["not_run"]
    assert "| ours: QAD W4A16 live teacher |" in md and "| ModelOpt W4A16 QAT, fp32 masters | not run: CUDA only" in md


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


def test_a_job_that_leaks_gets_its_worker_replaced_before_the_next_job(tmp_path):
    """The H100 MoE run (2026-12-06): every Model Optimizer job left ~30 GiB allocated in the peer worker, and the
    next jobs of both workers ran out of memory. A worker now reports what is still allocated after its job's
    free and, above LEAK_GIB, exits; the parent waits for it and the next job runs in a fresh process."""
    import os
    import step_workers as W
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
        "import step_workers as W\n"
        "held = {'gib': 0.0}\n"
        "def job(j):\n"
        "    held['gib'] = j.get('leave', 0.0)\n"
        "    return {'variant': j['name'], 'pid': os.getpid()}\n"
        "W.serve('peer', job, free=lambda: held['gib'])\n")
    w = W.Worker("peer", [sys.executable, str(script)], tmp_path / "w.log", dict(os.environ))
    try:
        a = w.run({"name": "a"}, 60)
        b = w.run({"name": "b", "leave": W.LEAK_GIB + 29.0}, 60)
        c = w.run({"name": "c"}, 60)
    finally:
        w.stop()
    assert "error" not in a and "error" not in b and "error" not in c
    assert a["pid"] == b["pid"] != c["pid"]
    assert "worker_restarted" not in a and a["mem_after_gib"] == 0.0
    assert b["mem_after_gib"] == W.LEAK_GIB + 29.0 and "30.00 GiB still allocated" in b["worker_restarted"]
    assert c["mem_before_gib"] == 0.0 and "worker_restarted" not in c
    # the table's notes name the job
    import argparse
    name = "ModelOpt W4A16 QAT, fp32 masters"
    runs = {name: [dict(b, variant=name, round=0, ms_per_step=9.0, tokens_per_s=1.0)]}
    args = argparse.Namespace(model="moe", batch=4, seq=2048, steps=8, warmup=3, format="nvfp4", device="cuda",
                              repeat=1, profile_steps=0)
    md, _ = step.report([("peer", name)], runs, [], args, versions_line="")
    assert f"replaced before the next job): {name} (round 0): 30.00 GiB" in md
