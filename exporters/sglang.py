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

from qatfactory.formats import ConvertedModel
from qatfactory.formats.layouts import Codec

from .base import ExportError, module_of, register_exporter, spec_of
from .vllm import SafetensorsExporter


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
