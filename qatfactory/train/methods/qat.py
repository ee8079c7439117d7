"""method=qat: quantization-aware training on next-token cross-entropy (no teacher)."""
from .quant_start import QuantStart


class QAT(QuantStart):
    name = "qat"
    summary = "quantization-aware training on the labels (CE); a teacher only to report KL (method.eval_teacher)"

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if cfg.method.loss.needs_teacher:
            raise ValueError(f"method.name='qat' trains on CE; method.loss.kind={cfg.method.loss.kind!r} needs a "
                             f"teacher (use method=qad)")
