"""Every file in a safetensors export is one the gate expects, or one no engine reads.

vLLM and SGLang load the shards the index names, or, without an index, every ``*.safetensors`` in
the folder (``*.bin`` / ``*.pt`` when there are none); transformers reads the tokenizer files, the
chat templates (``chat_template.jinja`` and ``additional_chat_templates/*.jinja``), the generation
config, and with trust_remote_code any ``*.py``. So a file the gate did not compare could change
what is served: an extra ``model-override.safetensors`` beside ``model.safetensors`` would be
loaded over the checked weights. What is expected comes from the student and the container, never
from a list in the export:

    qatfactory.json, config.json             always (hf_quant_config.json for ModelOpt)
    model.safetensors                        without an index
    model.safetensors.index.json + shards    every shard its weight_map names (and nothing else)
    the source files                         those the student's source_dir holds (compared by value
                                             in the "source files" row), additional_chat_templates too

Anything else is a FAIL naming it, except documents no loader opens (a model card, a licence) and
hidden folders (``.git/`` of a clone, ``.cache/huggingface/`` of a hub download).
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Iterable, List, Set

from .result import VerifyResult

# what no engine or transformers loads: model cards, licences, git's own files, images of a card
HARMLESS = ("README*", "LICENSE*", "LICENCE*", "NOTICE*", "USE_POLICY*", "*.md", ".gitattributes", ".gitignore",
            "*.png", "*.jpg", "*.jpeg", "*.svg", "*.gif")
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.npz")


def tree(d: Path) -> List[str]:
    """Every file and link under ``d`` as a relative path with '/' (links are listed, never followed)."""
    out = []
    for root, dirs, files in os.walk(d, followlinks=False):
        rel = os.path.relpath(root, d)
        for n in files + [x for x in dirs if os.path.islink(os.path.join(root, x))]:
            out.append(n if rel == "." else f"{rel}/{n}".replace(os.sep, "/"))
    return sorted(out)


def check_files(res: VerifyResult, d: Path, expected: Iterable[str]) -> None:
    """Row ``files: none unexpected``: each file under ``d`` is expected or harmless."""
    want: Set[str] = set(expected)
    extra = []
    for rel in tree(d):
        if rel in want:
            continue
        if any(part.startswith(".") for part in rel.split("/")[:-1]):
            continue   # .git/, .cache/huggingface/ (a clone or a hub download's bookkeeping): no loader looks there
        base = rel.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatch(base, p) for p in HARMLESS) and not os.path.islink(d / rel):
            continue
        why = ("a weight file neither the index nor the exporter names; a loader that reads every shard in "
               "the folder would load it" if any(fnmatch.fnmatch(base, p) for p in WEIGHTS) else
               "not written by the exporter and not compared with the student's source, yet an engine or "
               "transformers may read it")
        extra.append(f"{rel} ({why})")
    res.ok_or_fail("files", "none unexpected", not extra,
                   "; ".join(extra[:4]) + (f" (+{len(extra) - 4} more)" if len(extra) > 4 else "") if extra else
                   f"{len(want)} expected files, nothing else an engine reads")
