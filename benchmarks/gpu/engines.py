"""vLLM and SGLang themselves load and serve our safetensors exports (engines.sh runs this).

Phases, each in its own process and Python path, because the engines pin other versions of shared
packages (compressed-tensors 0.17.0 against our 0.20.1, SGLang's transformers 5.12.1 against 5.17):

``students`` (our stack)  SmolLM2-135M-Instruct from its packaged GGUF (tools/gpu/stage.sh carries it)
                          -> per format a PTQ student (prepare + calibrate) and a QAD student (the trainer,
                          ``python -m qatfactory.train``) -> the exports of every cell; a tiny random
                          Qwen3-MoE student for the MoE path. Held-out token ids and greedy prompts are
                          written once, so every model sees the same tokens.
``vllm`` (vLLM's stack)   one subprocess per export and one for the bf16 model: ``vllm.LLM(model=dir)``
                          offline; prompt log-probabilities (top-K) on the held-out tokens, greedy
                          continuations, decode throughput at batch 1 and 64, and which kernel vLLM
                          picked for each quantized linear.
``sglang`` (SGLang's stack, /tmp/sgsite; engines_sglang.py) bf16 and --sglang-cells (default: the ModelOpt
                          NVFP4 export) through ``sglang.Engine``, one model per process: the same record
                          as vLLM's (W/<cell>/sglang.json + .npz); ``sglang-warm`` builds its JIT kernels
                          ahead (FlashInfer's norm, SGLang's Marlin, activation, RoPE, KV store, positions),
                          after installing the caches an earlier GPU run built (sglang_jit.py).
``report`` (our stack)    each student's own fake-quant forward on the same tokens (bf16, on the GPU):
                          KL(student || vLLM) against KL(student || the same format's PTQ student) on
                          the same top-K partition (vLLM's top-K plus one bucket for the rest of the
                          vocabulary, a coarse-graining applied to both, so the two are comparable;
                          the student's mass outside the set is reported), the largest log-probability
                          difference on the set, top-1 and greedy agreement, tokens/s vs bf16.

    python benchmarks/gpu/engines.py students --work W [--steps 60]   # PYTHONPATH=/tmp/site:repo
    python benchmarks/gpu/engines.py vllm --work W                     # PYTHONPATH=/tmp/vsite
    python benchmarks/gpu/engines.py sglang --work W                   # PYTHONPATH=/tmp/sgsite
    python benchmarks/gpu/engines.py report --work W --out OUT         # PYTHONPATH=/tmp/site:repo
    python benchmarks/gpu/engines.py smoke --work W                    # CPU: tiny model, students + report
                                                                       # on stand-ins for the engines' output

Outputs: ``OUT/engines.json`` (every number), ``OUT/engines.md`` (the tables), ``W/<cell>/{vllm,sglang}.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOPK = 128          # prompt log-probabilities per position (vLLM's max_logprobs is raised to this)
GEN_TOKENS = 64
THROUGHPUT_TOKENS = 256
# what SGLang loads after bf16: the ModelOpt NVFP4 export (quant_algo NVFP4, FP4 Marlin on Hopper);
# engines_sglang.py says why the other cells are expected to be refused by SGLang 0.5.17
DEFAULT_SGLANG_CELLS = ("nvfp4-w4a4-modelopt", "llama768-nvfp4-w4a4-modelopt")
# the models the QAD / PTQ students are trained from (tiny_qwen3_moe is quantized untrained)
TRAINED_MODELS = ("smollm2", "tiny_llama")


@dataclass(frozen=True)
class Cell:
    name: str
    fmt: str                 # recipes/format/<fmt>.yaml
    flavour: str             # modelopt | compressed-tensors
    model: str = "smollm2"   # smollm2 | tiny_llama | tiny_qwen3_moe


CELLS = [
    Cell("nvfp4-w4a16-modelopt", "nvfp4_w4a16", "modelopt"),
    Cell("nvfp4-w4a4-modelopt", "nvfp4_w4a4", "modelopt"),
    Cell("nvfp4-w4a16-ct", "nvfp4_w4a16", "compressed-tensors"),
    Cell("mxfp4-w4a16-ct", "mxfp4_w4a16", "compressed-tensors"),
    Cell("mxfp4-w4a4-ct", "mxfp4_w4a4", "compressed-tensors"),
    Cell("moe-nvfp4-w4a16-ct", "nvfp4_w4a16", "compressed-tensors", "tiny_qwen3_moe"),
    # SGLang 0.5.17 runs NVFP4 on Hopper through its Marlin kernel, which has no tile for SmolLM2-135M's
    # hidden size: K = 576 and the fused q/k/v N = 960 fit none of its (thread_k, thread_n) = (128, 128),
    # (64, 128), (128, 64) (gemm/marlin/gptq_marlin.cuh; the H200 run of 2026-12-03 stopped there). This cell
    # is a random Llama whose every linear fits them, trained (QAD) and PTQ'd like the SmolLM2 cells
    Cell("llama768-nvfp4-w4a4-modelopt", "nvfp4_w4a4", "modelopt", "tiny_llama"),
]


def say(msg: str) -> None:
    print(f"[engines {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(p: Path, obj: Any) -> None:
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, p)


# ============================================================================ phase 1: students
def _ns(**kw):
    return argparse.Namespace(**kw)


def prepare_model_and_data(a) -> Dict[str, Any]:
    """SmolLM2 HF dir (from the carried GGUF parts, sha256-checked) and the Wikipedia files."""
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import staging      # here, not at the top: it needs qatfactory, absent from the vllm phase's path
    from transformers import AutoTokenizer
    work = Path(a.work)
    cache = work / "cache"
    if a.smoke:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_llm import train_bpe
        d = work / "tiny-model"
        if not (d / "config.json").exists():
            from qatfactory import assets
            tok = train_bpe(d, assets.wiki_texts()[:200], 320)
            from tiny_llm import tiny_llama
            tiny_llama(tok, 128, 512).save_pretrained(d)
        model_dir = d
    else:
        staging.setup_assets(_ns(asset_dirs=[REPO / ".gpu", staging.STASH_DIR], smoke=False, work=work), cache)
        os.environ["QATFACTORY_CACHE"] = str(cache)
        from qatfactory import assets
        model_dir = assets.prepare_model_dir("smollm2")
    os.environ["QATFACTORY_CACHE"] = str(cache)
    from qatfactory.train.demo_recipe import Settings
    from qatfactory.train.heldout import prepare_data
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    s = Settings(steps=a.steps, seq_len=a.seq, micro_batch=a.micro, eval_samples=a.eval_seqs,
                 calib_samples=a.calib, seed=0)
    data = prepare_data(tok, s, cache)
    return {"model_dir": str(model_dir), "data": data}


def heldout_ids(prep: Dict[str, Any], a) -> Dict[str, Any]:
    """The held-out token ids (packed as the trainer packs them) and the greedy prompts."""
    from transformers import AutoTokenizer
    from qatfactory.train.data import DataConfig, load_data
    tok = AutoTokenizer.from_pretrained(prep["model_dir"])
    d = prep["data"]
    cfg = DataConfig(train=[d["train"]], eval=[d["eval"]], eval_samples=a.eval_seqs, seq_len=a.seq)
    vocab = len(tok)
    _, ev = load_data(cfg, tok, vocab, 0)
    ids = ev.input_ids[: a.eval_seqs].tolist()
    prompts = [row[: a.prompt_len] for row in ev.input_ids[: a.prompts].tolist()]
    return {"heldout": ids, "prompts": prompts, "seq_len": a.seq}


def _train_overrides(a, prep, fmt: str, run_dir: Path) -> List[str]:
    d = prep["data"]
    dev = "cpu" if a.smoke else "cuda"
    return ["model=local", f"model.path={prep['model_dir']}", "model.dtype=bfloat16", f"format={fmt}",
            "method=qad", "train=gpu_1x" if not a.smoke else "train=default", "data=files",
            f"data.train=[{d['train']}]", f"data.eval=[{d['eval']}]", f"data.seq_len={a.seq}",
            f"data.eval_samples={a.eval_seqs}", "train.eval_samples=1", f"train.max_steps={a.steps}",
            f"train.micro_batch={a.micro}", "train.grad_accum=1", f"train.lr={a.lr:g}", "train.schedule=constant",
            "train.warmup_steps=0", "train.eval_every=0", "train.save_every=0", "train.save_final=false",
            "train.save_student=true", "train.progress=false", "train.plots=false", "train.tensorboard=false",
            "train.grad_ckpt=false", "train.optimizer=adamw_torch", f"train.device={dev}", "train.precision=" + ("fp32" if a.smoke else "bf16"),
            f"method.calib_samples={a.calib}", f"run_dir={run_dir}", "export=none"]


def ptq_student(prep, fmt: str, out: Path, a) -> None:
    """The PTQ baseline of a format, calibrated as the trainer calibrates, saved as a student dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from qatfactory import quantize as Q
    from qatfactory.train.config import compose
    from qatfactory.train.data import DataConfig, load_data
    dev = "cpu" if a.smoke else "cuda"
    qcfg = compose([f"format={fmt}"]).quant
    m = AutoModelForCausalLM.from_pretrained(prep["model_dir"], dtype=torch.bfloat16).to(dev)
    Q.prepare(m, qcfg)
    tok = AutoTokenizer.from_pretrained(prep["model_dir"])
    d = prep["data"]
    tr, _ = load_data(DataConfig(train=[d["train"]], eval=[d["eval"]], eval_samples=a.eval_seqs, seq_len=a.seq),
                      tok, len(tok), 0)
    Q.calibrate(m, [{"input_ids": tr.select([i])["input_ids"].to(dev), "attention_mask": tr.select([i])["attn"].to(dev)}
                    for i in range(min(a.calib, len(tr)))], qcfg.calib_method)
    Q.save_student(m.cpu(), str(out))


def tiny_llama_model(prep, out: Path, smoke: bool = False) -> str:
    """A random Llama with SmolLM2's tokenizer, head size and KV heads (so SGLang's KV-store and RoPE JIT
    modules are the SmolLM2 ones) and a hidden size whose every linear, fused as SGLang fuses them (q/k/v,
    gate/up), fits the Marlin tiles: hidden 768 (12 x 64 heads, 3 KV heads), MLP 2048, 4 layers, tied head.
    ``smoke``: a CPU-sized one of the same kind (hidden 256, 4 heads, 1 KV head, MLP 512, 2 layers)."""
    import torch
    import transformers as T
    if (out / "config.json").exists():
        return str(out)
    tok = T.AutoTokenizer.from_pretrained(prep["model_dir"])
    torch.manual_seed(0)
    size = (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)
            if smoke else dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
                               num_key_value_heads=3))
    cfg = T.LlamaConfig(vocab_size=len(tok), **size, head_dim=64, max_position_embeddings=2048,
                        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    m = T.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.05)          # decisive enough that top-1 and KL mean something
    h, qkv, mlp = cfg.hidden_size, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.intermediate_size
    shapes = [(h, qkv), (h, h), (h, 2 * mlp), (mlp, h)]
    from qatfactory.exporters.sglang import marlin_fits      # the exporter's own rule, which warns on a misfit
    assert all(marlin_fits(k, n) for k, n in shapes), shapes
    tmp = out.with_name(out.name + ".tmp")
    m.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return str(out)


def tiny_moe_student(prep, out: Path, a) -> None:
    """A random Qwen3-MoE (4 experts, top-2) with SmolLM2's tokenizer, NVFP4 W4A16: the MoE loading
    path (per-expert tensors, routers left in bf16); no training, decisive random weights."""
    import torch
    import transformers as T
    from qatfactory import quantize as Q
    tok = T.AutoTokenizer.from_pretrained(prep["model_dir"])
    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
                           tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    m = T.Qwen3MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.06)
            if n.endswith("mlp.gate.weight"):
                p.mul_(6)
    Q.prepare(m, Q.QuantConfig.preset("nvfp4_w4a16"))
    Q.save_student(m, str(out))
    tok.save_pretrained(str(out))


def export_cell(student_dir: Path, cell: Cell, out: Path, source_dir: Optional[str]) -> Dict[str, Any]:
    from qatfactory.faces.export import load_converted
    from qatfactory.exporters import export
    cm = load_converted(str(student_dir), source_dir)
    t = time.time()
    r = export(cm, str(out), engine="vllm", flavour=cell.flavour)
    return {"export_dir": str(r.path), "export_s": time.time() - t,
            "bytes": sum(f.stat().st_size for f in Path(r.path).rglob("*") if f.is_file())}


def bf16_name(model: str) -> str:
    """The engine record of a model's unquantized run (the throughput reference of its cells)."""
    return "bf16" if model == "smollm2" else f"bf16-{model}"


def bf16_jobs(st: Dict[str, Any], cells) -> List[Any]:
    """(name, model dir) of the bf16 runs the given cells need: SmolLM2's always, then each other trained model's."""
    models = st.get("models") or {}
    extra = sorted({st["cells"][c]["model"] for c in cells if st["cells"][c].get("model", "smollm2") in models} - {"smollm2"})
    return [("bf16", st["prep"]["model_dir"])] + [(bf16_name(m), models[m]) for m in extra]


def _pair_key(model: str, fmt: str) -> str:
    """Run and student folder names of a (model, format) pair: SmolLM2's are the format alone."""
    return fmt if model == "smollm2" else f"{model}-{fmt}"


def phase_students(a) -> Dict[str, Any]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    prep = prepare_model_and_data(a)
    say(f"model {prep['model_dir']}, data {prep['data']['articles']}")
    ids = heldout_ids(prep, a)
    write_json(work / "tokens.json", ids)
    state: Dict[str, Any] = {"prep": prep, "cells": {}, "formats": {}, "args": vars(a)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # each trainer process makes its own one-rank group on a free port: a port or rank left in this
    # process's environment (by a launcher, or an earlier in-process run) must not be inherited
    for k in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    # (model, format) pairs trained: SmolLM2's keep their old names (qad-<fmt>, ptq-<fmt>), others get the model's
    pairs = sorted({(c.model, c.fmt) for c in CELLS if c.model in TRAINED_MODELS and c.name in a.cells})
    preps = {"smollm2": prep}
    if any(m == "tiny_llama" for m, _ in pairs):
        preps["tiny_llama"] = dict(prep, model_dir=tiny_llama_model(prep, work / "model-tiny_llama", a.smoke))
    # the QAD runs are small for an H200: all of them at once, one process each, while the PTQ
    # students are calibrated here
    procs = {}
    for model, fmt in pairs:
        key = _pair_key(model, fmt)
        run_dir = work / f"qad-{key}"
        if (run_dir / "student" / "qatfactory_quant.json").exists():
            continue
        cmd = [sys.executable, "-m", "qatfactory.train"] + _train_overrides(a, preps[model], fmt, run_dir)
        say(f"QAD {key}: {a.steps} steps")
        log = open(work / f"qad-{key}.log", "w")
        procs[key] = (subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT), log,
                      time.time())
        if a.smoke:            # two CPU cores: one at a time
            procs[key][0].wait()
    for model, fmt in pairs:
        key = _pair_key(model, fmt)
        f: Dict[str, Any] = {}
        ptq_dir = work / f"ptq-{key}"
        if not (ptq_dir / "qatfactory_quant.json").exists():
            t = time.time()
            ptq_student(preps[model], fmt, ptq_dir, a)
            f["ptq_s"] = time.time() - t
        state["formats"][key] = f
    for key, (p, log, t) in procs.items():
        rc = p.wait()
        log.close()
        state["formats"][key]["qad_s"] = time.time() - t
        if rc != 0:
            tail = (work / f"qad-{key}.log").read_text().strip().splitlines()[-5:]
            raise RuntimeError(f"QAD {key} failed (exit {rc}): {tail}")
    for model, fmt in pairs:
        key = _pair_key(model, fmt)
        summ = json.loads((work / f"qad-{key}" / "summary.json").read_text())
        state["formats"][key]["train"] = {k: summ.get(k) for k in ("steps", "tokens", "time_s", "eval_first",
                                                                   "eval_last")}
    state["models"] = {m: p["model_dir"] for m, p in preps.items()}
    moe_dir = work / "student-tiny_qwen3_moe"
    for cell in CELLS:
        if cell.name not in a.cells:
            continue
        if cell.model == "tiny_qwen3_moe":
            if not (moe_dir / "qatfactory_quant.json").exists():
                tiny_moe_student(prep, moe_dir, a)
            sdir, src = moe_dir, str(moe_dir)
        else:
            sdir, src = work / f"qad-{_pair_key(cell.model, cell.fmt)}" / "student", preps[cell.model]["model_dir"]
        edir = work / cell.name / "export"
        if edir.exists():
            import shutil
            shutil.rmtree(edir)
        (work / cell.name).mkdir(exist_ok=True)
        rec = export_cell(sdir, cell, edir, src)
        rec.update(asdict(cell), student_dir=str(sdir),
                   ptq_dir=str(work / f"ptq-{_pair_key(cell.model, cell.fmt)}") if cell.model in TRAINED_MODELS else None)
        state["cells"][cell.name] = rec
        say(f"exported {cell.name}: {rec['bytes'] / 2**20:.1f} MiB")
    state["seconds"] = time.time() - t0
    write_json(work / "students.json", state)
    return state


# ============================================================================ phase 2: vLLM
def _describe_kernels(model) -> List[str]:
    """Which quantization method, scheme and kernel/backend vLLM chose, per distinct combination."""
    import enum

    def name(v):
        if isinstance(v, str):
            return v
        if isinstance(v, enum.Enum):
            return v.name
        return v.__name__ if isinstance(v, type) else type(v).__name__

    out = set()
    for _, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None or type(qm).__name__.startswith("Unquantized"):
            continue
        parts = [type(qm).__name__]
        for obj in (qm, getattr(mod, "scheme", None)):
            if obj is None:
                continue
            if obj is not qm:
                parts.append(type(obj).__name__)
            for attr in ("kernel", "moe_kernel", "backend", "nvfp4_backend", "mxfp4_backend", "experts_cls"):
                v = getattr(obj, attr, None)
                if v is not None:
                    parts.append(f"{attr}={name(v)}")
        out.add(" / ".join(parts))
    return sorted(out)


def _attention_scales(model) -> Dict[str, Dict[str, Any]]:
    """The per-layer scales vLLM's attention layers hold after loading (what its cache write, its query cast and
    its FP8 attention actually use), keyed by module name: k / v / q as the floats the kernels take, prob as a
    float, and the layer's kv_cache_dtype. Layers without the attributes (no attention) are left out."""
    out: Dict[str, Dict[str, Any]] = {}
    for name, mod in model.named_modules():
        if not hasattr(mod, "_k_scale_float") or not hasattr(mod, "kv_cache_dtype"):
            continue
        prob = getattr(mod, "_prob_scale", None)
        out[name] = {"k": float(mod._k_scale_float), "v": float(mod._v_scale_float),
                     "q": float(getattr(mod, "_q_scale_float", float("nan"))),
                     "prob": None if prob is None else float(prob.reshape(-1)[0].item()),
                     "kv_cache_dtype": str(mod.kv_cache_dtype)}
    return out


def vllm_one(model_dir: str, tokens_json: str, out_json: str, topk: int, attention_backend: Optional[str] = None,
             kv_cache_dtype: Optional[str] = None) -> None:
    """Runs inside vLLM's Python path, one model per process. ``attention_backend``: vLLM's
    ``--attention-backend`` (EngineArgs.attention_backend, e.g. FLASH_ATTN / TRITON_ATTN); None = vLLM's choice.
    ``kv_cache_dtype``: vLLM's ``kv_cache_dtype`` (e.g. "bfloat16" to serve an fp8-declaring export with an
    unquantized cache, a control); None = "auto" (resolved from the checkpoint)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the model lives in this process
    # vLLM's sampler imports FlashInfer at init unless told not to (its cuda requirements install it; the
    # carried copy leaves it out): greedy decoding and prompt log-probs need no FlashInfer sampling
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm
    toks = json.loads(Path(tokens_json).read_text())
    res: Dict[str, Any] = {"model_dir": model_dir, "vllm": vllm.__version__, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                           "attention_backend": attention_backend, "kv_cache_dtype_asked": kv_cache_dtype}
    t = time.time()
    llm, err = None, []
    import traceback
    for mode in ("cudagraphs", "eager", "eager-triton-attn"):
        kw = dict(model=model_dir, dtype="bfloat16", max_model_len=max(1024, toks["seq_len"] + 16), seed=0,
                  gpu_memory_utilization=0.30, max_logprobs=topk, enable_prefix_caching=False,
                  max_num_seqs=64, tokenizer=model_dir)
        if mode == "cudagraphs":
            kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        else:
            kw["enforce_eager"] = True
        if kv_cache_dtype:
            kw["kv_cache_dtype"] = kv_cache_dtype
        if attention_backend:
            kw["attention_backend"] = attention_backend     # every mode runs the backend asked for
        elif mode == "eager-triton-attn":
            kw["attention_config"] = {"backend": "TRITON_ATTN"}
        try:
            llm = LLM(**kw)
            res["mode"] = mode
            break
        except Exception as e:   # recorded; the next mode is tried
            err.append(f"{mode}: {type(e).__name__}: {str(e)[:400]} | " + traceback.format_exc()[-1500:])
            gc.collect()
            torch.cuda.empty_cache()
    res["init_errors"] = err
    if llm is None:
        res["loaded"] = False
        write_json(Path(out_json), res)
        return
    res["loaded"], res["init_s"] = True, time.time() - t
    try:    # what vLLM made of the checkpoint's KV-cache declaration ("auto" resolves from its config)
        res["kv_cache_dtype"] = str(llm.llm_engine.vllm_config.cache_config.cache_dtype)
    except Exception as e:
        res["kv_cache_dtype"] = f"(not read: {type(e).__name__})"
    try:    # the scales the served attention layers hold (are they the checkpoint's?)
        res["attention_scales"] = llm.apply_model(_attention_scales)[0]
    except Exception as e:
        res["attention_scales"] = {"(not read)": {"error": f"{type(e).__name__}: {str(e)[:300]}"}}
    try:
        res["kernels"] = sorted(set(sum(llm.apply_model(_describe_kernels), [])))
    except Exception as e:
        res["kernels"] = [f"(not read: {type(e).__name__}: {e})"]
    # prompt log-probabilities: position t holds token t's distribution given tokens < t
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk)
    t = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in toks["heldout"]], sp, use_tqdm=False)
    lp_rows, ix_rows = [], []
    for o in outs:
        lps, ixs = [], []
        for pos in o.prompt_logprobs[1:]:
            items = sorted(pos.items(), key=lambda kv: kv[1].rank)[:topk]
            ixs.append([k for k, _ in items])
            lps.append([v.logprob for _, v in items])
        lp_rows.append(lps)
        ix_rows.append(ixs)
    res["prompt_logprobs_s"] = time.time() - t
    import numpy as np
    np.savez_compressed(Path(out_json).with_suffix(".npz"), lp=np.array(lp_rows, dtype=np.float32),
                        ix=np.array(ix_rows, dtype=np.int32))
    g = llm.generate([TokensPrompt(prompt_token_ids=p) for p in toks["prompts"]],
                     SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    res["greedy"] = [list(o.outputs[0].token_ids) for o in g]
    tp = {}
    for batch in (1, 64):
        prompts = [TokensPrompt(prompt_token_ids=toks["prompts"][i % len(toks["prompts"])]) for i in range(batch)]
        spt = SamplingParams(max_tokens=THROUGHPUT_TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
        best = float("inf")
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.time()
            llm.generate(prompts, spt, use_tqdm=False)
            torch.cuda.synchronize()
            best = min(best, time.time() - t)
        tp[str(batch)] = {"tokens_per_s": batch * THROUGHPUT_TOKENS / best, "seconds": best}
    res["throughput"] = tp
    write_json(Path(out_json), res)


def phase_vllm(a) -> None:
    work = Path(a.work)
    st = json.loads((work / "students.json").read_text())
    jobs = bf16_jobs(st, st["cells"]) + [(n, c["export_dir"]) for n, c in st["cells"].items()]
    for name, d in jobs:
        out = work / name / "vllm.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        t = time.time()
        say(f"vLLM {name}: {d}")
        if out.exists() and json.loads(out.read_text()).get("loaded"):
            say(f"vLLM {name}: done in an earlier call")
            continue
        try:
            r = subprocess.run([sys.executable, __file__, "vllm-one", "--model", d, "--tokens", str(work / "tokens.json"),
                                "--out", str(out), "--topk", str(a.topk)], capture_output=True, text=True,
                               timeout=a.per_model_timeout)
            log, rc = r.stdout[-30000:] + "\n----- stderr\n" + r.stderr[-60000:], r.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = f"timed out after {a.per_model_timeout} s\n" + str(e.stdout or "")[-20000:] + str(e.stderr or "")[-40000:], -9
        (work / name / "vllm.log").write_text(log)
        if not out.exists():
            write_json(out, {"loaded": False, "error": (log.strip().splitlines() or ["?"])[-5:], "exit": rc})
        v = json.loads(out.read_text())
        say(f"  {name}: loaded={v.get('loaded')} mode={v.get('mode')} {time.time() - t:.0f} s "
            f"{v.get('kernels', '')} {v.get('throughput', '')}")


# ============================================================================ phase 3: report
def _student_model(sdir: str, dev: str, weights_only_acts: bool = False):
    import torch
    from qatfactory import quantize as Q
    from qatfactory.nn import QuantLinear
    m = Q.load_student(sdir, dtype=torch.bfloat16).to(dev).eval()
    if weights_only_acts:
        for mod in m.modules():
            if isinstance(mod, QuantLinear):
                mod.input_quant = None
    return m


def _logprobs(m, ids, dev):
    import torch
    with torch.no_grad():
        out = []
        for row in ids:
            x = torch.tensor([row], device=dev)
            out.append(torch.log_softmax(m(input_ids=x).logits[0, :-1].float(), -1).cpu())
        return torch.stack(out)     # [N, L-1, V]


def _greedy(m, prompts, dev, n):
    """Greedy continuations of equal-length prompts, in one batch (no padding needed)."""
    import torch
    with torch.no_grad():
        x = torch.tensor(prompts, device=dev)
        y = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
    return y[:, x.shape[1]:].tolist()


def coarse_kl(p_log, q_ix, q_lp):
    """KL(p || q) over the partition {each token of q's top-K set, everything else}: the same
    coarse-graining for every q compared, a lower bound of the full-vocabulary KL (data processing)."""
    import torch
    ix = torch.as_tensor(q_ix).long()
    ql = torch.as_tensor(q_lp).float()
    pl = p_log.gather(-1, ix)
    p_in, q_in = pl.exp().sum(-1), ql.exp().sum(-1)
    p_rest = (1 - p_in).clamp_min(0)
    q_rest = (1 - q_in).clamp_min(1e-12)
    kl = (pl.exp() * (pl - ql)).sum(-1) + torch.where(p_rest > 0, p_rest * (torch.log(p_rest.clamp_min(1e-30)) -
                                                                                torch.log(q_rest)), 0.0)
    return kl, p_rest


def agreement(a: List[List[int]], b: List[List[int]]) -> Dict[str, float]:
    same, prefix, full = 0, 0, 0
    n = 0
    for x, y in zip(a, b):
        k = min(len(x), len(y))
        eq = [x[i] == y[i] for i in range(k)]
        same += sum(eq)
        n += k
        pre = next((i for i, e in enumerate(eq) if not e), k)
        prefix += pre
        full += int(pre == k)
    m = max(len(a), 1)
    return {"token_match": same / max(n, 1), "mean_prefix": prefix / m, "identical": full / m}


ENGINES = ("vllm", "sglang")
RECORD_KEYS = ("loaded", "mode", "kernels", "init_errors", "throughput", "gpu", "error", "loaded_but_failed")


def _engine_record(work: Path, name: str, eng: str, fake: Optional[Dict[str, Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """The engine's record of one model (W/<name>/<eng>.json), or the smoke run's stand-in; None if none."""
    if fake is not None:
        return (fake.get(eng) or {}).get(name)
    p = work / name / f"{eng}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _scored(rec: Optional[Dict[str, Any]]) -> bool:
    """A record with something to score: loaded, and its log-probabilities and generations written."""
    return bool(rec and rec.get("loaded") and rec.get("greedy") is not None and not rec.get("loaded_but_failed"))


def top1_agree(p, q_ix, q_lp) -> float:
    """Fraction of positions where the student's and the engine's most likely token agree, ties counted as
    agreement on either side: a tiny random model gives exactly equal top log-probabilities at some positions,
    and argmax and an engine's top-k break such a tie differently (seen in the CPU smoke run, 2026-12-03)."""
    import numpy as np
    import torch
    ix = torch.as_tensor(np.asarray(q_ix)).long()
    lp = np.asarray(q_lp)
    student_max = p.max(-1).values
    engine_top_is_student_max = (p.gather(-1, ix[..., :1]).squeeze(-1) == student_max).numpy()
    tied = lp == lp[..., :1]                                   # the engine's tokens tied with its own top-1
    student_top = p.argmax(-1).numpy()[..., None]
    student_top_in_engine_ties = ((np.asarray(q_ix) == student_top) & tied).any(-1)
    return float((engine_top_is_student_max | student_top_in_engine_ties).mean())


def _score(p, pq, q_ix, q_lp, eng: str) -> Dict[str, Any]:
    """The student's log-probabilities `p` against an engine's top-K (`q_ix`, `q_lp`), and the same
    format's PTQ student `pq` (None: no baseline) on that engine's partition and in full."""
    import torch
    kl, p_rest = coarse_kl(p, q_ix, q_lp)
    diff = (p.gather(-1, torch.as_tensor(q_ix[..., :8]).long()) - torch.as_tensor(q_lp[..., :8])).abs()
    rr = {f"kl_vs_{eng}": float(kl.mean()), "p_outside_topk": float(p_rest.mean()),
          "max_abs_logprob_diff_top8": float(diff.max()), "mean_abs_logprob_diff_top8": float(diff.mean()),
          "top1_agree": top1_agree(p, q_ix, q_lp)}
    if pq is not None:
        kl_ptq, _ = coarse_kl(p, q_ix, pq.gather(-1, torch.as_tensor(q_ix).long()).numpy())
        rr["kl_vs_ptq"] = float(kl_ptq.mean())
        rr["kl_vs_ptq_full_vocab"] = float((p.exp() * (p - pq)).sum(-1).mean())
    return rr


def _verdict_fields(r: Dict[str, Any], rec: Dict[str, Any], bf: Dict[str, Any], eng: str) -> None:
    tp, tpb = rec.get("throughput") or {}, (bf or {}).get("throughput") or {}
    r["throughput_vs_bf16"] = {b: tp[b]["tokens_per_s"] / tpb[b]["tokens_per_s"] for b in tp if b in tpb}
    s = r["student"]
    # W4A4 on a GPU whose kernel is weight-only (Marlin on Hopper): the engine runs the trained weights with
    # bf16 activations, so the verdict compares it with the student's weight-only forward
    weight_only_kernel = any("marlin" in k.lower() for k in (rec.get("kernels") or []))
    basis = r.get("student weights only") if (weight_only_kernel and "student weights only" in r) else s
    r["verdict_basis"] = "student weights only" if basis is not s else "student"
    r["engine_runs_trained_numbers"] = ("kl_vs_ptq" in basis and basis[f"kl_vs_{eng}"] < basis["kl_vs_ptq"])


def phase_report(a, fake: Optional[Dict[str, Dict[str, Dict[str, Any]]]] = None) -> Dict[str, Any]:
    """Every engine record scored against the students. vLLM's results keep their place in each row
    (row["vllm"], row["student"], ...); SGLang's go under row["sglang"] in the same shape."""
    import numpy as np
    import torch
    work = Path(a.work)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    st = json.loads((work / "students.json").read_text())
    toks = json.loads((work / "tokens.json").read_text())
    dev = "cpu" if a.smoke else "cuda"
    bfs = {eng: _engine_record(work, "bf16", eng, fake) or {} for eng in ENGINES}
    bf_of = {}          # model -> engine -> its bf16 record (None: not served, so no throughput ratio)
    for m in {c.get("model", "smollm2") for c in st["cells"].values()}:
        bf_of[m] = bfs if m == "smollm2" else {eng: _engine_record(work, bf16_name(m), eng, fake) for eng in ENGINES}
    rows: Dict[str, Any] = {}
    for name, c in st["cells"].items():
        recs = {eng: _engine_record(work, name, eng, fake) for eng in ENGINES}
        v = recs["vllm"] or {"loaded": False}
        r: Dict[str, Any] = {"cell": c, "vllm": {k: v.get(k) for k in RECORD_KEYS + ("vllm",)}}
        if recs["sglang"] is not None:
            r["sglang"] = {"record": {k: recs["sglang"].get(k) for k in RECORD_KEYS + ("sglang", "server", "log_evidence")}}
        rows[name] = r
        todo = [eng for eng in ENGINES if _scored(recs[eng])]
        if not todo:
            continue
        arrays = {}
        for eng in todo:
            z = recs[eng]["arrays"] if fake is not None else np.load(work / name / f"{eng}.npz")
            arrays[eng] = (z["ix"], z["lp"])
        variants = [("student", False)]
        if "w4a4" in c["fmt"]:
            variants.append(("student weights only", True))
        for label, wo in variants:
            m = _student_model(c["student_dir"], dev, wo)
            p = _logprobs(m, toks["heldout"], dev)
            # the weight-only forward's continuations too: on a weight-only kernel they are what the engine should
            # reproduce (2026-12-06: SGLang's Llama-768 W4A4 cell matched 0 of 64 greedy tokens of the W4A4 forward)
            greedy = _greedy(m, toks["prompts"], dev, GEN_TOKENS)
            pq = None
            if c.get("ptq_dir"):        # the same format's PTQ student, same forward variant
                mp = _student_model(c["ptq_dir"], dev, wo)
                pq = _logprobs(mp, toks["heldout"], dev)
                del mp
            for eng in todo:
                rr = _score(p, pq, *arrays[eng], eng)
                rr[f"greedy_vs_{eng}"] = agreement(greedy, recs[eng]["greedy"])
                (r if eng == "vllm" else r["sglang"])[label] = rr
            del m, p, pq
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
        for eng in todo:
            rt = r if eng == "vllm" else r["sglang"]
            _verdict_fields(rt, recs[eng], bf_of[c.get("model", "smollm2")][eng], eng)
            s = rt["student"]
            say(f"{name}: KL(student||{eng}) {s[f'kl_vs_{eng}']:.5f} vs PTQ {s.get('kl_vs_ptq', float('nan')):.5f}, "
                f"greedy {s[f'greedy_vs_{eng}']}, tok/s x{rt['throughput_vs_bf16']}")
    rep = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "bf16": {k: bfs["vllm"].get(k) for k in ("throughput", "mode", "vllm", "torch", "gpu")},
           "cells": rows, "train": st.get("formats"),
           "topk": TOPK, "tokens": {"sequences": len(toks["heldout"]), "seq_len": toks["seq_len"],
                                    "prompts": len(toks["prompts"]), "gen_tokens": GEN_TOKENS}}
    if bfs["sglang"]:
        rep["sglang_bf16"] = {k: bfs["sglang"].get(k) for k in ("throughput", "mode", "sglang", "torch", "gpu", "loaded")}
    write_json(out / "engines.json", rep)
    (out / "engines.md").write_text(markdown(rep))
    return rep


def _f(x, fmt=".4f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def verdict(r: Dict[str, Any], rec: Optional[Dict[str, Any]] = None) -> str:
    """r: the engine's part of a row (the row itself for vLLM, row["sglang"] for SGLang); rec its record."""
    rec = r["vllm"] if rec is None else rec
    if not rec.get("loaded"):
        return "not loaded"
    if rec.get("loaded_but_failed"):
        return "loaded, then failed"
    if "engine_runs_trained_numbers" not in r or "kl_vs_ptq" not in (r.get(r.get("verdict_basis", "student")) or {}):
        return "no PTQ baseline (random MoE student)"
    yes = r["engine_runs_trained_numbers"]
    return ("yes" if yes else "NO") + (" (vs the weight-only forward)" if r.get("verdict_basis") != "student" else "")


def _table(rows: Dict[str, Any], eng: str, label: str) -> List[str]:
    """One engine's table: eng keys the metrics (kl_vs_<eng>), label names it in the header."""
    L = [f"| cell | loaded | {label} kernel | KL(student‖{label}) | KL(student‖PTQ) | max |Δlogp| top-8 | top-1 | "
         "greedy tokens equal | tok/s vs bf16 (b1 / b64) | runs the trained numbers |",
         "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for name, row in rows.items():
        r, rec = (row, row["vllm"]) if eng == "vllm" else (row[eng], row[eng]["record"])
        s = r.get("student", {})
        g = s.get(f"greedy_vs_{eng}", {})
        tpr = r.get("throughput_vs_bf16", {})
        k = "; ".join(rec.get("kernels") or []) or "-"
        L.append(f"| {name} | {'yes' if rec.get('loaded') else 'NO'} ({rec.get('mode') or '-'}) | {k} | "
                 f"{_f(s.get(f'kl_vs_{eng}'), '.5f')} | {_f(s.get('kl_vs_ptq'), '.5f')} | "
                 f"{_f(s.get('max_abs_logprob_diff_top8'), '.3g')} | {_f(s.get('top1_agree'), '.3f')} | "
                 f"{_f(g.get('token_match'), '.3f')} | {_f(tpr.get('1'), '.2f')} / {_f(tpr.get('64'), '.2f')} | "
                 f"{verdict(r, rec)} |")
        w = r.get("student weights only")
        if w:
            L.append(f"| {name} vs its weight-only forward | | | {_f(w.get(f'kl_vs_{eng}'), '.5f')} | "
                     f"{_f(w.get('kl_vs_ptq'), '.5f')} | "
                     f"{_f(w.get('max_abs_logprob_diff_top8'), '.3g')} | {_f(w.get('top1_agree'), '.3f')} | "
                     f"{_f(w.get(f'greedy_vs_{eng}', {}).get('token_match'), '.3f')} | | |")
        if not rec.get("loaded") or rec.get("loaded_but_failed"):
            why = rec.get("loaded_but_failed") or "; ".join(rec.get("init_errors") or [str(rec.get("error"))])
            L.append(f"| {name}: {'failed' if rec.get('loaded') else 'refused'} | | {why[:300]} | | | | | | |")
    return L


def _bf16_line(b: Dict[str, Any]) -> str:
    tp = b.get("throughput") or {}
    return (f"bf16 decode: {_f(tp.get('1', {}).get('tokens_per_s'), '.0f')} tok/s at batch 1, "
            f"{_f(tp.get('64', {}).get('tokens_per_s'), '.0f')} at batch 64 ({b.get('mode')}).")


def markdown(rep: Dict[str, Any]) -> str:
    b = rep["bf16"]
    L = [f"vLLM {b.get('vllm')} on {b.get('gpu')} (torch {b.get('torch')}), {rep['date']}; "
         f"{rep['tokens']['sequences']} held-out sequences x {rep['tokens']['seq_len']} tokens, top-{rep['topk']} "
         f"prompt log-probs; {rep['tokens']['prompts']} greedy prompts x {rep['tokens']['gen_tokens']} tokens. "
         + _bf16_line(b), ""]
    L += _table(rep["cells"], "vllm", "vLLM")
    sg = {n: r for n, r in rep["cells"].items() if "sglang" in r}
    if sg:
        sb = rep.get("sglang_bf16") or {}
        L += ["", f"SGLang {sb.get('sglang')} on {sb.get('gpu')} (torch {sb.get('torch')}), the same tokens; "
                  f"attention_backend=triton, sampling_backend=pytorch. " + _bf16_line(sb), ""]
        L += _table(sg, "sglang", "SGLang")
    return "\n".join(L) + "\n"


# ============================================================================ smoke (CPU)
def phase_smoke(a) -> Dict[str, Any]:
    """students + report on CPU with a tiny model; each engine's output is stood in for by the student's
    own top-K (so the KL column must come out 0 and the PTQ column positive): vLLM for every cell, SGLang
    for bf16 and the cells of --sglang-cells."""
    a.smoke = True
    st = phase_students(a)
    toks = json.loads((Path(a.work) / "tokens.json").read_text())
    bf = {"loaded": True, "mode": "stand-in", "throughput": {"1": {"tokens_per_s": 100.0}}}
    fake: Dict[str, Dict[str, Any]] = {"vllm": {"bf16": dict(bf)}, "sglang": {"bf16": dict(bf, sglang="stand-in")}}
    for name, _ in bf16_jobs(st, list(st["cells"]))[1:]:      # each other model's bf16, at another speed
        fake["vllm"][name] = dict(bf, throughput={"1": {"tokens_per_s": 200.0}})
    for name, c in st["cells"].items():
        m = _student_model(c["student_dir"], "cpu")
        p = _logprobs(m, toks["heldout"], "cpu")
        lp, ix = p.topk(a.topk, -1)
        rec = {"loaded": True, "mode": "stand-in", "kernels": ["stand-in"], "arrays": {"lp": lp.numpy(),
               "ix": ix.numpy()}, "greedy": _greedy(m, toks["prompts"], "cpu", GEN_TOKENS),
               "throughput": {"1": {"tokens_per_s": 100.0}}}
        fake["vllm"][name] = rec
        if name in a.sglang_cells:
            fake["sglang"][name] = dict(rec, throughput={"1": {"tokens_per_s": 50.0}})
    return phase_report(a, fake)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["students", "vllm", "report", "smoke", "vllm-one", "sglang", "sglang-one",
                                      "sglang-warm"])
    p.add_argument("--work", default="/tmp/qf-engines")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/qf-engines/out"))
    p.add_argument("--cells", default=",".join(c.name for c in CELLS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--calib", type=int, default=8)
    p.add_argument("--eval-seqs", type=int, default=8, dest="eval_seqs")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, dest="prompt_len")
    p.add_argument("--topk", type=int, default=TOPK)
    p.add_argument("--per-model-timeout", type=int, default=110, dest="per_model_timeout")
    p.add_argument("--sglang-cells", default=",".join(DEFAULT_SGLANG_CELLS), dest="sglang_cells",
                   help="the exports SGLang loads (after bf16), in order")
    p.add_argument("--sglang-timeout", type=int, default=240, dest="sglang_timeout",
                   help="seconds per SGLang model (its first load JIT-compiles kernels)")
    p.add_argument("--warm-wait", type=int, default=240, dest="warm_wait",
                   help="seconds to wait for the background JIT warm-up engines.sh started")
    p.add_argument("--jit-dir", default=os.environ.get("QF_JIT_PARTS", "/tmp/qf-parts/jit"), dest="jit_dir",
                   help="sglang-warm: carried JIT caches (*.tgz) to install first, if their stamp matches")
    p.add_argument("--model"), p.add_argument("--tokens")
    p.add_argument("--attention-backend", default=None, dest="attention_backend",
                   help="vllm-one: vLLM's attention backend (FLASH_ATTN, TRITON_ATTN, ...); default: vLLM's choice")
    p.add_argument("--kv-cache-dtype", default=None, dest="kv_cache_dtype",
                   help="vllm-one: vLLM's kv_cache_dtype (default: auto, from the checkpoint)")
    a = p.parse_args(argv)
    names = {x.name for x in CELLS}
    for opt in ("cells", "sglang_cells"):
        vals = [c for c in getattr(a, opt).split(",") if c]
        bad = [c for c in vals if c not in names]
        if bad:
            p.error(f"--{opt.replace('_', '-')}: unknown {bad}; allowed: {sorted(names)}")
        setattr(a, opt, vals)
    a.smoke = False
    return a


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.phase == "vllm-one":
        vllm_one(a.model, a.tokens, a.out, a.topk, a.attention_backend, a.kv_cache_dtype)
    elif a.phase in ("sglang", "sglang-one", "sglang-warm"):
        sys.path.insert(0, str(HERE))
        import engines_sglang as S      # here: SGLang's phases run in its own Python path
        if a.phase == "sglang-one":
            S.sglang_one(a.model, a.tokens, a.out, a.topk)
        elif a.phase == "sglang":
            S.phase_sglang(a, __file__)
        else:
            S.warm(a)
    elif a.phase == "students":
        phase_students(a)
    elif a.phase == "vllm":
        phase_vllm(a)
    elif a.phase == "report":
        phase_report(a)
    else:
        phase_smoke(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
