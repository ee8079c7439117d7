"""The trainer in one process on CPU (fp32, so runs can be compared exactly): ZeRO stages agree,
resume is bit-exact, a cached teacher equals a live one, QAD lowers the KL below the PTQ start."""
import json
from pathlib import Path

import pytest
import torch

from qatfactory.train.config import compose

BASE = ["train=cpu_tiny", "data.synthetic=16", "data.seq_len=32", "data.eval_samples=4",
        "train.eval_every=0", "train.max_steps=3", "train.lr=1e-3"]


def _run(run_dir, *over, eval_only=False):
    # the trainer, then the face's shipping when the run asks for an export (what `qatfactory train` does)
    from qatfactory.faces.ship import train_and_ship
    cfg = compose(BASE + [f"run_dir={run_dir}", *over])
    s = train_and_ship(cfg, eval_only=eval_only)
    s.pop("engine").destroy()
    return s


def _losses(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second random tiny Llama (other seed) saved as a local HF dir: a teacher that differs."""
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(123)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    m.save_pretrained(d)
    return str(d)


def test_zero_stages_0_1_2_agree_and_resume_is_bit_exact(tmp_path, teacher_dir):
    qad = ["method=qad", "format=bf16", f"method.teacher_path={teacher_dir}"]
    full = _run(tmp_path / "z0", *qad, "train.max_steps=4", "train.save_every=2", "train.keep_last=3")
    ref = _losses(tmp_path / "z0")
    assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1]          # it learns
    assert [p.name for p in sorted((tmp_path / "z0" / "checkpoints").iterdir())] == ["step-000002", "step-000004"]
    assert full["eval_last"]["eval/kl"] < full["eval_first"]["eval/kl"]
    # stop after 2 steps, then resume to 4: steps 3 and 4 bit for bit as in the uninterrupted run
    _run(tmp_path / "rs", *qad, "train.max_steps=2")
    _run(tmp_path / "rs", *qad, "train.max_steps=4", "resume=auto")
    got = _losses(tmp_path / "rs")
    assert got[3] == ref[3] and got[4] == ref[4], (got, ref)
    st = json.loads((tmp_path / "rs" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert st["step"] == 4 and st["position"] == 4 * 2
    # `qatfactory eval --checkpoint` restores the step-4 student and reproduces the run's final eval
    from qatfactory.faces import cli
    assert cli.main(["eval", "--checkpoint", str(tmp_path / "rs" / "checkpoints" / "step-000004")]) == 0
    ev = json.loads((tmp_path / "rs" / "eval-step-000004.json").read_text())["eval_last"]
    assert ev["eval/kl"] == pytest.approx(full["eval_last"]["eval/kl"], rel=1e-6)
    assert ev["eval/ce"] == pytest.approx(full["eval_last"]["eval/ce"], rel=1e-6)
    for stage in (1, 2):
        _run(tmp_path / f"z{stage}", *qad, "train.max_steps=4", f"train.zero_stage={stage}")
        zs = _losses(tmp_path / f"z{stage}")
        for k in ref:
            assert zs[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (stage, k, zs, ref)


def test_cached_teacher_equals_live_when_k_covers_vocab(tmp_path, teacher_dir):
    common = ["method=qad", "format=bf16", f"method.teacher_path={teacher_dir}", "method.loss.temperature=2.0"]
    live = _run(tmp_path / "live", *common)
    cached = _run(tmp_path / "cached", *common, "method.teacher=cached", "method.topk=259")
    meta = json.loads((tmp_path / "cached" / "teacher_cache" / "train" / "meta.json").read_text())
    assert meta["k"] == 259 and meta["n_samples"] == 16
    a, b = _losses(tmp_path / "live"), _losses(tmp_path / "cached")
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), (k, a, b)
    assert cached["eval_last"]["eval/kl"] == pytest.approx(live["eval_last"]["eval/kl"], rel=1e-4)
    # a cache made for other data is refused, by name
    with pytest.raises(ValueError, match="fingerprint"):
        _run(tmp_path / "other", *common, "method.teacher=cached",
             f"method.teacher_cache={tmp_path / 'cached' / 'teacher_cache'}", "train.seed=5")


TEXT = ("The student sees what the engine runs. Quantization rounds each block of weights to four bits, "
        "and distillation pulls the rounded model back toward its teacher, token by token. ") * 6


def test_qad_lowers_kl_below_ptq(tmp_path):
    """PTQ start -> QAD: the KL to the (unquantized) teacher falls. Train and eval read the same text file
    (the claim is that distillation recovers the teacher, not that a random model generalises)."""
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    fmt = ["format=nvfp4_w4a16", "model.tiny.initializer_range=0.3", f"data.train=[{f}]", f"data.eval=[{f}]",
           "data.synthetic=0", "train.eval_samples=8"]
    qat = _run(tmp_path / "qat", "method=qat", *fmt, "method.eval_teacher=false", "train.max_steps=1")
    assert "eval/kl" not in qat["eval_last"] and qat["eval_last"]["eval/ce"] > 0   # no teacher loaded
    ptq = _run(tmp_path / "ptq", "method=ptq", *fmt)
    assert not (tmp_path / "ptq" / "checkpoints").exists()
    kl0 = ptq["eval_last"]["eval/kl"]
    assert kl0 > 0.05                                   # quantization moved the student away
    qad = _run(tmp_path / "qad", "method=qad", *fmt, "train.max_steps=8", "train.plots=true")
    assert (tmp_path / "qad" / "plots" / "train.png").stat().st_size > 1000
    assert (tmp_path / "qad" / "plots" / "eval.png").exists()
    assert qad["eval_first"]["eval/kl"] == pytest.approx(kl0, rel=1e-6)
    assert qad["eval_last"]["eval/kl"] < 0.85 * kl0, (kl0, qad["eval_last"])
    assert qad["eval_last"]["eval/top1"] > qad["eval_first"]["eval/top1"]


def test_zero3_run_saves_student_and_exports_a_verified_checkpoint(tmp_path):
    """ZeRO-3 in one process: the weights are gathered for save_student / convert / export, and the
    exporter's own verification (reload with the engine's loader, byte-compare) passes."""
    s = _run(tmp_path / "z3", "method=qad", "format=nvfp4_w4a16", "export=vllm", "train.zero_stage=3",
             "train.max_steps=1", "train.save_student=true", "model.tiny.initializer_range=0.3")
    assert s["verify_ok"] is True
    assert Path(s["export_dir"], "config.json").exists()
    from qatfactory.quantize import load_student
    st = load_student(s["student_dir"])
    assert st.config.hidden_size == 64


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_lora_qad_under_gradient_checkpointing_trains_the_same_bits(tmp_path, device):
    """method=qad_lora with train.grad_ckpt=true (the memory recipe of LoRA-QAD): a fused group's amax used to be
    computed through LoRA's B·A with grad on and then detached, so the first forward saved A and B for a graph
    nobody used while the recompute hit the amax cache and saved fewer tensors -- torch's CheckpointError on the
    first backward (found on the GPU in benchmarks/papers/lora_memory.py). Now both run and give the same bits
    (on CPU; on a GPU, bf16 with the CUDA kernels, the same losses and adapters to rounding)."""
    import json

    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    out = {}
    for ckpt in ("false", "true"):
        cfg = compose(["train=cpu_tiny", "data.synthetic=12", "data.seq_len=32", "data.eval_samples=2",
                       "train.eval_every=0", "train.max_steps=3", "train.lr=1e-2", "method=qad_lora",
                       "quant.lora.rank=4", "quant.lora.alpha=4.0", "format=nvfp4_w4a16",
                       f"train.grad_ckpt={ckpt}", f"run_dir={tmp_path / ckpt}", f"train.device={device}"]
                      + (["train.precision=bf16"] if device == "cuda" else []))
        s = run(cfg)
        eng = s.pop("engine")
        w = {k: v.detach().clone() for k, v in eng.module.lm.state_dict().items() if "lora_" in k}
        eng.destroy()
        recs = [json.loads(x) for x in (tmp_path / ckpt / "metrics.jsonl").read_text().splitlines()]
        out[ckpt] = (w, [r["loss"] for r in recs if "loss" in r])
    (w0, l0), (w1, l1) = out["false"], out["true"]
    if device == "cpu":
        assert len(l0) == 3 and l0 == l1
        assert w0 and [k for k in w0 if not torch.equal(w0[k], w1[k])] == []
    else:
        assert len(l0) == 3 and l0 == pytest.approx(l1, rel=1e-3)
        assert w0 and [k for k in w0 if not torch.allclose(w0[k].float(), w1[k].float(), rtol=1e-2, atol=1e-4)] == []
    # the adapters trained (B starts at zero)
    assert any(v.abs().max() > 0 for k, v in w0.items() if "lora_B" in k)
