"""SGLang reads the same two safetensors containers as vLLM (see vllm.py): ModelOpt NVFP4 and
compressed-tensors NVFP4/MXFP4, with the same scale conventions (max over fused shards; ModelOpt
multiplies S, compressed-tensors divides by G = 1/S).

One difference decides what may be written (SGLang 0.5.23, ``compressed_tensors`` scheme
selection): compressed-tensors MXFP4 is accepted for MoE experts only (``Mxfp4MoEMethod``); a
dense linear in float4 group-32 raises "Activation-quantized float4 is only supported in the
NVFP4 layout" and the weight-only variant has no dense scheme. So an MXFP4 checkpoint for SGLang
must keep attention/dense linears in bf16 (listed in ``ignore``) or use NVFP4.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Dict, List, Tuple

from qatfactory.formats import ConvertedModel
from qatfactory.formats.layouts import Codec

from .base import ExportError, module_of, register_exporter, spec_of
from .vllm import SafetensorsExporter

# SGLang 0.5.17 runs NVFP4 below SM100 (Hopper, Ada) through its FP4 Marlin GEMM, whose (thread_k, thread_n)
# tiles are (128, 128), (64, 128), (128, 64) for small batches and (64, 256), (64, 128), (128, 64) for large ones
# (kernels/jit/csrc/gemm/marlin/gptq_marlin.cuh); a tile must divide K and N, and the linears it sees are the
# fused ones (q/k/v into one, gate/up into one). Measured on an H200, 2026-12-03: SmolLM2-135M's q/k/v
# (K 576, N 960) fits none and the engine stops in its first forward ("Invalid thread config").
MARLIN_TILES = ((128, 128), (64, 128), (128, 64), (64, 256))
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def marlin_fits(k: int, n: int) -> bool:
    """Whether one of the Marlin tiles divides a K x N linear (as SGLang fuses it)."""
    return any(k % tk == 0 and n % tn == 0 for tk, tn in MARLIN_TILES)


def marlin_misfits(converted: ConvertedModel) -> List[Tuple[str, int, int]]:
    """(fused module, K, N) of every NVFP4 dense linear, fused as SGLang fuses it, that no Marlin tile fits."""
    groups: Dict[str, List[Tuple[int, int]]] = defaultdict(list)
    for n, p in converted.packed.items():
        if spec_of(p).safetensors.codec is not Codec.E2M1_E4M3_FP32 or ".experts." in n or len(p.shape) != 2:
            continue
        mod = module_of(n)
        parent, _, leaf = mod.rpartition(".")
        groups[f"{parent}.{_FUSED.get(leaf, leaf)}"].append((int(p.shape[1]), int(p.shape[0])))
    out = []
    for g, parts in sorted(groups.items()):
        k, n_out = parts[0][0], sum(n for _, n in parts)
        if not marlin_fits(k, n_out):
            out.append((g, k, n_out))
    return out


def warn_marlin_misfits(converted: ConvertedModel, flavour: str) -> List[Tuple[str, int, int]]:
    """Warn (the checkpoint is valid; SGLang on Blackwell and vLLM run it) when SGLang on Hopper cannot."""
    bad = marlin_misfits(converted)
    if bad:
        g, k, n = bad[0]
        warnings.warn(
            f"sglang/{flavour}: {len(bad)} NVFP4 linears (fused as SGLang fuses them) fit none of the FP4 Marlin "
            f"tiles SGLang 0.5.17 runs NVFP4 with on GPUs below SM100 (e.g. {g}: K={k}, N={n}; a tile needs "
            f"K % 128 == 0 with N % 64 == 0, or K % 64 == 0 with N % 128 == 0): the checkpoint is valid and loads, "
            f"but on Hopper SGLang stops in its first forward ('Invalid thread config'). vLLM 0.24.0's Marlin ran such "
            f"shapes on an H200 (SmolLM2-135M); SGLang on SM100 (Blackwell) uses other kernels.", stacklevel=2)
    return bad


@register_exporter("sglang")
class SGLangExporter(SafetensorsExporter):
    def check(self, converted: ConvertedModel, flavour: str, **options) -> None:
        super().check(converted, flavour, **options)   # every packed format declares a safetensors layout
        dense_mx = [module_of(n) for n, p in converted.packed.items()
                    if spec_of(p).safetensors.codec is Codec.E2M1_E8M0 and ".experts." not in n]
        if dense_mx:
            raise ExportError(
                f"sglang/{flavour}: {len(dense_mx)} dense linears are MXFP4 (e.g. {dense_mx[:3]}); SGLang 0.5.23 "
                f"loads compressed-tensors MXFP4 only for MoE experts and raises for dense float4 group-32 "
                f"linears. Quantize only the experts to MXFP4 (keep attention/dense MLPs bf16), use NVFP4, or "
                f"export for vLLM instead.")
        warn_marlin_misfits(converted, flavour)
