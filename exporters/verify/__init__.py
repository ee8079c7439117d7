"""The parity gate: reload an export with third-party code and compare it with the student.

    res = verify("out/nvfp4-vllm", converted)     # converted: the student's ConvertedModel
    res.verdict   # "PASS" | "FAIL" | "INCOMPLETE";  res.ok is True for PASS only
    print(res.table())

The student is the truth: its formats, activation formats and packed tensors decide what must be in
the export and how it must decode; the export's metadata (qatfactory.json, config.json,
hf_quant_config.json, GGUF keys) is compared against the student, never read to decide what to
check. Per packed tensor three levels:

1. bytes    codes and scales on disk equal the training quantizer's bytes
2. weights  the engine's own library decodes them to the student's fake-quant weights
            (nvidia-modelopt / compressed-tensors compressors / gguf-py and libggml's C code)
3. logits   a model built by a third-party loader from the export's own config gives the
            student's logits; for GGUF also llama.cpp itself (llama_cpp_runtime.py)

and around them: every tensor present, none extra, dense tensors bytewise, every config value
the engine reads equal to the student's, NaN/Inf anywhere a failure, files read only from inside
the export directory. A required check that cannot run (a library missing, or opted out) makes the
verdict INCOMPLETE, never PASS. Flavours: safetensors.py (ModelOpt, compressed-tensors), gguf.py.
"""
from __future__ import annotations

import glob
from pathlib import Path
from typing import List, Optional

from qatfactory.formats import ConvertedModel

from .common import RECORD, default_prompt, read_json
from .gguf import verify_gguf
from .result import FAIL, INCOMPLETE, PASS, Check, Malformed, Missing, VerifyResult  # noqa: F401
from .safetensors import verify_safetensors

ENGINES = {"vllm": "safetensors", "sglang": "safetensors", "llama_cpp": "gguf"}


def verify(export_dir, student: ConvertedModel, prompt_ids: Optional[List[int]] = None, logits: bool = True,
           llama_cpp: Optional[bool] = True) -> VerifyResult:
    """Check ``export_dir`` against ``student``. ``logits=False`` skips the logits checks and
    ``llama_cpp=False`` the llama.cpp runtime run: both are opt-outs, so the verdict is then at best
    INCOMPLETE. Raises FileNotFoundError when ``export_dir`` is no qatfactory export at all."""
    d = Path(export_dir)
    if not isinstance(student, ConvertedModel):
        raise TypeError(f"verify: expected a qatfactory.formats.ConvertedModel, got {type(student).__name__}")
    if not d.is_dir():
        raise FileNotFoundError(f"{export_dir}: no such export directory")
    if not (d / RECORD).exists() and not (d / RECORD).is_symlink():
        raise FileNotFoundError(f"{export_dir}: no {RECORD}; not a qatfactory export")
    res = VerifyResult(str(d), "?", "?")
    try:
        rec = read_json(d, RECORD)
    except Malformed as e:
        res.add(RECORD, "readable", FAIL, str(e))
        rec = {}
    engine = rec.get("engine")
    has_gguf = bool(glob.glob(str(d / "*.gguf")))
    container = ENGINES.get(engine) or ("gguf" if has_gguf else "safetensors")
    res.engine = engine if isinstance(engine, str) else "?"
    res.flavour = rec.get("flavour") if isinstance(rec.get("flavour"), str) else "?"
    if engine not in ENGINES:
        res.add(RECORD, "engine", FAIL, f"engine={engine!r}; known: {sorted(ENGINES)}")
    elif (container == "gguf") != has_gguf:
        res.add(RECORD, "engine", FAIL, f"engine={engine!r} but the directory {'holds' if has_gguf else 'has no'} "
                                        f"a .gguf file")
    vocab = int(student.config.get("vocab_size") or 0)
    prompt = list(prompt_ids) if prompt_ids is not None else default_prompt(vocab)
    if not prompt or any(not (0 <= int(i) < vocab) for i in prompt):
        raise ValueError(f"verify: prompt ids must be non-empty and in [0, {vocab})")
    try:
        if container == "gguf":
            res.flavour = "gguf" if res.flavour == "?" else res.flavour
            verify_gguf(res, d, student, rec, prompt, logits, llama_cpp is not False)
        else:
            verify_safetensors(res, d, student, rec, prompt, logits)
    except Missing as e:
        res.missing("-", "gate", e)
    except Malformed as e:
        res.add("-", "gate", FAIL, str(e))
    except Exception as e:  # the gate never ends in a traceback: an export it cannot read is a FAIL
        res.add("-", "gate", FAIL, f"the export could not be checked: {type(e).__name__}: {str(e)[:400]}")
    return res


__all__ = ["verify", "VerifyResult", "Check", "default_prompt", "PASS", "FAIL", "INCOMPLETE"]
