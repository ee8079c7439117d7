"""llm-compressor's post-training quantization (vllm-project/llm-compressor) on the same model, data and held-out
windows as benchmarks/accuracy/qad_recipe.py, each arm exported by llm-compressor's own
``save_pretrained(..., save_compressed=True)`` (a compressed-tensors checkpoint vLLM loads) and scored from
that export by the same evaluator.

    python benchmarks/accuracy/peer_llmcompressor.py --out runs/recipe                  # GPU
    python benchmarks/accuracy/peer_llmcompressor.py --smoke --out /tmp/recipe          # CPU, tiny model

Release: llmcompressor 0.14.0.1, which pins transformers <= 5.17.0, compressed-tensors == 0.19.0 and
torch <= 2.14.0; this project runs transformers 5.25 and compressed-tensors 0.20, so the peer runs in its own
interpreter (``--peer-python``; by default ``.venv-peer-llmc/bin/python`` when that venv exists, built by
``python3 -m venv .venv-peer-llmc && .venv-peer-llmc/bin/python -m pip install torch==2.13.0
llmcompressor==0.14.0.1``), in a worker process that imports nothing of qatfactory. Its export is read back
here with this project's transformers + compressed-tensors (another release of the library vLLM reads it with).

The recipes are llm-compressor's documented examples (read at commit ab1ba3e of its repository, 2026-08):

* nvfp4_w4a16: ``QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])`` through
  ``oneshot(model=model, recipe=recipe)``, examples/quantization_w4a16_fp4/nvfp4/llama3_example.py. The scheme
  is weight-only and data-free (llm-compressor picks its DataFreePipeline), so, as in the example, no calibration
  set is passed. Beside it, the int4 recipe of examples/quantization_w4a16/llama3_example.py:
  ``GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])`` with 512 calibration samples of at most
  2,048 tokens. Its W4A16 preset groups 128 weights; SmolLM2-135M's 576-wide inputs (and the smoke's 64) are not
  a multiple of 128, which llm-compressor refuses, so the preset runs with groups of 64 (every other field of the
  preset kept) and the row says so.
* nvfp4_w4a4: ``scheme="NVFP4"``, 20 calibration samples of 2,048 tokens,
  examples/quantization_w4a4_fp4/llama3_example.py.
* mxfp4_w4a4: ``scheme="MXFP4"``, data-free, examples/quantization_w4a4_mxfp4/llama3_mxfp4.py.

Calibration windows are the first training windows of every arm's training text (the examples' ultrachat is
not available offline), 2,048 tokens each (the smoke: the preset's length). Each export is checked by
peer_export_check.py against the fake-quantized weights llm-compressor held before saving (compressed-tensors'
own ``forward_quantize`` in the peer's process). These are PTQ rows: they train nothing, --steps only keeps the
preset equal to the other processes' for ``qad_recipe.py --merge``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_common as PC  # noqa: E402

TAG = "peer_llmcompressor"
PEER_VENV = PC.REPO / ".venv-peer-llmc"
EX = "vllm-project/llm-compressor examples/"
# per table format: (row name, recipe kind, scheme, calibration samples (None: data-free), source)
ARMS = {
    "nvfp4_w4a16": [("llm-compressor NVFP4A16", "qmod", "NVFP4A16", None,
                     EX + "quantization_w4a16_fp4/nvfp4/llama3_example.py"),
                    ("llm-compressor GPTQ W4A16 g64", "gptq", "W4A16", 512,
                     EX + "quantization_w4a16/llama3_example.py")],
    "nvfp4_w4a4": [("llm-compressor NVFP4", "qmod", "NVFP4", 20, EX + "quantization_w4a4_fp4/llama3_example.py")],
    "mxfp4_w4a4": [("llm-compressor MXFP4", "qmod", "MXFP4", None, EX + "quantization_w4a4_mxfp4/llama3_mxfp4.py")],
}
GPTQ_GROUP = 64


# ============================================================================ worker (llm-compressor's Python)
def worker(spec_path: Path) -> int:
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from transformers import AutoModelForCausalLM

    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    s = json.loads(spec_path.read_text())
    out = Path(s["out_dir"])
    dtype = torch.bfloat16 if s["device"] == "cuda" else torch.float32
    # loaded on the CPU as the examples do; oneshot's pipelines move each layer to the accelerator
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=dtype)
    tok, real_tok = PC.stand_in_tokenizer(s["model_dir"])
    if s["kind"] == "gptq":
        scheme = preset_name_to_scheme(s["scheme"], ["Linear"])
        scheme.weights.group_size = s["group_size"]
        recipe = GPTQModifier(ignore=["lm_head"], config_groups={"group_0": scheme})
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=s["scheme"], ignore=["lm_head"])
    kw: Dict[str, Any] = {}
    if s.get("calib"):
        from datasets import Dataset
        from safetensors.torch import load_file
        ids = load_file(s["calib"])["input_ids"]
        kw = dict(dataset=Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}),
                  processor=tok, max_seq_length=int(ids.shape[1]), num_calibration_samples=int(ids.shape[0]))
    t = time.time()
    oneshot(model=model, recipe=recipe, **kw)
    secs = time.time() - t
    qdq = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            sch = getattr(m, "quantization_scheme", None)
            if sch is not None and sch.weights is not None and hasattr(m, "weight_scale"):
                qdq[name + ".weight"] = forward_quantize(m, m.weight, "weight", sch.weights)
    PC.save_qdq(out / "peer_qdq.safetensors", qdq)
    export = out / "export"
    model.save_pretrained(str(export), save_compressed=True)
    if real_tok:
        tok.save_pretrained(str(export))
    PC.write_json(out / "worker.json", {
        "export": str(export), "peer_qdq": str(out / "peer_qdq.safetensors"), "seconds_quantize": secs,
        "quantized_linears": len(qdq), "recipe": str(recipe)[:400], "tokenizer": "model's" if real_tok else "stand-in",
        "versions": PC.versions(["llmcompressor", "compressed-tensors", "transformers", "torch"]),
        "python": sys.executable})
    return 0


# ============================================================================ harness (this project's Python)
def default_python() -> str:
    py = PEER_VENV / "bin" / "python"
    return str(py) if py.is_file() else sys.executable


def run(a) -> int:
    p, work, data, res, teacher, tok, ev = PC.setup(a, a.tag, "llm-compressor")
    import torch
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    md = PC.model_dir(a, teacher, work)
    python = a.peer_python or default_python()
    res["peer_python"] = python
    res["ptq"] = {}
    seq = p["seq"] if a.smoke else PC.DOC_SEQ
    for name, kind, scheme, n_calib, source in ARMS[a.format]:
        row = name + (f" (preset group 128 -> {GPTQ_GROUP})" if kind == "gptq" else "")
        arm_dir = work / name.replace(" ", "_")
        spec: Dict[str, Any] = {"model_dir": md, "out_dir": str(arm_dir), "kind": kind, "scheme": scheme,
                                "group_size": GPTQ_GROUP, "device": a.device, "source": source}

        def arm():      # called at once: the loop's current values
            if n_calib:
                spec["calib"] = str(arm_dir / "calib.safetensors")
                spec["calib_info"] = PC.calib_windows(data, tok, seq, n_calib, arm_dir / "calib.safetensors")
            rec = PC.run_worker(python, Path(__file__), spec, arm_dir, a.peer_pythonpath, a.budget_s)
            r = PC.score(ev, rec, scheme in ("NVFP4", "MXFP4"), dtype, a.device)
            r.update(source=source, calib=spec.get("calib_info", "data-free (as documented)"))
            return r, rec["versions"].get("llmcompressor")
        PC.ptq_row(res, row, a.tag, source, arm)
    return PC.finish(a.out, res, a.tag)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    PC.base_args(ap, sorted(ARMS))
    ap.add_argument("--tag", default=TAG)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
