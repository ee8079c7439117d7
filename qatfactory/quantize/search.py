"""Block-scale search for calibration (max / mse / four_over_six): the numerics are the format's
(``qatfactory.formats.scale_search``); this is the calibration's entry, with its config's choices."""
from __future__ import annotations

import torch

from ..formats.scale_search import search_block_scales
from .config import CALIB_METHODS, _check_choice


def search_scales(fmt, w3: torch.Tensor, amax: torch.Tensor, method: str) -> torch.Tensor:
    """Block-scale bytes [G, R, K/block] for w3 [G, R, K] with per-tensor amax [G]
    (``qatfactory.formats.scale_search.search_block_scales``, after the config's check of ``method``)."""
    _check_choice("calibrate method", method, CALIB_METHODS)
    return search_block_scales(fmt, w3, amax, method)
