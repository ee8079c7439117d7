"""What a reader matches in a container, looked up in the format spec (qatfactory/formats/layouts.py and the
registered formats' layout records): the same tables the exporters write with, so a layout change in the spec
is one the readers follow, and no reader code names a format, a tensor suffix, a scale dtype or a block size.

A frozen-code codec family (``CODEC_READ_AS``: the codecs whose checkpoints read back as one format) gives:

* its read-as format and that format's ``SafetensorsLayout`` (ct_format, modelopt_algo, group_size,
  scale_dtype) and ``GGUFLayout`` (the ggml type its blocks are repacked into);
* the format whose own bytes are blocks of that ggml type (GGML_BLOCKS codec), which decodes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from qatfactory.formats import REGISTRY, get_format
from qatfactory.formats import layouts as L


@dataclass(frozen=True)
class ReadLayout:
    """One codec family as a reader sees it."""

    codec: L.Codec
    read_as: str                          # the registered format the stored bytes decode as
    block_size: int                       # elements per block scale
    scale_dtype: torch.dtype              # the safetensors dtype of the block scales
    has_global_scale: bool                # an fp32 per-tensor scale beside the blocks
    ct_format: Optional[str]              # compressed-tensors "format"
    modelopt_algo: Optional[Tuple[str, str]]   # ModelOpt quant_algo (W4A4, W4A16)
    ggml_type: Optional[L.GGMLType]       # the GGUF blocks it is repacked into
    ggml_blocks_format: Optional[str]     # the format whose own bytes are those blocks

    @property
    def label(self) -> str:
        """The layout name a checkpoint of this codec records (NativeCheckpoint.layout, scale files)."""
        return self.codec.value


def blocks_format(ggml_type) -> str:
    """The one registered format whose own bytes (to_bytes) are GGUF blocks of ``ggml_type``."""
    hits = sorted(f.name for f in REGISTRY.values()
                  if f.spec.gguf is not None and f.spec.gguf.codec is L.Codec.GGML_BLOCKS
                  and f.spec.gguf.ggml_type == ggml_type)
    if len(hits) != 1:
        raise ValueError(f"GGUF type {L.GGMLType(ggml_type).name}: {len(hits)} registered formats declare its blocks "
                         f"as their own bytes ({hits}); a reader needs exactly one")
    return hits[0]


def read_layouts() -> Dict[L.Codec, ReadLayout]:
    """Every codec family a native checkpoint may hold, from its read-as format's spec."""
    out = {}
    for codec, name in L.CODEC_READ_AS.items():
        spec = get_format(name).spec
        st, gg = spec.safetensors, spec.gguf
        if st is None or st.codec is not codec or spec.block_size != st.group_size:
            raise ValueError(f"format spec {name!r}: its safetensors layout is not the {codec.name} codec with one "
                             f"scale per {spec.block_size} elements, as CODEC_READ_AS says")
        gt = gg.ggml_type if gg is not None and gg.codec is codec else None
        out[codec] = ReadLayout(codec, name, spec.block_size, getattr(torch, st.scale_dtype),
                                spec.global_scale is not None, st.ct_format, st.modelopt_algo, gt,
                                blocks_format(gt) if gt is not None else None)
    return out


def by_ct_format() -> Dict[str, ReadLayout]:
    return {r.ct_format: r for r in read_layouts().values() if r.ct_format}


def by_modelopt_algo() -> Dict[str, Tuple[ReadLayout, bool]]:
    """ModelOpt quant_algo -> (layout, activations quantized)."""
    out = {}
    for r in read_layouts().values():
        if r.modelopt_algo:
            w4a4, w4a16 = r.modelopt_algo
            out[w4a4.upper()], out[w4a16.upper()] = (r, True), (r, False)
    return out


def by_ggml_type() -> Dict[L.GGMLType, ReadLayout]:
    return {r.ggml_type: r for r in read_layouts().values() if r.ggml_type is not None}


def by_label(label: str) -> ReadLayout:
    """The codec family a recorded layout name ("nvfp4", "mxfp4": Codec values) stands for."""
    for r in read_layouts().values():
        if r.label == label:
            return r
    raise ValueError(f"layout {label!r}; allowed: {sorted(r.label for r in read_layouts().values())}")


def labels() -> Tuple[str, ...]:
    return tuple(r.label for r in read_layouts().values())


def safetensors_flavours() -> Tuple[str, ...]:
    return (L.MODELOPT, L.COMPRESSED_TENSORS)
