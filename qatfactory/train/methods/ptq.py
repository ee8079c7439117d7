"""method=ptq: calibrate the scales and evaluate against the teacher; no training."""
from .base import Method, Needs


class PTQ(Method):
    name = "ptq"
    summary = "post-training quantization: prepare + calibrate, evaluate, save; no optimizer step"
    needs = Needs(trains=False)
    quant_start_refusal = "method=ptq does not train"
