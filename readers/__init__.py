"""Readers of third-party 4-bit checkpoints: the inverse of the exporters, beside them.

    from qatfactory.readers import read_native
    ck = read_native("exports/nvfp4-ct")     # ModelOpt / compressed-tensors safetensors, or a GGUF
    ck.packed["model.layers.0.mlp.down_proj.weight"]   # PackedTensor: codes, scale bytes, per-tensor scale

Containers read (each with its own library: safetensors' ``safe_open``, gguf-py's ``GGUFReader``)::

    ModelOpt NVFP4        <m>.weight u8 [out, in/2], .weight_scale f8e4m3 [out, in/16], .weight_scale_2 f32 (S)
    compressed-tensors    <m>.weight_packed u8, .weight_scale f8e4m3 (NVFP4) | u8 E8M0 (MXFP4),
                          .weight_global_scale f32 [1] = G = 1/S (NVFP4; the engine multiplies by fl(1/G))
    GGUF (llama.cpp)      NVFP4 blocks [+ F32 <t>.scale = S], MXFP4 blocks; Q/K rows of the llama
                          architecture un-permuted; names through gguf-py's own HF <-> GGUF table

Every name, dtype, block size and type above is read from the format spec, the tables the exporters write
with (formats/layouts.py: ``FLAVOUR_TENSORS``, ``CODEC_READ_AS``, the read-as formats' ``SafetensorsLayout`` /
``GGUFLayout``; readers/layouts.py looks them up); the readers name none of them.

Weight-only (W4A16) bases; an activation-quantized one, a checkpoint that is not NVFP4/MXFP4, fused shards
with different per-tensor scales, MoE experts, a path that leaves the directory, NaN scales: each refused
with one line (exitcodes: BadInputError, UnsafeFileError, CorruptFileError). Nothing read from a file is
ever used as a path except plain shard names checked to lie inside the directory.

The code plane: SHA-256 over the packed tensors in name order of ``name \\0 rows x cols \\0 codes`` (E2M1
pairs, element 2i in the low nibble, HF row order), the same for every container; the gate's own reader
(exporters/verify/code_plane.py) computes it independently.

Layering: readers import formats and the leaf utilities only (never nn, quantize, train, exporters).
"""
from pathlib import Path

from qatfactory.exitcodes import BadInputError

from .base import (  # noqa: F401
    INDEX,
    CodePlaneError,
    FormatMismatchError,
    NativeCheckpoint,
    NotNativeError,
    code_plane_sha256,
    inside,
)
from .gguf_file import read_gguf
from .safetensors_file import read_safetensors
from .targets import check_target, resolve_target  # noqa: F401


def read_native(path) -> NativeCheckpoint:
    """Read a native NVFP4 / MXFP4 checkpoint: a safetensors export directory (ModelOpt or
    compressed-tensors) or a GGUF file (or a directory holding exactly one)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model.path={str(path)!r} does not exist (a native NVFP4/MXFP4 export directory or "
                                f"GGUF file)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise NotNativeError(f"{p}: a file that is not a .gguf; give a native NVFP4/MXFP4 export directory "
                                 f"(ModelOpt / compressed-tensors safetensors) or a GGUF file")
        return read_gguf(p.parent, p.name)
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if ggufs:
        if len(ggufs) != 1:
            raise BadInputError(f"{p}: holds {len(ggufs)} GGUF files {ggufs}; give the file itself")
        inside(p, ggufs[0], "GGUF file")
        return read_gguf(p, ggufs[0])
    if not (p / "config.json").exists():
        raise NotNativeError(f"{p}: no config.json and no .gguf file: not a native NVFP4/MXFP4 checkpoint")
    return read_safetensors(p)
