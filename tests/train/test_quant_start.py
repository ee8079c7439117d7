"""train.quant_start (ParetoQ's full-precision-then-QAT schedule) on CPU, fp32, bit for bit:

* before the switch the run is the plain model: its losses and its eval equal a format=bf16 run's;
* at the switch the scales are calibrated from the trained weights (ParetoQ's init), quantization is on,
  the optimizer state starts afresh and the LR schedule restarts at quant_lr;
* a resume from a checkpoint before, exactly at, and after the switch continues as the uninterrupted run."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from test_train import BASE, _losses, _run

# 6 steps, 3 in full precision (cosine over 3) then 3 quantized (cosine over 3 from quant_lr). Gradient
# clipping off: DeepSpeed gives the (unused) scale parameters zero gradients, and the extra zeros in its
# stacked norm sum change the clip factor of the full-precision steps in the last bit
Q = ["method=qat", "format=paretoq_4bit", "model.tiny.initializer_range=0.3", "model.dtype=float32",
     "train.max_steps=6", "train.schedule=cosine", "train.lr=3e-3", "train.clip=0"]
SWITCH = ["train.quant_start=0.5", "train.quant_lr=1e-3"]


def _records(d):
    return [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("qs") / "run"
    _run(d, *Q, *SWITCH, "train.save_every=1", "train.keep_last=10", "train.save_student=true")
    return d


def test_full_precision_phase_is_the_plain_model(full, tmp_path):
    ref = tmp_path / "bf16"
    _run(ref, *[q for q in Q if not q.startswith(("format=", "train.max_steps="))], "format=bf16",
         "train.max_steps=3")
    got, want = _losses(full), _losses(ref)
    assert [got[s] for s in (1, 2, 3)] == [want[s] for s in (1, 2, 3)]
    evals = [r for r in _records(full) if "eval/ce" in r]
    fp = [r for r in evals if r["step"] == 3 and r["quant_on"] is False]
    ref_eval = [r for r in _records(ref) if "eval/ce" in r and r["step"] == 3]
    assert fp and fp[0]["eval/ce"] == ref_eval[0]["eval/ce"]       # the FP model's held-out CE at the switch
    assert [r["quant_on"] for r in evals] == [False, False, True]   # start, switch, end


def test_switch_calibrates_restarts_the_schedule_and_quantizes(full):
    recs = {r["step"]: r for r in _records(full) if "loss" in r}
    lr, qlr = 3e-3, 1e-3
    cos = [0.5 * (1 + math.cos(math.pi * i / 3)) for i in range(3)]
    assert [recs[s]["lr"] for s in (1, 2, 3)] == pytest.approx([lr * c for c in cos], rel=1e-6)
    assert [recs[s]["lr"] for s in (4, 5, 6)] == pytest.approx([qlr * c for c in cos], rel=1e-6)
    # the saved student is quantized
    from qatfactory.quantize import load_student
    st = load_student(str(full / "student"))
    q = st.model.layers[0].mlp.down_proj
    assert q.quant_enabled and q.weight_quant.strategy == "learnable"

    def module(step):
        f = next((full / "checkpoints" / f"step-{step:06d}" / "ds").rglob("*model_states.pt"))
        return torch.load(f, weights_only=True, map_location="cpu")["module"]
    w3, w4 = module(3), module(4)
    key = "lm.model.layers.0.mlp.down_proj"
    # step 4 starts from ParetoQ's init of the step-3 weights, max|W| / 7 per row (prepare's init from the
    # random weights is long gone), and a fresh AdamW: its first step moves every parameter by exactly lr
    init = w3[key + ".weight"].abs().amax(-1) / 7
    a4 = w4[key + ".weight_quant.alpha"].reshape(-1)
    assert not torch.allclose(w3[key + ".weight_quant.alpha"].reshape(-1), init)
    assert torch.allclose((a4 - init).abs(), torch.full_like(a4, qlr), rtol=1e-2)   # a kept state: ~0.6 lr
    dw = (w4[key + ".weight"] - w3[key + ".weight"]).abs()
    moved = dw > 0
    assert moved.float().mean() > 0.9 and torch.allclose(dw[moved], torch.full_like(dw[moved], qlr), rtol=1e-2)


@pytest.mark.parametrize("at", [2, 3, 4])
def test_resume_across_the_switch_is_bit_exact(full, tmp_path, at):
    ref = _losses(full)
    d = tmp_path / "run"
    shutil.copytree(full, d, symlinks=True)
    for c in (d / "checkpoints").iterdir():
        if int(c.name.split("-")[1]) > at:
            shutil.rmtree(c)
    shutil.rmtree(d / "student", ignore_errors=True)
    _run(d, *Q, *SWITCH, "train.save_every=1", "train.keep_last=10", "resume=auto")
    got = _losses(d)
    assert [got[s] for s in range(at + 1, 7)] == [ref[s] for s in range(at + 1, 7)], (at, got, ref)
    ev = [r for r in _records(d) if "eval/ce" in r and r["step"] == 6]
    ev_ref = [r for r in _records(full) if "eval/ce" in r and r["step"] == 6]
    assert ev[-1]["eval/ce"] == ev_ref[-1]["eval/ce"] and ev[-1]["quant_on"] is True


def test_bad_quant_start_is_refused_by_name():
    from qatfactory.train.config import compose
    with pytest.raises(ValueError, match="train.quant_start=1.5; allowed"):
        compose(BASE + Q + ["train.quant_start=1.5"])
    with pytest.raises(ValueError, match="format=bf16 quantizes nothing"):
        compose(BASE + ["format=bf16", "train.quant_start=0.5"])
    with pytest.raises(ValueError, match="method=ptq does not train"):
        compose(BASE + ["method=ptq", "format=paretoq_4bit", "train.quant_start=0.5"])
    with pytest.raises(ValueError, match="train.quant_lr=0.0"):
        compose(BASE + Q + ["train.quant_lr=0.0"])
