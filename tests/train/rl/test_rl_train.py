"""method=grpo|dapo end to end on CPU: the reward of a trivially learnable task rises under ZeRO-2 with
two gloo ranks (the deepspeed launcher); in one process, micro-batching leaves the update unchanged,
several policy updates per rollout move the ratio off 1, KL / dynamic sampling / AQN are logged, and
the export ships through the gate (adapter beside the verified base, or merged through the quantizer)."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SAY7 = ["format=nvfp4_w4a16", "train=cpu_tiny", "method.rl.task=say7", "method.rl.max_new_tokens=4",
        "method.rl.mask_truncated=false", "method.rl.lora_rank=8", "method.rl.n_eval=8", "train.eval_every=0",
        "model.tiny.initializer_range=0.3", "train.lr=2e-2"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_say7_reward_rises_under_zero2_with_two_gloo_ranks(tmp_path):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.fail("the deepspeed launcher is not on PATH (deepspeed is a test dependency)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(_port()), "--module", "qatfactory.train", "method=dapo",
           *SAY7, "train.zero_stage=2", "train.max_steps=6", "method.rl.prompts_per_step=4", "train.micro_batch=8",
           f"run_dir={tmp_path / 'z2'}"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summ = json.loads((tmp_path / "z2" / "summary.json").read_text())
    assert summ["world_size"] == 2
    recs = [r for r in _metrics(tmp_path / "z2") if "reward" in r]
    rw = [r["reward"] for r in recs]
    assert len(rw) == 6 and all(r["updates"] == 1 for r in recs)
    assert sum(rw[-2:]) / 2 > sum(rw[:2]) / 2 + 0.15, rw
    assert summ["eval_last"]["eval/reward"] > summ["eval_first"]["eval/reward"] + 0.2, summ
    assert summ["eval_last"]["eval/prompts"] == 8          # the held-out prompts split over both ranks
    assert (tmp_path / "z2" / "adapter" / "adapter_model.safetensors").exists()


@pytest.fixture(autouse=True)
def one_thread():
    # a tiny model on a shared 2-core machine runs ~10x faster on one thread (no OpenMP spin-waits)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(run_dir, *over):
    from qatfactory.faces.ship import train_and_ship
    from qatfactory.train.config import compose
    cfg = compose([*SAY7, f"run_dir={run_dir}", "method.rl.prompts_per_step=2", *over])
    s = train_and_ship(cfg)
    s.pop("engine").destroy()
    return s


def _adapter(run_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def test_micro_batches_do_not_change_the_update(tmp_path, monkeypatch):
    # plain SGD (the update is then linear in the gradient; Adam's first step is ~lr * sign(g) and
    # would amplify float noise in near-zero gradients): 1 micro-batch of 16 vs 4 of 4
    from qatfactory.train.methods.grpo import GRPO
    monkeypatch.setattr(GRPO, "optimizer", lambda self, ctx, params: torch.optim.SGD(params, lr=ctx.cfg.train.lr))
    over = ["method=grpo", "method.rl.beta=0", "train.max_steps=1", "method.rl.n_eval=0", "train.lr=10"]
    a = _run(tmp_path / "one", *over, "train.micro_batch=16")
    b = _run(tmp_path / "four", *over, "train.micro_batch=4")
    ra, rb = _metrics(tmp_path / "one"), _metrics(tmp_path / "four")
    assert ra[0]["reward"] == rb[0]["reward"] and ra[0]["updates"] == rb[0]["updates"] == 1
    ta, tb = _adapter(tmp_path / "one"), _adapter(tmp_path / "four")
    assert sorted(ta) == sorted(tb) and len(ta) == 2 * 7 * 2
    moved = 0
    for k in ta:
        assert torch.allclose(ta[k], tb[k], rtol=1e-4, atol=1e-6), (k, (ta[k] - tb[k]).abs().max())
        moved += int("lora_B" in k and ta[k].abs().max() > 1e-6)
    assert moved == 14                                       # every B left zero: the update happened
    assert a["steps"] == b["steps"] == 1


def test_grpo_kl_several_updates_dynamic_sampling_and_aqn(tmp_path):
    from qatfactory.nn.noise import stage_sigma
    s = _run(tmp_path / "g", "method=grpo", "train.max_steps=3", "train.micro_batch=8", "method.rl.num_iterations=2",
             "method.rl.minibatches=2", "method.rl.dynamic_sampling=true", "method.rl.aqn.enabled=true",
             "method.rl.aqn.stages=3", "method.rl.aqn.sigma_start=0.05", "method.rl.aqn.sigma_end=0.01",
             "method.rl.n_eval=4")
    recs = [r for r in _metrics(tmp_path / "g") if "reward" in r]
    assert [r["updates"] for r in recs] == [4, 4, 4]          # 2 iterations x 2 minibatches
    # the second pass sees a moved policy: ratios off 1 (the first pass is exactly 1)
    assert all(abs(r["ratio_mean"] - 1.0) > 1e-7 for r in recs[1:]), [r["ratio_mean"] for r in recs]
    assert recs[0]["kl"] >= 0 and recs[-1]["kl"] > 0
    assert all(0.0 <= r["frac_zero_std"] <= 1.0 for r in recs)
    assert [r["aqn/sigma"] for r in recs] == pytest.approx([0.0, stage_sigma(1, 0.05, 0.01, 3), stage_sigma(2, 0.05, 0.01, 3)])
    assert recs[1]["aqn/sigma_eff"] == pytest.approx(0.05, rel=0.3) and recs[1]["aqn/sigma_over_gain_max"] > 0
    assert s["method"] == "grpo" and s["eval_last"]["eval/prompts"] == 4


def test_export_adapter_beside_the_verified_base_and_merged(tmp_path):
    s = _run(tmp_path / "a", "method=dapo", "train.max_steps=2", "train.micro_batch=16", "export=vllm",
             "method.rl.n_eval=0")
    assert s["verify_ok"] is True and s["export_lora"] == "adapter"
    cfg = json.loads(Path(s["adapter_dir"], "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8
    m = _run(tmp_path / "m", "method=dapo", "train.max_steps=2", "train.micro_batch=16", "export=vllm",
             "method.rl.export_lora=merge", "method.rl.n_eval=2")
    # the merged export is verified against what it ships, and its distance to the trained policy is reported
    assert m["verify_ok"] is True and m["merge_kl_to_trained"] >= 0 and 0 <= m["merge_top1_agreement"] <= 1
    q = _run(tmp_path / "q", "method=dapo", "train.max_steps=2", "train.micro_batch=16", "export=vllm",
             "method.rl.lora_mode=merged", "method.rl.n_eval=0", "train.save_student=true")
    assert q["verify_ok"] is True and q["export_lora"] == "merged" and Path(q["student_dir"]).is_dir()


def test_packed_base_trains_the_same_bits_as_the_dequantized_base(tmp_path):
    # method.rl.base=packed holds the frozen base as codes + scales and decodes a layer at each use: every
    # logged number and the trained adapter equal the run on the dequantized base
    over = ["method=grpo", "train.max_steps=2", "train.micro_batch=8", "method.rl.num_iterations=2",
            "method.rl.n_eval=2"]
    _run(tmp_path / "deq", *over)
    _run(tmp_path / "packed", *over, "method.rl.base=packed")
    drop = ("time", "s_", "tok_per_s", "_ms", "seconds", "wall", "mem_")
    clean = [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in _metrics(tmp_path / "deq")]
    got = [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in _metrics(tmp_path / "packed")]
    assert clean == got and any("reward" in r for r in got)
    ta, tb = _adapter(tmp_path / "deq"), _adapter(tmp_path / "packed")
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    from qatfactory.train.config import compose
    from qatfactory.train.methods.grpo import GRPO
    for extra in (["method.rl.lora_mode=merged"], ["format=bf16"]):
        with pytest.raises(ValueError, match="method.rl.base=packed holds a quantized frozen base"):
            GRPO().validate(compose([*SAY7, "method=grpo", "method.rl.base=packed", *extra]))
    with pytest.raises(ValueError, match=r"method.rl.base='int4'; allowed: \['dequantized', 'packed'\]"):
        compose(["method=grpo", "method.rl.base=int4"])


def test_sampler_vs_trainer_gap_is_logged_corrected_and_bounded(tmp_path):
    # AQN perturbs the rollouts only: from stage 1 on the sampler's policy differs from the one the loss scores,
    # and the gap, its correction weights and the bound see it; at stage 0 the two agree to float noise
    aqn = ["method.rl.aqn.enabled=true", "method.rl.aqn.stages=3", "method.rl.aqn.sigma_start=0.05",
           "method.rl.aqn.sigma_end=0.01"]
    _run(tmp_path / "c", "method=dapo", "train.max_steps=2", "train.micro_batch=16", "method.rl.n_eval=0",
         "method.rl.is_correction=token_truncated", "method.rl.is_cap=2.0", *aqn)
    r0, r1 = [r for r in _metrics(tmp_path / "c") if "reward" in r]
    assert r0["aqn/sigma"] == 0 and r0["sampler_kl"] < 1e-9 and r0["is_weight_mean"] == pytest.approx(1, abs=1e-5)
    assert r1["aqn/sigma"] > 0 and r1["sampler_kl"] > 1e-4 and r1["sampler_logp_absdiff_max"] > 1e-2
    assert r1["is_weight_mean"] != pytest.approx(1, abs=1e-4) and r1["is_weight_mean"] <= 2.0
    with pytest.raises(RuntimeError, match=r"step 1: the sampler's policy is .* above method.rl.sampler_kl_max=1e-06"):
        _run(tmp_path / "b", "method=dapo", "train.max_steps=2", "train.micro_batch=16", "method.rl.n_eval=0",
             "method.rl.sampler_kl_max=1e-6", *aqn)


def test_bf16_lora_arm_and_refusals(tmp_path):
    # BF16-LoRA + AQN with the sampler's own (noisy) log-probs as the old policy: the ratio is 1 up to
    # float error while sigma is 0 (stage 0), and visibly off 1 once the rollouts carry noise
    s = _run(tmp_path / "b", "method=dapo", "format=bf16", "train.max_steps=2", "train.micro_batch=16",
             "method.rl.n_eval=0", "method.rl.old_logprobs=rollout", "method.rl.aqn.enabled=true",
             "method.rl.aqn.stages=3", "method.rl.aqn.sigma_start=0.05", "method.rl.aqn.sigma_end=0.01")
    assert s["format"] == "bf16" and Path(s["adapter_dir"]).is_dir()
    r1, r2 = [r for r in _metrics(tmp_path / "b") if "reward" in r]
    assert r1["aqn/sigma"] == 0 and abs(r1["ratio_mean"] - 1) < 1e-4
    assert r2["aqn/sigma"] > 0 and abs(r2["ratio_mean"] - 1) > 1e-4, (r1["ratio_mean"], r2["ratio_mean"])
    from qatfactory.train.config import compose
    from qatfactory.train.methods.grpo import GRPO

    def check(cfg, world):
        GRPO().validate(cfg)
        GRPO().preflight(cfg, world)
    for over, msg in ((["train.zero_stage=3"], "zero_stage=3 is not supported"),
                      (["method.rl.prompts_per_step=3"], "does not split over 2 ranks"),
                      (["train.micro_batch=5"], "whole micro-batches"),
                      (["format=bf16", "method.rl.lora_mode=merged"], "lora_mode='merged' merges into the quantizer"),
                      (["quant.lora.rank=4"], "quant.lora.rank must be 0")):
        with pytest.raises(ValueError, match=msg):
            check(compose([*SAY7, "method=dapo", "method.rl.prompts_per_step=2", *over]), world=2)
    with pytest.raises(ValueError, match=r"method.rl.loss_norm='tokens'; allowed"):
        compose(["method=grpo", "method.rl.loss_norm=tokens"])


def test_warmup_runs_before_the_base_is_quantized(tmp_path):
    # method.rl.warmup_steps: the supervised warm-up changes the model the quantizer then freezes; without
    # it the frozen base is the initial model, bit for bit
    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    over = ["method=dapo", "method.rl.task=arith", "method.rl.task_level=0", "method.rl.n_train=16",
            "method.rl.max_new_tokens=8", "train.max_steps=1", "method.rl.n_eval=2", "train.micro_batch=8"]
    fresh = build_model(compose([*SAY7, *over]), torch.device("cpu"))[0].model.layers[0].self_attn.q_proj.weight
    w = _run(tmp_path / "w", *over, "method.rl.warmup_steps=3", "method.rl.warmup_batch=4", "method.rl.warmup_lr=1e-3")
    n = _run(tmp_path / "n", *over)
    assert w["warmup"]["steps"] == 3 and w["warmup"]["examples"] == 12 and w["warmup"]["loss_first"] > 0
    assert "warmup" not in n

    def q_weight(s):
        m = s["student"].model.model.layers[0].self_attn.q_proj
        assert type(m).__name__ == "QuantLinear"
        return m.weight.detach()
    assert torch.equal(q_weight(n), fresh)
    assert (q_weight(w) - fresh).abs().max() > 1e-4
    # the adapter names the warmed-up model as its base, and that directory holds it
    from transformers import AutoModelForCausalLM
    from qatfactory.train.rl.warmup import read_record
    base = json.loads((tmp_path / "w" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == tmp_path / "w" / "warmup" and read_record(base)["steps"] == 3
    saved = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert torch.equal(saved.model.layers[0].self_attn.q_proj.weight, q_weight(w))
    with pytest.raises(ValueError, match=r"warmup_steps=2 needs method.rl.task=arith"):
        compose([*SAY7, "method=dapo", "method.rl.warmup_steps=2"])
    with pytest.raises(ValueError, match=r"warmup_levels=\[9\]; allowed: levels 0..6"):
        compose([*SAY7, "method=dapo", "method.rl.task=arith", "method.rl.warmup_levels=[9]"])
