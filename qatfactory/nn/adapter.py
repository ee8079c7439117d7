"""LoRA as a separate adapter beside a frozen base, and the base frozen at its serving weights.

QeRL trains a LoRA on a frozen NVFP4 base and serves them as vLLM does with a LoRA request: the
base through its 4-bit kernel, the adapter as a bf16 side path,

    y = x @ Q(W)^T + b + (alpha / r) * (x @ A^T) @ B^T

This differs from nn/lora.py, where the adapter is merged *before* quantization
(``fake_quant(W + s*B@A)``, what ``convert`` ships as one tensor). Here:

* :func:`attach` puts a :class:`~qatfactory.nn.lora.LoRA` (A random, B zero, float32) on each target
  linear as ``<module>.adapter`` and adds its output with a forward hook; the base is untouched.
* :func:`serving_weights` computes every QuantLinear's fake-quantized weight once (its
  ``quantized_weight()``: the same amax, scales and LoRA merge as ``convert`` packs) and makes the
  module multiply by that tensor until the context ends: a frozen base is "dequantized once".
  The tensors are bit-identical to the dequantized bytes that ``convert`` hands the exporters
  (tested against an independent decode). It costs one more copy of the linear weights.
* :func:`adapters_disabled` turns every adapter off (the KL reference of GRPO: the frozen base).
* :func:`save_peft_adapter` writes the adapters as a PEFT LoRA directory (``adapter_config.json``
  and ``adapter_model.safetensors``), the format vLLM's and SGLang's LoRA loaders and ``peft``
  read; :func:`merge_into_quant` hands an adapter to a QuantLinear's own merged LoRA so that
  ``convert`` ships ``Q(W + s*B@A)`` instead (an approximation of the trained policy: measure it).
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .. import _fsutil
from .linear import QuantLinear
from .lora import LoRA


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, QuantLinear))


def _hook(mod: nn.Module, args, out):
    ad: LoRA = mod.adapter
    if not getattr(ad, "active", True):
        return out
    x = args[0]
    d = F.linear(F.linear(x.to(ad.lora_A.dtype), ad.lora_A), ad.lora_B)
    if ad.scaling != 1.0:
        # alpha = rank (QeRL's 16/16) is a multiply by 1.0, the identity bit for bit: one launch fewer per
        # adapted linear, forward and backward, on decode steps that are bound by the host launching ops
        d = d * ad.scaling
    return out + d.to(out.dtype)


def attach(model: nn.Module, rank: int, alpha: float, targets: List[str]) -> Dict[str, LoRA]:
    """A side LoRA on every linear whose name matches a pattern of ``targets`` (fnmatch); returns
    {module name: LoRA}. Refuses a QuantLinear that already has a merged LoRA."""
    out: Dict[str, LoRA] = {}
    for name, m in model.named_modules():
        if not _is_linear(m) or not any(fnmatch.fnmatchcase(name, p) for p in targets):
            continue
        if isinstance(m, QuantLinear) and m.lora is not None:
            raise ValueError(f"adapter.attach: {name} already has a merged LoRA (quant.lora.rank > 0); "
                             f"a module takes one of the two")
        if hasattr(m, "adapter"):
            raise ValueError(f"adapter.attach: {name} already has an adapter")
        dev = m.weight.device
        m.adapter = LoRA(m.in_features, m.out_features, rank, alpha, device=dev)
        m._adapter_handle = m.register_forward_hook(_hook)
        out[name] = m.adapter
    if not out:
        raise ValueError(f"adapter.attach: targets={list(targets)} match no linear module")
    return out


def adapters(model: nn.Module) -> Dict[str, LoRA]:
    return {n: m.adapter for n, m in model.named_modules() if _is_linear(m) and isinstance(getattr(m, "adapter", None), LoRA)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    ads = list(adapters(model).values())
    for a in ads:
        a.active = False
    try:
        yield
    finally:
        for a in ads:
            a.active = True


def _frozen_forward(mod: QuantLinear, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(mod._quant_input(x), w, mod.bias)


@contextlib.contextmanager
def serving_weights(model: nn.Module) -> Iterator[Dict[str, torch.Tensor]]:
    """Inside, each QuantLinear multiplies by its fake-quantized weight computed once on entry
    (yielded by module name); the weights' later changes are not seen until the next entry."""
    frozen: Dict[str, torch.Tensor] = {}
    mods: List[QuantLinear] = []
    try:
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, QuantLinear):
                    if "forward" in m.__dict__:
                        raise RuntimeError(f"serving_weights: {name} is already frozen (nested use)")
                    w = m.quantized_weight().detach()
                    frozen[name] = w
                    m.forward = _bind(m, w)
                    mods.append(m)
        yield frozen
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)


def _bind(m, w):
    def fwd(x):
        return _frozen_forward(m, w, x)
    return fwd


def merge_into_quant(model: nn.Module) -> List[str]:
    """Move every side adapter of a QuantLinear into its merged LoRA slot (``convert`` then packs
    Q(W + s*B@A)); returns the names. The hook is removed: the module is a QA-LoRA module after."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and isinstance(getattr(m, "adapter", None), LoRA):
            ad = m.adapter
            m._adapter_handle.remove()
            del m.adapter
            del m._adapter_handle
            m.lora = ad
            names.append(name)
    return names


# ----------------------------------------------------------------------------- PEFT directory
def peft_tensors(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    out = {}
    for name, a in adapters(model).items():
        for k, t in (("lora_A", a.lora_A), ("lora_B", a.lora_B)):
            v = t.detach().to("cpu", dtype or t.dtype).contiguous()
            out[f"base_model.model.{name}.{k}.weight"] = v
    return out


def peft_config(model: nn.Module, base_model: Optional[str] = None) -> Dict:
    ads = adapters(model)
    if not ads:
        raise ValueError("save_peft_adapter: the model has no adapters (adapter.attach)")
    ranks = {a.rank for a in ads.values()}
    alphas = {a.alpha for a in ads.values()}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"save_peft_adapter: adapters differ in rank {sorted(ranks)} / alpha {sorted(alphas)}; "
                         f"a PEFT config holds one of each")
    leaves = {n.rsplit(".", 1)[-1] for n in ads}
    all_linear = [n for n, m in model.named_modules() if _is_linear(m)]
    # leaf names when the adapter covers every module of that leaf name (the usual form, which
    # vLLM's loader checks against its supported modules); full names otherwise
    if all(n in ads for n in all_linear if n.rsplit(".", 1)[-1] in leaves):
        targets = sorted(leaves)
    else:
        targets = sorted(ads)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(), "lora_alpha": alphas.pop(),
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
            "init_lora_weights": True, "base_model_name_or_path": base_model}


def save_peft_adapter(model: nn.Module, out_dir: str, base_model: Optional[str] = None,
                      dtype: Optional[torch.dtype] = None) -> str:
    """adapter_config.json + adapter_model.safetensors (what peft, vLLM and SGLang read) and our record,
    qatfactory_adapter.json, written to a temporary directory beside ``out_dir`` and swapped into place.
    An existing ``out_dir`` is replaced only when it is empty or an adapter this function wrote (its
    record); anybody else's directory -- a PEFT adapter from another tool included -- is left as it is
    (NotOursError, nothing changed)."""
    out_dir = os.path.abspath(out_dir)
    cfg = peft_config(model, base_model)
    tensors = peft_tensors(model, dtype)
    record = {"qatfactory_adapter": {"base_model": base_model, "r": cfg["r"], "lora_alpha": cfg["lora_alpha"],
                                     "tensors": len(tensors)}}
    with _fsutil.atomic_dir(out_dir, replace=True, kinds=("adapter",), what="save_peft_adapter") as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(tmp, _fsutil.ADAPTER_RECORD), "w") as f:
            json.dump(record, f, indent=2)
    return out_dir
