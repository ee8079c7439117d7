"""calibrate: frozen block scales, static activation amax and the KV cache's amax from sample batches."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from ..nn import kv_cache as KV  # the KV cache in the loop (nn/kv_cache.py)
from .config import CALIB_METHODS, QuantConfig, _check_choice
from .modules import _init_scale_state, _quant_experts, _quant_linears


def _act_quantizers(model):
    out = []
    for name, m in _quant_linears(model):
        if m.input_quant is not None:
            out.append((name, m.input_quant))
    for name, m in _quant_experts(model):
        for q in (m.gate_up_input_quant, m.down_input_quant):
            if q is not None:
                out.append((name, q))
    return out


def _imatrix_hook(acc):
    def hook(mod, args):
        x = args[0].detach()
        x2 = x.reshape(-1, x.shape[-1]).double()
        acc[0] += (x2 * x2).sum(0)
        acc[1] += x2.shape[0]
    return hook


def set_quantization(model: nn.Module, enabled: bool) -> int:
    """Switch the fake quantization of every QuantLinear on or off (off: the plain linear on the latent
    weights, the full-precision phase of ``train.quant_start``). Quantizer state is kept either way.
    Returns the number of modules switched; fused experts have no off switch and refuse."""
    if getattr(model, "_qf_config", None) is None:
        raise ValueError("set_quantization: the model is not prepared")
    if not enabled and _quant_experts(model):
        raise NotImplementedError("set_quantization(False): fused 3-D experts cannot run unquantized here; "
                                  "train.quant_start supports dense models")
    n = 0
    for _, m in _quant_linears(model):
        m.quant_enabled = bool(enabled)
        n += 1
    return n


def calibrate(model: nn.Module, batches=None, method: Optional[str] = None) -> Dict[str, Any]:
    """PTQ: block scales from the weights (``max`` | ``mse`` | ``four_over_six``) for frozen /
    learnable strategies, and static activation amax for W4A4 (forward hooks' running max of
    |input| over ``batches``; fused groups then share the max).

    llama.cpp types (q4_k, q6_k, ...): with ``batches``, each QuantLinear also gets an importance
    matrix, the per-column mean of x^2 over all tokens (what llama-imatrix computes), which the
    format's quantizer then uses in training and in convert alike. Fused 3-D experts get none.

    ``batches``: an iterable of dicts of model kwargs, or of input_ids tensors."""
    cfg: QuantConfig = getattr(model, "_qf_config", None)
    if cfg is None:
        raise ValueError("calibrate: the model is not prepared; call qatfactory.quantize.prepare(model, cfg) first")
    method = method or cfg.calib_method
    _check_choice("calibrate method", method, CALIB_METHODS)
    _init_scale_state(model, method)
    acts = [(n, q) for n, q in _act_quantizers(model) if q.static]
    imat = [(n, m) for n, m in _quant_linears(model) if m.weight_quant.uses_imatrix] if batches is not None else []
    kvq = [(n, q) for n, q in KV.kv_quantizers(model) if q.static]    # per-layer K/V amax
    n_batches = 0
    if acts and batches is None:
        raise ValueError("calibrate: W4A4 with a static activation amax needs batches= (an iterable of "
                         "input_ids tensors or dicts of model kwargs)")
    if kvq and batches is None:
        raise ValueError(f"calibrate: the KV-cache format {cfg.kv_format!r} has one K and one V scale per layer, "
                         f"calibrated on batches=; give an iterable of input_ids tensors or dicts of model kwargs")
    if kvq and (acts or imat) and not isinstance(batches, (list, tuple)):
        batches = list(batches)    # the KV pass below runs over them again
    if acts or imat:
        for _, q in acts:
            q.amax.zero_()
            q.calibrating = True
        for _, q in kvq:
            q.calibrating = "pass"    # K/V untouched until their own pass below
        sums = {n: [torch.zeros(m.in_features, dtype=torch.float64, device=m.weight.device), 0] for n, m in imat}
        hooks = [m.register_forward_pre_hook(_imatrix_hook(sums[n])) for n, m in imat]
        for _, m in imat:     # statistics of the inputs the plain quantizer would see
            m.weight_quant.imatrix.zero_()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for b in batches:
                    model(**b) if isinstance(b, dict) else model(input_ids=b)
                    n_batches += 1
        finally:
            for _, q in acts:
                q.calibrating = False
            for _, q in kvq:
                q.calibrating = None
            for h in hooks:
                h.remove()
            model.train(was_training)
        for n, m in imat:
            s2, cnt = sums[n]
            if cnt:
                m.weight_quant.imatrix.copy_((s2 / cnt).float())
        for name, m in _quant_linears(model):
            if m.input_quant is not None and len(m._group) > 1:
                a = torch.stack([g.input_quant.amax for g in m._group]).amax()
                for g in m._group:
                    g.input_quant.amax.copy_(a)
        missing = sorted({n for n, q in acts if not float(q.amax) > 0})
        if missing:
            raise ValueError(f"calibrate: no non-zero activation reached {missing[:8]} over {n_batches} batch(es); "
                             f"give batches that exercise every module")
    out = {"method": method, "batches": n_batches, "activation_quantizers": len(acts), "imatrix": len(imat)}
    if kvq:   # a pass of its own, after the above: K and V as the served (quantized) model computes them
        out["kv_cache"] = _calibrate_kv(model, kvq, batches, cfg.kv_calib_method)
        out["batches"] = max(n_batches, out["kv_cache"]["batches"])
    return out


def _calibrate_kv(model, kvq, batches, method: str) -> Dict[str, Any]:
    was_training = model.training
    model.eval()
    for _, q in kvq:
        q.start_calibration(method)
    n = 0
    try:
        with torch.no_grad():
            for b in batches:
                model(**b) if isinstance(b, dict) else model(input_ids=b)
                n += 1
    finally:
        amax = {name: q.finish_calibration() for name, q in kvq}
        model.train(was_training)
    missing = sorted(name for name, a in amax.items() if not (a["k_amax"] > 0 and a["v_amax"] > 0))
    if missing:
        raise ValueError(f"calibrate: no non-zero K/V reached the KV-cache quantizers of {missing[:8]} over {n} "
                         f"batch(es); give batches with tokens")
    return {"format": kvq[0][1].fmt_name, "method": method, "layers": len(kvq), "batches": n, "amax": amax}
