"""Block-scale search under a format's own quantizer: the candidate bytes around the format's rule, each
block's squared error after the format's own quantize -> dequantize, and the best byte per block.

    from qatfactory.formats import get_format
    from qatfactory.formats.scale_search import search_block_scales
    s = search_block_scales(get_format("nvfp4"), w3, amax, "mse")   # uint8 [G, R, K/block]

Numerics only (torch and the codecs): quantize/ walks a model and calls this per weight."""
from __future__ import annotations

from typing import Optional

import torch

from . import codecs as C

# formats whose block scale is one byte on a grid (the search steps on it; nn/ rounds a learned float onto it)
GRID_CODECS = ("e4m3", "e8m0")
SEARCH_METHODS = ("max", "mse", "four_over_six")


def scale_grid(fmt) -> Optional[str]:
    """'e4m3' / 'e8m0' for the NVFP4 / MXFP4 families (one scale byte per block), else None."""
    s = fmt.spec
    if s.element == "e2m1" and s.scale_codec in GRID_CODECS and s.super_block == s.block_size:
        return s.scale_codec
    return None


def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2 y) for y > 0 from the float bits (torch.log2 rounds near powers of two)."""
    m, e = torch.frexp(y)
    return torch.where(m == 0.5, e - 1, e)


def _candidates(grid: str, p, w3: torch.Tensor, xb: torch.Tensor, method: str) -> list:
    """The scale bytes to try, the format's own (max-derived) bytes first.

    mse: the rule's byte and its neighbours on the scale grid (E4M3: -6..+2 steps; E8M0: -1..+1).
    four_over_six: the block max scaled to 6 (the rule) or to 4 (NVIDIA's "Four Over Six"; with the
    exporter's fixed g = amax/2688 a scale above 448 saturates and loses); all-zero blocks keep the rule's."""
    base = p.scales
    if method == "mse":
        lo, hi = (1, 0x7E) if grid == "e4m3" else (0, 254)
        offs = [o for o in (range(-6, 3) if grid == "e4m3" else range(-1, 2)) if o != 0]
        return [base] + [(base.int() + o).clamp(lo, hi).to(torch.uint8) for o in offs]
    amax_b = xb.abs().amax(-1)
    zero = amax_b == 0
    if grid == "e4m3":
        g = p.global_scale.float() if p.global_scale is not None else torch.ones((), device=w3.device)
        g = g.reshape(*g.shape, *([1] * (amax_b.ndim - g.ndim)))
        b6 = base
        b4 = C.e4m3_encode((amax_b / (4.0 * g)).clamp(C.E4M3_MIN_SUBNORMAL, C.E4M3_MAX))
    else:
        safe = torch.where(zero, torch.ones_like(amax_b), amax_b)
        b6 = (_ceil_log2(safe / 6.0) + 127).clamp(0, 254).to(torch.uint8)
        b4 = (_ceil_log2(safe / 4.0) + 127).clamp(0, 254).to(torch.uint8)
    return [torch.where(zero, base, b6), torch.where(zero, base, b4)]


@torch.no_grad()
def search_block_scales(fmt, w3: torch.Tensor, amax: torch.Tensor, method: str) -> torch.Tensor:
    """Block-scale bytes [G, R, K/block] for w3 [G, R, K] with per-tensor amax [G] (used only by formats
    with a global scale).

    max: the format's own rule. mse / four_over_six: per block, the candidate (``_candidates``) whose
    dequantized block has the least squared error against w3; ties keep the earlier candidate."""
    if method not in SEARCH_METHODS:
        raise ValueError(f"scale search method={method!r}; allowed: {list(SEARCH_METHODS)}")
    grid = scale_grid(fmt)
    if grid is None:
        raise NotImplementedError(f"block-scale calibration is not supported for {fmt.name!r}")
    kw = {"amax": amax} if amax is not None and fmt.spec.global_scale is not None else {}
    p = fmt.quantize(w3, **kw)
    if method == "max":
        return p.scales
    xb = w3.float().reshape(*p.scales.shape, -1)

    def err(c):
        y = fmt.dequantize(fmt.quantize(w3, scales=c, **kw)).reshape(xb.shape)
        return ((y - xb) ** 2).sum(-1)

    cands = _candidates(grid, p, w3, xb, method)
    best, best_err = cands[0], err(cands[0])
    for c in cands[1:]:
        e = err(c)
        better = e < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, e, best_err)
    return best
