"""Bit-exact emulators of the 4-bit serving formats (numerics only: numpy and torch).

    from qatfactory.formats import get_format, list_formats
    f = get_format("nvfp4"); p = f.quantize(x); y = f.dequantize(p)
"""
import importlib as _importlib

from .converted import ConvertedModel  # noqa: F401
from .layouts import Codec, GGUFLayout, SafetensorsLayout  # noqa: F401
from .spec import (  # noqa: F401
    REGISTRY,
    Format,
    FormatSpec,
    PackedTensor,
    get_format,
    list_formats,
    register,
    unregister,
)

# one import per format file; each file ends with its register(...) lines
for _mod in ("nvfp4", "mxfp4", "q4_k", "q5_0", "q6_k", "q8_0", "nvfp4_ggml", "intgrid"):
    try:
        _importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:  # a format file not written yet
        if _e.name != f"{__name__}.{_mod}":
            raise
