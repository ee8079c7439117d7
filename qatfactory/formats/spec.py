"""Format specs, packed tensors and the registry.

A *format* is one frozen :class:`FormatSpec` (every numerics rule as a field) plus one
object implementing :class:`Format` (numpy reference, torch emulator, pack/unpack).
Each ``formats/<name>.py`` ends with ``register(...)`` lines; nothing outside
``formats/`` branches on a format name. What each engine container holds is declared in the spec too
(``spec.gguf``, ``spec.safetensors``: typed records of layouts.py); exporters, the verify gate and the
kernels read them and branch on a codec family, so a new format that fits one needs no code there.

Conventions shared by every format (the public API, relied on by tests and users):

* ``x`` is a float32 / bf16 / fp16 tensor ``[..., K]``; blocks run along the last axis.
* ``quantize(x, ...) -> PackedTensor``; ``dequantize(p) -> float32 [..., K]``;
  ``fake_quantize(x) -> x.dtype`` equal to ``dequantize(quantize(x)).to(x.dtype)``
  with a straight-through gradient; ``to_bytes(p) -> np.uint8 [..., bytes_per_row]``
  in the engine's own byte layout; ``from_bytes(b, K) -> PackedTensor`` inverts it.
* ``quantize_ref(x_np, ...) -> np.uint8 [..., bytes_per_row]`` is the numpy reference
  that follows the engine's reference code in the same float32 order; the emulator
  must equal it byte for byte.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .layouts import Codec, GGUFLayout, NibbleOrder, SafetensorsLayout, ScaleRule, TieRule


@dataclass(frozen=True)
class FormatSpec:
    """Every rule of a format, as data. Adding an engine variant = a new spec + registry line."""

    name: str
    engine: str                  # whose numerics these are, with the version read
    element: str                 # "e2m1" | "uint4" | "int5" | "int6" | "int8"
    block_size: int              # elements sharing one scale
    super_block: int             # elements per engine block record (64 for ggml NVFP4, 256 for k-quants)
    bytes_per_block: int         # bytes per super_block in the engine layout (to_bytes)
    scale_codec: str             # "e4m3" | "ue4m3_ggml" | "e8m0" | "fp16" | "fp16+6bit"
    scale_rule: str              # a ScaleRule member where code dispatches on it, else the rule in words
    tie_rule: str                # a TieRule member ("rne" | "toward_zero" | "argmin_first") or the rule in words
    global_scale: Optional[str]  # e.g. "amax/2688 (decode)"; None when the format has none
    nibble_order: str            # a NibbleOrder member ("pairs" | "split_halves") or the layout in words
    oracle: str                  # the independent tool the tests compare against
    fallback: Optional[str] = None   # what the engine does when K % super_block != 0
    role: str = "weight"         # "weight" | "activation" | "both"
    symmetric: bool = True       # False for formats with mins (q4_k)
    notes: str = ""
    # what each engine container holds (layouts.py); None: that container cannot hold the format
    gguf: Optional[GGUFLayout] = None              # llama.cpp
    safetensors: Optional[SafetensorsLayout] = None  # vLLM / SGLang

    def __post_init__(self):
        # the typed rules: a value that spells a known rule becomes its enum member
        for fld, enum_cls in (("scale_rule", ScaleRule), ("tie_rule", TieRule), ("nibble_order", NibbleOrder)):
            v = getattr(self, fld)
            if not isinstance(v, enum_cls) and v in enum_cls._value2member_map_:
                object.__setattr__(self, fld, enum_cls(v))
        for fld, cls in (("gguf", GGUFLayout), ("safetensors", SafetensorsLayout)):
            v = getattr(self, fld)
            if v is not None and not isinstance(v, cls):
                raise TypeError(f"FormatSpec {self.name!r}: {fld}={v!r}; allowed: a {cls.__name__} or None")

    @property
    def ggml_type(self) -> Optional[int]:
        """The ggml type id when the format's own bytes (to_bytes) are GGUF blocks (a llama.cpp format),
        else None (a format the GGUF exporter repacks, or none)."""
        g = self.gguf
        return int(g.ggml_type) if g is not None and g.codec is Codec.GGML_BLOCKS else None

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per element (the per-tensor fp32 scale is not counted)."""
        return self.bytes_per_block * 8.0 / self.super_block

    def layout(self, container: str):
        """The format's layout record for ``container`` ("gguf" | "safetensors"), or None."""
        if container not in ("gguf", "safetensors"):
            raise ValueError(f"container={container!r}; allowed: 'gguf', 'safetensors'")
        return getattr(self, container)

    def as_dict(self) -> Dict[str, Any]:
        """The numerics record (qatfactory.json "numerics"): the rule fields, ggml_type, bits_per_weight."""
        d: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("gguf", "safetensors"):
                continue
            if f.name == "fallback":
                d["ggml_type"] = self.ggml_type
            d[f.name] = getattr(self, f.name)
        d["bits_per_weight"] = self.bits_per_weight
        return d


@dataclass
class PackedTensor:
    """A quantized tensor as the format stores it.

    * ``codes``: uint8. For E2M1 formats the codes packed in pairs along K
      (element 2i low nibble, 2i+1 high nibble) ``[..., K/2]``; other formats say in
      their module docstring what ``codes`` holds.
    * ``scales``: uint8 view of the block scales (E4M3 / E8M0 bytes) ``[..., K/block]``,
      or the format's own scale record.
    * ``global_scale``: float32 0-d decode scale (NVFP4: amax/2688) or None.
    * ``extra``: further named tensors a format needs (k-quant super-scales and mins).
    """

    format: str
    shape: Tuple[int, ...]
    codes: torch.Tensor
    scales: Optional[torch.Tensor] = None
    global_scale: Optional[torch.Tensor] = None
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device) -> "PackedTensor":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedTensor(self.format, self.shape, mv(self.codes), mv(self.scales),
                            mv(self.global_scale), {k: mv(v) for k, v in self.extra.items()})

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.format).spec

    def dequantize(self) -> torch.Tensor:
        return get_format(self.format).dequantize(self)

    def to_bytes(self) -> np.ndarray:
        return get_format(self.format).to_bytes(self)

    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size()
        for t in [self.scales, self.global_scale, *self.extra.values()]:
            if t is not None:
                n += t.numel() * t.element_size()
        return n


class _STE(torch.autograd.Function):
    """y = q (computed without grad); dy/dx = 1, or masked where the format clipped x."""

    @staticmethod
    def forward(ctx, x, q, mask):
        ctx.save_for_backward(mask)
        return q

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        if mask.numel() == 0:
            return g, None, None
        return g * mask.to(g.dtype), None, None


class Format:
    """Base class: subclasses implement quantize / dequantize / to_bytes / from_bytes /
    quantize_ref (and optionally dequantize_ref, clip_mask)."""

    spec: FormatSpec

    def __init__(self, spec: FormatSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"<Format {self.spec.name}: {self.spec.engine}>"

    # -- shape / input checks -------------------------------------------------------------
    def check_input(self, x) -> None:
        """Raise ValueError for shapes the engine cannot hold; names the fallback."""
        if x.ndim < 1:
            raise ValueError(f"{self.name}: expected a tensor [..., K], got a scalar")
        k = x.shape[-1]
        sb = self.spec.super_block
        if k % sb != 0:
            fb = f"; the engine's fallback for such rows is {self.spec.fallback}" if self.spec.fallback else ""
            raise ValueError(
                f"{self.name}: last dimension K={k} is not a multiple of the block size {sb}{fb}")

    @staticmethod
    def check_finite(name: str, x) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.numel():
                # min and max propagate NaN, and +-Inf is the max or the min: one reduction pass,
                # where isfinite().all() writes a mask first (10x slower on CPU here)
                lo, hi = torch.aminmax(x.detach())
                finite = torch.isfinite(lo) & torch.isfinite(hi)
            else:
                finite = torch.isfinite(x).all()
        else:
            finite = np.isfinite(x).all()
        if not bool(finite):
            raise ValueError(f"{name}: input contains NaN or Inf; this format defines no encoding for "
                             f"them in the engine's reference, so it refuses rather than return garbage")

    # -- the API ----------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, **kw) -> PackedTensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize(self, p: PackedTensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_bytes(self, p: PackedTensor) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def from_bytes(self, b, k: Optional[int] = None) -> PackedTensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def quantize_ref(self, x: np.ndarray, **kw) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantize_ref(self, b: np.ndarray, k: int) -> np.ndarray:
        """numpy decode of engine bytes; default goes through from_bytes + dequantize."""
        return self.dequantize(self.from_bytes(b, k)).numpy()

    def clip_mask(self, x: torch.Tensor, p: PackedTensor) -> Optional[torch.Tensor]:
        """Bool mask [..., K], True where x lies inside the representable range (for the
        clipped STE). None means the format never clips (identity STE)."""
        return None

    # -- frozen codes, moving block scales (scale-only adapters, nn/scale_adapter.py) ---------
    # dequantize(p) == (code_values(p) [..., nb, block] * block_multiplier(p)[..., None]), bit for bit;
    # shift_scales moves each block's scale by a factor 2^theta on the format's own scale grid.
    def code_values(self, p: PackedTensor) -> torch.Tensor:
        """float32 [..., K]: the values of the element codes before any scale (the decode table)."""
        raise NotImplementedError(f"{self.name}: no frozen-code decomposition (scale-only adapters need a format "
                                  f"with one scale byte per block: the NVFP4 / MXFP4 families)")

    def block_multiplier(self, p: PackedTensor) -> torch.Tensor:
        """float32 [..., K/block]: what dequantize multiplies each block's code values by."""
        raise NotImplementedError(f"{self.name}: no frozen-code decomposition (scale-only adapters need a format "
                                  f"with one scale byte per block: the NVFP4 / MXFP4 families)")

    def shift_scales(self, scales: torch.Tensor, log2_offset: torch.Tensor):
        """(bytes, clamped): each block scale byte moved to the byte the format's own scale encoder
        gives for value(byte) * 2^log2_offset, clamped to the grid's positive finite range (never a
        zero or NaN byte); ``clamped`` is True where the requested value lay outside that range.
        A byte the format cannot scale (zero, NaN, reserved) is returned unchanged. log2_offset == 0
        returns the bytes unchanged."""
        raise NotImplementedError(f"{self.name}: block scales cannot be shifted (scale-only adapters need a format "
                                  f"with one scale byte per block: the NVFP4 / MXFP4 families)")

    # -- scales kept between searches (quant.kquant_refresh_every, nn/kquant_refresh.py) --------
    def searches_scales(self, imatrix: bool) -> bool:
        """Whether quantize() finds its block scales by a search (with / without an importance matrix)
        that ``quantize(x, **scale_kwargs(p))`` can skip, quantizing x's elements under p's scales."""
        return False

    def scale_kwargs(self, p: PackedTensor) -> Dict[str, torch.Tensor]:
        """The quantize() keywords that give back p's block scales (see searches_scales)."""
        raise NotImplementedError(f"{self.name}: no scale search to skip")

    def fake_quantize(self, x: torch.Tensor, ste: str = "identity", **kw) -> torch.Tensor:
        """dequantize(quantize(x)) in x.dtype, with a straight-through gradient.

        ste="identity": dy/dx = 1 everywhere. ste="clipped": dy/dx = 0 where the format
        saturated x (outside the block's representable range), 1 elsewhere."""
        if ste not in ("identity", "clipped"):
            raise ValueError(f"fake_quantize: ste={ste!r}; allowed: 'identity', 'clipped'")
        return self.fake_quantize_packed(x, self.quantize(x.detach(), **kw), ste)

    def fake_quantize_packed(self, x: torch.Tensor, p: PackedTensor, ste: str = "identity") -> torch.Tensor:
        """fake_quantize's output for x given p = quantize(x.detach(), ...): dequantize(p) in x.dtype
        with the straight-through gradient (``clipped``: masked by clip_mask(x, p))."""
        if ste not in ("identity", "clipped"):
            raise ValueError(f"fake_quantize: ste={ste!r}; allowed: 'identity', 'clipped'")
        xd = x.detach()
        q = self.dequantize(p).to(x.dtype)
        mask = torch.empty(0, device=x.device)
        if ste == "clipped":
            m = self.clip_mask(xd, p)
            if m is not None:
                mask = m
        if not x.requires_grad:
            return q
        return _STE.apply(x, q, mask)


REGISTRY: Dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format to the registry (the one line a new format file ends with). Its spec's layout
    records tell the exporters what each engine container holds; no other code needs to name it."""
    name = fmt.spec.name
    if name in REGISTRY:
        raise ValueError(f"format {name!r} is already registered")
    REGISTRY[name] = fmt
    return fmt


def unregister(name: str) -> Format:
    """Remove a registered format (a plug-in's or a test's own); returns it."""
    if name not in REGISTRY:
        raise ValueError(f"format {name!r} is not registered; registered formats: {sorted(REGISTRY)}")
    return REGISTRY.pop(name)


def get_format(name: str) -> Format:
    if isinstance(name, Format):
        return name
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; registered formats: {sorted(REGISTRY)}") from None


def list_formats() -> List[str]:
    return sorted(REGISTRY)
