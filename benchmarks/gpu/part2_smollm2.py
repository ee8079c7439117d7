"""Part 2 of the GPU pipeline (benchmarks/gpu/pipeline.py): SmolLM2-135M-Instruct from its
packaged GGUF (tools/gpu/staging.py reassembles it; ``qatfactory.assets.prepare_model_dir`` makes the HF
directory), the Wikipedia split written by ``qatfactory.train.heldout.prepare_data``, QAD under the deepspeed
launcher, then held-out KL to the teacher and perplexity for teacher / PTQ / QAD with the demo's
evaluation (``qatfactory.train.heldout.HeldOut``), exports and verify; optionally GSM8K (greedy).
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# staging.py (the carried GGUF parts and assets) sits with the GPU machine's other logistics in tools/gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
# isort: split
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from launches import ExportJob, run_launch
from pipeline_report import Report
from qatfactory import assets
from qatfactory import quantize as Q
from qatfactory.train.config import compose
from qatfactory.train.data import DataConfig, load_data
from qatfactory.train.demo_recipe import Settings
from qatfactory.train.heldout import HeldOut, bits_per_param, prepare_data
from staging import setup_assets, stash
from supervise import REPO, Budget, GpuMonitor, say


# ============================================================================ asset preparation
def prep_part2(a, res: Dict[str, Any]) -> None:
    """Runs in a thread while part 1 trains: assets -> local HF model dir -> data files."""
    try:
        t = time.time()
        hf_logging.disable_progress_bar()
        cache = Path(a.work) / "cache"
        if a.stash_dir and (REPO / ".gpu").is_dir():
            res["stashed"] = stash(REPO / ".gpu", Path(a.stash_dir))
        res["assets"] = setup_assets(a, cache)
        os.environ["QATFACTORY_CACHE"] = str(cache)
        t1 = time.time()
        model_dir = assets.prepare_model_dir("smollm2")
        res["model_dir"] = str(model_dir)
        res["model_dir_s"] = time.time() - t1
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        glob_batch = a.p2_micro * a.world * a.p2_accum
        # the wiki training split holds ~1M SmolLM2 tokens: when the run wants more, the files hold
        # what fits and the trainer repeats epochs (data.Order)
        steps = a.p2_steps
        while True:
            s = Settings(steps=steps, seq_len=a.p2_seq, micro_batch=glob_batch, eval_samples=a.p2_eval_samples,
                         calib_samples=a.p2_calib, seed=0)
            try:
                res["data"] = prepare_data(tok, s, cache)
                break
            except ValueError:
                if steps <= 1:
                    raise
                steps //= 2
        res["data"]["steps_covered_by_files"] = steps
        res["seconds"] = time.time() - t
        res["ok"] = True
    except Exception as e:  # reported; part 1 goes on
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"


# ============================================================================ training, evaluation, exports
def p2_overrides(a, fmt: str, prep: Dict[str, Any], run_dir: Path) -> List[str]:
    d = prep["data"]
    over = ["model=local", f"model.path={prep['model_dir']}", "model.dtype=bfloat16", f"format={fmt}", "method=qad",
            f"train={a.p2_train}", f"train.zero_stage={a.p2_zero}", "data=files", f"data.train=[{d['train']}]",
            f"data.eval=[{d['eval']}]", f"data.seq_len={a.p2_seq}", f"data.eval_samples={a.p2_eval_samples}",
            f"train.eval_samples={min(a.p2_eval_samples, 2 * a.world)}", f"train.max_steps={a.p2_steps}",
            f"train.micro_batch={a.p2_micro}", f"train.grad_accum={a.p2_accum}", f"train.lr={a.p2_lr:g}",
            f"train.grad_ckpt={'true' if a.p2_grad_ckpt else 'false'}",
            "train.schedule=constant", "train.warmup_steps=0", "train.eval_every=0", "train.save_every=0",
            "train.save_final=false", "train.save_student=true", f"train.optimizer={a.p2_optimizer}",
            "train.progress=false", "train.plots=false", "train.tensorboard=false", "train.seed=0",
            f"method.calib_samples={a.p2_calib}", f"run_dir={run_dir}"]
    over += ["train.device=cuda", "train.precision=bf16"] if a.gpu else ["train.device=cpu", f"train.precision={a.p2_cpu_precision}"]
    return over


def p2_exports(fmt: str) -> List[Tuple[str, str]]:
    # ModelOpt has no MXFP4 linear (exporters/vllm.py refuses it): MXFP4 goes to vLLM as compressed-tensors
    return [("vllm", "modelopt" if fmt.startswith("nvfp4") else "compressed-tensors"), ("llama_cpp", "gguf")]


class Part2Eval:
    """The demo's held-out evaluation (qatfactory.train.heldout.HeldOut) for teacher, PTQ and QAD students,
    in this process on the first GPU (or the CPU in the smoke run)."""

    def __init__(self, a, prep: Dict[str, Any]):
        self.a, self.prep = a, prep
        self.dev = "cuda:0" if a.gpu else "cpu"
        self.model_dir = prep["model_dir"]
        self.tok = AutoTokenizer.from_pretrained(self.model_dir)
        d = prep["data"]
        self.dcfg = DataConfig(train=[d["train"]], eval=[d["eval"]], eval_samples=a.p2_eval_samples, seq_len=a.p2_seq)
        vocab = AutoConfig.from_pretrained(self.model_dir).vocab_size
        self.train_s, eval_s = load_data(self.dcfg, self.tok, vocab, 0)
        if len(eval_s) > a.p2_eval_samples:
            eval_s = eval_s.slice(0, a.p2_eval_samples)
        self.eval_s = eval_s
        self.held = None
        self.torch = torch

    def _load(self):
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.torch.bfloat16).to(self.dev)

    def teacher(self) -> Dict[str, Any]:
        t = time.time()
        m = self._load()
        self.held = HeldOut(self.eval_s, max(1, min(4, len(self.eval_s))), self.dev)
        self.held.fill_teacher(m, self.torch.bfloat16)
        r = self.held.evaluate(m)
        r["params"] = sum(p.numel() for p in m.parameters())
        r["seconds"] = time.time() - t
        self._free(m)
        return r

    def ptq(self, fmt: str) -> Tuple[Dict[str, Any], Any]:
        """The PTQ baseline calibrated as the trainer calibrates: the recipe's QuantConfig, the first
        method.calib_samples training samples."""
        t = time.time()
        qcfg = compose([f"format={fmt}"]).quant
        m = self._load()
        Q.prepare(m, qcfg)
        calib = [self.train_s.select([i]) for i in range(min(self.a.p2_calib, len(self.train_s)))]
        Q.calibrate(m, [{"input_ids": b["input_ids"].to(self.dev), "attention_mask": b["attn"].to(self.dev)}
                        for b in calib], qcfg.calib_method)
        r = self.held.evaluate(m)
        r["bits"] = bits_per_param(Q.coverage(m).raise_if_errors())
        r["seconds"] = time.time() - t
        return r, m

    def qad(self, student_dir: Path) -> Tuple[Dict[str, Any], Any]:
        t = time.time()
        m = Q.load_student(str(student_dir)).to(self.dev)
        r = self.held.evaluate(m)
        r["seconds"] = time.time() - t
        return r, m

    def _free(self, m) -> None:
        del m
        gc.collect()
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()


def gsm8k_eval(model, tok, problems: List[dict], max_new: int, dev: str, batch: int = 50) -> Dict[str, Any]:
    """Greedy answers to GSM8K questions through the chat template; a problem counts as solved when the
    last number of the answer equals the reference after '####'."""
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    num = re.compile(r"-?\d[\d,]*\.?\d*")

    def norm(x: str) -> Optional[str]:
        x = x.replace(",", "").rstrip(".")
        try:
            v = float(x)
        except ValueError:
            return None
        return str(int(v)) if v == int(v) else str(v)

    correct, outs = 0, []
    t = time.time()
    model.eval()
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        ask = "\nSolve step by step and end with the final number."
        if getattr(tok, "chat_template", None):
            prompts = [tok.apply_chat_template([{"role": "user", "content": p["question"] + ask}], tokenize=False,
                                               add_generation_prompt=True) for p in chunk]
        else:       # a base model's tokenizer: plain question / answer text
            prompts = [f"Question: {p['question']}{ask}\nAnswer:" for p in chunk]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        for p, g in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
            text = tok.decode(g, skip_special_tokens=True)
            gold = norm(p["answer"].split("####")[-1].strip())
            found = num.findall(text)
            pred = norm(found[-1]) if found else None
            correct += int(pred is not None and pred == gold)
            outs.append(pred)
    return {"problems": len(problems), "correct": correct, "accuracy": correct / max(1, len(problems)),
            "max_new_tokens": max_new, "seconds": time.time() - t, "predictions": outs}


def part2(a, rep: "Report", budget: Budget, mon: GpuMonitor, prep: Dict[str, Any], prep_thread: threading.Thread):
    P = rep.data["part2"]
    P["status"] = "waiting for the asset preparation"
    prep_thread.join(max(1.0, budget.left()))
    P["prep"] = {k: v for k, v in prep.items() if k != "data"}
    if not prep.get("ok"):
        P["status"] = "skipped: " + prep.get("error", "asset preparation did not finish in the budget")
        say(f"part 2: {P['status']}")
        return []
    P["data"] = prep["data"]
    P.update(seq_len=a.p2_seq, steps=a.p2_steps, micro_batch_per_rank=a.p2_micro, grad_accum=a.p2_accum,
             world=a.world, lr=a.p2_lr, tokens_per_step=a.p2_micro * a.p2_accum * a.world * a.p2_seq,
             optimizer=a.p2_optimizer, train=a.p2_train, zero=a.p2_zero, grad_ckpt=bool(a.p2_grad_ckpt), formats={})
    ev = Part2Eval(a, prep)
    P["eval_tokens_target"] = len(ev.eval_s) * a.p2_seq
    jobs: List[ExportJob] = []
    keep: Dict[str, Any] = {}
    for i, fmt in enumerate(a.p2_formats):
        F = P["formats"][fmt] = {"status": "running"}
        need = a.p2_min_s if i == 0 else a.p2_min_s + a.p2_export_s
        if budget.left() < need:
            F["status"] = f"skipped: {budget.left():.0f} s left, this format needs ~{need:.0f} s"
            say(f"part 2 {fmt}: {F['status']}")
            continue
        run_dir = Path(a.work) / "p2" / f"qad-{fmt}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        proc, finish = run_launch(a, f"p2-{fmt}", p2_overrides(a, fmt, prep, run_dir), run_dir, budget, a.p2_cap,
                                  mon, block=False)
        # the launch spends its first tens of seconds importing and loading on the CPU: the
        # teacher and PTQ evaluations on GPU 0 overlap it
        try:
            if ev.held is None:
                P["teacher"] = ev.teacher()
                say(f"part 2 teacher held-out: ppl {P['teacher']['ppl']:.3f} over {P['teacher']['tokens']:.0f} tokens")
            F["ptq"], m = ev.ptq(fmt)
            say(f"part 2 {fmt} PTQ held-out: KL {F['ptq']['kl']:.4f}, ppl {F['ptq']['ppl']:.3f}")
            if i == 0 and a.gsm8k:
                keep["ptq"] = m.cpu()
            ev._free(m)
        except Exception as e:
            F["eval_error"] = f"{type(e).__name__}: {e}"
            say(f"part 2 {fmt}: evaluation failed: {F['eval_error']}")
        rep.save()
        rec = finish()
        F["train"] = rec
        student = run_dir / "student"
        if rec["rc"] != 0 or not student.is_dir():
            F["status"] = "failed: training launch"
            rep.save()
            continue
        try:
            F["qad"], m = ev.qad(student)
            say(f"part 2 {fmt} QAD held-out: KL {F.get('ptq', {}).get('kl', float('nan')):.4f} -> {F['qad']['kl']:.4f}, "
                f"ppl {F.get('ptq', {}).get('ppl', float('nan')):.3f} -> {F['qad']['ppl']:.3f}")
            if i == 0 and a.gsm8k:
                keep["qad"] = m.cpu()
            ev._free(m)
        except Exception as e:
            F["eval_error"] = f"{type(e).__name__}: {e}"
        F["status"] = "trained; exports running"
        jobs_f = [ExportJob(a, f"p2-{fmt}", student, eng, fl, run_dir / "exports", budget, prep["model_dir"])
                  for eng, fl in p2_exports(fmt)]
        F["exports"] = [j.rec for j in jobs_f]
        jobs += jobs_f
        rep.save()
    if a.gsm8k and keep:
        G = P["gsm8k"] = {}
        try:
            problems = assets.gsm8k()[:a.gsm8k]
            models = [("teacher", None), ("ptq", keep.get("ptq")), ("qad", keep.get("qad"))]
            for name, m in models:
                if budget.left() < a.gsm8k_min_s:
                    G[name] = {"status": f"skipped: {budget.left():.0f} s left"}
                    continue
                m = ev._load() if m is None else m.to(ev.dev)
                G[name] = gsm8k_eval(m, ev.tok, problems, a.gsm8k_tokens, ev.dev)
                say(f"part 2 GSM8K {name} ({a.p2_formats[0]}): {G[name]['correct']}/{G[name]['problems']}")
                ev._free(m)
                rep.save()
        except Exception as e:
            G["error"] = f"{type(e).__name__}: {e}"
    return jobs
