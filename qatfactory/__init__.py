"""qatfactory: quantization-aware training and distillation for the format you will serve.

Importing qatfactory needs neither a GPU, CuPy nor DeepSpeed, and loads none of the trainer: the
Python API (``qatfactory.quantize_model``, ``ship``, ``Distiller``, ... of :mod:`qatfactory.api`) is
imported on first use of one of its names.
"""
__version__ = "0.1.0"

# the public names of qatfactory.api, loaded when first asked for (the API imports the exporters)
_API = ("format_names", "quant_config", "quantize_model", "calibration_batches", "save", "load", "ship", "coverage",
        "Distiller", "QuantConfig", "LossConfig", "Shipped")


def __getattr__(name):
    if name in _API:
        from . import api  # noqa: PLC0415 (lazy: `import qatfactory` stays light)
        return getattr(api, name)
    raise AttributeError(f"module 'qatfactory' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
