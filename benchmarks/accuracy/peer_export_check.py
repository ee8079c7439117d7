"""An independent look at a peer's compressed-tensors export (llm-compressor's, AutoRound's): every packed weight
decoded twice, by this file's own few lines (the format's bit layout, read from the safetensors bytes) and by
compressed-tensors' own decompressor, and compared with the fake-quantized weights the peer itself reported.

    python benchmarks/accuracy/peer_export_check.py EXPORT_DIR [--peer-qdq PEER.safetensors]

What holds for a sound export, per quantized Linear:

* ``own == ct``: the two decoders give the same weight (in the dtype compressed-tensors decodes into);
* ``on grid``: the peer's fake-quantized weight divided by the exported block scale lies on the format's grid
  (NVFP4 / MXFP4: the 15 E2M1 values; int4: the integers -8..7), so the peer's weights are what the format can
  hold with those scales;
* ``== peer``: the decoded weight is the peer's fake-quantized weight.

Nothing here is shared with the peers or with qatfactory's exporters; compressed-tensors is the reader vLLM's
own loader uses.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional

# E2M1 by its 4 bits: sign, 2 exponent bits, 1 mantissa bit
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "pack-quantized")


def _nibbles(packed, per_word: int):
    """Low nibble first: byte b (or int32 word) holds elements k*per_word .. k*per_word+per_word-1."""
    import torch
    x = packed.to(torch.int64) & ((1 << (4 * per_word)) - 1)
    parts = [(x >> (4 * k)) & 0xF for k in range(per_word)]
    return torch.stack(parts, -1).reshape(packed.shape[0], -1)


def own_decode(fmt: str, t: Dict[str, Any], group: int):
    """(weight fp32, per-element scale fp32) from the module's tensors, by the format's layout alone."""
    import torch
    sf = t["weight_scale"]
    if fmt == "nvfp4-pack-quantized":
        codes = _nibbles(t["weight_packed"], 2)
        scale = sf.to(torch.float32) / t["weight_global_scale"].to(torch.float32).reshape(())
        vals = torch.tensor(E2M1)[codes]
    elif fmt == "mxfp4-pack-quantized":
        codes = _nibbles(t["weight_packed"], 2)
        # E8M0: the byte is a power-of-two exponent biased by 127
        scale = torch.exp2(sf.to(torch.int64).to(torch.float32) - 127.0)
        vals = torch.tensor(E2M1)[codes]
    elif fmt == "pack-quantized":
        rows, cols = (int(v) for v in t["weight_shape"].tolist())
        codes = _nibbles(t["weight_packed"], 8)[:, :cols]
        # symmetric int4 is stored offset by 8 so that every code is a non-negative nibble
        vals = (codes - 8).to(torch.float32)
        scale = sf.to(torch.float32)
        if "weight_zero_point" in t:
            raise ValueError("asymmetric int4 (weight_zero_point) is not a layout this check reads")
    else:
        raise ValueError(f"format {fmt!r}; this check reads {FORMATS}")
    if "weight_g_idx" in t:
        per = scale[:, t["weight_g_idx"].to(torch.int64)]
    else:
        per = scale.repeat_interleave(group, dim=1)[:, :vals.shape[1]]
    return vals * per, per


def _scheme_of(qc: Dict[str, Any]):
    from compressed_tensors.quantization import QuantizationScheme
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} config groups; this check reads exports of one scheme")
    return QuantizationScheme.model_validate(next(iter(groups.values())))


def check(export_dir: Path, peer_qdq: Optional[Path] = None) -> Dict[str, Any]:
    """Decode every packed weight of ``export_dir`` both ways, compare with ``peer_qdq`` (a safetensors file of
    the peer's fake-quantized weights under the Linear's ``<module>.weight`` name), return the summary."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from safetensors import safe_open
    from safetensors.torch import load_file

    d = Path(export_dir)
    qc = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"{d}/config.json: quantization_config.format {fmt!r}; this check reads {FORMATS}")
    scheme = _scheme_of(qc)
    group = int(scheme.weights.group_size)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors: Dict[str, Dict[str, Any]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                mod, _, local = k.rpartition(".")
                tensors.setdefault(mod, {})[local] = s.get_tensor(k)
    peer = load_file(str(peer_qdq)) if peer_qdq else {}
    out: Dict[str, Any] = {"format": fmt, "group_size": group, "modules": 0, "own_vs_ct_max": 0.0,
                           "own_eq_ct": True, "off_grid": 0, "peer_checked": 0, "peer_max_abs": 0.0,
                           "peer_max_rel": 0.0, "nonfinite": 0, "ct_dtype": None, "input_activations": scheme.input_activations
                           is not None, "input_global_scale": False}
    grid = torch.tensor(sorted(set(E2M1)))
    for mod, t in sorted(tensors.items()):
        if "weight_packed" not in t:
            continue
        out["modules"] += 1
        out["input_global_scale"] |= "input_global_scale" in t
        mine, per = own_decode(fmt, t, group)
        local = {k: v for k, v in t.items() if k.startswith("weight")}
        ct = compressor.decompress(local, scheme)["weight"]
        out["ct_dtype"] = str(ct.dtype).replace("torch.", "")
        diff = float((mine.to(ct.dtype).float() - ct.float()).abs().max())
        out["own_vs_ct_max"] = max(out["own_vs_ct_max"], diff)
        out["own_eq_ct"] &= torch.equal(mine.to(ct.dtype), ct)
        out["nonfinite"] += int((~torch.isfinite(ct)).sum())
        w = peer.get(mod + ".weight")
        if w is None:
            continue
        out["peer_checked"] += 1
        w = w.float()
        # the peer's weight in units of its block scale: on the format's grid, up to fp32 rounding of the division
        ratio = torch.where(per != 0, w / per, torch.zeros_like(w))
        if fmt == "pack-quantized":
            near = ratio.round().clamp(-8, 7)
        else:
            near = grid[(ratio.unsqueeze(-1) - grid).abs().argmin(-1)]
        # a peer that holds its weights in bf16 (AutoRound) rounds value x scale to 8 significant bits
        out["off_grid"] += int(((ratio - near).abs() > 2.0 ** -8 * near.abs().clamp_min(0.5)).sum())
        # a NaN would compare as no error at all: it counts as the largest one
        err = torch.nan_to_num((ct.float() - w).abs(), nan=float("inf"))
        out["peer_max_abs"] = max(out["peer_max_abs"], float(err.max()))
        out["peer_max_rel"] = max(out["peer_max_rel"], float((err / w.abs().clamp_min(1e-12)).max()))
    # compressed-tensors decodes NVFP4 in bf16 (x fp8 / G), so a peer's fp32 weight agrees to a bf16 rounding
    tol = 2.0 ** -8 if out["ct_dtype"] in ("bfloat16",) else 1e-6
    out["ok"] = bool(out["modules"] and out["own_eq_ct"] and out["off_grid"] == 0 and out["nonfinite"] == 0
                     and (not peer or (out["peer_checked"] == out["modules"] and out["peer_max_rel"] <= tol)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--peer-qdq", type=Path, default=None)
    a = ap.parse_args(argv)
    r = check(a.export_dir, a.peer_qdq)
    print(json.dumps(r, indent=1))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
