"""QAD inside Hugging Face's Trainer (qatfactory.integrations.transformers) against `qatfactory train`.

The same tiny model, seed, samples, data order and settings through both trainers on CPU (fp32) give the
same student, bit for bit: the same fake quantization, teacher, chunked loss, AdamW and schedule. The HF
run's export passes the parity gate, and its saved student is what `qatfactory export` takes."""
import json
from pathlib import Path

import pytest
import torch
from optional_imports import needed

from qatfactory.train.config import compose

needed("accelerate")     # transformers' Trainer runs on it (the test extra)

STEPS, SEED = 3, 0
BASE = ["train=cpu_tiny", "method=qad", "format=nvfp4_w4a16", "data.synthetic=16", "data.seq_len=32",
        "data.eval_samples=4", "train.eval_every=0", f"train.max_steps={STEPS}", "train.lr=1e-3",
        "model.tiny.initializer_range=0.3", f"train.seed={SEED}"]


class Rows(torch.utils.data.Dataset):
    """data.Samples as the rows a Hugging Face collator takes: labels -100 where a token does not count."""

    def __init__(self, s):
        self.s = s

    def __len__(self):
        return len(self.s)

    def __getitem__(self, i):
        b = self.s.select([i])
        ids, attn, mask = b["input_ids"][0], b["attn"][0], b["mask"][0]
        return {"input_ids": ids, "attention_mask": attn, "labels": ids.masked_fill(~mask.bool(), -100), "sample_ids": i}


def ours(run_dir, *over):
    from qatfactory.faces.ship import train_and_ship
    s = train_and_ship(compose(BASE + [f"run_dir={run_dir}", *over]))
    s.pop("engine").destroy()
    return s


def hf_args(out, over=(), **kw):
    from transformers import TrainingArguments
    cfg = compose(BASE + list(over))
    t = cfg.train
    d = dict(output_dir=str(out), max_steps=t.max_steps, per_device_train_batch_size=t.micro_batch,
             gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, lr_scheduler_type="constant",
             adam_beta1=t.betas[0], adam_beta2=t.betas[1], weight_decay=t.weight_decay, max_grad_norm=t.clip,
             optim="adamw_torch", seed=t.seed, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
             dataloader_num_workers=0, disable_tqdm=True)
    d.update(kw)
    return cfg, TrainingArguments(**d)


def hf_trainer(out, over=(), teacher="copy", **kw):
    """The same student as `ours` before training (tiny model of cfg.model, its seed), the same samples."""
    from qatfactory.integrations.transformers import QADTrainer
    from qatfactory.train.data import load_data
    from qatfactory.train.runtime import build_model
    ship = kw.pop("ship", None)
    cfg, args = hf_args(out, over, **kw)
    model, tok, _ = build_model(cfg)
    train, _ = load_data(cfg.data, tok, model.get_output_embeddings().weight.shape[0], cfg.train.seed)
    return QADTrainer(model=model, args=args, train_dataset=Rows(train), format=cfg.quant.name,
                      data_order="qatfactory", ship=ship, teacher=teacher)


def both(tmp_path, name, *over, teacher="copy"):
    ref = ours(tmp_path / f"ours-{name}", *over)
    if teacher == "cache":      # the top-k cache our run wrote, read by sample id
        teacher = tmp_path / f"ours-{name}" / "teacher_cache" / "train"
    tr = hf_trainer(tmp_path / f"hf-{name}", over, teacher=teacher)
    tr.train()
    recs = [json.loads(x) for x in (tmp_path / f"ours-{name}" / "metrics.jsonl").read_text().splitlines()]
    both.summary = ref
    return ref["student"].model.state_dict(), tr.model.state_dict(), [r["loss"] for r in recs if "loss" in r], tr


def test_hf_trainer_qad_is_our_loop_bit_for_bit(tmp_path):
    """Two micro-batches per step (DeepSpeed and the Trainer both halve each micro-batch's loss: exact),
    no gradient clipping: every weight and quantizer state of the student equal to the bit."""
    mine, got, want, tr = both(tmp_path, "ga2", "train.clip=0", "train.grad_accum=2")
    assert sorted(got) == sorted(mine)
    diff = [k for k in mine if not torch.equal(got[k], mine[k])]
    assert not diff, diff[:8]
    have = [r["loss"] for r in tr.state.log_history if "loss" in r]
    assert len(want) == len(have) == STEPS and have == pytest.approx(want, rel=1e-6), (have, want)
    # the loss is the mean KL to the teacher: logged as kl too, as our loop logs it (train/kl on both paths' trackers)
    assert all(r["kl"] == r["loss"] for r in tr.state.log_history if "loss" in r)
    # the Trainer's evaluate() reports the method's loss: on the held-out samples, our run's final eval/kl
    from qatfactory.train.data import load_data
    from qatfactory.train.runtime import build_model
    cfg = compose(BASE + ["train.clip=0", "train.grad_accum=2"])
    _, held = load_data(cfg.data, build_model(cfg)[1], 259, cfg.train.seed)
    ev = tr.evaluate(Rows(held))
    assert ev["eval_loss"] == pytest.approx(both.summary["eval_last"]["eval/kl"], rel=1e-5)
    # it trained: the weights are not the start's
    start = hf_trainer(tmp_path / "start").model.state_dict()
    assert not torch.equal(start["model.layers.0.mlp.up_proj.weight"], got["model.layers.0.mlp.up_proj.weight"])


def test_cached_top_k_teacher_is_our_loop_bit_for_bit(tmp_path):
    """method.teacher=cached: our run writes the top-k cache; QADTrainer given its folder reads it by the batch's
    sample_ids (the rows' numbers) and trains the same student, bit for bit."""
    mine, got, want, tr = both(tmp_path, "cached", "train.clip=0", "method.teacher=cached", "method.topk=16",
                               teacher="cache")
    assert tr.qatfactory.cache is not None and tr.qatfactory.live is None and tr.qatfactory.cache.k == 16
    diff = [k for k in mine if not torch.equal(got[k], mine[k])]
    assert not diff, diff[:8]
    assert [r["loss"] for r in tr.state.log_history if "loss" in r] == pytest.approx(want, rel=1e-6)


def test_with_gradient_clipping_the_difference_is_rounding_and_bounded(tmp_path):
    """train.clip = max_grad_norm = 1.0, and the steps are clipped (norms ~5). DeepSpeed's clip takes the total
    norm as (sum of squared per-parameter norms) ** 0.5, torch's as the vector norm of the per-parameter norms:
    the clip coefficient can differ in its last bit, and so each clipped gradient by about one ulp. AdamW
    divides by the gradient's own running RMS, so after STEPS steps a weight differs by a few float32 ulps
    of the update (lr = 1e-3), never more: bounded here at 1e-6 (measured 6e-8)."""
    mine, got, want, tr = both(tmp_path, "clip", "train.clip=1.0")
    assert min(r["grad_norm"] for r in tr.state.log_history if "grad_norm" in r) > 1.0   # every step clipped
    worst = max((got[k].double() - mine[k].double()).abs().max().item() for k in mine)
    assert worst <= 1e-6, worst
    have = [r["loss"] for r in tr.state.log_history if "loss" in r]
    assert have[0] == pytest.approx(want[0], rel=1e-6)        # the first loss precedes any clipped update
    assert have == pytest.approx(want, rel=1e-5), (have, want)


def test_hf_trainer_ships_a_gated_export_and_saves_the_student(tmp_path):
    tr = hf_trainer(tmp_path / "hf", ship="vllm", max_steps=1)
    tr.train()
    assert tr.shipped is not None and tr.shipped.ok is True, tr.shipped and tr.shipped.gate
    assert Path(tr.shipped.path) == tmp_path / "hf" / "export-vllm"
    assert (tmp_path / "hf" / "export-vllm" / "config.json").is_file()
    tr.save_model()
    rec = json.loads((tmp_path / "hf" / "student" / "qatfactory_quant.json").read_text())
    assert rec["quant_config"]["name"] == "nvfp4_w4a16"
    from qatfactory.faces import cli
    assert cli.main(["verify", str(tmp_path / "hf" / "export-vllm"), "--against", str(tmp_path / "hf" / "student"),
                     "--quiet"]) == 0


def test_hf_trainer_refusals_before_training(tmp_path):
    from qatfactory.exitcodes import UsageError
    from qatfactory.integrations.transformers import QADTrainer
    from qatfactory.train.runtime import build_model

    def tiny():
        return build_model(compose(BASE))[0]
    with pytest.raises(UsageError, match="format=xyz: no such recipe"):
        QADTrainer(model=tiny(), args=hf_args(tmp_path / "b")[1], format="xyz")
    # a ship target that is somebody else's folder is refused when the trainer is built, not after training
    (tmp_path / "c" / "export-vllm").mkdir(parents=True)
    (tmp_path / "c" / "export-vllm" / "mine.txt").write_text("keep me")
    with pytest.raises(Exception, match="export"):
        hf_trainer(tmp_path / "c", ship="vllm")
    assert (tmp_path / "c" / "export-vllm" / "mine.txt").read_text() == "keep me"


def test_rl_keeps_the_trainers_loss_trains_lora_only_and_noises_rollouts_only(tmp_path):
    """method=rl (TRL's GRPO and the like): the base trainer's own loss, our frozen quantized base with LoRA
    (only lora_A / lora_B train), and AQN on the norm gains inside the rollout sampling (`_generate`) only."""
    from transformers import Trainer

    from qatfactory.integrations.transformers import quantized
    from qatfactory.train.runtime import build_model

    class Sampler(Trainer):              # stands in for TRL's GRPOTrainer: its rollouts run in _generate
        def _generate(self, prompts):
            return self.model.model.layers[0].input_layernorm.weight.detach().clone()

        def compute_loss(self, model, inputs, **kw):
            return "the trainer's own"

    model = build_model(compose(BASE))[0]
    clean = model.model.layers[0].input_layernorm.weight.detach().clone()
    tr = quantized(Sampler, "rl")(model=model, args=hf_args(tmp_path, max_steps=9)[1], quant={"lora": {"rank": 4}},
                                  aqn={"stages": 3})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    assert tr.compute_loss(model, {}) == "the trainer's own"
    tr.state.global_step = 0                            # stage 0: no noise
    assert torch.equal(tr._generate(["p"]), clean)
    tr.state.global_step = 4                            # stage 1: sigma_start
    noisy = tr._generate(["p"])
    assert not torch.equal(noisy, clean) and tr._qf_aqn.last["sigma"] == pytest.approx(1e-2)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, clean)     # the loss forward sees it clean
    from qatfactory.exitcodes import UsageError
    with pytest.raises(UsageError, match="method=rl keeps the trainer's own loss"):
        quantized(Sampler, "rl")(model=build_model(compose(BASE))[0], args=hf_args(tmp_path)[1], loss="jsd")
    with pytest.raises(UsageError, match="aqn= with method=qad"):
        quantized(Sampler, "qad")(model=build_model(compose(BASE))[0], args=hf_args(tmp_path)[1], aqn=True)


def test_the_users_training_arguments_are_kept(tmp_path):
    """Activation (gradient) checkpointing recomputes the same forward (the same student to the bit); bf16
    autocast trains (the chunked loss accumulates in float32); ZeRO-3 is refused by name before anything runs."""
    from qatfactory.exitcodes import UsageError
    from qatfactory.integrations.transformers import check_zero_stage
    over = ("train.clip=0",)
    plain = hf_trainer(tmp_path / "plain", over, max_steps=2)
    plain.train()
    ckpt = hf_trainer(tmp_path / "ckpt", over, max_steps=2, activation_checkpointing=True)
    ckpt.train()
    assert ckpt.model.is_activation_checkpointing
    a, b = plain.model.state_dict(), ckpt.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    bf = hf_trainer(tmp_path / "bf16", over, max_steps=2, bf16=True)
    bf.train()
    losses = [r["loss"] for r in bf.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses), losses
    check_zero_stage({"zero_optimization": {"stage": 2}})
    with pytest.raises(UsageError, match="zero_optimization.stage=3 with a qatfactory Trainer: not supported"):
        check_zero_stage({"zero_optimization": {"stage": 3}})
