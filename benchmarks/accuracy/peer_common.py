"""What the post-training peers of benchmarks/accuracy (peer_llmcompressor.py, peer_autoround.py) share: the same
setup as peer_modelopt.py (data, teacher, held-out windows, evaluator), the peer run in its own process and
Python (a peer may pin other releases than this project: llm-compressor 0.14 pins transformers <= 5.17 and
compressed-tensors 0.19), and the scoring of the export the peer wrote, read back the way vLLM's loader reads
it (transformers + compressed-tensors), checked by peer_export_check.py.

Only the standard library at import: a peer's worker process imports this file from an interpreter that has
the peer but not qatfactory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# the documented calibration length of both peers' examples (llm-compressor MAX_SEQUENCE_LENGTH, AutoRound seqlen)
DOC_SEQ = 2048


# ============================================================================ worker side (the peer's Python)
def stand_in_tokenizer(model_dir: str):
    """The model directory's own tokenizer, or where it has none a word-level stand-in over the model's vocabulary
    (the smoke's random model reads bytes with qatfactory's ByteTokenizer). The peers are handed token windows,
    never text, so the tokenizer only satisfies their constructors."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir), True
    except (OSError, ValueError, KeyError, TypeError):
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast
        n = AutoConfig.from_pretrained(model_dir).vocab_size
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(n)},
                                                                                  unk_token="t0")))
        return tok, False


def save_qdq(path: Path, weights: Dict[str, Any]) -> None:
    """The peer's fake-quantized weights, fp32, beside (never inside) the export folder."""
    from safetensors.torch import save_file
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().float().contiguous().cpu() for k, v in weights.items()}, str(tmp))
    os.replace(tmp, path)


def versions(names: List[str]) -> Dict[str, Optional[str]]:
    from importlib.metadata import PackageNotFoundError, version
    out: Dict[str, Optional[str]] = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


# ============================================================================ harness side (this project's Python)
def ptq_row(res: Dict[str, Any], row: str, tag: str, source: str, arm) -> None:
    """res["ptq"][row] from ``arm()`` -> (scores, the peer's version); a recipe that does not run here is a row
    saying why, never a score."""
    try:
        res["ptq"][row], version = arm()
        res["peer_version"] = version
    except Exception as e:  # noqa: BLE001 - the row names the failure; finish() exits non-zero on it
        import traceback
        traceback.print_exc()           # the log keeps where it failed; the row keeps the one-line reason
        res["ptq"][row] = {"error": f"{type(e).__name__}: {e}"[:300], "source": source}
    print(f"[{tag}] {row}: {res['ptq'][row].get('wiki_ho', res['ptq'][row])}", flush=True)


def setup(a, tag: str, peer: str):
    """Every peer's setup: preset (with --steps as it applies it, so --merge accepts the JSON), data, teacher,
    evaluator, training windows. Returns (p, work, data, res, teacher, tok, ev)."""
    sys.path.insert(0, str(HERE.parent / "papers"))
    sys.path.insert(0, str(HERE))
    import papers_common as C
    import qad_recipe as R
    a.device = C.resolve_device(a)
    p = R.preset(a.smoke)
    if a.steps:
        p["steps"] = a.steps
        p["eval_every"] = max(1, a.steps // 8)
    work = a.work or a.out / f"work-{a.tag}"
    data = C.data_files(work, ("wiki_train", "austen_train") + R.HELD, p["limits"])
    res: Dict[str, Any] = {"smoke": a.smoke, "preset": p, "format": a.format, "calib": f"{peer} (its own)",
                           "tokens_per_step": p["micro"] * p["seq"], "peer": peer,
                           "provenance": C.provenance(C.model_record(a.smoke, a.model_path), data, [a.seed], a.device)}
    teacher, tok, _ = C.load_teacher(a.smoke, a.model_path, a.device)
    ev = C.Evaluator(teacher, tok, {k: data["files"][k] for k in R.HELD}, {"*": p["eval_seq"]}, p["eval_windows"],
                     a.device)
    res["teacher"] = ev.evaluate(teacher)
    return p, Path(work), data, res, teacher, tok, ev


def model_dir(a, teacher, work: Path) -> str:
    """The directory the peer loads: --model-path as given, else the teacher as built here (the smoke's random
    model, the packaged SmolLM2) written once as a Hugging Face folder."""
    if a.model_path:
        return str(a.model_path)
    d = work / "teacher-hf"
    if not (d / "config.json").is_file():
        teacher.save_pretrained(str(d))
    return str(d)


def calib_windows(data, tok, seq: int, n: int, path: Path) -> Dict[str, Any]:
    """The first ``n`` training windows of ``seq`` tokens (the training text of every arm, in its order) as a
    safetensors file of input_ids the worker reads."""
    import torch
    from safetensors.torch import save_file

    from qatfactory.train.data import DataConfig, build_samples
    files = [data["files"]["wiki_train"], data["files"]["austen_train"]]
    s = build_samples(files, tok, DataConfig(train=files, seq_len=seq, eval_samples=0))
    ids = s.input_ids[:n].to(torch.int64).contiguous()
    if len(ids) < 1:
        raise ValueError(f"no calibration window of {seq} tokens in the training files")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": ids}, str(path))
    return {"windows": int(ids.shape[0]), "seq": int(ids.shape[1]), "tokens": int(ids.numel()), "asked": n}


def run_worker(python: str, script: Path, spec: Dict[str, Any], out_dir: Path, pythonpath: Optional[str],
               timeout: Optional[float]) -> Dict[str, Any]:
    """The peer in its own process and interpreter: ``python script --worker spec.json``; returns the worker's
    record (worker.json), or raises with the tail of its log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    write_json(spec_path, spec)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = out_dir / "worker.log"
    t = time.time()
    with open(log, "w") as fh:
        r = subprocess.run([python, str(script), "--worker", str(spec_path)], stdout=fh, stderr=subprocess.STDOUT,
                           env=env, timeout=timeout)
    rec_path = out_dir / "worker.json"
    if r.returncode != 0 or not rec_path.is_file():
        lines = log.read_text(errors="replace").strip().splitlines()
        # the whole traceback into the harness's log (the worker's own log stays in the work folder)
        print("\n".join(f"  worker| {x}" for x in lines[-60:]), flush=True)
        tail = lines[-6:]
        raise RuntimeError(f"{script.name} worker ({python}) exit {r.returncode}: " + " | ".join(tail)[-600:])
    rec = json.loads(rec_path.read_text())
    rec["worker_seconds"] = time.time() - t
    return rec


def load_export(export_dir: str, act_quant: bool, dtype, device: str):
    """The export as vLLM's loader reads it, through transformers + compressed-tensors: weight-only schemes
    decompressed into plain Linear weights; a W4A4 scheme kept compressed, so compressed-tensors' forward
    quantizes the activations as the format says (its forward runs in the weights' bf16)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig
    # loaded straight onto the evaluation device: transformers dispatches a compressed-tensors model with
    # accelerate hooks that move every input to the device the weights were loaded on, so a model loaded on
    # the CPU and moved to the GPU afterwards gets its inputs sent back to the CPU
    place = {"device_map": {"": str(torch.device(device))}}
    if act_quant:
        m = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.bfloat16, **place)
    else:
        m = AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, **place,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    try:
        from accelerate.hooks import remove_hook_from_module
        remove_hook_from_module(m, recurse=True)
    except ImportError:
        pass
    return m.to(torch.device(device)).eval()


def score(ev, rec: Dict[str, Any], act_quant: bool, dtype, device: str) -> Dict[str, Any]:
    """Held-out KL etc. of the export (the shared evaluator), its independent check, the worker's record."""
    import peer_export_check as X
    qdq = rec.get("peer_qdq")
    chk = X.check(Path(rec["export"]), Path(qdq) if qdq else None)
    # the config must say what the arm ran: an engine quantizes activations exactly where it says so (and NVFP4
    # activations need their calibrated input_global_scale)
    needs_gs = act_quant and chk["format"] == "nvfp4-pack-quantized"
    chk["config_ok"] = chk["input_activations"] == act_quant and chk["input_global_scale"] == needs_gs
    m = load_export(rec["export"], act_quant, dtype, device)
    r = ev.evaluate(m)
    del m
    r.update(export=rec["export"], export_check=chk, peer_record={k: v for k, v in rec.items() if k != "export"})
    return r


def finish(out: Path, res: Dict[str, Any], tag: str) -> int:
    """The report in qad_recipe.py's layout (its --merge takes these rows); exit 1 when a row failed or an
    export did not pass its check."""
    import papers_common as C
    import qad_recipe as R
    res.setdefault("arms", [])
    R.report(out, res, tag)
    print((out / f"{tag}.md").read_text())
    bad = [k for k, v in res["ptq"].items() if "error" in v or not v.get("export_check", {}).get("ok")]
    if bad:
        C.say(tag, f"failed or unchecked: {bad}")
    return 1 if bad else 0


def base_args(ap, formats: List[str]) -> None:
    sys.path.insert(0, str(HERE.parent / "papers"))
    import papers_common as C
    C.base_args(ap)
    ap.add_argument("--format", default="nvfp4_w4a16", choices=formats)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-python", default=None,
                    help="the interpreter that has the peer (default: this one, or the peer's own venv when built)")
    ap.add_argument("--peer-pythonpath", default=os.environ.get("QF_PEER_PYTHONPATH"),
                    help="prepended to the worker's PYTHONPATH (the GPU machine's staged peer site)")
