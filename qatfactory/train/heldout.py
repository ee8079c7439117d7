"""The packaged Wikipedia corpus as a run's data files, and the held-out evaluation every model of a
run is measured by (the demo and the benchmarks built on its pipeline share both, so their numbers
compare):

* ``prepare_data``: the seeded split of ``qatfactory.assets.wiki_splits`` written as calibration +
  training and held-out JSONL files (``{"text"}``), just large enough for the run, cached;
* ``HeldOut``: held-out samples with the teacher's final hidden states kept once, scored by the
  trainer's own evaluation (``train.student.evaluate``: full-vocabulary forward KL to the teacher,
  cross-entropy, perplexity, top-1 agreement);
* ``bits_per_param``: the storage side of the same comparison, from ``quantize.coverage``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from .. import assets
from ..distill.losses import LiveTeacherOut, LossConfig
from ..distill.teachers import LiveTeacher
from .student import StudentLM, evaluate


def _doc_lengths(tok, docs: List[str]) -> List[int]:
    return [len(x) for x in tok(docs, add_special_tokens=False)["input_ids"]]


def prepare_data(tok, s, cache: Path) -> Dict[str, Any]:
    """Write the calibration+training and held-out files (JSONL ``{"text"}``) from the seeded
    Wikipedia split, just large enough for the run; cached by (seed, sizes, tokenizer) under
    ``cache/demo-data``. ``s`` gives the sizes: ``seed``, ``seq_len``, ``steps``, ``micro_batch``,
    ``calib_samples``, ``eval_samples`` (a ``train.demo_recipe.Settings`` or anything with them).
    Returns the record (file paths, article counts, the packaged source's provenance, the rule)."""
    splits = assets.wiki_splits(s.seed)
    need_train = (s.steps * s.micro_batch + s.calib_samples) * s.seq_len
    need_eval = s.eval_samples * s.seq_len
    tok_id = hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest()[:12]
    key = hashlib.sha256(json.dumps([s.seed, s.seq_len, need_train, need_eval, tok_id]).encode()).hexdigest()[:16]
    d = cache / "demo-data" / key
    meta_p = d / "meta.json"
    if meta_p.exists():
        return json.loads(meta_p.read_text())

    def take(docs: List[str], need: int, slack: float) -> List[str]:
        out, n = [], 0
        for i in range(0, len(docs), 64):
            chunk = docs[i:i + 64]
            for doc, ln in zip(chunk, _doc_lengths(tok, chunk)):
                out.append(doc)
                n += ln + 1
                if n >= need * slack:
                    return out
        raise ValueError(f"demo data: the split has {n} tokens, the run needs {need}; lower --steps/--seq-len")

    # calibration articles first: the trainer calibrates on its first method.calib_samples samples;
    # long sequences can need more than the 64 calibration articles: then the calibration set
    # continues into the training articles, and training starts after the ones it took
    calib = take(splits["calib"] + splits["train"], s.calib_samples * s.seq_len, 1.05)
    borrowed = max(0, len(calib) - len(splits["calib"]))
    train = take(splits["train"][borrowed:], need_train, 1.1)
    held = take(splits["eval"], need_eval, 1.05)
    d.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train.jsonl", calib + train), ("eval.jsonl", held)):
        tmp = d / f".{name}.tmp"
        tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        os.replace(tmp, d / name)
    prov = assets.provenance("wiki")
    meta = {"train": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl"), "seed": s.seed,
            "articles": {"calib": len(calib), "train": len(train), "eval": len(held)},
            "split_sizes": {k: len(v) for k, v in splits.items()},
            "source": {k: prov.get(k) for k in ("package", "wheel", "wheel_sha256", "file_sha256", "license", "what")},
            "split_rule": f"qatfactory.assets.wiki_splits(seed={s.seed}): articles sorted by title, shuffled "
                          f"with random.Random({s.seed}); first 64 calibration, next 256 held-out, rest training"
                          + (f" ({borrowed} training articles lent to calibration)" if borrowed else "")}
    tmp = d / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_p)
    return meta



class HeldOut:
    """Held-out samples with the teacher's final hidden states kept once, so every model is
    measured by the trainer's own evaluation (train.student.evaluate) against the same
    full-vocabulary teacher distribution. It is that evaluation's teacher: ``batch`` gives the
    stored outputs of a micro-batch of ``mb`` samples."""

    has_eval = True

    def __init__(self, samples, micro_batch: int, device: str = "cpu"):
        self.samples, self.mb, self.device = samples, micro_batch, device
        self.teacher_h: List[Any] = []
        self.teacher_w = None

    def batches(self):
        n = len(self.samples)
        for i, lo in enumerate(range(0, n, self.mb)):
            yield i, self.samples.select(list(range(lo, min(lo + self.mb, n))))

    def fill_teacher(self, teacher_model, dtype) -> float:
        """Run the teacher once; returns seconds per micro-batch forward."""
        lt = LiveTeacher(teacher_model, dtype, self.device)
        t0, n = time.time(), 0
        for _, b in self.batches():
            with lt.outputs(b["input_ids"], b["attn"], b.get("position_ids")) as t:
                self.teacher_h.append(t.hidden.detach().clone())
                if self.teacher_w is None and t.weight is not None:
                    self.teacher_w = t.weight.detach().clone()
            n += 1
        if self.teacher_w is None:
            raise NotImplementedError("demo: the teacher's head is not a plain linear; the evaluation needs its "
                                      "weight")
        return (time.time() - t0) / max(n, 1)

    def batch(self, split: str, b: Dict[str, torch.Tensor], device):
        i = int(b["sample_ids"][0]) // self.mb
        return contextlib.nullcontext(LiveTeacherOut(self.teacher_h[i], self.teacher_w))

    def evaluate(self, lm) -> Dict[str, float]:
        st = StudentLM(lm, LossConfig()).train(lm.training)      # leaves lm in the mode it was in
        r = evaluate(st, self.samples, self, len(self.samples), self.mb, 0, 1, self.device)
        return {k: r[f"eval/{k}"] for k in ("tokens", "kl", "ce", "ppl", "top1")}


def bits_per_param(cov) -> Dict[str, Any]:
    """Storage bits from quantize.coverage: per quantized weight and over the whole model (tied
    embeddings counted once, norms and embeddings at their dtype)."""
    t = cov.totals
    per_fmt: Dict[str, int] = {}
    for r in cov.rows:
        if r.status == "quantized":
            per_fmt[r.format] = per_fmt.get(r.format, 0) + int(r.numel)
    return {"quantized_params": int(t["quantized_params"]), "all_params": int(t["params"]),
            "bits_quantized": float(t["bits_per_quantized_param"]), "bits_all": float(t["bits_per_param"]),
            "params_by_format": per_fmt}

