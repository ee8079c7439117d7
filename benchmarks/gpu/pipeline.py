"""One GPU pipeline for two acceptance runs, sized for ~6 minutes on 2 H200s (run.sh stage ``pipeline``).

Part 1 (issue 5): ``deepspeed --num_gpus N -m qatfactory.train`` ZeRO-3 QAD (live bf16 teacher,
nvfp4_w4a16) of a ~1.1B random Llama-shaped model (hidden 2048, 16 layers, vocab 32000, untied) on
synthetic tokens, seq 2048. Launch 1 runs all N steps and checkpoints at step k; launch 2 resumes
from that checkpoint into another run directory and finishes. The losses of steps k+1..N of the two
launches are compared (max abs difference, reported, not demanded to be zero on GPU), then the final
student is exported (vLLM ModelOpt NVFP4, llama.cpp GGUF) and ``qatfactory verify`` checks each export.

Part 2 (issue 7): SmolLM2-135M-Instruct from its packaged GGUF, carried in ``split -b`` parts
(``smollm2.gguf.part-aa`` ...) found in ``.gpu/`` and ``/tmp/qf-parts/`` (earlier calls may have
stashed some there), reassembled and checked against the sha256 of the asset's provenance record,
turned into a local HF directory by ``qatfactory.assets.prepare_model_dir``; the Wikipedia split is
written to JSONL files by ``qatfactory.demo.prepare_data``; QAD under the deepspeed launcher
(``train=gpu_1x`` with ZeRO-2 by default, ``--p2-train``/``--p2-zero``; ``model=local``, ``data=files``, seq
2048, ``method=qad``: 5e-6 constant),
then held-out KL to the teacher and perplexity for teacher / PTQ / QAD with the demo's evaluation
(``qatfactory.demo.HeldOut``), export (vLLM + GGUF) and verify; optionally GSM8K (greedy).

CPU work overlaps GPU work: the asset preparation of part 2 runs while part 1 trains, the exports
and verifications of part 1 run while part 2 trains. A time budget (``--budget``) skips what no
longer fits, and ``pipeline.json`` / ``pipeline.md`` are rewritten after every stage, so a run cut
short still reports what it measured.

    python benchmarks/gpu/pipeline.py --out $OUT --budget 340     # the GPU run (via pipeline.sh / run.sh)
    python benchmarks/gpu/pipeline.py --smoke --out /tmp/pipe     # CPU: tiny model, 2 gloo ranks, same code path

Output (``--out``): ``pipeline.json`` (every number), ``pipeline.md`` (tables), ``pipeline_launches.log``
(head and tail of each subprocess log), ``pipeline_curves.png`` (losses). Bulky files (checkpoints,
students, exports) stay in ``--work``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from supervise import NCCL_ENV, REPO, T0, Budget, GpuMonitor, du, say, stop_children
from staging import STASH_DIR, setup_assets, stash
from launches import CkptWatch, ExportJob, run_launch
from pipeline_report import Report, collect_logs, plot




class Interrupted(BaseException):
    """SIGTERM (run.sh's timeout): stop children, write the report, exit."""


def quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def prep_part2(a, res: Dict[str, Any]) -> None:
    """Runs in a thread while part 1 trains: assets -> local HF model dir -> data files."""
    try:
        t = time.time()
        quiet_transformers()
        cache = Path(a.work) / "cache"
        if a.stash_dir and (REPO / ".gpu").is_dir():
            res["stashed"] = stash(REPO / ".gpu", Path(a.stash_dir))
        res["assets"] = setup_assets(a, cache)
        os.environ["QATFACTORY_CACHE"] = str(cache)
        from qatfactory import assets, demo
        t1 = time.time()
        model_dir = assets.prepare_model_dir("smollm2")
        res["model_dir"] = str(model_dir)
        res["model_dir_s"] = time.time() - t1
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        glob_batch = a.p2_micro * a.world * a.p2_accum
        # the wiki training split holds ~1M SmolLM2 tokens: when the run wants more, the files hold
        # what fits and the trainer repeats epochs (data.Order)
        steps = a.p2_steps
        while True:
            s = demo.Settings(steps=steps, seq_len=a.p2_seq, micro_batch=glob_batch, eval_samples=a.p2_eval_samples,
                              calib_samples=a.p2_calib, seed=0)
            try:
                res["data"] = demo.prepare_data(tok, s, cache)
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


# ============================================================================ part 1
def p1_overrides(a) -> List[str]:
    if a.smoke:
        model = ["model=tiny_llama", "model.dtype=float32", "model.tiny.tie_word_embeddings=false",
                 f"model.tiny.num_hidden_layers={a.p1_layers}", "model.tiny.initializer_range=0.3"]
        prec = ["train.precision=fp32", "train.device=cpu"]
    else:
        # benchmarks/step.py's model: a random Llama, hidden 2048, 16 heads / 8 KV heads, MLP 5632, vocab 32000
        model = ["model=tiny_llama", "model.dtype=bfloat16", "model.tiny.vocab_size=32000",
                 "model.tiny.hidden_size=2048", "model.tiny.intermediate_size=5632",
                 f"model.tiny.num_hidden_layers={a.p1_layers}", "model.tiny.num_attention_heads=16",
                 "model.tiny.num_key_value_heads=8", "model.tiny.tie_word_embeddings=false"]
        prec = ["train.precision=bf16", "train.device=cuda"]
    n = a.p1_steps * a.p1_micro * a.world
    return model + prec + [
        "method=qad", "format=nvfp4_w4a16", "train=gpu_multi", "data=synthetic", f"data.synthetic={n}",
        f"data.seq_len={a.p1_seq}", "data.eval_samples=2", f"train.max_steps={a.p1_steps}",
        # keep every periodic checkpoint: the one of step k must survive for the resumed launch
        f"train.save_every={a.p1_ckpt}", "train.save_final=false", f"train.keep_last={a.p1_steps // a.p1_ckpt + 1}",
        f"train.micro_batch={a.p1_micro}", "train.grad_accum=1", f"train.optimizer={a.p1_optimizer}",
        "train.eval_every=0", "train.eval_samples=2", "train.progress=false", "train.plots=false",
        "train.tensorboard=false", "method.calib_samples=2"]


def compare_losses(first: Dict[str, float], resumed: Dict[str, float], k: int, n: int) -> Dict[str, Any]:
    steps = list(range(k + 1, n + 1))
    missing = [s for s in steps if str(s) not in first or str(s) not in resumed]
    if missing:
        return {"steps": steps, "missing_steps": missing, "max_abs_diff": None, "bit_equal": False}
    a = [first[str(s)] for s in steps]
    b = [resumed[str(s)] for s in steps]
    d = [abs(x - y) for x, y in zip(a, b)]
    return {"steps": steps, "uninterrupted": a, "resumed": b, "abs_diff": d, "max_abs_diff": max(d),
            "max_rel_diff": max(x / max(abs(y), 1e-30) for x, y in zip(d, a)), "bit_equal": a == b}


def part1(a, rep: "Report", budget: Budget, mon: GpuMonitor) -> List[ExportJob]:
    P = rep.data["part1"]
    P.update(status="running", model_layers=a.p1_layers, steps=a.p1_steps, ckpt_step=a.p1_ckpt, seq_len=a.p1_seq,
             micro_batch_per_rank=a.p1_micro, world=a.world, optimizer=a.p1_optimizer,
             tokens_per_step=a.p1_micro * a.world * a.p1_seq)
    work = Path(a.work) / "p1"
    if work.exists():
        shutil.rmtree(work)
    over = p1_overrides(a)
    run1, run2 = work / "run1", work / "run2"
    if budget.left() < a.p1_min_s:
        P["status"] = f"skipped: {budget.left():.0f} s left, part 1 needs ~{a.p1_min_s:.0f} s"
        return []
    watch = CkptWatch(run1, a.p1_ckpt)
    r1 = run_launch(a, "p1-run1", over + ["train.save_student=false", f"run_dir={run1}"], run1, budget,
                    a.p1_cap, mon, watch)
    P["run1"] = r1
    ck = run1 / "checkpoints" / f"step-{a.p1_ckpt:06d}"
    if ck.is_dir():
        mt = [f.stat().st_mtime for f in ck.rglob("*") if f.is_file()]
        # two views of the save time: the directory watch from outside (0.2 s polls) and the span of
        # the files' modification times (first file finished -> last file finished)
        P["checkpoint"] = {"step": a.p1_ckpt, "bytes": du(ck), "save_s": watch.seconds(), "path": str(ck),
                           "files": len(mt), "mtime_span_s": max(mt) - min(mt) if mt else None}
    rep.save()
    if r1["rc"] != 0 or not ck.is_dir():
        P["status"] = "failed: launch 1" + ("" if ck.is_dir() else f" (no checkpoint {ck.name})")
        return []
    if budget.left() < a.p1_min_s * 0.8:
        P["status"] = f"partial: no time left for the resumed launch ({budget.left():.0f} s)"
        return []
    r2 = run_launch(a, "p1-run2", over + ["train.save_student=true", f"run_dir={run2}", f"resume={ck}"], run2,
                    budget, a.p1_cap, mon)
    P["run2"] = r2
    P["resume"] = compare_losses(r1.get("losses", {}), r2.get("losses", {}), a.p1_ckpt, a.p1_steps)
    rs = P["resume"]
    if rs["max_abs_diff"] is not None:
        say(f"p1 resume: steps {a.p1_ckpt + 1}..{a.p1_steps}, max |loss diff| {rs['max_abs_diff']:.3g}, "
            f"bit equal: {rs['bit_equal']}")
    rep.save()
    student = run2 / "student"
    if r2["rc"] != 0 or not student.is_dir():
        P["status"] = "failed: launch 2 (resume)" + ("" if student.is_dir() else ", no student")
        return []
    P["status"] = "trained; exports running"
    jobs = [ExportJob(a, "p1", student, eng, fl, work / "exports", budget) for eng, fl in a.p1_exports]
    P["exports"] = [j.rec for j in jobs]
    return jobs


# ============================================================================ part 2
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
    """The demo's held-out evaluation (qatfactory.demo.HeldOut) for teacher, PTQ and QAD students,
    in this process on the first GPU (or the CPU in the smoke run)."""

    def __init__(self, a, prep: Dict[str, Any]):
        import torch
        from qatfactory.train.data import DataConfig, load_data
        from transformers import AutoTokenizer
        self.a, self.prep = a, prep
        self.dev = "cuda:0" if a.gpu else "cpu"
        self.model_dir = prep["model_dir"]
        self.tok = AutoTokenizer.from_pretrained(self.model_dir)
        d = prep["data"]
        self.dcfg = DataConfig(train=[d["train"]], eval=[d["eval"]], eval_samples=a.p2_eval_samples, seq_len=a.p2_seq)
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(self.model_dir).vocab_size
        self.train_s, eval_s = load_data(self.dcfg, self.tok, vocab, 0)
        if len(eval_s) > a.p2_eval_samples:
            eval_s = eval_s.slice(0, a.p2_eval_samples)
        self.eval_s = eval_s
        self.held = None
        self.torch = torch

    def _load(self):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.torch.bfloat16).to(self.dev)

    def teacher(self) -> Dict[str, Any]:
        from qatfactory import demo
        t = time.time()
        m = self._load()
        self.held = demo.HeldOut(self.eval_s, max(1, min(4, len(self.eval_s))), self.dev)
        self.held.fill_teacher(m, self.torch.bfloat16)
        r = self.held.evaluate(m)
        r["params"] = sum(p.numel() for p in m.parameters())
        r["seconds"] = time.time() - t
        self._free(m)
        return r

    def ptq(self, fmt: str) -> Tuple[Dict[str, Any], Any]:
        """The PTQ baseline calibrated as the trainer calibrates: the recipe's QuantConfig, the first
        method.calib_samples training samples."""
        from qatfactory import demo
        from qatfactory import quantize as Q
        from qatfactory.train.config import compose
        t = time.time()
        qcfg = compose([f"format={fmt}"]).quant
        m = self._load()
        Q.prepare(m, qcfg)
        calib = [self.train_s.select([i]) for i in range(min(self.a.p2_calib, len(self.train_s)))]
        Q.calibrate(m, [{"input_ids": b["input_ids"].to(self.dev), "attention_mask": b["attn"].to(self.dev)}
                        for b in calib], qcfg.calib_method)
        r = self.held.evaluate(m)
        r["bits"] = demo.bits_per_param(Q.coverage(m).raise_if_errors())
        r["seconds"] = time.time() - t
        return r, m

    def qad(self, student_dir: Path) -> Tuple[Dict[str, Any], Any]:
        from qatfactory import quantize as Q
        t = time.time()
        m = Q.load_student(str(student_dir)).to(self.dev)
        r = self.held.evaluate(m)
        r["seconds"] = time.time() - t
        return r, m

    def _free(self, m) -> None:
        del m
        import gc
        gc.collect()
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()


def gsm8k_eval(model, tok, problems: List[dict], max_new: int, dev: str, batch: int = 50) -> Dict[str, Any]:
    """Greedy answers to GSM8K questions through the chat template; a problem counts as solved when the
    last number of the answer equals the reference after '####'."""
    import re
    import torch
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
            from qatfactory import assets
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


# ============================================================================ main
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or f"runs/gpu-pipeline-{time.strftime('%Y%m%d-%H%M%S')}",
                   help="summary files (default: $OUT)")
    p.add_argument("--work", default=None, help="checkpoints, students, exports, logs (default: /tmp/qf-pipeline, "
                                                "smoke: <out>/work)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, 2 gloo ranks, a few steps, same code path")
    p.add_argument("--parts", default="1,2", help="which parts to run: 1, 2 or 1,2")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 340; smoke 900)")
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs) per launch")
    p.add_argument("--asset-dirs", default=f"{REPO / '.gpu'}:{STASH_DIR}",
                   help="where the GGUF parts and .../assets/<name>/ files are looked for (':'-separated)")
    p.add_argument("--stash-dir", default=None, help=f"copy .gpu/ parts and assets here (GPU default: {STASH_DIR})")
    g = p.add_argument_group("part 1")
    g.add_argument("--p1-layers", type=int, default=None, help="default 16 (smoke 2)")
    g.add_argument("--p1-steps", type=int, default=None, help="default 12 (smoke 4)")
    g.add_argument("--p1-ckpt", type=int, default=None, help="checkpoint step k < steps; default 6 (smoke 2)")
    g.add_argument("--p1-seq", type=int, default=None, help="default 2048 (smoke 32)")
    g.add_argument("--p1-micro", type=int, default=None, help="micro-batch per rank; default 2 (smoke 1)")
    g.add_argument("--p1-optimizer", default="adamw_torch", choices=("adamw_torch", "adamw_fused"),
                   help="adamw_fused JIT-builds DeepSpeed's FusedAdam first (~1 min on a fresh machine)")
    g.add_argument("--p1-cap", type=float, default=None, help="seconds per launch at most (default 180)")
    g = p.add_argument_group("part 2")
    g.add_argument("--p2-formats", default=None, help="default nvfp4_w4a16,mxfp4_w4a4 (the second one only if "
                                                      "time allows; smoke: nvfp4_w4a16)")
    g.add_argument("--p2-steps", type=int, default=None, help="default 60 (smoke 2)")
    g.add_argument("--p2-seq", type=int, default=None, help="default 2048 (smoke 64)")
    g.add_argument("--p2-micro", type=int, default=None, help="micro-batch per rank; default 4 (smoke 1)")
    g.add_argument("--p2-accum", type=int, default=None,
                   help="gradient accumulation; default 1 (smoke 1): a 135M model is host-bound, so every extra "
                        "micro-step costs a whole forward/backward of kernel launches")
    g.add_argument("--p2-grad-ckpt", type=int, default=0, choices=(0, 1),
                   help="activation checkpointing (gpu_1x turns it on; off by default here: the 135M model needs "
                        "~10 GiB without it, and recomputing costs 1.6x per step on the H200)")
    g.add_argument("--p2-lr", type=float, default=5e-6, help="constant (method=qad's 5e-6)")
    g.add_argument("--p2-eval-samples", type=int, default=None, help="held-out samples; default 10 (smoke 2)")
    g.add_argument("--p2-calib", type=int, default=None, help="calibration samples; default 8 (smoke 2)")
    g.add_argument("--p2-optimizer", default="adamw_torch", choices=("adamw_torch", "adamw_fused"))
    g.add_argument("--p2-train", default="gpu_1x",
                   help="train recipe of the SmolLM2 run (default gpu_1x: ZeRO-3's per-module gathers made a 135M "
                        "model take 3.1 s per 16K-token step on 2 H200s with gpu_multi)")
    g.add_argument("--p2-zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage of the SmolLM2 run")
    g.add_argument("--p2-cap", type=float, default=None, help="seconds per training launch at most (default 150)")
    g.add_argument("--gsm8k", type=int, default=None, help="GSM8K problems for teacher/PTQ/QAD (0: off); default 50 "
                                                          "when time is left (smoke 2)")
    g.add_argument("--gsm8k-tokens", type=int, default=None, help="new tokens per answer; default 256 (smoke 4)")
    a = p.parse_args(list(argv))
    smoke = a.smoke
    dflt = dict(budget=(900.0, 340.0), p1_layers=(2, 16), p1_steps=(4, 12), p1_ckpt=(2, 6), p1_seq=(32, 2048),
                p1_micro=(1, 2), p1_cap=(300.0, 180.0), p2_formats=("nvfp4_w4a16", "nvfp4_w4a16,mxfp4_w4a4"),
                p2_steps=(2, 60), p2_seq=(64, 2048), p2_micro=(1, 4), p2_accum=(1, 1), p2_eval_samples=(2, 10),
                p2_calib=(2, 8), p2_cap=(300.0, 150.0), gsm8k=(2, 50), gsm8k_tokens=(4, 256))
    for k, (s, g_) in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, s if smoke else g_)
    a.p2_formats = [f.strip() for f in a.p2_formats.split(",") if f.strip()]
    a.parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    a.asset_dirs = [Path(x) for x in a.asset_dirs.split(":") if x]
    if a.stash_dir is None and not smoke:
        a.stash_dir = str(STASH_DIR)
    if a.work is None:
        a.work = str(Path(a.out) / "work") if smoke else "/tmp/qf-pipeline"
    a.work = str(Path(a.work).resolve())
    a.out = str(Path(a.out).resolve())
    a.p1_exports = [("vllm", "modelopt"), ("llama_cpp", "gguf")]
    # smallest remaining time worth starting a stage with
    a.p1_min_s = 20.0 if smoke else 90.0
    a.p2_min_s = 20.0 if smoke else 75.0
    a.p2_export_s = 10.0 if smoke else 35.0     # a later format's exports + verify must fit too
    a.gsm8k_min_s = 5.0 if smoke else 25.0
    a.p2_cpu_precision = "bf16"
    return a


def check_args(a) -> None:
    import torch
    bad = sorted(a.parts - {"1", "2"})
    if bad or not a.parts:
        raise ValueError(f"--parts={','.join(sorted(a.parts))!r}; allowed: 1, 2 or 1,2")
    for k in ("p1_layers", "p1_steps", "p1_ckpt", "p1_seq", "p1_micro", "p2_steps", "p2_seq", "p2_micro", "p2_accum",
              "p2_eval_samples", "p2_calib", "world"):
        if int(getattr(a, k)) < 1:
            raise ValueError(f"--{k.replace('_', '-')}={getattr(a, k)!r}; allowed: an int >= 1")
    if not a.p1_ckpt < a.p1_steps:
        raise ValueError(f"--p1-ckpt={a.p1_ckpt} must be below --p1-steps={a.p1_steps} (the resumed launch needs "
                         f"steps left to compare)")
    if a.gsm8k < 0 or a.gsm8k_tokens < 1:
        raise ValueError(f"--gsm8k={a.gsm8k}, --gsm8k-tokens={a.gsm8k_tokens}; allowed: >= 0 and >= 1")
    if not a.p2_lr > 0 or not a.budget > 0:
        raise ValueError(f"--p2-lr={a.p2_lr}, --budget={a.budget}; allowed: numbers > 0")
    from qatfactory.train.config import recipes_dir
    known = {p.stem for p in (recipes_dir() / "format").glob("*.yaml")}
    unknown = [f for f in a.p2_formats if f not in known or f == "bf16"]
    if unknown or not a.p2_formats:
        raise ValueError(f"--p2-formats: unknown {unknown}; allowed: {sorted(known - {'bf16'})}")
    a.gpu = not a.smoke
    if a.gpu:
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible; the CPU check of this script is --smoke")
        if torch.cuda.device_count() < a.world:
            raise ValueError(f"--world={a.world} but {torch.cuda.device_count()} GPU(s) are visible")


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(a)
    except ValueError as e:
        print(f"pipeline: {e}", file=sys.stderr)
        return 2
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Path(a.work).mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget)
    rep = Report(a)
    say(f"{'SMOKE (CPU) ' if a.smoke else ''}pipeline: parts {sorted(a.parts)}, budget {a.budget:.0f} s, "
        f"out {a.out}, work {a.work}")
    rep.save()

    def on_term(signum, frame):
        raise Interrupted()
    signal.signal(signal.SIGTERM, on_term)

    mon = GpuMonitor(a.gpu)
    jobs: List[ExportJob] = []
    prep: Dict[str, Any] = {}
    prep_thread = threading.Thread(target=prep_part2, args=(a, prep), daemon=True)
    rc = 0
    try:
        if "2" in a.parts:
            prep_thread.start()          # CPU work, while part 1 keeps the GPUs busy
        if "1" in a.parts:
            jobs += part1(a, rep, budget, mon)
            rep.save()
        if "2" in a.parts:
            jobs += part2(a, rep, budget, mon, prep, prep_thread)
            rep.save()
            if rep.data["part2"]["status"] in ("waiting for the asset preparation",):
                rep.data["part2"]["status"] = "done"
        for j in jobs:
            j.join(budget.left())
            rep.save()
    except Interrupted:
        say("SIGTERM: stopping children, writing the report")
        rep.data["interrupted"] = "SIGTERM (time limit)"
        rc = 124
    except Exception as e:
        import traceback
        rep.data["crash"] = traceback.format_exc()[-4000:]
        say(f"pipeline crashed: {type(e).__name__}: {e}")
        rc = 1
    finally:
        stop_children()
        mon.close()
        finalize_status(rep.data)
        try:
            plot(rep.data, Path(a.out))
        except Exception as e:      # a plot never hides the numbers
            say(f"plot failed: {e}")
        collect_logs(Path(a.work), Path(a.out))
        rep.save(final=True)
    say(f"done in {time.time() - T0:.0f} s: {a.out}/pipeline.md")
    ok = rep.data.get("verdict", {}).get("ok", False)
    return rc or (0 if ok else 1)


def finalize_status(d: Dict[str, Any]) -> None:
    """One verdict: every stage that ran succeeded (launches rc 0, every export written and verified
    PASS); stages skipped for lack of time are listed, not failed."""
    problems, skipped = [], []
    P = d["part1"]
    if P.get("status", "").startswith("skipped") or P.get("status") == "not run":
        skipped.append(f"part 1: {P.get('status')}")
    else:
        for k in ("run1", "run2"):
            if k in P and P[k]["rc"] != 0:
                problems.append(f"part 1 {k}: rc {P[k]['rc']}")
        if P.get("status", "").startswith(("failed", "partial")):
            problems.append(f"part 1: {P['status']}")
        bad = [e for e in P.get("exports") or [] if e["status"] != "PASS"]
        problems += [f"part 1 export {e['engine']}/{e['flavour']}: {e['status']}" for e in bad]
        if "exports" in P:
            P["status"] = "done" if not bad else "exports with problems"
    Q = d["part2"]
    if Q.get("status", "").startswith("skipped") or Q.get("status") == "not run":
        skipped.append(f"part 2: {Q.get('status')}")
    for fmt, F in (Q.get("formats") or {}).items():
        if F["status"].startswith("skipped"):
            skipped.append(f"part 2 {fmt}: {F['status']}")
            continue
        if F["status"].startswith("failed") or F.get("eval_error"):
            problems.append(f"part 2 {fmt}: {F['status']} {F.get('eval_error', '')}".strip())
        for e in F.get("exports") or []:
            if e["status"] != "PASS":
                problems.append(f"part 2 {fmt} export {e['engine']}/{e['flavour']}: {e['status']}")
        if F["status"].startswith("trained"):
            F["status"] = "done"
    if Q.get("formats") and Q.get("status") not in (None,) and not Q["status"].startswith("skipped"):
        Q["status"] = "done" if not any(p.startswith("part 2") for p in problems) else "with failures"
    if d.get("interrupted"):
        problems.append(d["interrupted"])
    if d.get("crash"):
        problems.append("crash: " + d["crash"].strip().splitlines()[-1])
    d["verdict"] = {"ok": not problems, "problems": problems, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())
