"""qatfactory: quantization-aware training and distillation for the format you will serve.

Importing qatfactory needs neither a GPU, CuPy nor DeepSpeed.
"""
__version__ = "0.1.0"
