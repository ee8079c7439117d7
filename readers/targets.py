"""The format whose encoder rounds a native checkpoint's trained block scales: the base's own, or another
registered format that decodes the base's bytes to the very same values (compared on every tensor)."""
from __future__ import annotations

import torch

from qatfactory.formats import PackedTensor, get_format

from .base import FormatMismatchError, NativeCheckpoint


def resolve_target(ck: NativeCheckpoint, target: str = "auto") -> str:
    """The format whose encoder rounds the trained scales: 'auto' = the base's (the record's when it
    names a compatible one). Any other must decode the base's bytes to the same values."""
    if target == "auto":
        fs = ck.record.get("weight_formats") if isinstance(ck.record.get("weight_formats"), list) else []
        cand = [f for f in fs if isinstance(f, str)]
        target = ck.base_format
        if len(cand) == 1:
            try:
                check_target(ck, cand[0])
                target = cand[0]
            except (FormatMismatchError, ValueError):
                pass
    check_target(ck, target)
    return target


def check_target(ck: NativeCheckpoint, target: str) -> None:
    f = get_format(target)            # ValueError names the registered formats
    b = get_format(ck.base_format)
    s, sb = f.spec, b.spec
    why = None
    if s.role == "activation":
        why = "an activation format"
    elif s.element != sb.element or s.block_size != sb.block_size:
        why = f"{s.block_size}-element {s.scale_codec} blocks, the base has {sb.block_size}-element {sb.scale_codec} blocks"
    elif (s.global_scale is None) != (sb.global_scale is None):
        why = "a per-tensor scale where the base has none" if s.global_scale else "no per-tensor scale, the base has one"
    else:
        try:
            f.shift_scales(torch.zeros(1, 1, dtype=torch.uint8), torch.zeros(1, 1))
        except NotImplementedError:
            why = "no scale encoder to train with"
    if why is None:
        for n, p in ck.packed.items():
            q = PackedTensor(target, p.shape, p.codes, p.scales, p.global_scale)
            a, c = b.dequantize(p), f.dequantize(q)
            if not (torch.isfinite(a).all() and torch.equal(a, c)):
                why = f"{n} decodes differently (or to NaN)"
                break
    if why is not None:
        raise FormatMismatchError(f"format mismatch between the base ({ck.base_format}, {ck.container}) and the target "
                                  f"{target!r}: {why}; the trained scales must be bytes the base's layout decodes "
                                  f"exactly. Use the base's own format (method.scale.target=auto)")
