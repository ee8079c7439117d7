"""Held-out scores and greedy answers of GGUF files, computed by llama.cpp's own runtime (llama-cpp-python):
the worker process of benchmarks/accuracy/llama_cpp_arms.py.

    python benchmarks/accuracy/llama_cpp_score.py spec.json out.json

Every model of the spec (the teacher and each arm) is loaded once, side by side, with ``logits_all``: each
held-out window is run through the teacher, then through every arm, and the full-vocabulary distributions are
compared at every position (KL(teacher || arm) in float64, the arm's negative log-likelihood of the text's next
token, whether both argmaxes agree). Windows are the first ``windows`` non-overlapping runs of ``seq`` tokens of
a held-out text, tokenized by llama.cpp from the teacher GGUF (all the files share its vocabulary), no BOS added:
every arm sees the same token ids. Then, for the behaviour checks, each model answers the same chat prompts
greedily (temperature 0, top-k 1, no repetition penalty) until its end-of-generation token or ``max_tokens``.

Its own process because llama.cpp's libggml must not meet another copy of it (gguf-py's readers, libggml-python)
in one process, and because a model that crashes llama.cpp must cost its row, not the harness. Imports only the
standard library, numpy and llama_cpp.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np

CHUNK = 128     # rows of [rows, vocab] float64 at a time: SmolLM2's 49,152-wide rows are 400 KB each


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def window_scores(teacher_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> Dict[str, float]:
    """Sums over the rows (positions) of one window: KL(teacher || model) over the full vocabulary, the model's
    and the teacher's negative log-likelihood of ``targets`` (the next token at each row), top-1 agreement, and
    the row count. Rows are ``len(targets)`` (the last position has no next token and is not scored)."""
    n = len(targets)
    out = {"kl": 0.0, "nll": 0.0, "nll_teacher": 0.0, "top1": 0.0, "tokens": float(n)}
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        lt, ls = log_softmax64(teacher_logits[a:b]), log_softmax64(logits[a:b])
        out["kl"] += float((np.exp(lt) * (lt - ls)).sum())
        rows = np.arange(b - a)
        out["nll"] -= float(ls[rows, targets[a:b]].sum())
        out["nll_teacher"] -= float(lt[rows, targets[a:b]].sum())
        out["top1"] += float((lt.argmax(-1) == ls.argmax(-1)).sum())
    return out


def _load(path: str, n_ctx: int, threads: int):
    import llama_cpp.llama_cpp as C
    from llama_cpp import Llama
    defaults = C.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False   # the plain CPU backend: the AMX / repacked layouts trap on some kernels
        return p
    C.llama_model_default_params = params
    try:
        return Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                     n_threads_batch=threads, type_k=0, type_v=0, flash_attn=False, verbose=False)
    finally:
        C.llama_model_default_params = defaults


def windows_of(llm, text_path: str, seq: int, n: int) -> List[List[int]]:
    """The first ``n`` non-overlapping ``seq``-token windows of the file's text (its documents in order, one
    tokenization per document so a long file is not tokenized past what is used)."""
    toks: List[int] = []
    with open(text_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            doc = json.loads(line)["text"]
            toks += llm.tokenize((doc.strip() + "\n\n").encode("utf-8"), add_bos=False, special=False)
            if len(toks) >= seq * n:
                break
    out = [toks[i * seq:(i + 1) * seq] for i in range(min(n, len(toks) // seq))]
    if not out:
        raise ValueError(f"{text_path}: fewer than {seq} tokens")
    return out


def logits_of(llm, tokens: Sequence[int]) -> np.ndarray:
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def answer(llm, prompt: Sequence[int], max_tokens: int) -> Dict[str, Any]:
    llm.reset()
    r = llm.create_completion(prompt=list(prompt), max_tokens=max_tokens, temperature=0.0, top_k=1, top_p=1.0,
                              min_p=0.0, repeat_penalty=1.0)
    c = r["choices"][0]
    return {"text": c["text"], "tokens": int(r["usage"]["completion_tokens"]), "finish": c.get("finish_reason")}


def run(spec: Dict[str, Any]) -> Dict[str, Any]:
    seq, threads = int(spec["seq"]), int(spec.get("threads") or 1)
    gen_ctx = max((len(p) for p in spec.get("prompts", [])), default=0) + int(spec.get("max_tokens", 0)) + 8
    n_ctx = max(seq, gen_ctx, 64)
    models = {"teacher": spec["teacher"], **spec["arms"]}
    t0 = time.time()
    llms = {k: _load(p, n_ctx, threads) for k, p in models.items()}
    out: Dict[str, Any] = {"n_ctx": n_ctx, "threads": threads, "load_s": time.time() - t0, "sets": {},
                           "scores": {k: {} for k in spec["arms"]}, "seconds": {k: 0.0 for k in models}}
    for name, path in spec["heldout"].items():
        wins = windows_of(llms["teacher"], path, seq, int(spec["windows"]))
        out["sets"][name] = {"windows": len(wins), "seq": seq, "tokens_scored": len(wins) * (seq - 1),
                             "token_sha256": hashlib.sha256(np.array(wins, dtype=np.int32).tobytes()).hexdigest()}
        acc = {k: {"kl": 0.0, "nll": 0.0, "nll_teacher": 0.0, "top1": 0.0, "tokens": 0.0} for k in spec["arms"]}
        for w in wins:
            t = time.time()
            tl = logits_of(llms["teacher"], w)
            out["seconds"]["teacher"] += time.time() - t
            targets = np.array(w[1:], dtype=np.int64)
            for k in spec["arms"]:
                t = time.time()
                sl = logits_of(llms[k], w)
                out["seconds"][k] += time.time() - t
                for key, v in window_scores(tl[:-1], sl[:-1], targets).items():
                    acc[k][key] += v
        for k, a in acc.items():
            n = a["tokens"]
            out["scores"][k][name] = {"kl": a["kl"] / n, "ppl": float(np.exp(a["nll"] / n)),
                                      "ppl_teacher": float(np.exp(a["nll_teacher"] / n)), "top1": a["top1"] / n,
                                      "tokens": int(n)}
        print(f"[llama.cpp score] {name}: " + ", ".join(f"{k} KL {v[name]['kl']:.4f}"
                                                       for k, v in out["scores"].items()), flush=True)
    if spec.get("prompts"):
        out["answers"] = {}
        for k, llm in llms.items():
            t = time.time()
            out["answers"][k] = [answer(llm, p, int(spec["max_tokens"])) for p in spec["prompts"]]
            out["seconds"][k] += time.time() - t
            print(f"[llama.cpp answers] {k}: mean {np.mean([a['tokens'] for a in out['answers'][k]]):.1f} tokens",
                  flush=True)
    return out


def main(argv: List[str]) -> int:
    spec = json.load(open(argv[0]))
    res = run(spec)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
