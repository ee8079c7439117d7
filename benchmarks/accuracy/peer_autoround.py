"""Intel's AutoRound (intel/auto-round: signed-gradient rounding and clipping tuned block by block) on the same
model, data and held-out windows as benchmarks/accuracy/qad_recipe.py, exported by AutoRound's own
``save_quantized(..., format="llm_compressor")`` (a compressed-tensors checkpoint vLLM loads) and scored from
that export by the same evaluator.

    python benchmarks/accuracy/peer_autoround.py --out runs/recipe                  # GPU
    python benchmarks/accuracy/peer_autoround.py --smoke --out /tmp/recipe          # CPU, tiny model

Release: auto-round 0.16.1, which pins nothing of this project's stack (torch, transformers >= 4.38), so it
installs beside it (the ``bench`` extra); ``--peer-python`` still runs it in another interpreter if asked. The
tuning runs in a worker process that imports nothing of qatfactory.

Settings are AutoRound's documented defaults (README.md, "API Usage" and "Important Hyperparameters", read at
commit b9f3d00 of its repository, 2026-08): ``iters`` 200, ``lr`` None (= 1/iters), ``nsamples`` 128,
``seqlen`` 2,048, ``batch_size`` 8, torch.compile on (off on a CPU, where compiling is most of a smoke's time);
the README's scheme table recommends the llm_compressor format for NVFP4 and MXFP4. ``low_cpu_mem_usage`` is
turned off (a memory setting, no numbers change) so that the tuned fake-quantized weights stay in memory after
``quantize()`` for the export check. The smoke runs 2 iterations on 4 windows of the preset's length.

* nvfp4_w4a16: the ``NVFP4`` preset with ``act_bits=16`` (AutoRound's NVFP4 preset quantizes activations too).
  auto-round 0.16.1 writes this export's config with NVFP4 input activations anyway
  (export_to_llmcompressor/export_to_fp.py ``_get_scheme`` maps every nv_fp layer to the NVFP4 preset) and no
  ``input_global_scale``: the row's ``export_check.config_ok`` is false, and the table scores its weights.
* nvfp4_w4a4: the ``NVFP4`` preset; mxfp4_w4a4: the ``MXFP4`` preset.

Calibration windows are the first training windows of every arm's training text (AutoRound's default
NeelNanda/pile-10k is not available offline). Each export is checked by peer_export_check.py against the
fake-quantized weights AutoRound held after tuning. These are PTQ rows: --steps only keeps the preset equal to
the other processes' for ``qad_recipe.py --merge``.
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

TAG = "peer_autoround"
DOC = "intel/auto-round README.md (API Usage, Important Hyperparameters, Supported Schemes)"
# per table format: (row name, preset, overrides of the preset, whether the export quantizes activations)
ARMS = {
    "nvfp4_w4a16": [("auto-round NVFP4 act_bits=16", "NVFP4", {"act_bits": 16}, False)],
    "nvfp4_w4a4": [("auto-round NVFP4", "NVFP4", {}, True)],
    "mxfp4_w4a4": [("auto-round MXFP4", "MXFP4", {}, True)],
}
DOC_SETTINGS = {"iters": 200, "nsamples": 128, "seqlen": PC.DOC_SEQ, "batch_size": 8, "lr": None}
SMOKE_SETTINGS = {"iters": 2, "nsamples": 4, "batch_size": 2, "lr": None}


# ============================================================================ worker (AutoRound's Python)
def worker(spec_path: Path) -> int:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from auto_round import AutoRound

    s = json.loads(spec_path.read_text())
    out = Path(s["out_dir"])
    st = s["settings"]
    dtype = torch.bfloat16 if s["device"] == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=dtype)
    tok, real_tok = PC.stand_in_tokenizer(s["model_dir"])
    ids = load_file(s["calib"])["input_ids"]
    bs = st["batch_size"]
    data = [ids[i:i + bs] for i in range(0, len(ids), bs)]
    ar = AutoRound(model, tokenizer=tok, scheme=s["scheme"], dataset=data, nsamples=int(ids.shape[0]),
                   seqlen=int(ids.shape[1]), iters=st["iters"], lr=st["lr"], batch_size=bs, seed=s["seed"],
                   device_map=s["device"], enable_torch_compile=s["device"] == "cuda", low_cpu_mem_usage=False,
                   **s["overrides"])
    t = time.time()
    qmodel, _ = ar.quantize()
    secs = time.time() - t
    qdq = {}
    for name, m in qmodel.named_modules():
        # a tuned Linear carries its block scales; one that also quantizes activations sits in a wrapper
        base = getattr(m, "orig_layer", m)
        if isinstance(base, torch.nn.Linear) and getattr(base, "scale", None) is not None and \
                not name.endswith(".orig_layer"):
            qdq[name + ".weight"] = base.weight
    PC.save_qdq(out / "peer_qdq.safetensors", qdq)
    ar.save_quantized(str(out / "export"), format="llm_compressor", inplace=True)
    found = sorted(p.parent for p in (out / "export").rglob("config.json"))
    if len(found) != 1:
        raise RuntimeError(f"{out / 'export'}: {len(found)} config.json files after save_quantized; expected one")
    PC.write_json(out / "worker.json", {
        "export": str(found[0]), "peer_qdq": str(out / "peer_qdq.safetensors"), "seconds_quantize": secs,
        "quantized_linears": len(qdq), "tokenizer": "model's" if real_tok else "stand-in",
        "versions": PC.versions(["auto-round", "compressed-tensors", "transformers", "torch"]),
        "python": sys.executable})
    return 0


# ============================================================================ harness (this project's Python)
def run(a) -> int:
    p, work, data, res, teacher, tok, ev = PC.setup(a, a.tag, "auto-round")
    import torch
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    md = PC.model_dir(a, teacher, work)
    python = a.peer_python or sys.executable
    res["peer_python"] = python
    res["ptq"] = {}
    st = dict(DOC_SETTINGS) if not a.smoke else dict(SMOKE_SETTINGS, seqlen=p["seq"])
    if a.iters is not None:
        st["iters"] = a.iters
    res["autoround_settings"] = st
    for name, preset, overrides, act_quant in ARMS[a.format]:
        row = f"{name} (iters {st['iters']})"
        arm_dir = work / name.replace(" ", "_").replace("=", "")
        spec: Dict[str, Any] = {"model_dir": md, "out_dir": str(arm_dir), "scheme": preset, "overrides": overrides,
                                "settings": st, "device": a.device, "seed": a.seed, "source": DOC}

        def arm():      # called at once: the loop's current values
            spec["calib"] = str(arm_dir / "calib.safetensors")
            info = PC.calib_windows(data, tok, st["seqlen"], st["nsamples"], arm_dir / "calib.safetensors")
            rec = PC.run_worker(python, Path(__file__), spec, arm_dir, a.peer_pythonpath, a.budget_s)
            r = PC.score(ev, rec, act_quant, dtype, a.device)
            r.update(source=DOC, calib=info, settings=st, scheme={"preset": preset, **overrides})
            return r, rec["versions"].get("auto-round")
        PC.ptq_row(res, row, a.tag, DOC, arm)
    return PC.finish(a.out, res, a.tag)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    PC.base_args(ap, sorted(ARMS))
    ap.add_argument("--tag", default=TAG)
    ap.add_argument("--iters", type=int, default=None, help="tuning iterations (its documented default: 200)")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
