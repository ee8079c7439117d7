"""SGLang itself loads and serves one NVFP4 export on the H200 (engines.py's ``sglang`` phases).

Runs in SGLang's own Python path (PYTHONPATH=/tmp/sgsite, staged by tools/gpu/stage.sh ``install-sglang``), one model
per process, the same way engines.py runs vLLM, and writes the same record (``W/<cell>/sglang.json`` + a
``.npz`` of prompt top-K log-probabilities in vLLM's layout), which engines.py ``report`` scores against
the students.

How SGLang 0.5.17 is driven, and why (read from its source, 2026-12-01):
  * ``sglang.Engine(model_path=export, attention_backend="triton", sampling_backend="pytorch", ...)``: the
    Triton attention backend needs no FlashAttention (the carried sglang-kernel has no flash_ops) and the
    PyTorch sampler no FlashInfer kernel; FlashInfer's ``norm`` JIT module is built all the same (every
    RMSNorm calls it: sglang_jit.py), so FlashInfer is carried with that module's sources and headers;
    ``grammar_backend="none"`` (xgrammar is 0.2.9, not the pinned 0.2.1); ``skip_tokenizer_init`` (ids in,
    ids out); the radix cache off, so every prompt's log-probabilities are computed, none reused.
  * prompt log-probabilities: ``generate(input_ids=..., return_logprob=True, logprob_start_len=0,
    top_logprobs_num=K)``; ``meta_info["input_top_logprobs"][t]`` holds token t's top-K as
    (logprob, token_id, text) given tokens < t, None at t=0.
  * NVFP4 on Hopper: ``quant_algo: NVFP4`` (the ModelOpt W4A4 export) resolves to ``modelopt_fp4`` and,
    below SM100, to the FP4 Marlin GEMM (fp4_gemm_runner_backend "auto" -> "marlin"): weights FP4,
    activations bf16, as vLLM's Marlin path. The Marlin kernels are JIT-compiled (tvm-ffi + nvcc) at
    first use, every instantiation for bf16 in one translation unit; ``warm`` builds them ahead
    (engines.sh starts it in the background during the vLLM call) into TVM_FFI_CACHE_DIR, with FlashInfer's
    norm (FLASHINFER_WORKSPACE_BASE) and SGLang's other JIT kernels of this path (``warm_modules``).
    ``quant_algo: W4A16_NVFP4`` (our ModelOpt W4A16 export) is refused by ModelOptFp4Config.from_config
    (only FP8 / NVFP4 / NVFP4_AWQ outside MIXED_PRECISION checkpoints); expected, not yet seen.
"""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

GEN_TOKENS = 64
THROUGHPUT_TOKENS = 256
MODES = ("cudagraphs", "eager")
# what the record keeps of get_server_info(): how SGLang resolved the run
SERVER_KEYS = ("quantization", "attention_backend", "sampling_backend", "fp4_gemm_runner_backend", "kv_cache_dtype",
               "dtype", "disable_cuda_graph", "grammar_backend", "mem_fraction_static", "max_total_num_tokens",
               "context_length", "version")
LOG_EVIDENCE = re.compile(r"(?i)marlin|modelopt|nvfp4|fp4|quantiz|quant=|load weight|mem usage|attention backend|"
                          r"capture cuda graph|jit")


def say(msg: str) -> None:
    print(f"[engines/sglang {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(p: Path, obj: Any) -> None:
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, p)


def engine_kwargs(model_dir: str, seq_len: int, mode: str, max_bs: int = 64) -> Dict[str, Any]:
    """sglang.Engine's arguments for one try (mode: "cudagraphs" = decode graphs up to `max_bs`, "eager")."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    kw: Dict[str, Any] = dict(
        model_path=model_dir, tokenizer_path=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
        attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
        context_length=max(1024, seq_len + 16), mem_fraction_static=0.25, max_running_requests=max_bs,
        disable_radix_cache=True, random_seed=0, trust_remote_code=False, log_level="info",
        disable_prefill_cuda_graph=True)
    if mode == "cudagraphs":
        kw["cuda_graph_max_bs_decode"] = max_bs
    else:
        kw["disable_cuda_graph"] = True
    return kw


def top_logprobs_arrays(outs: Sequence[Dict[str, Any]], rows: Sequence[Sequence[int]], topk: int):
    """[N, L-1, K] log-probabilities and token ids from SGLang's input_top_logprobs, in vLLM's layout:
    position t-1 holds token t's distribution given tokens < t, best first. Raises on anything that
    does not line up with the prompts (a silent misalignment would make every KL meaningless)."""
    import numpy as np
    if len(outs) != len(rows):
        raise ValueError(f"{len(outs)} outputs for {len(rows)} prompts")
    lp = np.zeros((len(rows), len(rows[0]) - 1, topk), np.float32)
    ix = np.zeros(lp.shape, np.int32)
    for n, (o, row) in enumerate(zip(outs, rows)):
        meta = o["meta_info"]
        top, tok = meta.get("input_top_logprobs"), meta.get("input_token_logprobs")
        if top is None or len(top) != len(row):
            raise ValueError(f"prompt {n}: {None if top is None else len(top)} top-logprob positions for "
                             f"{len(row)} tokens (logprob_start_len=0 expected)")
        if tok is not None and [t[1] for t in tok] != list(row):
            raise ValueError(f"prompt {n}: input_token_logprobs name other tokens than the prompt's")
        for t, pos in enumerate(top[1:]):
            if not pos or len(pos) < topk:
                raise ValueError(f"prompt {n} position {t + 1}: {0 if not pos else len(pos)} of {topk} top logprobs")
            best = sorted(pos, key=lambda e: (-e[0], e[1]))[:topk]
            lp[n, t] = [e[0] for e in best]
            ix[n, t] = [e[1] for e in best]
    return lp, ix


def _jit_listing(cache: Optional[str]) -> List[str]:
    if not cache or not Path(cache).is_dir():
        return []
    return sorted(p.name for p in Path(cache).iterdir() if p.is_dir())


def _fi_listing() -> List[str]:
    """FlashInfer's built modules: "jit:<name>" under FLASHINFER_WORKSPACE_BASE, "aot:<name>" carried ones."""
    import importlib.util
    out = []
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE")
    if base:
        out += [f"jit:{Path(p).parent.name}" for p in Path(base).glob(".cache/flashinfer/*/*/cached_ops/*/*.so")]
    spec = importlib.util.find_spec("flashinfer")
    if spec and spec.origin:
        out += [f"aot:{Path(p).parent.name}" for p in (Path(spec.origin).parent / "data" / "aot").glob("*/*.so")]
    return sorted(set(out))


def sglang_one(model_dir: str, tokens_json: str, out_json: str, topk: int) -> None:
    """Runs inside SGLang's Python path, one model per process."""
    import numpy as np
    import torch
    import sglang
    from sglang.srt.entrypoints.engine import Engine
    toks = json.loads(Path(tokens_json).read_text())
    cache = os.environ.get("TVM_FFI_CACHE_DIR")
    jit_before, fi_before = set(_jit_listing(cache)), set(_fi_listing())
    res: Dict[str, Any] = {"model_dir": model_dir, "engine": "sglang", "sglang": sglang.__version__,
                           "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    t = time.time()
    eng, err = None, []
    for mode in MODES:
        try:
            eng = Engine(**engine_kwargs(model_dir, toks["seq_len"], mode))
            res["mode"] = mode
            break
        except Exception as e:   # recorded; the next mode is tried
            err.append(f"{mode}: {type(e).__name__}: {str(e)[:400]} | " + traceback.format_exc()[-1500:])
            gc.collect()
    res["init_errors"] = err
    if eng is None:
        res["loaded"] = False
        write_json(Path(out_json), res)
        return
    res["loaded"], res["init_s"] = True, time.time() - t
    try:
        info = eng.get_server_info()
        res["server"] = {k: info.get(k) for k in SERVER_KEYS if k in info}
    except Exception as e:
        res["server"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        sp = {"max_new_tokens": 1, "temperature": 0.0}
        t = time.time()
        outs = eng.generate(input_ids=toks["heldout"], sampling_params=sp, return_logprob=True,
                            logprob_start_len=0, top_logprobs_num=topk)
        lp, ix = top_logprobs_arrays(outs, toks["heldout"], topk)
        res["prompt_logprobs_s"] = time.time() - t
        np.savez_compressed(Path(out_json).with_suffix(".npz"), lp=lp, ix=ix)
        greedy = {"max_new_tokens": GEN_TOKENS, "temperature": 0.0, "ignore_eos": True}
        g = eng.generate(input_ids=toks["prompts"], sampling_params=greedy)
        res["greedy"] = [list(o["output_ids"]) for o in g]
        tp = {}
        for batch in (1, 64):
            ids = [toks["prompts"][i % len(toks["prompts"])] for i in range(batch)]
            eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
            best = float("inf")
            for _ in range(2):
                t = time.time()
                eng.generate(input_ids=ids, sampling_params={"max_new_tokens": THROUGHPUT_TOKENS, "temperature": 0.0,
                                                             "ignore_eos": True})
                best = min(best, time.time() - t)
            tp[str(batch)] = {"tokens_per_s": batch * THROUGHPUT_TOKENS / best, "seconds": best}
        res["throughput"] = tp
    except Exception as e:
        res["loaded_but_failed"] = f"{type(e).__name__}: {str(e)[:400]} | " + traceback.format_exc()[-1500:]
    finally:
        jit, fi = _jit_listing(cache), _fi_listing()
        res["jit_modules"] = {"present": jit, "built_here": sorted(set(jit) - jit_before),
                              "flashinfer_present": fi, "flashinfer_built_here": sorted(set(fi) - fi_before)}
        write_json(Path(out_json), res)
        eng.shutdown()


def _kill_group(p: subprocess.Popen) -> None:
    """SGLang's scheduler and detokenizer are children of the model's process: end the whole group."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_warm(work: Path, timeout: float) -> Optional[Dict[str, Any]]:
    """If the background JIT warm-up (engines.sh vllm) is still running, wait for it (a second build of
    the same module would race it in the same build folder); its record, or None if it never ran."""
    rec, pid_f = work / "sglang-warm.json", work / "sglang-warm.pid"
    t0 = time.time()
    while pid_f.exists() and time.time() - t0 < timeout:
        try:
            os.kill(int(pid_f.read_text().strip()), 0)
        except (ProcessLookupError, ValueError):
            break
        if rec.exists() and json.loads(rec.read_text()).get("done"):
            break
        time.sleep(2)
    return json.loads(rec.read_text()) if rec.exists() else None


def warm_running(work: Path) -> bool:
    """The background warm-up started and neither finished nor died."""
    rec, pid_f = work / "sglang-warm.json", work / "sglang-warm.pid"
    if not pid_f.exists() or (rec.exists() and json.loads(rec.read_text()).get("done")):
        return False
    try:
        os.kill(int(pid_f.read_text().strip()), 0)
        return True
    except (ProcessLookupError, ValueError):
        return False


def phase_sglang(a, engines_py: str) -> None:
    work = Path(a.work)
    st = json.loads((work / "students.json").read_text())
    cells = [c for c in a.sglang_cells if c in st["cells"]]
    missing = [c for c in a.sglang_cells if c not in st["cells"]]
    if missing:
        say(f"no export for {missing} in students.json (run the students phase with them)")
    import engines
    jobs = engines.bf16_jobs(st, cells) + [(n, st["cells"][n]["export_dir"]) for n in cells]
    waited = False
    for name, d in jobs:
        out = work / name / "sglang.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists() and json.loads(out.read_text()).get("throughput"):
            say(f"SGLang {name}: done in an earlier call")
            continue
        if not waited:
            # every model waits for the background build (bf16 too: its RMSNorm, activation, RoPE and KV store
            # are JIT modules the warm-up builds), so that two builds of one module never share a build folder
            warm, waited = wait_warm(work, a.warm_wait), True
            if warm:
                say(f"JIT warm-up: {warm.get('modules')} done={warm.get('done')}")
            if warm_running(work):
                say(f"the JIT warm-up is still building after {a.warm_wait} s ({work / 'sglang-warm.log'}): "
                    f"the models wait for the next call")
                return
        t = time.time()
        say(f"SGLang {name}: {d}")
        cmd = [sys.executable, engines_py, "sglang-one", "--model", d, "--tokens", str(work / "tokens.json"),
               "--out", str(out), "--topk", str(a.topk)]
        log_p = work / name / "sglang.log"
        with open(log_p, "w") as log_f:
            # a log file, not a pipe: a child SGLang leaves behind would hold a pipe open past the model's end
            p = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=a.sglang_timeout)
            except subprocess.TimeoutExpired:
                _kill_group(p)
                p.wait()
                rc = -9
                log_f.write(f"\n[engines] timed out after {a.sglang_timeout} s; process group killed\n")
            _kill_group(p)           # whatever SGLang left behind holds GPU memory
        log = log_p.read_text(errors="replace")
        if not out.exists():
            write_json(out, {"loaded": False, "engine": "sglang", "error": (log.strip().splitlines() or ["?"])[-5:],
                             "exit": rc})
        v = json.loads(out.read_text())
        ev = []
        for line in log.splitlines():
            s = line.strip()
            if LOG_EVIDENCE.search(s) and s not in ev:
                ev.append(s[:300])
        v["log_evidence"] = ev[:40]
        v["kernels"] = describe(v)
        write_json(out, v)
        say(f"  {name}: loaded={v.get('loaded')} mode={v.get('mode')} {time.time() - t:.0f} s {v['kernels']} "
            f"{v.get('throughput', '')}")


def jit_family(module_dir: str) -> str:
    """tvm-ffi build folder -> kernel family: sgl_kernel_jit_<args>_<16-hex source hash>__arch_..__tvmffi_.."""
    name = module_dir.split("__arch_")[0].replace("sgl_kernel_jit_", "")
    return re.sub(r"_[0-9a-f]{16}$", "", name)


def describe(v: Dict[str, Any]) -> List[str]:
    """What the record shows of SGLang's choices: its resolved quantization method and FP4 GEMM backend,
    and the Marlin JIT modules built (in this process or by the warm-up). Which GEMM a layer called is
    not observable from outside the scheduler process; "auto" resolves to Marlin below SM100
    (sglang/srt/layers/quantization/fp4_utils.py, a reading of the source, so marked as such)."""
    s = v.get("server") or {}
    out = []
    q = s.get("quantization")
    if q is None:
        q = next((m.group(1) for line in v.get("log_evidence") or [] for m in [re.search(r"quant=([\w-]+)", line)] if m),
                 None)
    if q:
        be = s.get("fp4_gemm_runner_backend")
        out.append(f"quantization={q}" + (f" / fp4_gemm_runner_backend={be}" if be else "")
                   + (" (auto -> marlin below SM100, per fp4_utils.py)" if "fp4" in str(q) and be in (None, "auto") else ""))
    jit = v.get("jit_modules") or {}
    built = {jit_family(m) for m in jit.get("built_here", [])}
    for fam in sorted({jit_family(m) for m in jit.get("present", [])}):
        if "marlin" in fam:
            out.append(f"JIT {fam} ({'built in this run' if fam in built else 'built earlier'})")
    fi_built = set(jit.get("flashinfer_built_here", []))
    for m in jit.get("flashinfer_present", []):
        kind, name = m.split(":", 1)
        how = "carried from an earlier run" if kind == "aot" else ("built in this run" if m in fi_built else "built earlier")
        out.append(f"FlashInfer JIT {name} ({how})")
    return out


def _model_shape(work: Path) -> Dict[str, int]:
    """What SGLang's JIT template arguments depend on, from the bf16 model's config.json (the Llama exports
    share it): head_dim, KV heads, the rotary dim (RotaryEmbedding's cos_sin_cache width)."""
    st = json.loads((work / "students.json").read_text())
    cfg = json.loads((Path(st["prep"]["model_dir"]) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"head_dim": head_dim, "kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            "rotary_dim": int(head_dim * cfg.get("partial_rotary_factor", 1.0))}


def warm_modules(shape: Optional[Dict[str, int]]):
    """(name, build) for every JIT module the Llama path reaches (read from SGLang 0.5.17 / FlashInfer 0.6.15's
    source; sglang_jit.py FLASHINFER_MODULES says where FlashInfer's are reached), each built exactly as the
    engine's first call builds it, so the engine finds it in the cache:
      flashinfer_norm      every RMSNorm (sgl_kernel rmsnorm / fused_add_rmsnorm -> flashinfer.norm);
                           checked on a tiny bf16 tensor against torch, so a carried .so that is wrong is caught
      gptq_marlin_repack   NVFP4 weights repacked for Marlin at load (marlin_utils_fp4.py:152)
      gptq_marlin_bf16     the FP4 Marlin GEMM, every instantiation for bf16 (marlin_utils_fp4.py:102)
      activation_bf16      SiluAndMul (layers/activation.py:95: the JIT kernel when the width is a multiple of 8)
      fused_rope           RotaryEmbedding.forward_cuda -> apply_rope_inplace (rope.py:142: is_neox, rotary dim,
                           bf16 q and k)
      kvcache              the KV-cache store (memory_pool.py:157: K and V rows of kv_heads*head_dim*2 bytes)
      clamp_position_i64   decode positions from the int64 seq_lens (forward_batch_info.py:904)"""
    import torch

    def norm_check():
        from flashinfer.norm import fused_add_rmsnorm, rmsnorm
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(3, 64, dtype=torch.bfloat16, device="cuda", generator=g)
        r = torch.randn(3, 64, dtype=torch.bfloat16, device="cuda", generator=g)
        w = torch.rand(64, dtype=torch.bfloat16, device="cuda", generator=g) + 0.5

        def ref(v):
            v = v.float()
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        xi, ri = x.clone(), r.clone()
        fused_add_rmsnorm(xi, ri, w, 1e-6)          # ri <- r + x, xi <- rmsnorm(ri) * w
        for what, got, want in (("rmsnorm", rmsnorm(x, w, 1e-6), ref(x)), ("fused_add_rmsnorm", xi, ref(r.float() + x.float()))):
            err = float((got.float() - want).abs().max())
            if not err <= 0.02 * float(want.abs().max()):
                raise RuntimeError(f"flashinfer {what} differs from torch by {err}")

    def norm():
        from flashinfer.jit.norm import gen_norm_module
        spec = gen_norm_module()
        carried = spec.is_aot                        # installed from a carried cache (sglang_jit.unpack)
        spec.build_and_load()
        try:
            norm_check()
        except Exception as e:
            if not carried:
                raise
            # a carried module that fails: ours to remove (unpack put it there); built here instead, where
            # the engine's own process will find it (this process keeps the bad one loaded)
            spec.aot_path.unlink()
            spec.build(verbose=False)
            return f"carried {spec.aot_path} failed its check ({type(e).__name__}: {e}); removed, built here"
        return "carried, checked against torch" if carried else "built here, checked against torch"

    def marlin_repack():
        from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module
        _jit_gptq_marlin_repack_module()

    def marlin_bf16():
        from sglang.kernels.ops.quantization.gptq_marlin import _jit_gptq_marlin_module
        _jit_gptq_marlin_module(torch.bfloat16)

    mods = [("flashinfer_norm", norm), ("gptq_marlin_repack", marlin_repack), ("gptq_marlin_bf16", marlin_bf16)]
    if shape:      # each import inside its builder: one renamed in a later SGLang costs that module alone
        row = shape["kv_heads"] * shape["head_dim"] * 2

        def activation():
            from sglang.kernels.ops.activation.activation import activation_module
            activation_module(torch.bfloat16)

        def rope():
            from sglang.kernels.ops.attention.rope import _jit_fused_rope_module
            _jit_fused_rope_module(True, shape["rotary_dim"], torch.bfloat16, torch.bfloat16)

        def kvcache():
            from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module
            _jit_kvcache_module(row, row)

        def clamp_position():
            from sglang.kernels.ops.attention.clamp_position import _jit_clamp_position_module
            _jit_clamp_position_module(torch.int64)

        mods += [("activation_bf16", activation), ("fused_rope", rope), ("kvcache", kvcache),
                 ("clamp_position_i64", clamp_position)]
    return mods


def warm(a) -> None:
    """Build SGLang's and FlashInfer's JIT modules ahead (CPU-bound nvcc work; the GPU only names the arch and
    runs one tiny check), after installing the caches an earlier GPU run built (sglang_jit.py unpack: only
    those whose stamp is this machine's)."""
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rec: Dict[str, Any] = {"started": time.time(), "cache": os.environ.get("TVM_FFI_CACHE_DIR"),
                           "flashinfer_workspace": os.environ.get("FLASHINFER_WORKSPACE_BASE"),
                           "flashinfer_extra": {k: os.environ.get(k) for k in ("FLASHINFER_EXTRA_CUDAFLAGS",
                                                                               "FLASHINFER_EXTRA_LDFLAGS")},
                           "carried": [], "modules": {}}
    out = work / "sglang-warm.json"
    write_json(out, rec)
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import sglang_jit as J
        ours = J.current_stamp()
        rec["stamp"] = ours
        for t in sorted(Path(a.jit_dir).glob("*.tgz")) if a.jit_dir else []:
            try:
                rec["carried"].append(J.unpack(t, ours))
            except (ValueError, OSError) as e:
                rec["carried"].append({"file": t.name, "used": False, "why": f"{type(e).__name__}: {e}"})
        write_json(out, rec)
        try:
            shape = _model_shape(work)
        except (OSError, KeyError, ValueError) as e:
            shape, rec["shape_error"] = None, f"{type(e).__name__}: {e}"
        rec["shape"] = shape
        for name, fn in warm_modules(shape):
            t = time.time()
            try:
                note = fn()
                rec["modules"][name] = round(time.time() - t, 1)
                if isinstance(note, str):
                    rec.setdefault("notes", {})[name] = note
            except Exception as e:
                rec["modules"][name] = f"{type(e).__name__}: {str(e)[-800:]}"
            write_json(out, rec)
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e} | " + traceback.format_exc()[-1500:]
    rec["done"], rec["seconds"] = True, time.time() - rec["started"]
    write_json(out, rec)
