"""NVIDIA Model Optimizer's PTQ and QAD on the same model, data, tokens and held-out windows as
benchmarks/accuracy/qad_recipe.py, scored by the same evaluator.

    python benchmarks/accuracy/peer_modelopt.py --out runs/recipe --steps 800           # GPU: PTQ rows + QAD
    python benchmarks/accuracy/peer_modelopt.py --smoke --out /tmp/recipe               # CPU, tiny model

What runs is Model Optimizer's own documented path, examples/llm_qat of NVIDIA/Model-Optimizer (read at commit
a2fbac7, 2026-08): ``quantize.py`` calibrates with ``mtq.quantize(model, cfg, forward_loop)`` over
``calib_size`` = 512 training samples (its default), then ``train.py`` fine-tunes the quantized model with
``QADTrainer`` (a Hugging Face Trainer; KL on logits from a frozen bf16 teacher, ``LogitsDistillationLoss``,
temperature 1) at the settings of ``configs/train/qad_nvfp4.yaml``: learning rate 1e-5, cosine schedule,
5 % warm-up, bf16, AdamW. Held equal to our arms instead of its file: the tokens per step (its 2 x 2 x 8,192
becomes our micro-batch x sequence length), the number of steps, the training windows and their text.
``--lrs`` runs it at other rates too, so the peer is also seen at the rate that suits this model size.

The format's ModelOpt config: nvfp4_w4a16 -> ``W4A16_NVFP4_CFG``; nvfp4_w4a4 -> ``NVFP4_DEFAULT_CFG``;
mxfp4_w4a4 -> ``MXFP4_DEFAULT_CFG``; the PTQ rows add the AWQ variant ModelOpt ships for NVFP4
(``NVFP4_AWQ_LITE_CFG``) where the format is NVFP4.

Writes ``<tag>.json`` / ``<tag>.md`` in qad_recipe.py's layout, so ``qad_recipe.py --merge`` puts these rows
in the same table and plot.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "papers"))
import papers_common as C  # noqa: E402
import peer_common as PC  # noqa: E402
import qad_recipe as R  # noqa: E402

TAG = "peer_modelopt"
CFGS = {"nvfp4_w4a16": ["W4A16_NVFP4_CFG", "NVFP4_AWQ_LITE_CFG"], "nvfp4_w4a4": ["NVFP4_DEFAULT_CFG",
        "NVFP4_AWQ_LITE_CFG"], "mxfp4_w4a4": ["MXFP4_DEFAULT_CFG"]}
DOC_LR = 1e-5
CPU_STAND_IN = "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"
CALIB_SIZE = 512


def windows(path_list, tok, seq: int):
    from qatfactory.train.data import DataConfig, build_samples
    return build_samples(list(path_list), tok, DataConfig(train=list(path_list), seq_len=seq, eval_samples=0))


def quantize(model, cfg_name: str, calib_ids, device, micro: int):
    import modelopt.torch.quantization as mtq
    import torch
    cfg = getattr(mtq, cfg_name)

    def forward_loop(m):
        with torch.no_grad():
            for lo in range(0, len(calib_ids), micro):
                m(input_ids=calib_ids[lo:lo + micro].to(device), use_cache=False)
    mtq.quantize(model, cfg, forward_loop)
    return model


class _Windows:
    """The training windows as a Dataset of dicts, the form Hugging Face's Trainer collates."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        import torch
        x = self.ids[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


def _deadline_callback(deadline: Optional[float]):
    """Stops the Trainer once the wall clock passes ``deadline`` (the call's budget less the evaluation), so
    a job cut by the device call's limit still reports its student, as a row that says how many steps ran."""
    from transformers import TrainerCallback

    class Deadline(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if deadline is not None and time.time() > deadline:
                control.should_training_stop = True
            return control
    return Deadline()


def qad(student, teacher, train_ids, a, p, lr: float, out_dir: Path, deadline: Optional[float] = None) -> Dict[str, Any]:
    import torch
    from transformers import TrainingArguments

    from modelopt.torch.quantization.plugins.transformers_trainer import QADTrainer
    bf16 = a.device == "cuda"
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=p["micro"], gradient_accumulation_steps=1,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(1, round(0.05 * p["steps"])),
        max_steps=p["steps"], bf16=bf16,
        logging_steps=max(1, p["steps"] // 20), save_strategy="no", report_to=[], seed=a.seed,
        dataloader_drop_last=True, remove_unused_columns=False, use_cpu=a.device != "cuda",
        eval_strategy="no", do_train=True, do_eval=False)
    n = p["steps"] * p["micro"]
    ds = _Windows(train_ids[:n] if len(train_ids) >= n else train_ids)
    tr = QADTrainer(model=student, args=args, train_dataset=ds,
                    distill_args={"teacher_model": teacher, "temperature": 1.0, "criterion": "logits_loss"},
                    callbacks=[_deadline_callback(deadline)])
    t = time.time()
    tr.train()
    secs = time.time() - t
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    student.eval()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    done = int(tr.state.global_step)
    r = {"seconds_train": secs, "step_ms": 1000 * secs / max(1, done), "train_loss": losses,
         "tokens": done * p["micro"] * p["seq"], "steps_done": done}
    if done < p["steps"]:
        r["cut"] = f"stopped at step {done} of {p['steps']} by the time budget (cosine schedule planned for {p['steps']})"
    return r


def run(a) -> int:
    t_start = time.time()
    p, work, data, res, teacher, tok, ev = PC.setup(a, a.tag, "nvidia-modelopt")
    res.update(calib=f"modelopt {CALIB_SIZE}", peer_version=C._version("nvidia-modelopt"))
    train = windows([data["files"]["wiki_train"], data["files"]["austen_train"]], tok, p["seq"])
    calib = train.input_ids[:CALIB_SIZE]
    res["ptq"] = {}
    cfgs = CFGS.get(a.format)
    if not cfgs:
        raise SystemExit(f"--format {a.format}: ModelOpt configs known for {sorted(CFGS)}")
    if a.device != "cuda":
        # ModelOpt's FP4 block quantizers run only on CUDA; on a CPU the same code path (quantize,
        # QADTrainer, evaluation) runs with its block INT4 weight-only config, which measures nothing here
        cfgs = [CPU_STAND_IN]
        res["cpu_stand_in"] = CPU_STAND_IN
    for name in (cfgs if a.ptq else []):
        try:
            m = quantize(C.load_teacher(a.smoke, a.model_path, a.device)[0], name, calib, a.device, p["micro"])
            res["ptq"][f"modelopt {name}"] = ev.evaluate(m)
            C.free(m)
        except Exception as e:  # noqa: BLE001 - a config that does not run here is a row saying why
            res["ptq"][f"modelopt {name}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        C.say(a.tag, f"PTQ {name}: {res['ptq'][f'modelopt {name}'].get('wiki_ho', res['ptq'][f'modelopt {name}'])}")
    arms = [{"name": f"modelopt_qad_lr{lr:g}", "kind": "modelopt_qad", "lr": lr} for lr in a.lrs]

    def one(arm, seed):
        import torch
        student = quantize(C.load_teacher(a.smoke, a.model_path, a.device)[0], cfgs[0], calib, a.device, p["micro"])
        student.train().requires_grad_(True)
        for n_, q in student.named_modules():
            if "quantizer" in type(q).__name__.lower():
                q.requires_grad_(False)
        # the example's launch (launch.sh: accelerate with FSDP2, mixed precision bf16) trains fp32 parameters:
        # accelerate upcasts every trainable low-precision parameter to fp32 before sharding, and bf16 is the
        # compute dtype only. Trained as loaded (bf16), AdamW's updates at 1e-5 fall below bf16's resolution.
        upcast = 0
        for prm in student.parameters():
            if prm.requires_grad and prm.dtype != torch.float32:
                prm.data = prm.data.float()
                upcast += 1
        # the held-out evaluation after training takes well under a minute for this model
        deadline = None if a.budget_s is None else t_start + a.budget_s - 45
        r = qad(student, teacher, train.input_ids, a, p, arm["lr"], work / arm["name"], deadline)
        r.update(lr=arm["lr"], method="modelopt QADTrainer", schedule="cosine (5% warm-up)", scales="modelopt",
                 master_weights=f"fp32 ({upcast} bf16 parameters upcast, as accelerate's FSDP2 launch does)",
                 curve={"step": [], "kl": [], "ce": []})
        if a.device == "cuda":
            student.to(torch.bfloat16)      # scored in the dtype every other arm's student is scored in
        r["eval"] = ev.evaluate(student)
        C.free(student)
        return r

    return C.run_and_report(arms, [a.seed], C.Budget(a.budget_s), one, res, lambda r: [],
                            lambda out, r: R.report(out, r, a.tag), a.out, a.tag)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.base_args(ap)
    ap.add_argument("--format", default="nvfp4_w4a16", choices=sorted(CFGS))
    ap.add_argument("--lrs", default=f"{DOC_LR:g}", help="QAD learning rates (its documented one: 1e-5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=TAG)
    ap.add_argument("--no-ptq", dest="ptq", action="store_false",
                    help="skip the PTQ rows (each calibrates 512 windows; AWQ-lite searches for minutes): a QAD-only job")
    a = ap.parse_args(argv)
    a.lrs = [float(x) for x in a.lrs.split(",") if x.strip()] if a.lrs else []
    if any(not math.isfinite(x) or x <= 0 for x in a.lrs):
        ap.error(f"--lrs {a.lrs}: positive finite rates")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
