"""``qatfactory eval <student | model dir | GGUF export> tasks=... [key=value ...]``: lm-evaluation-harness
(``lm-eval``) on what was trained, or on what the engine runs, with data from local files only.

* a **student** (``save_student``: the fake-quant model, bit for bit what the export serves) or any local HF
  model directory (the teacher, a ``format=bf16`` run's student): wrapped as lm-eval's own ``HFLM`` (its
  loglikelihood, loglikelihood_rolling and generate_until);
* a **GGUF export** (a directory holding ``model.gguf``, or the file): :class:`LlamaCppLM`, llama.cpp's
  runtime (llama-cpp-python) in a child process (its libggml must not meet libggml-python's), scoring token
  ids that the HF tokenizer made, so both backends see the same tokens.

Tasks (``qatfactory/faces/eval_tasks``, lm-eval YAML; ``tasks=list`` prints them): ``qf_gsm8k`` (the packaged GSM8K
test split, lm-eval's ``gsm8k`` prompt, filters and scoring, zero-shot), ``qf_wiki_ppl`` (rolling word / byte
perplexity and bits per byte on the 256 held-out Wikipedia articles of ``assets.wiki_splits(0)``),
``qf_persuasion_ppl`` (the same on *Persuasion*, chapter by chapter) run offline from the packages;
``qf_arc_easy``, ``qf_arc_challenge``, ``qf_hellaswag`` read **your** copy of those sets
(``data_files=PATH`` or ``data_files=task:PATH,task:PATH``; JSONL / JSON / parquet in the Hugging Face
layout). ``include=DIR`` adds your own task YAMLs (lm-eval imports the Python modules their ``!function`` tags
name from that folder: code runs; a YAML may not reuse a built-in ``qf_*`` task name); lm-eval's built-in tasks (hub datasets) need ``hub=true``.

Options: ``limit=N``, ``num_fewshot=K``, ``batch_size=N``, ``max_length=N`` (tokens per forward / rolling
window; default the model's context, at most 2048), ``max_gen_toks=N``, ``device=cpu|cuda``,
``tokenizer=DIR`` (default: the tokenizer files beside the model), ``dtype=float32|bfloat16``,
``out=DIR`` (a new directory; default ``runs/eval-<name>-<time>``), ``log_samples=true``.
Writes ``results.json`` (lm-eval's results, the per-sample outputs when asked, provenance) and
``results.md``; the input directory is only read.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:   # the eval extra is optional: the one line the command prints names it
    raise ImportError(f"lm-eval is not installed ({e}); pip install 'qatfactory[eval]'") from None
from tqdm import tqdm

from .. import _fsutil, _quiet, assets
from .. import exitcodes as X
from ..assets import sha256_file
from ..exitcodes import BadInputError, UsageError

TASK_DIR = Path(__file__).resolve().parent / "eval_tasks"
OFFLINE_TASKS = ("qf_gsm8k", "qf_wiki_ppl", "qf_persuasion_ppl")
USER_DATA_TASKS = ("qf_arc_easy", "qf_arc_challenge", "qf_hellaswag")
OPTIONS = ("tasks", "limit", "num_fewshot", "batch_size", "max_length", "max_gen_toks", "device", "tokenizer",
           "dtype", "out", "include", "hub", "data_files", "log_samples")
GGUF_NAME = "model.gguf"


def _offline_env() -> None:
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse(argv: List[str]) -> Tuple[Path, Dict[str, str]]:
    if not argv or argv[0].startswith("-"):
        raise UsageError("usage: qatfactory eval <student dir | model dir | GGUF export> tasks=t1,t2 [limit=N] ...")
    target, opts = Path(argv[0]), {}
    for a in argv[1:]:
        if "=" not in a:
            raise UsageError(f"qatfactory eval: {a!r} is not key=value; allowed keys: {list(OPTIONS)}")
        k, v = a.split("=", 1)
        if k not in OPTIONS:
            raise UsageError(f"qatfactory eval: unknown option {k!r}; allowed: {list(OPTIONS)}")
        opts[k] = v
    if "tasks" not in opts:
        raise UsageError(f"qatfactory eval: tasks= is required; offline: {list(OFFLINE_TASKS)}, with your data "
                         f"(data_files=): {list(USER_DATA_TASKS)}")
    return target, opts


def _int(opts, k, default=None, lo=1):
    if k not in opts:
        return default
    try:
        v = int(opts[k])
    except ValueError:
        raise UsageError(f"qatfactory eval: {k}={opts[k]!r}; allowed: an integer >= {lo}") from None
    if v < lo:
        raise UsageError(f"qatfactory eval: {k}={v}; allowed: an integer >= {lo}")
    return v


def _bool(opts, k) -> bool:
    v = opts.get(k, "false").lower()
    if v not in ("true", "false", "1", "0"):
        raise UsageError(f"qatfactory eval: {k}={opts[k]!r}; allowed: true or false")
    return v in ("true", "1")


def data_files_map(opts: Dict[str, str], tasks: List[str]) -> Dict[str, str]:
    """data_files=PATH (one user-data task) or task:PATH,task:PATH -> {task: PATH}; every path must exist."""
    raw = opts.get("data_files")
    if not raw:
        return {}
    out: Dict[str, str] = {}
    users = [t for t in tasks if t in USER_DATA_TASKS]
    for item in raw.split(","):
        task, sep, path = item.partition(":")
        if not sep or "/" in task or task not in USER_DATA_TASKS:
            if len(users) != 1 or out:
                raise UsageError(f"qatfactory eval: data_files={raw!r}: with {len(users)} tasks that read your data, "
                                 f"write data_files=task:PATH,task:PATH (tasks: {list(USER_DATA_TASKS)})")
            task, path = users[0], item
        out[task] = path
    extra = [t for t in out if t not in tasks]
    if extra:
        raise UsageError(f"qatfactory eval: data_files names {extra[0]}, a task not asked for; tasks asked: {tasks} "
                         f"(add it to tasks= or drop its data_files entry)")
    for task, path in out.items():
        if not Path(path).is_file():
            raise BadInputError(f"qatfactory eval: data_files for {task}: {path} is not a file")
        check_data_file(task, Path(path))
    return out


# the columns each user-data task reads (the Hugging Face layout of its set) and what each must hold
_STR, _LIST, _LABEL = "a string", "a list of strings", "a string or an int"
DATA_FIELDS = {
    "qf_arc_easy": {"question": _STR, "choices": "an object {text: [...], label: [...]}", "answerKey": _STR},
    "qf_arc_challenge": {"question": _STR, "choices": "an object {text: [...], label: [...]}", "answerKey": _STR},
    "qf_hellaswag": {"activity_label": _STR, "ctx_a": _STR, "ctx_b": _STR, "endings": _LIST, "label": _LABEL},
}


def _field_ok(kind: str, v) -> bool:
    if kind == _STR:
        return isinstance(v, str)
    if kind == _LIST:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if kind == _LABEL:
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v.strip().isdigit())
    return isinstance(v, dict) and all(isinstance(v.get(k), list) for k in ("text", "label")) \
        and len(v["text"]) == len(v["label"]) and len(v["text"]) > 0


def check_data_file(task: str, p: Path) -> None:
    """Every record of a user's data file holds the fields the task reads, with their types, so a malformed
    file ends here with one line (file, record, field, what is allowed) instead of inside lm-eval."""
    need = DATA_FIELDS.get(task, {})
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # noqa: PLC0415 (optional: pyarrow, a datasets requirement)
            cols = set(pq.read_schema(str(p)).names)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file are many
            raise BadInputError(f"qatfactory eval: {p}: not a readable parquet file ({type(e).__name__})") from None
        gone = sorted(set(need) - cols)
        if gone:
            raise BadInputError(f"qatfactory eval: {p}: no column {gone[0]!r}; {task} reads {sorted(need)}")
        return
    if p.suffix not in (".jsonl", ".json"):
        raise BadInputError(f"qatfactory eval: {p}: allowed file types for data_files: .jsonl, .json, .parquet")
    from .._inputs import loads  # noqa: PLC0415 (CLI start)
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix == ".json" and text.lstrip().startswith("["):
        doc = loads(text, str(p))
        recs = [(f"{p} record {i}", r) for i, r in enumerate(doc)]
    else:
        recs = [(f"{p}:{i + 1}", loads(line, f"{p}:{i + 1}")) for i, line in enumerate(text.splitlines())
                if line.strip()]
    if not recs:
        raise BadInputError(f"qatfactory eval: {p}: no records; {task} reads one JSON object per line")
    for where, r in recs:
        if not isinstance(r, dict):
            raise BadInputError(f"qatfactory eval: {where}: a JSON {type(r).__name__}; allowed: an object with "
                                f"{sorted(need)}")
        for k, kind in need.items():
            if not _field_ok(kind, r.get(k)):
                raise BadInputError(f"qatfactory eval: {where}: field {k!r} = {str(r.get(k, '(missing)'))[:40]!r}; "
                                    f"allowed: {kind}")
        if "answerKey" in need and r["answerKey"] not in r["choices"]["label"]:
            raise BadInputError(f"qatfactory eval: {where}: answerKey {r['answerKey']!r}; allowed: one of its "
                                f"choices.label {r['choices']['label']}")


# ----------------------------------------------------------------------------- what is evaluated
def kind_of(target: Path) -> str:
    if target.is_file() and target.suffix == ".gguf":
        return "gguf"
    if not target.is_dir():
        raise BadInputError(f"qatfactory eval: {target} is neither a directory nor a .gguf file")
    if (target / GGUF_NAME).is_file():
        return "gguf"
    if (target / "qatfactory_quant.json").is_file():
        from ..quantize.io import read_record  # noqa: PLC0415 (CLI start)
        return "plain" if read_record(str(target)).get("plain") else "student"
    if (target / "hf_quant_config.json").is_file() or (target / "qatfactory.json").is_file():
        raise BadInputError(f"qatfactory eval: {target} is a vLLM / SGLang export; evaluate the student it was made "
                            f"from (the export is bit-identical to it, `qatfactory verify` proves it), or serve it "
                            f"with vLLM and use lm-eval's vllm backend")
    if (target / "config.json").is_file():
        return "plain"
    raise BadInputError(f"qatfactory eval: {target} holds no student (qatfactory_quant.json), no HF model "
                        f"(config.json) and no {GGUF_NAME}")


def load_tokenizer(target: Path, opts: Dict[str, str]):
    from transformers import AutoTokenizer  # noqa: PLC0415 (heavy: transformers)
    cand = Path(opts["tokenizer"]) if "tokenizer" in opts else (target if target.is_dir() else target.parent)
    if "tokenizer" not in opts and (cand / "qatfactory_quant.json").is_file() and not (
            (cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file()):
        # a student without tokenizer files: the model folder its record names, while it still is that model
        from ..quantize.io import recorded_source  # noqa: PLC0415 (heavy: quantize loads torch)
        src, why = recorded_source(str(cand))
        if why:
            print(f"note: {why}", file=sys.stderr)
        cand = Path(src) if src else cand
    if not ((cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file()):
        raise BadInputError(f"qatfactory eval: no tokenizer in {cand}; give tokenizer=DIR (the model directory the "
                            f"student was trained from)")
    return AutoTokenizer.from_pretrained(str(cand))      # never trust_remote_code


def prefix_id(tok) -> int:
    """The token every rolling window / empty context starts from: BOS, else EOS (the same for both backends)."""
    t = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if t is None:
        raise BadInputError("qatfactory eval: the tokenizer has neither a BOS nor an EOS token")
    return int(t)


def build_lm(target: Path, kind: str, tok, opts: Dict[str, str]):
    import torch  # noqa: PLC0415 (CLI start)
    device = opts.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "gguf":
        path = target if target.is_file() else target / GGUF_NAME
        return LlamaCppLM(str(path), tok, max_length=_int(opts, "max_length", 2048),
                          max_gen_toks=_int(opts, "max_gen_toks", 256)), {"backend": "llama.cpp", "gguf": str(path)}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    dt = opts.get("dtype", "float32" if device == "cpu" else "bfloat16")
    if dt not in dtypes:
        raise UsageError(f"qatfactory eval: dtype={dt!r}; allowed: {list(dtypes)}")
    if kind == "student":
        from ..quantize import load_student  # noqa: PLC0415 (CLI start)
        model = load_student(str(target), dtype=dtypes[dt])
    else:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)

        from .._inputs import check_model_config  # noqa: PLC0415 (CLI start)
        check_model_config(target)      # config.json with limits and against the weights, before it is built
        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtypes[dt])
    model.to(device).eval()
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415 (heavy: HFLM loads torch, transformers, accelerate)
    ctx = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=_int(opts, "batch_size", 1),
              max_length=_int(opts, "max_length", min(ctx, 2048)), prefix_token_id=prefix_id(tok),
              max_gen_toks=_int(opts, "max_gen_toks", 256))
    return lm, {"backend": "lm-eval HFLM on the " + ("fake-quant student" if kind == "student" else "HF model"),
                "dtype": dt, "device": device}


# ----------------------------------------------------------------------------- llama.cpp
_WORKER = r"""
import json, os, sys
import numpy as np
try:
    from llama_cpp import Llama
except ImportError as e:
    print(json.dumps({"error": f"llama_cpp is not importable ({e}); pip install llama-cpp-python or run "
                               f"`python scripts/llama_cpp_runtime.py ensure`"}), flush=True)
    sys.exit(3)
import llama_cpp.llama_cpp as C
path, n_ctx = sys.argv[1], int(sys.argv[2])
_defaults = C.llama_model_default_params
def _params():
    p = _defaults()
    p.use_extra_bufts = False      # the plain CPU backend, as the parity gate runs llama.cpp
    return p
C.llama_model_default_params = _params
llm = Llama(model_path=path, logits_all=True, n_ctx=n_ctx, n_batch=min(512, n_ctx), verbose=False, type_k=0,
            type_v=0, flash_attn=False, n_threads=max(1, min(8, os.cpu_count() or 1)))
print(json.dumps({"ready": True, "n_vocab": llm.n_vocab(), "n_ctx": llm.n_ctx()}), flush=True)

def logsm(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))

for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "loglik":
        toks, n = req["tokens"], req["n_cont"]
        llm.reset()
        llm.eval(toks)
        rows = logsm(np.asarray(llm.scores[len(toks) - n - 1:len(toks) - 1]))
        tgt = np.asarray(toks[len(toks) - n:])
        lp = float(rows[np.arange(n), tgt].sum())
        print(json.dumps({"logprob": lp, "greedy": bool((rows.argmax(-1) == tgt).all())}), flush=True)
    elif req["op"] == "generate":
        llm.reset()
        llm.eval(req["tokens"])
        out = []
        for _ in range(req["max_new"]):
            nxt = int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax())
            out.append(nxt)
            if nxt in req["stop_ids"] or llm.n_tokens >= llm.n_ctx():
                break
            llm.eval([nxt])
        print(json.dumps({"ids": out}), flush=True)
"""


class LlamaCppLM(TemplateLM):
    """lm-eval's LM interface on llama.cpp's runtime. Tokens come from the HF tokenizer; llama.cpp computes the
    logits (greedy decoding for generate_until, log-softmax in float64). Each request is one llama.cpp eval
    of at most ``max_length`` tokens (longer inputs keep their last max_length tokens, as HFLM does).
    llama.cpp runs as the parity gate runs it: the plain CPU backend (no repacked weight layouts) with an F32
    KV cache; llama-cli's defaults (F16 KV cache, repacked weights) differ from it in the last digits."""

    def __init__(self, gguf: str, tokenizer, max_length: int = 2048, max_gen_toks: int = 256):
        super().__init__()
        self.tokenizer, self.max_length, self.max_gen_toks = tokenizer, int(max_length), int(max_gen_toks)
        self._prefix = prefix_id(tokenizer)
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, gguf, str(self.max_length + self.max_gen_toks)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hello = self._read()
        if "error" in hello:
            raise BadInputError(f"qatfactory eval: {hello['error']}")
        if hello.get("n_vocab") is not None and hello["n_vocab"] < len(tokenizer):
            raise BadInputError(f"qatfactory eval: {gguf} has {hello['n_vocab']} tokens, the tokenizer {len(tokenizer)}; "
                                f"give the tokenizer the model was exported with (tokenizer=DIR)")

    def _read(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            err = (self.proc.stderr.read() or "").strip().splitlines()[-3:]
            raise RuntimeError(f"llama.cpp worker stopped (exit {self.proc.poll()}): {' | '.join(err)}")
        return json.loads(line)

    def _ask(self, req: Dict[str, Any]) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self._prefix)

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kw) -> List[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        out = []
        for _, ctx, cont in tqdm(requests, disable=disable_tqdm, desc="llama.cpp loglikelihood"):
            # the last max_length + 1 tokens: max_length inputs predicting the continuation (as HFLM cuts them)
            toks = (ctx + cont)[-(self.max_length + 1):]
            r = self._ask({"op": "loglik", "tokens": toks, "n_cont": min(len(cont), len(toks) - 1)})
            out.append((r["logprob"], r["greedy"]))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        res = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self._prefix, max_seq_len=self.max_length,
                context_len=1)]
            res.append(sum(lp for lp, _ in self._loglikelihood_tokens([(None, c, x) for c, x in windows],
                                                                        disable_tqdm=True)))
        return res

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="llama.cpp generate"):
            ctx, kw = req.args
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos = self.tokenizer.decode([self.eot_token_id])
            if eos not in until:
                until.append(eos)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(ctx)[-(self.max_length):]
            r = self._ask({"op": "generate", "tokens": ids, "max_new": max_new, "stop_ids": [self.eot_token_id]})
            text = self.tokenizer.decode(r["ids"], skip_special_tokens=False)
            for s in until:
                if s and s in text:
                    text = text.split(s)[0]
            out.append(text)
        return out


# ----------------------------------------------------------------------------- the command
def task_names(include: List[str], hub: bool) -> List[str]:
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 (heavy: lm_eval.tasks loads datasets)
    tm = TaskManager(include_path=[str(TASK_DIR)] + include, include_defaults=hub)
    return sorted(tm.all_tasks)


def _yaml_tasks(f: Path) -> List[str]:
    """The task names a task YAML declares (``task:``, a list under it), its ``!function`` tags left unread."""
    import yaml  # noqa: PLC0415 (CLI start)

    class _Loader(yaml.SafeLoader):
        pass
    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        doc = yaml.load(f.read_text(encoding="utf-8", errors="replace"), Loader=_Loader)
    except yaml.YAMLError as e:
        raise BadInputError(f"qatfactory eval: include: {f} is not valid YAML ({str(e).splitlines()[0]})") from None
    t = doc.get("task") if isinstance(doc, dict) else None
    return [x for x in (t if isinstance(t, list) else [t]) if isinstance(x, str)]


def check_include(d: Path) -> None:
    """A task YAML of ``include=DIR`` may not take the name of a built-in task: lm-eval would run the user's
    task under the name whose results a reader takes for ours."""
    ours = {t: f for f in TASK_DIR.glob("*.yaml") for t in _yaml_tasks(f)}
    for f in sorted(d.rglob("*.y*ml")):
        for t in _yaml_tasks(f):
            if t in ours:
                raise UsageError(f"qatfactory eval: include={d}: {f} declares task {t!r}, the name of the built-in "
                                 f"task in {ours[t].name}; allowed: a name of its own (built-in: {sorted(ours)})")


def out_dir(target: Path, opts: Dict[str, str]) -> Path:
    """Where the results go: out= or runs/eval-<name>-<time>; a new or empty directory outside what is evaluated
    (checked before the model is loaded)."""
    out = Path(opts["out"]) if "out" in opts else Path("runs") / f"eval-{target.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    src, o = target.resolve(), out.resolve()
    if o == src or (target.is_dir() and src in o.parents):
        raise UsageError(f"qatfactory eval: out={out} is inside the evaluated folder {src}; the input is only read: "
                         f"allowed: a directory outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInputError(f"qatfactory eval: out={out} exists and is not empty; give a new directory")
    return out


def run(argv: List[str]) -> Dict[str, Any]:
    _offline_env()
    if argv[:1] == ["tasks=list"] or argv[1:2] == ["tasks=list"]:
        print("offline:", ", ".join(OFFLINE_TASKS), "| with your data (data_files=):", ", ".join(USER_DATA_TASKS))
        return {}
    target, opts = parse(argv)
    tasks = [t for t in opts["tasks"].split(",") if t]
    include = [p for p in opts.get("include", "").split(",") if p]
    for p in include:
        if not Path(p).is_dir():
            raise BadInputError(f"qatfactory eval: include={p}: not a directory of task YAMLs")
        check_include(Path(p))
    out = out_dir(target, opts)
    hub = _bool(opts, "hub")
    try:
        import lm_eval  # noqa: F401,PLC0415 (heavy: lm_eval's evaluator loads torch, datasets)
        from lm_eval import simple_evaluate  # noqa: PLC0415 (heavy: lm_eval's evaluator loads torch, datasets)
        from lm_eval.tasks import TaskManager  # noqa: PLC0415 (heavy: lm_eval's evaluator loads torch, datasets)
    except ImportError as e:
        raise BadInputError(f"qatfactory eval needs lm-eval (pip install 'lm-eval==0.4.13'): {e}") from None
    files = data_files_map(opts, tasks)
    tm = TaskManager(include_path=[str(TASK_DIR)] + include, include_defaults=hub,
                     metadata={"qf_data_files": files})
    known = set(tm.all_tasks)
    bad = [t for t in tasks if t not in known]
    if bad:
        ours = sorted(t for t in known if t.startswith("qf_"))
        raise UsageError(f"qatfactory eval: unknown task(s) {bad}; allowed: {ours}"
                         + (" plus your include= tasks" if include else "")
                         + ("" if hub else " (lm-eval's own tasks read hub datasets: add hub=true if you have them)"))
    missing = [t for t in tasks if t in USER_DATA_TASKS and t not in files]
    if missing:
        raise BadInputError(f"qatfactory eval: {missing} read your own copy of the data set: give "
                            f"data_files={missing[0]}:/path/to/{missing[0].replace('qf_', '')}.jsonl (nothing of it "
                            f"is packaged; offline tasks: {list(OFFLINE_TASKS)})")
    kind = kind_of(target)
    tok = load_tokenizer(target, opts)
    lm, info = build_lm(target, kind, tok, opts)
    gen = {"max_gen_toks": _int(opts, "max_gen_toks")} if "max_gen_toks" in opts else None
    t0 = time.time()
    # lm-eval records the commit of the current directory by running git unasked, whose "fatal: not a
    # git repository" lands on the user's terminal outside a clone: ask git only inside a work tree
    import lm_eval.evaluator as lm_evaluator  # noqa: PLC0415 (heavy: lm_eval's evaluator, loaded above)
    git_hash = getattr(lm_evaluator, "get_git_commit_hash", None)
    if git_hash is not None:
        lm_evaluator.get_git_commit_hash = _quiet.git_commit
    # the student's weights do not change during an evaluation, yet every generated token's forward would
    # fake-quantize every weight again (a k-quant scale search per tensor per token): the trainer's step
    # cache keeps fq(W) once for the whole evaluation, the same bits as computing it per forward
    frozen = contextlib.nullcontext()
    if kind == "student":
        from ..nn import step_cache  # noqa: PLC0415 (CLI start: torch)
        frozen = step_cache.enabled(weights=True)
    try:
        with frozen:
            res = simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=_int(opts, "limit"),
                                  num_fewshot=_int(opts, "num_fewshot", lo=0), log_samples=_bool(opts, "log_samples"),
                                  bootstrap_iters=0, gen_kwargs=gen)
    finally:
        if git_hash is not None:
            lm_evaluator.get_git_commit_hash = git_hash
        if isinstance(lm, LlamaCppLM):
            lm.close()
    rec = {"target": str(target), "kind": kind, **info, "tasks": tasks, "limit": opts.get("limit"),
           "results": res["results"], "n_samples": res.get("n-samples"), "configs": res.get("configs"),
           "seconds": time.time() - t0, "provenance": provenance(tasks, files)}
    if _bool(opts, "log_samples"):
        rec["samples"] = res.get("samples")
    write(out, rec)
    print(table(rec))
    print(f"[qatfactory] eval: {out}/results.json")
    rec["out"] = str(out)
    return rec


def provenance(tasks: List[str], files: Dict[str, str]) -> Dict[str, Any]:

    data: Dict[str, Any] = {}
    need = {"qf_gsm8k": "gsm8k", "qf_wiki_ppl": "wiki", "qf_persuasion_ppl": "austen"}
    for t in tasks:
        if t in need:
            pr = assets.provenance(need[t])
            data[t] = {k: pr.get(k) for k in ("package", "wheel", "deb", "file_sha256") if pr.get(k)}
        elif t in files:
            data[t] = {"file": files[t], "sha256": sha256_file(Path(files[t]))}
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lm_eval": version("lm-eval"),
            "torch": version("torch"), "transformers": version("transformers"), "data": data}


def table(rec: Dict[str, Any]) -> str:
    rows = ["| task | metric | value |", "|---|---|---|"]
    for task, ms in sorted(rec["results"].items()):
        for k, v in sorted(ms.items()):
            if k == "alias" or "_stderr" in k or not isinstance(v, (int, float)):
                continue
            rows.append(f"| {task} | {k} | {v:.6g} |")
    return "\n".join(rows)


def write(out: Path, rec: Dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _fsutil.write_text_atomic(out / "results.json", json.dumps(rec, indent=1, default=str))
    _fsutil.write_text_atomic(out / "results.md", f"# qatfactory eval {rec['target']} ({rec['backend']})\n\n"
                              f"{rec['provenance']['date']}, lm-eval {rec['provenance']['lm_eval']}, limit "
                              f"{rec['limit']}\n\n{table(rec)}\n")


def main(argv: List[str]) -> int:
    try:
        run(list(argv))
    except (UsageError, BadInputError) as e:
        return X.report("qatfactory eval", e, X.code_for(e))
    except FileNotFoundError as e:
        return X.report("qatfactory eval", e, X.BAD_INPUT)
    except KeyboardInterrupt as e:
        return X.report("qatfactory eval", e, X.INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - one line, QATFACTORY_DEBUG=1 for the traceback
        return X.report("qatfactory eval", e, X.RUN_FAILED)
    return X.OK
