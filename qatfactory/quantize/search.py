"""Block-scale search for calibration: the byte grid around the format's own rule (max / mse / four_over_six)."""
from __future__ import annotations

import torch

from ..nn.fake_quant import (
    quant_kwargs,
    scale_grid,
)
from .config import CALIB_METHODS, _check_choice


def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2 y) for y > 0 from the float bits (torch.log2 rounds near powers of two)."""
    m, e = torch.frexp(y)
    return torch.where(m == 0.5, e - 1, e)


@torch.no_grad()
def search_scales(fmt, w3: torch.Tensor, amax: torch.Tensor, method: str) -> torch.Tensor:
    """Block-scale bytes [G, R, K/block] for w3 [G, R, K] with per-tensor amax [G].

    max: the format's own rule. mse: per block, the byte among the max-derived one and its
    neighbours on the scale grid (E4M3: -6..+2 steps; E8M0: -1..+1) with the least squared error.
    four_over_six: per block, the better of scaling the block max to 6 or to 4 (NVIDIA's
    "Four Over Six"; with the exporter's fixed g = amax/2688 a scale above 448 saturates and loses)."""
    _check_choice("calibrate method", method, CALIB_METHODS)
    grid = scale_grid(fmt)
    if grid is None:
        raise NotImplementedError(f"block-scale calibration is not supported for {fmt.name!r}")
    kw = quant_kwargs(fmt, amax=amax)
    p = fmt.quantize(w3, **kw)
    base = p.scales
    if method == "max":
        return base
    x = w3.float()
    xb = x.reshape(*base.shape, -1)

    def err(c):
        y = fmt.dequantize(fmt.quantize(w3, scales=c, **kw)).reshape(xb.shape)
        return ((y - xb) ** 2).sum(-1)

    if method == "mse":
        lo, hi = (1, 0x7E) if grid == "e4m3" else (0, 254)
        offs = [o for o in (range(-6, 3) if grid == "e4m3" else range(-1, 2)) if o != 0]
        cands = [base] + [(base.int() + o).clamp(lo, hi).to(torch.uint8) for o in offs]
    else:
        amax_b = xb.abs().amax(-1)
        zero = amax_b == 0
        if grid == "e4m3":
            g = p.global_scale.float() if p.global_scale is not None else torch.ones((), device=w3.device)
            g = g.reshape(*g.shape, *([1] * (amax_b.ndim - g.ndim)))
            from ..formats import codecs as C
            b6 = base
            b4 = C.e4m3_encode((amax_b / (4.0 * g)).clamp(C.E4M3_MIN_SUBNORMAL, C.E4M3_MAX))
        else:
            safe = torch.where(zero, torch.ones_like(amax_b), amax_b)
            b6 = (_ceil_log2(safe / 6.0) + 127).clamp(0, 254).to(torch.uint8)
            b4 = (_ceil_log2(safe / 4.0) + 127).clamp(0, 254).to(torch.uint8)
        cands = [torch.where(zero, base, b6), torch.where(zero, base, b4)]
    best, best_err = cands[0], err(cands[0])
    for c in cands[1:]:
        e = err(c)
        better = e < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, e, best_err)
    return best
