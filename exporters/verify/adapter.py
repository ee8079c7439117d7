"""The LoRA adapter folder an RL run ships (``vllm serve --lora-modules name=DIR`` loads it) against
the adapter the run trained.

The truth is the trained adapter as the run held it in memory (``TrainedAdapter``: each target
module's lora_A / lora_B, rank, alpha, and the model's linear module names); the folder is read with
third-party code only: peft's ``LoraConfig.from_pretrained`` for adapter_config.json, peft's own
target matching (``check_target_module_exists``) for which modules the config adapts, and
safetensors for adapter_model.safetensors. Rows:

    adapter_config.json  == trained adapter   r, lora_alpha, the modules it adapts (exactly the trained
                                              ones), and the settings that change the delta
                                              (use_rslora, use_dora, fan_in_fan_out, bias, modules_to_save)
    <peft tensor name>   == trained            bytes, dtype and shape, one row per module
    adapter              none extra / missing  tensors the trained adapter does not have, or lacks
    files                none unexpected       adapter_model.bin or anything else a loader could read

PEFT stores a causal LM's adapter of module ``M`` as ``base_model.model.M.lora_A.weight`` (and
lora_B): that is the format's naming, written out here, not taken from the exporter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from .common import inside, names_sample, nonfinite, read_json, same_bits
from .files import check_files
from .result import FAIL, OK, Malformed, Missing, VerifyResult, need

CONFIG, WEIGHTS, RECORD = "adapter_config.json", "adapter_model.safetensors", "qatfactory_adapter.json"


@dataclass
class TrainedAdapter:
    """The adapter as trained: ``modules`` maps a module name (as the model names it) to its
    (lora_A [r, in], lora_B [out, r]); ``linears`` lists every linear module of the model."""

    rank: int
    alpha: float
    modules: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
    linears: List[str] = field(default_factory=list)


def peft_key(module: str, which: str) -> str:
    return f"base_model.model.{module}.{which}.weight"


def check_adapter(res: VerifyResult, adapter_dir, trained: TrainedAdapter) -> None:
    """Rows comparing ``adapter_dir`` (a PEFT LoRA folder) with ``trained``."""
    d = Path(adapter_dir)
    label = f"adapter {d.name}"
    if not d.is_dir():
        res.add(label, "found", FAIL, f"{d} is not a directory")
        return
    check_files(res, d, [CONFIG, WEIGHTS, RECORD])
    _config(res, d, trained)
    try:
        st = need("safetensors")
        p = inside(d, WEIGHTS)
        with st.safe_open(str(p), framework="pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
    except Missing as e:
        res.missing(label, "tensors", e)
        return
    except Malformed as e:
        res.add(label, "tensors", FAIL, str(e))
        return
    except Exception as e:
        res.add(label, "tensors", FAIL, f"{WEIGHTS} is not readable safetensors: {type(e).__name__}: {str(e)[:200]}")
        return
    want = {}
    for m, (a, b) in trained.modules.items():
        want[peft_key(m, "lora_A")] = a
        want[peft_key(m, "lora_B")] = b
    extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    res.ok_or_fail(label, "none extra", not extra, f"{len(extra)} tensors the trained adapter does not have: "
                   + names_sample(extra) if extra else f"{len(got)} tensors")
    res.ok_or_fail(label, "none missing", not lost, f"{len(lost)} missing: " + names_sample(lost) if lost else
                   f"all {len(want)} present")
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k].detach().cpu()
        good = same_bits(g, w) and nonfinite(g) == 0
        detail = f"{g.dtype} {tuple(g.shape)}"
        if not good:
            if g.shape == w.shape:
                diff = (g.float() - w.float()).abs()
                detail += f": {int((diff > 0).sum())} of {g.numel()} values differ, max |diff| " \
                          f"{float(diff.max()):.3g} (trained max |w| {float(w.float().abs().max()):.3g})"
            else:
                detail += f" != trained {w.dtype} {tuple(w.shape)}"
            if nonfinite(g):
                detail += f"; {nonfinite(g)} NaN/Inf"
        res.ok_or_fail(k, "== trained adapter", good, detail, source="safetensors")


def _config(res: VerifyResult, d: Path, trained: TrainedAdapter) -> None:
    check = "== trained adapter"
    try:
        read_json(d, CONFIG)      # a plain JSON object inside the folder, before peft reads it
        peft = need("peft")
        cfg = peft.LoraConfig.from_pretrained(str(d))
        matcher = need("peft.tuners.tuners_utils").check_target_module_exists
    except Missing as e:
        res.missing(CONFIG, check, e)
        return
    except Malformed as e:
        res.add(CONFIG, check, FAIL, str(e))
        return
    except Exception as e:
        res.add(CONFIG, check, FAIL, f"peft cannot read it: {type(e).__name__}: {str(e)[:200]}")
        return
    bad = []
    if cfg.r != trained.rank:
        bad.append(f"r={cfg.r} (trained: {trained.rank})")
    if float(cfg.lora_alpha) != float(trained.alpha):
        bad.append(f"lora_alpha={cfg.lora_alpha} (trained: {trained.alpha})")
    for k, v in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
                 ("modules_to_save", None)):
        if getattr(cfg, k, v) != v:
            bad.append(f"{k}={getattr(cfg, k)!r} (trained: {v!r})")
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None):
        bad.append(f"rank_pattern/alpha_pattern {cfg.rank_pattern or cfg.alpha_pattern} (trained: one rank, one alpha)")
    adapted = {m for m in (trained.linears or trained.modules) if matcher(cfg, m)}
    if adapted != set(trained.modules):
        more, fewer = sorted(adapted - set(trained.modules)), sorted(set(trained.modules) - adapted)
        bad.append(f"target_modules={cfg.target_modules!r} adapts " + (f"untrained {names_sample(more)}" if more else "")
                   + ("; " if more and fewer else "") + (f"not the trained {names_sample(fewer)}" if fewer else ""))
    res.ok_or_fail(CONFIG, check, not bad, "; ".join(bad) if bad else
                   f"r={cfg.r}, alpha={cfg.lora_alpha}, {len(adapted)} modules", source="peft LoraConfig")


def verify_adapter(adapter_dir, trained: TrainedAdapter) -> VerifyResult:
    """The adapter folder alone, as one gate result (engine "vllm-lora")."""
    res = VerifyResult(str(adapter_dir), "vllm-lora", "peft")
    check_adapter(res, adapter_dir, trained)
    return res


__all__ = ["TrainedAdapter", "check_adapter", "verify_adapter", "OK"]
