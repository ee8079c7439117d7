"""KV-cache formats: how a serving engine stores the keys and values of attention, as data plus one
object per engine rule, in their own registry (a cache type is not a weight format: it has no
packed tensor in the checkpoint, at most one scale per layer for K and one for V).

    from qatfactory.formats.kv import get_kv_format, list_kv_formats
    f = get_kv_format("fp8_e4m3")
    s = f.scale(amax)                  # the per-layer scale the checkpoint carries (k_scale / v_scale)
    b = f.encode(k, s)                 # uint8 [..., row_bytes(head_dim)]: the engine's cache bytes
    y = f.decode(b, head_dim, s)       # float32, what the engine's attention reads back
    y = f.fake_quantize(k, s)          # decode(encode(k)) in k.dtype, straight-through gradient

Conventions shared by every KV format:

* ``x`` is one attention input [..., head_dim] (transformers' [batch, kv_heads, tokens, head_dim]);
  every block lies along head_dim inside one (token, head) row, as every engine stores it
  (vLLM/SGLang: per-token, per-head rows of the paged cache; llama.cpp: one row of
  n_kv_heads * head_dim per token, whose blocks never straddle a head because llama.cpp refuses a
  cache type whose block does not divide head_dim).
* ``scale`` is the per-tensor fp32 scale the engine loads from the checkpoint (None for formats
  without one, the llama.cpp types); ``scale(amax)`` computes it exactly as the exporter writes it.
* ``encode_ref`` / ``decode_ref`` are numpy references that follow the engine's code in its float32
  order; the torch ``encode`` must equal them byte for byte (tests/formats/test_kv.py), and each
  rule is compared there with a third-party implementation that runs on CPU (torch's and
  ml_dtypes' float8/float4 casts, libggml's quantizers) or named a transcription where none runs.

``head_order``: llama.cpp's ``llama`` architecture (Llama, Mistral, Mixtral) stores K in the row
order its converter permuted q/k into (within a head: 0, d/2, 1, d/2+1, ...; NeoX -> GPT-J RoPE), so
the blocks of a llama.cpp cache type cover other elements of K than in transformers' order;
:func:`gguf_k_order` gives that permutation. vLLM and SGLang keep transformers' order.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from .spec import _STE


@dataclass(frozen=True)
class KVCacheSpec:
    """Every rule of one engine's KV-cache write path, as data."""

    name: str
    engine: str                   # whose write path, with the file it follows
    element: str                  # "e4m3" | "e2m1" | "int8" | "int4" | "int5"
    block: int                    # elements along head_dim that share a block scale; 0 = none
    scale_rule: str               # the per-tensor scale: what the checkpoint stores and how it is used
    rounding: str                 # element rounding and saturation, in the engine's words
    static_scale: bool            # one calibrated scale per layer for K and one for V
    head_order: str               # "hf" | "gguf" (llama arch: K in the converter's permuted order)
    bits_per_element: float       # storage bits per K/V element (block scales included)
    oracle: str                   # the independent implementation the tests compare with
    overflow: str = "saturate"    # beyond the largest code: "saturate" | "nan" (SGLang's torch cast)
    vllm_cache_dtype: Optional[str] = None     # vLLM --kv-cache-dtype that runs this rule
    sglang_cache_dtype: Optional[str] = None   # SGLang --kv-cache-dtype
    modelopt_algo: Optional[str] = None        # hf_quant_config.json quantization.kv_cache_quant_algo
    ct_num_bits: Optional[int] = None          # compressed-tensors kv_cache_scheme (vLLM: 8-bit float only)
    llama_cpp_type: Optional[str] = None       # llama.cpp --cache-type-k / --cache-type-v
    ggml_type: Optional[int] = None
    notes: str = ""

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def ct_scheme(self) -> Optional[Dict[str, Any]]:
        """compressed-tensors ``kv_cache_scheme`` for this rule (vLLM validates type float, 8 bits,
        strategy tensor|attn_head, symmetric), or None when the container cannot hold it."""
        if self.ct_num_bits is None:
            return None
        return {"num_bits": self.ct_num_bits, "type": "float", "strategy": "tensor", "dynamic": False,
                "symmetric": True}


def gguf_k_order(head_dim: int) -> torch.Tensor:
    """index[j] = the transformers-order element that llama.cpp's ``llama`` architecture stores at
    position j of a K head (its converter's q/k row permutation: view [2, d/2], swap, flatten)."""
    if head_dim % 2:
        raise ValueError(f"gguf_k_order: head_dim={head_dim} must be even")
    return torch.arange(head_dim).reshape(2, head_dim // 2).t().reshape(-1)


FP8_MAX = 448.0
_SCALE_MIN_NORMAL = 2.0 ** -126


def bf16_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= s, as float32 (s finite and > 0, so its sign bit is clear): the
    float32 bits with anything in their low half carried into the upper half, which is kept."""
    b = int(s.to(torch.float32).reshape(()).view(torch.int32))
    return torch.tensor((b + 0xFFFF) & ~0xFFFF, dtype=torch.int32).view(torch.float32)


def modelopt_kv_scale(name: str, amax) -> torch.Tensor:
    """fp32(amax) / 448 as one IEEE float32 division: the k_scale / v_scale ModelOpt's exporter writes
    (``unified_export_hf``: "kv cache scale as amax / 448 for both FP8 and NVFP4") and that
    compressed-tensors' FP8 observer computes (max / FP8 max). Guard (ours): a zero or subnormal quotient
    (amax below ~5e-36, an all-zero K) becomes 1.0, the scale vLLM assumes when a checkpoint has none;
    such a tensor encodes to zeros either way. NaN/Inf/negative amax is refused."""
    a = torch.as_tensor(amax, dtype=torch.float32).detach()
    if a.numel() != 1 or not bool(torch.isfinite(a).all()) or float(a.reshape(-1)[0]) < 0:
        raise ValueError(f"{name}: amax must be one finite float >= 0, got {amax!r}")
    s = a.reshape(()).cpu() / torch.tensor(FP8_MAX, dtype=torch.float32)
    return torch.ones_like(s) if float(s) < _SCALE_MIN_NORMAL else s


def amax_over_448(name: str, amax) -> torch.Tensor:
    """The per-layer scale every static-scale KV format uses: :func:`modelopt_kv_scale` rounded UP to a
    bfloat16 value (1.0, the guard's value, is one already).

    Why the rounding: vLLM 0.24 holds k_scale / v_scale in ``KVCacheScaleParameter``
    (``quantization/kv_cache.py``: ``torch.tensor(-1.0)``, created while the model's dtype is torch's
    default, filled by ``param.data.copy_(loaded)``), so a bf16 model divides by bf16(s), not by the
    float32 s of the file. Read back from a served model (H100, 2026-12-06): every exported scale that
    was not already a bf16 value came back moved by up to 0.32%. SGLang 0.5.17 keeps the scales in
    float32. A bf16 value passes unchanged through a cast to bf16, to fp16 (within its normal range,
    s >= 2**-14; the gate checks the export's dtype) and to fp32, so one scale is exact in every
    engine. Rounding up, not to nearest, keeps the calibrated amax within 448 * s (no saturation of
    what calibration saw)."""
    return bf16_ceil(modelopt_kv_scale(name, amax))


class KVCacheFormat:
    """Base class. Subclasses implement encode / decode / encode_ref / decode_ref / row_bytes and,
    for static-scale formats, scale()."""

    spec: KVCacheSpec

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"<KVCacheFormat {self.spec.name}: {self.spec.engine}>"

    # -- checks -----------------------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        b = self.spec.block
        if b and head_dim % b:
            raise ValueError(f"{self.name}: head_dim={head_dim} is not a multiple of the block size {b} "
                             f"(the engine refuses this cache type for the model: "
                             f"{'llama.cpp: block size does not divide n_embd_head' if self.spec.llama_cpp_type else 'vLLM: head_size must be a multiple of 16'})")

    def _scale_arg(self, scale) -> Optional[torch.Tensor]:
        if not self.spec.static_scale:
            if scale is not None:
                raise ValueError(f"{self.name}: this cache type has no per-tensor scale (got scale={scale!r})")
            return None
        if scale is None:
            raise ValueError(f"{self.name}: needs the per-layer scale (k_scale / v_scale); calibrate the "
                             f"KV scales first")
        s = torch.as_tensor(scale, dtype=torch.float32)
        if s.numel() != 1 or not bool(torch.isfinite(s).all()) or not float(s.reshape(-1)[0]) > 0:
            raise ValueError(f"{self.name}: scale must be one finite float32 > 0, got {scale!r}")
        return s.reshape(())

    @staticmethod
    def _finite(name: str, x) -> None:
        ok = bool(torch.isfinite(x).all()) if isinstance(x, torch.Tensor) else bool(np.isfinite(x).all())
        if not ok:
            raise ValueError(f"{name}: K/V contain NaN or Inf; no engine defines a cache encoding for them")

    # -- the API ----------------------------------------------------------------------------
    def scale(self, amax) -> Optional[torch.Tensor]:
        """The per-tensor scale the exporter writes for a calibrated amax (None: no scale)."""
        return None

    def row_bytes(self, head_dim: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, x: torch.Tensor, scale=None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, b: torch.Tensor, head_dim: int, scale=None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def encode_ref(self, x: np.ndarray, scale=None) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode_ref(self, b: np.ndarray, head_dim: int, scale=None) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def values(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        """float32 decode(encode(x)); subclasses may compute it without building the bytes (on the
        tensor's device), which tests/formats/test_kv.py holds equal to the byte path."""
        return self.decode(self.encode(x, scale), x.shape[-1], scale)

    def fake_quantize(self, x: torch.Tensor, scale=None) -> torch.Tensor:
        """decode(encode(x)) in x.dtype (what the engine's attention reads, rounded to the model dtype
        as its dequantizing kernels do), with an identity straight-through gradient."""
        xd = x.detach()
        q = self.values(xd, scale).to(x.dtype)
        if not x.requires_grad:
            return q
        return _STE.apply(x, q, torch.empty(0, device=x.device))


# ----------------------------------------------------------------------------- registry
KV_REGISTRY: Dict[str, KVCacheFormat] = {}
_RULE_MODULES = ("kv_fp8", "kv_nvfp4", "kv_ggml")
_loaded = False


def register_kv(fmt: KVCacheFormat) -> KVCacheFormat:
    if fmt.spec.name in KV_REGISTRY:
        raise ValueError(f"KV-cache format {fmt.spec.name!r} is already registered")
    KV_REGISTRY[fmt.spec.name] = fmt
    return fmt


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for m in _RULE_MODULES:
            importlib.import_module(f"{__package__}.{m}")


def get_kv_format(name) -> KVCacheFormat:
    if isinstance(name, KVCacheFormat):
        return name
    _load()
    try:
        return KV_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV-cache format {name!r}; registered: {sorted(KV_REGISTRY)}") from None


def list_kv_formats() -> List[str]:
    _load()
    return sorted(KV_REGISTRY)


def kv_formats_for(engine: str) -> List[str]:
    """The KV formats an engine runs: 'vllm', 'sglang' or 'llama_cpp'."""
    key = {"vllm": "vllm_cache_dtype", "sglang": "sglang_cache_dtype", "llama_cpp": "llama_cpp_type"}.get(engine)
    if key is None:
        raise ValueError(f"kv_formats_for: engine={engine!r}; allowed: vllm, sglang, llama_cpp")
    return [n for n in list_kv_formats() if getattr(get_kv_format(n).spec, key)]


def markdown_table() -> str:
    """The table of KV-cache formats in docs/kv-cache.md (``python -m qatfactory.formats.kv``)."""
    rows = ["| name | engine write path followed | block | per-layer scale | rounding | bits/element | serve with | oracle |",
            "|---|---|---|---|---|---|---|---|"]
    for name in list_kv_formats():
        s = get_kv_format(name).spec
        serve = "; ".join(x for x in (
            f"vLLM `--kv-cache-dtype {s.vllm_cache_dtype}`" if s.vllm_cache_dtype else "",
            f"SGLang `--kv-cache-dtype {s.sglang_cache_dtype}`" if s.sglang_cache_dtype else "",
            f"llama.cpp `--cache-type-k {s.llama_cpp_type} --cache-type-v {s.llama_cpp_type}`" if s.llama_cpp_type
            else "") if x)
        rows.append(f"| `{s.name}` | {s.engine} | {s.block or 'per tensor'} | "
                    f"{'yes: ' + s.scale_rule if s.static_scale else 'none (' + s.scale_rule + ')'} | {s.rounding} | "
                    f"{s.bits_per_element:g} | {serve} | {s.oracle} |")
    return "\n".join(rows)


if __name__ == "__main__":    # run as a script, this file is not the registry module: use the package's
    from qatfactory.formats.kv import markdown_table as _table
    print(_table())
