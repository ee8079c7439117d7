"""Q4_K_M served by llama.cpp: our PTQ and our QAD exports against llama-quantize without and with an importance
matrix, one model, one data mix, one token budget, every file scored by llama.cpp's own runtime.

    python benchmarks/accuracy/llama_cpp_arms.py --out runs/q4km --steps 96          # SmolLM2-135M-Instruct
    python benchmarks/accuracy/llama_cpp_arms.py --out runs/q4km --arms qad --qad-run runs/x/qad   # a trained run
    python benchmarks/accuracy/llama_cpp_arms.py --smoke --out /tmp/q4km              # tiny random model, CPU
    python benchmarks/accuracy/llama_cpp_arms.py --merge a.json b.json --out runs/q4km  # one table

The arms, each a GGUF file of llama.cpp's Q4_K_M tensor types (so the files have equal tensor data):

* **our PTQ**: ``qatfactory train method=ptq format=q4_k`` (calibration only: the trainer's first
  ``--calib-samples`` training windows give the scales and the importance matrix) and ``qatfactory export
  --engine llama_cpp`` of its student;
* **our QAD**: ``qatfactory train method=qad format=q4_k`` for ``--steps`` steps of ``--micro`` x ``--seq``
  tokens at ``--lr`` (cosine), the same calibration first, then the same export (``--qad-run`` takes a finished
  run of that command instead of training);
* **llama-quantize Q4_K_M** (llama.cpp tools/quantize/README.md: ``llama-quantize model-f32.gguf out.gguf
  Q4_K_M``) of the teacher GGUF;
* **llama-quantize Q4_K_M + imatrix** (llama.cpp tools/imatrix/README.md: ``llama-imatrix -m model-f32.gguf -f
  calibration.txt -o imatrix.gguf``, then ``llama-quantize --imatrix imatrix.gguf ... Q4_K_M``), the importance
  matrix made on the same calibration text as our PTQ (the trainer's calibration windows, decoded), at
  llama-imatrix's default context (512 tokens; the smoke's windows are shorter).

The teacher is the model converted to an F32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (the bf16 weights
exactly). Scores (benchmarks/accuracy/llama_cpp_score.py, in its own process): each held-out set's first
``--windows`` windows of ``--eval-seq`` tokens (llama.cpp's tokenizer; Wikipedia articles never trained on,
and *Persuasion*, out of the training novels), run through the teacher and every arm by llama-cpp-python with
``logits_all``; KL(teacher || arm) over the full vocabulary at every position, perplexity, top-1 agreement. Then
the behaviour checks of benchmarks/accuracy/behaviour.py: every model answers a fixed chat prompt set greedily in
llama.cpp; mean answer length against the teacher's and the share of answers in the asked format.

Writes ``<tag>.md`` / ``<tag>.json`` into --out (GGUFs, runs and logs under --work).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(HERE.parent / "papers"), str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import behaviour as B  # noqa: E402
import papers_common as C  # noqa: E402

TAG = "llama_cpp_arms"
HELD = ("wiki_ho", "austen_ho")
ARMS = ("ptq", "qad", "lq", "lq_imatrix")
IMATRIX_CTX = 512          # llama-imatrix's default context (common/common.h n_ctx 4096 is overridden by its tool)
SOURCES = {
    "ptq": "qatfactory train method=ptq format=q4_k + qatfactory export --engine llama_cpp",
    "qad": "qatfactory train method=qad format=q4_k + qatfactory export --engine llama_cpp",
    "lq": "llama.cpp tools/quantize/README.md: llama-quantize <f32.gguf> <out.gguf> Q4_K_M",
    "lq_imatrix": "llama.cpp tools/imatrix/README.md: llama-imatrix -m <f32.gguf> -f <calibration text>, then "
                  "llama-quantize --imatrix imatrix.gguf <f32.gguf> <out.gguf> Q4_K_M",
}
CHILD_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def preset(smoke: bool) -> Dict[str, Any]:
    if smoke:
        return dict(steps=2, micro=2, seq=64, calib_samples=4, eval_seq=128, windows=2, max_tokens=12, warmup=0,
                    imatrix_ctx=64, limits={"wiki_train": 40_000, "austen_train": 20_000, "wiki_ho": 6_000,
                                             "austen_ho": 6_000})
    return dict(steps=96, micro=2, seq=256, calib_samples=32, eval_seq=512, windows=16, max_tokens=200, warmup=4,
                imatrix_ctx=IMATRIX_CTX, limits={"wiki_train": 4_000_000, "austen_train": 4_000_000})


# ============================================================================ model
def smoke_model_dir(work: Path) -> Path:
    """A random 2-layer Llama of SmolLM2-135M's widths with SmolLM2's own tokenizer and chat template: llama.cpp's
    converter and tools need a real tokenizer, and these widths take Q4_K_M's whole type policy (q4_k, q6_k, the
    q5_0 fallback of the 576-wide rows, a q8_0 token embedding)."""
    d = work / "smoke-hf"
    if (d / "config.json").is_file():
        return d
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory import assets
    tok = assets.prepare_tokenizer_dir("smollm2")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=512, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    tmp = work / ".smoke-hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / f).is_file():
            shutil.copy(tok / f, tmp / f)
    os.replace(tmp, d)
    return d


def model_dir_of(a, work: Path) -> Path:
    """--model-path, else the smoke's random model, else the packaged SmolLM2-135M-Instruct made into a local
    directory once (what papers_common's ``prepare`` does on the offline machine)."""
    if a.model_path:
        return Path(a.model_path).resolve()
    if a.smoke:
        return smoke_model_dir(work)
    from qatfactory import assets
    return Path(assets.prepare_model_dir("smollm2"))


# ============================================================================ our arms (the CLI, as users run it)
def child_env(threads: int) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CHILD_DROP}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


def cli(args: List[str], log: Path, threads: int) -> None:
    """``qatfactory <args>`` in its own process (the trainer initialises torch.distributed); the log kept."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "qatfactory.faces.cli", *args]
    with open(log, "w") as fh:
        fh.write("$ qatfactory " + " ".join(args) + "\n")
        fh.flush()
        r = subprocess.run(cmd, cwd=str(REPO), stdout=fh, stderr=subprocess.STDOUT, env=child_env(threads))
    if r.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        raise RuntimeError(f"`qatfactory {args[0]}` exit {r.returncode} (log {log}): " + " | ".join(tail)[-800:])


def train_overrides(a, p, data, model_dir: Path, method: str, run_dir: Path) -> List[str]:
    f = data["files"]
    o = C.model_overrides(False, str(model_dir), "cpu") + [
        "format=q4_k", f"method={method}", f"method.calib_samples={p['calib_samples']}",
        "data=files", f"data.train=[{f['wiki_train']},{f['austen_train']}]", f"data.eval=[{f['wiki_ho']}]",
        f"data.seq_len={p['seq']}", "data.eval_samples=2"]
    steps = p["steps"] if method == "qad" else 1
    # the trainer's own held-out evaluation (2 windows) is a progress signal only; the smoke evaluates once
    every = steps if a.smoke else max(1, steps // 4)
    o += C.train_overrides("cpu", run_dir, a.seed, steps, a.lr, p["micro"], 1, every, True,
                           p["warmup"] if method == "qad" else 0)
    # with data.eval given the trainer reads train.eval_samples (0: every window of the held-out file, here
    # thousands), not data.eval_samples
    return [x if not x.startswith("train.eval_samples=") else "train.eval_samples=2" for x in o]


def check_qad_run(run: Path) -> Dict[str, Any]:
    """A finished ``qatfactory train method=qad format=q4_k`` run given with --qad-run: its student, and what it
    trained (read from the run's own config.yaml and metrics.jsonl)."""
    import yaml
    cfg_p, st = run / "config.yaml", run / "student"
    if not cfg_p.is_file() or not st.is_dir():
        raise SystemExit(f"--qad-run {run}: no config.yaml and student/ (a finished run with train.save_student=true)")
    cfg = yaml.safe_load(cfg_p.read_text())
    got = (cfg.get("method", {}).get("name"), cfg.get("quant", {}).get("weight_format"))
    if got != ("qad", "q4_k_m"):
        raise SystemExit(f"--qad-run {run}: method/weight_format {got}; allowed: ('qad', 'q4_k_m')")
    t = cfg.get("train", {})
    steps = [json.loads(x).get("step") for x in (run / "metrics.jsonl").read_text().splitlines()
             if x.strip() and '"loss"' in x] if (run / "metrics.jsonl").is_file() else []
    done = max([s for s in steps if s is not None], default=0)
    seq = cfg.get("data", {}).get("seq_len")
    summ = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    return {"run": str(run), "steps": done, "train_s": summ.get("time_s"), "max_steps": t.get("max_steps"),
            "lr": t.get("lr"),
            "schedule": t.get("schedule"), "micro": t.get("micro_batch"), "seq": seq,
            "tokens": done * (t.get("micro_batch") or 0) * (t.get("grad_accum") or 1) * (seq or 0),
            "train": cfg.get("data", {}).get("train"), "calib_samples": cfg.get("method", {}).get("calib_samples")}


def earlier(work: Path, method: str) -> Optional[Path]:
    """--rescore: the newest run of ``method`` an earlier call made under --work (with its export beside)."""
    runs = sorted(work.glob(f"runs-*/{method}/student"))
    return runs[-1].parent if runs and (work / "exports" / method / "model.gguf").is_file() else None


def our_arm(a, p, data, model_dir: Path, method: str, work: Path) -> Dict[str, Any]:
    t0 = time.time()
    exp = work / "exports" / method
    if a.rescore and (method != "qad" or not a.qad_run) and earlier(work, method):
        run = earlier(work, method)
        info = check_qad_run(run) if method == "qad" else {"run": str(run), "steps": 0, "tokens": 0}
        return {"gguf": str(exp / "model.gguf"), "made_s": None, "rescored": True, **info}
    if method == "qad" and a.qad_run:
        run = Path(a.qad_run).resolve()
        info = check_qad_run(run)
    else:
        run = C.runs_dir(work) / method
        over = train_overrides(a, p, data, model_dir, method, run)
        cli(["train", *over], work / "logs" / f"train-{method}.log", a.threads)
        info = check_qad_run(run) if method == "qad" else {"run": str(run), "steps": 0, "tokens": 0}
        info["command"] = "qatfactory train " + " ".join(over)
    cli(["export", "--engine", "llama_cpp", "--out", str(exp), "--force", "--source-dir", str(model_dir),
         str(run / "student")], work / "logs" / f"export-{method}.log", a.threads)
    # a run given with --qad-run was trained elsewhere: its own wall time (summary.json) is part of the making
    made = time.time() - t0 + (info.get("train_s") or 0 if method == "qad" and a.qad_run else 0)
    return {"gguf": str(exp / "model.gguf"), "made_s": made, **info}


def calibration_text(a, p, data, model_dir: Path, path: Path) -> Dict[str, Any]:
    """The text of the trainer's calibration windows (its first method.calib_samples training windows, in its
    order), decoded, for llama-imatrix: the importance matrix sees what our calibration saw."""
    from qatfactory.train.config import compose
    teacher, tok, vocab = C.load_teacher(False, str(model_dir), "cpu")
    C.free(teacher)
    cfg = compose(train_overrides(a, p, data, model_dir, "ptq", path.parent / "unused-run"))
    batches = C.calib_batches(cfg, tok, vocab, "cpu", p["calib_samples"])
    texts = [tok.decode(b["input_ids"][0].tolist()) for b in batches]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return {"windows": len(texts), "tokens": sum(int(b["input_ids"].numel()) for b in batches), "path": str(path)}


def llama_quantize_arms(teacher: Path, calib_txt: Optional[Path], want: List[str], p, work: Path,
                        threads: int, rescore: bool = False) -> Dict[str, Dict[str, Any]]:
    from qatfactory.faces import llama_tools as LT
    out: Dict[str, Dict[str, Any]] = {}
    d = work / "llama-quantize"
    d.mkdir(parents=True, exist_ok=True)
    if rescore:
        for k, f in (("lq", d / "Q4_K_M.gguf"), ("lq_imatrix", d / "Q4_K_M-imatrix.gguf")):
            if k in want and f.is_file():
                out[k] = {"gguf": str(f), "made_s": None, "rescored": True}
        want = [k for k in want if k not in out]
    if "lq" in want:
        t0 = time.time()
        f = d / "Q4_K_M.gguf"
        LT.quantize(teacher, f, "Q4_K_M", threads=threads)
        out["lq"] = {"gguf": str(f), "made_s": time.time() - t0}
    if "lq_imatrix" in want:
        t0 = time.time()
        im = LT.imatrix(teacher, calib_txt, d / "imatrix.gguf", ctx=p["imatrix_ctx"], threads=threads)
        f = d / "Q4_K_M-imatrix.gguf"
        LT.quantize(teacher, f, "Q4_K_M", imatrix=im, threads=threads)
        out["lq_imatrix"] = {"gguf": str(f), "imatrix": str(im), "imatrix_ctx": p["imatrix_ctx"],
                             "made_s": time.time() - t0}
    return out


# ============================================================================ files and scores
def file_record(path: Path) -> Dict[str, Any]:
    """Size, tensor data, tensor types and bits per weight (tensor data bits over all tensor elements; and over
    the 2-D weights only, the ones a quantization type applies to) of a GGUF, read with gguf-py."""
    import gguf
    r = gguf.GGUFReader(str(path))
    types: Dict[str, int] = {}
    n_all = b_all = n_2d = b_2d = 0
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        n, b = int(t.n_elements), int(t.n_bytes)
        n_all, b_all = n_all + n, b_all + b
        if len([x for x in t.shape if int(x) > 1]) == 2:
            n_2d, b_2d = n_2d + n, b_2d + b
    emb = {t.name: t.tensor_type.name for t in r.tensors if t.name in ("token_embd.weight", "output.weight")}
    return {"bytes": path.stat().st_size, "data_bytes": b_all, "params": n_all, "bpw": 8 * b_all / n_all,
            "bpw_2d": 8 * b_2d / n_2d if n_2d else None, "types": dict(sorted(types.items())), **emb}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 22), b""):
            h.update(blk)
    return h.hexdigest()


def chat_prompts(model_dir: Path) -> List[List[int]]:
    """behaviour.py's prompts as the model's chat template renders them (one user turn, generation prompt)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for _, text in B.all_prompts():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append([int(i) for i in ids])
    return out


def score(teacher: Path, ggufs: Dict[str, str], data, p, prompts: Optional[List[List[int]]], work: Path,
          threads: int) -> Dict[str, Any]:
    spec = {"teacher": str(teacher), "arms": ggufs, "heldout": {k: data["files"][k] for k in HELD},
            "seq": p["eval_seq"], "windows": p["windows"], "threads": threads,
            "prompts": prompts or [], "max_tokens": p["max_tokens"]}
    d = work / "score"
    d.mkdir(parents=True, exist_ok=True)
    sp, out, log = d / "spec.json", d / "scores.json", d / "score.log"
    C.write_json(sp, spec)
    with open(log, "w") as fh:
        r = subprocess.run([sys.executable, str(HERE / "llama_cpp_score.py"), str(sp), str(out)], stdout=fh,
                           stderr=subprocess.STDOUT, env=child_env(threads), cwd=str(REPO))
    if r.returncode != 0 or not out.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        raise RuntimeError(f"llama.cpp scoring exit {r.returncode}: " + " | ".join(tail)[-800:])
    return json.loads(out.read_text())


# ============================================================================ the run
def label(key: str, res: Dict[str, Any]) -> str:
    r = res["arms"].get(key, {})
    if key == "ptq":
        return "our PTQ"
    if key == "qad":
        return (f"our QAD, {r.get('steps')} steps x {r.get('micro')} x {r.get('seq')} tokens, "
                f"LR {r.get('lr')} {r.get('schedule')}") if r.get("steps") is not None else "our QAD"
    return {"lq": "llama-quantize Q4_K_M", "lq_imatrix": "llama-quantize Q4_K_M + imatrix"}[key]


def run(a) -> int:
    p = preset(a.smoke)
    for k in ("steps", "windows", "max_tokens", "calib_samples"):
        if getattr(a, k, None):
            p[k] = getattr(a, k)
    want = [x for x in a.arms.split(",") if x]
    # absolute: llama.cpp's converter runs in its own source folder
    a.out = a.out.resolve()
    work = Path(a.work or a.out / f"work-{a.tag}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = C.data_files(work, ("wiki_train", "austen_train") + HELD, p["limits"])
    model_dir = model_dir_of(a, work)
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "format": "q4_k (llama.cpp Q4_K_M)", "arms": {},
                           "provenance": C.provenance(C.model_record(a.smoke and not a.model_path, a.model_path),
                                                      data, [a.seed], "cpu"),
                           "model_dir": str(model_dir), "threads": a.threads}
    if a.smoke and not a.model_path:
        res["provenance"]["model"] = {"name": "random 2-layer Llama, SmolLM2-135M widths and tokenizer (SMOKE)",
                                      "source": "torch.manual_seed(0)"}
    from qatfactory.faces import llama_compare as LC
    from qatfactory.faces import llama_tools as LT
    res["provenance"]["versions"]["llama_cpp"] = LT.runtime().VERSION + " (llama.cpp 0c1e570)"
    t0 = time.time()
    teacher = LC.teacher_gguf(model_dir, work)
    res["teacher"] = {"gguf": str(teacher), "sha256": sha256(teacher), "made_s": time.time() - t0,
                      "how": "llama.cpp convert_hf_to_gguf.py --outtype f32", **file_record(teacher)}
    calib = None
    lq_done = a.rescore and (work / "llama-quantize" / "Q4_K_M-imatrix.gguf").is_file()
    if "lq_imatrix" in want and not lq_done:
        calib = calibration_text(a, p, data, model_dir, work / "calibration.txt")
        res["calibration_text"] = calib
    elif "lq_imatrix" in want:
        res["calibration_text"] = {"path": str(work / "calibration.txt"), "windows": p["calib_samples"],
                                   "tokens": p["calib_samples"] * p["seq"], "rescored": True}
    for key in ("ptq", "qad"):
        if key in want:
            try:
                res["arms"][key] = our_arm(a, p, data, model_dir, key, work)
            except Exception as e:  # noqa: BLE001 - the row says why; the other arms still run
                res["arms"][key] = {"error": f"{type(e).__name__}: {e}"[:600]}
            C.say(a.tag, f"{key}: {res['arms'][key].get('gguf', res['arms'][key].get('error'))}")
    try:
        res["arms"].update(llama_quantize_arms(teacher, Path(calib["path"]) if calib else None,
                                               [k for k in want if k.startswith("lq")], p, work, a.threads,
                                               a.rescore))
    except Exception as e:  # noqa: BLE001
        for k in want:
            if k.startswith("lq") and k not in res["arms"]:
                res["arms"][k] = {"error": f"{type(e).__name__}: {e}"[:600]}
    for k, r in res["arms"].items():
        r["label"], r["source"] = label(k, res), SOURCES[k]
        if "gguf" in r:
            r["file"] = file_record(Path(r["gguf"]))
    ggufs = {k: r["gguf"] for k, r in res["arms"].items() if "gguf" in r}
    if a.score_teacher_as_arm:
        ggufs["teacher_again"] = str(teacher)
    prompts = chat_prompts(model_dir) if not a.no_behaviour else None
    t = time.time()
    sc = score(teacher, ggufs, data, p, prompts, work, a.threads)
    res["scoring"] = {k: sc[k] for k in ("n_ctx", "threads", "load_s", "sets", "seconds")}
    res["scoring"]["wall_s"] = time.time() - t
    res["teacher"]["scores"] = {s: {"ppl": next(iter(sc["scores"].values()))[s]["ppl_teacher"]} for s in HELD} \
        if sc["scores"] else {}
    for k, scores in sc["scores"].items():
        row = res["arms"].setdefault(k, {"label": "teacher F32 GGUF again (self-check)", "source": "-",
                                         "file": file_record(teacher)})
        row["scores"] = scores
        if prompts:
            row["behaviour"] = B.summary(sc["answers"][k], sc["answers"]["teacher"])
            row["answers"] = sc["answers"][k]
    if prompts:
        res["teacher"]["answers"] = sc["answers"]["teacher"]
        res["teacher"]["behaviour"] = B.summary(sc["answers"]["teacher"], sc["answers"]["teacher"])
    report(a.out, res, a.tag)
    print((a.out / f"{a.tag}.md").read_text())
    bad = [k for k, r in res["arms"].items() if "error" in r or "scores" not in r]
    if bad:
        C.say(a.tag, f"failed: {bad}")
    return 1 if bad else 0


# ============================================================================ report
def _f(x, nd=4):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}g}"


HEAD = ["arm", "recipe (source)", "file MiB", "bits/weight", "WIKI KL", "WIKI ppl", "WIKI top-1", "AUS KL",
        "AUS ppl", "AUS top-1", "WIKI KL vs llama-quantize + imatrix", "answer length vs teacher",
        "format kept", "same answer as teacher", "minutes to make"]


def rows_of(res: Dict[str, Any]) -> List[List[Any]]:
    t = res["teacher"]
    tb = t.get("behaviour") or {}
    rows = [["teacher (F32 GGUF, llama.cpp converter)", t.get("how", ""), f"{t['bytes'] / 2**20:.1f}",
             _f(t["bpw"], 3), 0, _f((t.get("scores") or {}).get("wiki_ho", {}).get("ppl")), 1, 0,
             _f((t.get("scores") or {}).get("austen_ho", {}).get("ppl")), 1, "-", "1" if tb else "-",
             _f(tb.get("format_kept"), 3), "1" if tb else "-", "-"]]
    ref = (res["arms"].get("lq_imatrix", {}).get("scores") or {}).get("wiki_ho", {}).get("kl")
    order = [k for k in ARMS if k in res["arms"]] + [k for k in res["arms"] if k not in ARMS]
    for k in order:
        r = res["arms"][k]
        if "scores" not in r:
            rows.append([r.get("label", k), r.get("source", ""), r.get("error", "not scored")] + [""] * 12)
            continue
        w, au, f, b = r["scores"]["wiki_ho"], r["scores"]["austen_ho"], r.get("file", {}), r.get("behaviour") or {}
        rows.append([r["label"], r["source"], f"{f.get('bytes', 0) / 2**20:.1f}", _f(f.get("bpw"), 3),
                     _f(w["kl"]), _f(w["ppl"]), _f(w["top1"], 3), _f(au["kl"]), _f(au["ppl"]), _f(au["top1"], 3),
                     f"{w['kl'] / ref:.2f}x" if ref else "-", _f(b.get("length_ratio"), 3),
                     _f(b.get("format_kept"), 3), _f(b.get("same_answer"), 3),
                     _f(r["made_s"] / 60, 3) if r.get("made_s") is not None else "-"])
    return rows


def report(out: Path, res: Dict[str, Any], tag: str = TAG) -> None:
    p = res["preset"]
    lines = C.header("Q4_K_M served by llama.cpp: our PTQ / QAD exports vs llama-quantize (scored by llama.cpp)",
                     res)
    sets = (res.get("scoring") or {}).get("sets", {})
    ntok = ", ".join(f"{k} {v['windows']} x {v['seq']} tokens" for k, v in sets.items())
    lines += [f"llama.cpp {res['provenance']['versions'].get('llama_cpp')}, CPU, {res.get('threads')} thread(s). "
              f"Teacher: the model as an F32 GGUF by llama.cpp's converter. Every number is computed from "
              f"llama-cpp-python's logits (`logits_all`), full vocabulary, every position of each window but its "
              f"last ({ntok}); KL(teacher || arm) in nats/token. Calibration: the trainer's first "
              f"{p['calib_samples']} training windows of {p['seq']} tokens (our PTQ and QAD; llama-imatrix reads "
              f"the same text at {p['imatrix_ctx']}-token chunks).", ""]
    lines.append(C.md_table(HEAD, rows_of(res)))
    q = res["arms"].get("qad", {})
    if q.get("tokens") is not None and "error" not in q:
        lines += ["", f"QAD: {q.get('steps')} steps = {q.get('tokens') or 0:,} training tokens "
                      f"(run `{q.get('run')}`)."]
    lines += ["", "Behaviour: greedy answers in llama.cpp to the chat prompts of benchmarks/accuracy/behaviour.py "
                  f"({len(B.PROMPTS)} format prompts, {len(B.LONG)} long ones; at most {p['max_tokens']} new "
                  "tokens). Answer length = mean new tokens over all prompts, as a ratio to the teacher's; format "
                  "kept = share of the format prompts whose answer keeps the asked format (the teacher's own share "
                  "is in its row)."]
    if res.get("merged_from"):
        lines += ["", "Merged from: " + ", ".join(res["merged_from"]) + "."]
    C.write_text(out / f"{tag}.md", "\n".join(lines) + "\n")
    C.write_json(out / f"{tag}.json", res)


def merge(paths: List[Path], out: Path) -> int:
    """One table from several calls' JSONs (say the llama-quantize and PTQ arms in one call, QAD later in
    another): every JSON must have scored the same teacher file on the same held-out tokens, else the merge stops
    naming the file; an arm measured twice keeps the later file's row."""
    docs = [json.loads(Path(x).read_text()) for x in paths]
    if not docs:
        raise SystemExit("--merge: no JSON given")
    def key(d):
        return (d["teacher"]["sha256"], {k: v.get("token_sha256") for k, v in d["scoring"]["sets"].items()},
                d["preset"].get("max_tokens"))
    for x, d in zip(paths, docs):
        if key(d) != key(docs[0]):
            raise SystemExit(f"--merge: {x} scored another teacher or other held-out tokens than {paths[0]}; "
                             "not merged")
    m = dict(docs[-1])
    m["arms"] = {}
    for d in docs:
        for k, r in d["arms"].items():
            if "scores" in r or k not in m["arms"]:
                m["arms"][k] = r
    if not m["teacher"].get("behaviour"):
        m["teacher"] = next((d["teacher"] for d in docs if d["teacher"].get("behaviour")), m["teacher"])
    m["merged_from"] = [str(x) for x in paths]
    report(out, m, TAG)
    print((out / f"{TAG}.md").read_text())
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=None, help="GGUFs, runs, logs (default: <out>/work-<tag>)")
    ap.add_argument("--smoke", action="store_true", help="a random 2-layer model, a few steps (measures nothing)")
    ap.add_argument("--model-path", default=None, help="a local HF model directory (default: packaged SmolLM2)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=None, help="QAD steps (the token budget: steps x micro x seq)")
    ap.add_argument("--lr", type=float, default=1e-4, help="QAD learning rate, cosine (the NVFP4 sweep's best)")
    ap.add_argument("--calib-samples", type=int, default=None, dest="calib_samples")
    ap.add_argument("--windows", type=int, default=None, help="held-out windows per set")
    ap.add_argument("--max-tokens", type=int, default=None, dest="max_tokens", help="behaviour: new tokens cap")
    ap.add_argument("--no-behaviour", action="store_true", help="held-out scores only, no greedy answers")
    ap.add_argument("--qad-run", default=None, help="a finished `qatfactory train method=qad format=q4_k` run")
    ap.add_argument("--rescore", action="store_true",
                    help="score the GGUFs an earlier call left in --work again (no training, no quantizing)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=TAG)
    ap.add_argument("--score-teacher-as-arm", action="store_true",
                    help="also score the teacher file as an arm (a self-check: KL 0, top-1 1)")
    ap.add_argument("--merge", nargs="*", type=Path, default=None, help="merge these JSONs into one table")
    a = ap.parse_args(argv)
    if a.merge is not None:
        return merge(a.merge, a.out)
    bad = [x for x in a.arms.split(",") if x not in ARMS]
    if bad or not a.arms:
        ap.error(f"--arms {a.arms!r}: unknown {bad}; allowed: {', '.join(ARMS)}")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
