"""method=qad: quantization-aware distillation, a divergence to the frozen teacher (live or cached)."""
from .base import Needs
from .quant_start import QuantStart


class QAD(QuantStart):
    name = "qad"
    summary = "quantization-aware distillation: KL (or JSD) to the frozen unquantized teacher, live or cached"
    needs = Needs(teacher=("live", "cached"))
