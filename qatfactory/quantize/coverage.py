"""coverage: which Linear-like parameters were quantized, in which format, and which were kept (and why)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..nn.embedding import QuantEmbedding
from ..nn.fake_quant import (
    has_global_scale,
)
from ..nn.linear import QuantLinear
from ..nn.lora import LoRA
from .config import POLICY_TARGETS, QuantConfig, match
from .modules import (
    _QUANT_MODULES,
    _QUANT_STATE_TYPES,
    CoverageError,
    _exclusion,
    _is_conv1d,
    _is_quant_site,
    _lm_head_name,
    _resolve_format,
    _tied_lm_head,
)


@dataclass
class CoverageRow:
    name: str
    shape: List[int]
    numel: int
    format: str          # format name, or the dtype for tensors kept as they are
    bits: float          # storage bits of the whole tensor as shipped
    status: str          # quantized | excluded | kept (a policy's f16) | dense | tied | adapter | quantizer | MISSING
    note: str = ""


@dataclass
class CoverageReport:
    rows: List[CoverageRow]
    totals: Dict[str, Any]
    errors: List[str]

    def raise_if_errors(self) -> "CoverageReport":
        if self.errors:
            raise CoverageError("coverage: " + "; ".join(self.errors[:10])
                                + (f" (and {len(self.errors) - 10} more)" if len(self.errors) > 10 else ""))
        return self

    def table(self) -> str:
        w = max([len(r.name) for r in self.rows] + [9])
        lines = [f"{'parameter':<{w}}  {'shape':<16} {'format':<10} {'bits/p':>7}  status"]
        for r in self.rows:
            bpp = r.bits / r.numel if r.numel else 0.0
            note = f"  ({r.note})" if r.note else ""
            lines.append(f"{r.name:<{w}}  {str(tuple(r.shape)):<16} {r.format:<10} {bpp:>7.3f}  {r.status}{note}")
        t = self.totals
        lines.append(f"total {t['params']:,} parameters, {t['quantized_params']:,} quantized "
                     f"({100 * t['quantized_fraction']:.1f}%), {t['bits_per_param']:.3f} bits/parameter "
                     f"({t['bits_per_quantized_param']:.3f} in quantized tensors)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _dtype_bits(t: torch.Tensor) -> int:
    return t.element_size() * 8


def coverage(model: nn.Module, cfg: Optional[QuantConfig] = None) -> CoverageReport:
    """Every parameter with its format and bits; errors for Linear-like weights left out
    without being excluded (nn.Linear, fused 3-D experts) and for targeted modules not quantized."""
    cfg = cfg or getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("coverage: the model is not prepared and no cfg= was given")
    lm_name = _lm_head_name(model)
    tied = _tied_lm_head(model, lm_name)
    rows: List[CoverageRow] = []
    errors: List[str] = []
    seen: Dict[int, str] = {}
    state_owner = {}
    for n, m in model.named_modules():
        if isinstance(m, _QUANT_MODULES):
            for cn, c in m.named_modules():
                if isinstance(c, _QUANT_STATE_TYPES) and cn:
                    state_owner[id(c)] = "adapter" if isinstance(c, LoRA) else "quantizer"
    for n, m in model.named_modules():
        kind_state = state_owner.get(id(m))
        for pn, p in m.named_parameters(recurse=False):
            full = f"{n}.{pn}" if n else pn
            quant_site = _is_quant_site(m, pn)
            was_seen = id(p) in seen
            tied_head = isinstance(m, QuantLinear) and m.tied_to is not None
            if (was_seen and not quant_site) or tied_head:
                other = seen.get(id(p)) or f"{m.tied_to.qname}.weight"
                rows.append(CoverageRow(full, list(p.shape), p.numel(), str(p.dtype).replace("torch.", ""), 0,
                                        "tied", f"same tensor as {other}; counted there"))
                continue
            seen.setdefault(id(p), full)
            shape, numel = list(p.shape), p.numel()
            if kind_state is not None:
                rows.append(CoverageRow(full, shape, numel, str(p.dtype).replace("torch.", ""),
                                        numel * _dtype_bits(p), kind_state))
                continue
            if quant_site:
                q = m.weight_quant if isinstance(m, (QuantLinear, QuantEmbedding)) else (
                    m.gate_up_quant if pn == "gate_up_proj" else m.down_quant)
                fmt = q.fmt
                n_glob = q.shape3[0] if has_global_scale(fmt) else 0
                note = q.strategy + (", shares storage with the embeddings" if was_seen else "")
                rows.append(CoverageRow(full, shape, numel, q.fmt_name,
                                        numel * fmt.spec.bits_per_weight + 32 * n_glob, "quantized", note))
                continue
            conv = isinstance(m, nn.modules.conv._ConvNd)
            # a convolution (Gated DeltaNet's and Mamba's short causal conv) is no matmul the engines quantize:
            # vLLM and llama.cpp run it in the model dtype
            linear_like = not conv and ((isinstance(m, nn.Linear) and pn == "weight") or p.ndim == 3)
            if _is_conv1d(m) and pn == "weight":
                why = _exclusion(cfg, n, lm_name, tied)
                if why is None and any(match(t, n) for t in cfg.targets):
                    errors.append(f"{full} {tuple(p.shape)} is a transformers Conv1D (GPT-2 style) weight, which "
                                  f"qatfactory does not quantize; add it to QuantConfig.exclude to keep it as it is")
                    rows.append(CoverageRow(full, list(p.shape), p.numel(), str(p.dtype).replace("torch.", ""),
                                            p.numel() * _dtype_bits(p), "MISSING", "Conv1D is not supported"))
                    continue
                linear_like = True
            status, note = "dense", ""
            if linear_like:
                why = _exclusion(cfg, n, lm_name, tied)
                policy = False
                if why is None and isinstance(m, nn.Linear) and cfg.resolve(n)[0] in POLICY_TARGETS and \
                        _resolve_format(cfg, cfg.resolve(n)[0], full, tuple(p.shape),
                                        getattr(model, "config", None)) is None:
                    why = f"the {cfg.resolve(n)[0]} policy keeps rows of length {p.shape[-1]} in f16"
                    policy = True
                if why is not None:
                    status, note = ("kept" if policy else "excluded"), why
                elif any(match(t, n) for t in cfg.targets):
                    status = "MISSING"
                    errors.append(f"{full} {tuple(p.shape)} is matched by targets but was not quantized")
                else:
                    status = "MISSING"
                    errors.append(f"{full} {tuple(p.shape)} is a Linear-like weight left out without being excluded "
                                  f"(add it to QuantConfig.exclude or to targets)")
            elif p.ndim >= 2 and any(match(e, n) for e in cfg.exclude):
                status, note = "excluded", "exclude pattern"
            elif conv and pn == "weight":
                note = "convolution: engines keep it in the model dtype"
            rows.append(CoverageRow(full, shape, numel, str(p.dtype).replace("torch.", ""),
                                    numel * _dtype_bits(p), status, note))
    shipped = [r for r in rows if r.status not in ("adapter", "quantizer", "tied")]
    q = [r for r in shipped if r.status == "quantized"]
    # asked for: Linear-like weights that the config targets and does not exclude (a policy's f16
    # rows and unsupported layers count as asked for and not delivered)
    asked = [r for r in shipped if r.status in ("quantized", "kept", "MISSING")]
    n_asked = sum(r.numel for r in asked)
    frac = (sum(r.numel for r in q) / n_asked) if n_asked else 1.0
    min_cov = float(getattr(cfg, "min_coverage", 0.0) or 0.0)
    if n_asked and frac < min_cov:
        kept = [r for r in asked if r.status != "quantized"]
        why = sorted({r.note for r in kept if r.note})
        errors.append(f"{100 * frac:.1f}% of the {n_asked:,} Linear-like parameters asked for are quantized, below "
                      f"QuantConfig.min_coverage={min_cov:g} (kept as they are: {', '.join(r.name for r in kept[:3])}"
                      f"{' ...' if len(kept) > 3 else ''}; {'; '.join(why[:2])}). Pick a format whose block size "
                      f"divides the rows, add a rule, or lower min_coverage to accept it")
    n_all = sum(r.numel for r in shipped)
    n_q = sum(r.numel for r in q)
    by_fmt: Dict[str, int] = {}
    for r in q:
        by_fmt[r.format] = by_fmt.get(r.format, 0) + r.numel
    totals = {
        "params": n_all,
        "quantized_params": n_q,
        "quantized_fraction": n_q / n_all if n_all else 0.0,
        "bits_total": sum(r.bits for r in shipped),
        "bits_per_param": sum(r.bits for r in shipped) / n_all if n_all else 0.0,
        "bits_per_quantized_param": sum(r.bits for r in q) / n_q if n_q else 0.0,
        "by_format": by_fmt,
        "excluded": [r.name for r in shipped if r.status == "excluded"],
        "missing": [r.name for r in rows if r.status == "MISSING"],
        "asked_params": n_asked,
        "asked_fraction": frac,
        "not_quantized": [r.name for r in asked if r.status != "quantized"],
    }
    return CoverageReport(rows, totals, errors)
