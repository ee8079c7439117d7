"""The block-scale search as a format-level function (formats/scale_search.py, nothing of nn/quantize):
mse picks, per block, the byte of least squared error among the rule's byte and its grid neighbours
(E4M3: -6..+2 steps, E8M0: -1..+1; ties keep the rule's byte), each candidate scored here by the
format's own quantize -> dequantize one byte at a time; bad methods and formats without a one-byte
scale grid are refused by name. (tests/quantize/test_quantize.py checks four_over_six against ml_dtypes.)"""
import re

import pytest
import torch

from qatfactory.formats import get_format, list_formats
from qatfactory.formats.scale_search import SEARCH_METHODS, scale_grid, search_block_scales

GRID = [n for n in list_formats() if scale_grid(get_format(n)) and get_format(n).spec.role != "activation"]


def _kw(f, amax):
    return {"amax": amax} if f.spec.global_scale is not None else {}


def _w():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1, 8, 256, generator=g) * torch.logspace(-3, 0, 8)[None, :, None]
    w[0, 2, :64] = 0.0                                  # all-zero blocks
    return w


def test_the_grid_formats_are_the_nvfp4_and_mxfp4_families():
    assert {"nvfp4", "mxfp4"} <= set(GRID)
    assert scale_grid(get_format("q4_k")) is None


@pytest.mark.parametrize("name", GRID)
def test_max_is_the_formats_own_rule(name):
    f, w = get_format(name), _w()
    amax = w.abs().amax().reshape(1)
    assert torch.equal(search_block_scales(f, w, amax, "max"), f.quantize(w, **_kw(f, amax)).scales)


@pytest.mark.parametrize("name", GRID)
def test_mse_is_the_argmin_over_the_grid_neighbours(name):
    f, w = get_format(name), _w()
    amax = w.abs().amax().reshape(1)
    base = f.quantize(w, **_kw(f, amax)).scales
    grid = scale_grid(f)
    offs = [0] + [o for o in (range(-6, 3) if grid == "e4m3" else range(-1, 2)) if o != 0]
    lo, hi = (1, 0x7E) if grid == "e4m3" else (0, 254)
    bs = f.spec.block_size
    errs = []
    for o in offs:
        c = (base.int() + o).clamp(lo, hi).to(torch.uint8)
        y = f.dequantize(f.quantize(w, scales=c, **_kw(f, amax)))
        errs.append(((y - w) ** 2).reshape(*base.shape, bs).sum(-1))
    errs = torch.stack(errs)                                               # [offsets, G, R, K/block]
    best = torch.stack([(base.int() + o).clamp(lo, hi) for o in offs]).gather(0, errs.argmin(0)[None])[0]
    got = search_block_scales(f, w, amax, "mse")
    assert torch.equal(got, best.to(torch.uint8))        # argmin returns the first minimum: ties keep the rule
    assert bool((got != base).any())                     # the search moved some byte: it did something


def test_bad_method_and_format_are_refused_by_name():
    w = _w()
    with pytest.raises(ValueError, match=re.escape(f"method='l1'; allowed: {list(SEARCH_METHODS)}")):
        search_block_scales(get_format("nvfp4"), w, w.abs().amax().reshape(1), "l1")
    with pytest.raises(NotImplementedError, match="q4_k"):
        search_block_scales(get_format("q4_k"), w, w.abs().amax().reshape(1), "mse")
