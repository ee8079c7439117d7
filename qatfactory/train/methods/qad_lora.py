"""method=qad_lora: QAD with LoRA adapters on the frozen fake-quantized base (quant.lora: prepare
attaches them and freezes the rest); only the adapters train."""
from .base import Needs
from .qad import QAD


class QADLoRA(QAD):
    name = "qad_lora"
    summary = "QAD of LoRA adapters on the frozen fake-quantized base (quant.lora.rank >= 1)"
    needs = Needs(teacher=("live", "cached"), quantized=True)
    quant_start_refusal = "qad_lora trains adapters on a frozen quantized base"

    def validate(self, cfg) -> None:
        if cfg.quant.lora.rank < 1:
            raise ValueError("method.name='qad_lora' needs quant.lora.rank >= 1 (the LoRA rank)")
        super().validate(cfg)
