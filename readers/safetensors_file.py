"""ModelOpt and compressed-tensors safetensors checkpoints (vLLM / SGLang) read back as PackedTensors.

What is matched comes from the format spec (readers/layouts.py): the container's quant_method / producer
names and tensor suffixes (``formats.layouts.FLAVOUR_TENSORS``), each codec family's compressed-tensors
format name, ModelOpt quant_algo, block size and scale dtype (its read-as format's ``SafetensorsLayout``).
The files are read with safetensors' own ``safe_open``."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import torch
from safetensors import safe_open

from qatfactory.exitcodes import BadInputError, CorruptFileError
from qatfactory.formats import PackedTensor
from qatfactory.formats import layouts as L

from . import layouts as R
from .base import (
    NativeCheckpoint,
    NotNativeError,
    check_claimed_sizes,
    check_hf_config,
    export_record,
    json_object,
    shards,
)

WEIGHT = ".weight"     # the HF parameter name of a linear's weight: <module>.weight


def _or(names) -> str:
    names = list(names)
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def quant_config(d: Path, cfg: Dict[str, Any]) -> Tuple[str, R.ReadLayout, bool]:
    """(container flavour, codec family, activations quantized) from config.json / hf_quant_config.json."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict) and (d / L.MODELOPT_CONFIG_FILE).exists():
        hq = json_object(d, L.MODELOPT_CONFIG_FILE)
        q = hq.get("quantization") if isinstance(hq.get("quantization"), dict) else {}
        qc = dict(q, quant_method=L.MODELOPT if (hq.get("producer") or {}).get("name") == L.MODELOPT else None)
    if not isinstance(qc, dict):
        raise NotNativeError(f"{d}: config.json has no quantization_config: a high-precision checkpoint, not a native "
                             f"4-bit one. Scale adapters train the block scales of an NVFP4/MXFP4 export (quantize and "
                             f"export it first, e.g. qatfactory train method=ptq export=vllm)")
    qm = qc.get("quant_method")
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    acts = [g.get("input_activations") for g in groups.values() if isinstance(g, dict)]
    if qm == L.MODELOPT:
        algos = R.by_modelopt_algo()
        algo = str(qc.get("quant_algo") or "").upper()
        if algo not in algos:
            w4a16 = [n for n, (_, a) in algos.items() if not a]
            raise NotNativeError(f"{d}: ModelOpt quant_algo={qc.get('quant_algo')!r}; scale adapters need "
                                 f"{_or(sorted(algos))} (weight-only: {_or(w4a16)})")
        r, w4a4 = algos[algo]
        # a W4A4 algorithm name over config groups that all quantize no activations is weight-only
        return L.MODELOPT, r, w4a4 and not (acts and all(a is None for a in acts))
    if qm == L.COMPRESSED_TENSORS:
        lay = R.by_ct_format()
        fmts = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        fmts.discard(None)
        fmts.discard(L.CT_MIXED_FORMAT)
        if len(fmts) != 1 or next(iter(fmts)) not in lay:
            raise NotNativeError(f"{d}: compressed-tensors format {sorted(fmts)}; scale adapters need "
                                 f"{_or(lay)} (one scheme)")
        return L.COMPRESSED_TENSORS, lay[fmts.pop()], any(a is not None for a in acts)
    raise NotNativeError(f"{d}: quantization_config quant_method={qm!r}; scale adapters need a ModelOpt NVFP4 or "
                         f"compressed-tensors NVFP4/MXFP4 export, or a GGUF with NVFP4/MXFP4 tensors")


def read_safetensors(d: Path) -> NativeCheckpoint:
    cfg = json_object(d, "config.json")
    container, r, w4a4 = quant_config(d, cfg)
    if w4a4:
        raise NotNativeError(f"{d}: an activation-quantized (W4A4) checkpoint; scale adapters train weight-only "
                             f"(W4A16) bases: export the base without activation quantization")
    check_hf_config(d, cfg)
    sd: Dict[str, torch.Tensor] = {}
    files = shards(d)
    for fn in files:
        try:
            with safe_open(str(d / fn), framework="pt") as f:
                for k in f.keys():
                    if k in sd:
                        raise CorruptFileError(f"{d / fn}: tensor {k} is stored twice")
                    sd[k] = f.get_tensor(k)
        except BadInputError:
            raise
        except Exception as e:
            raise CorruptFileError(f"{d / fn}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    emb = sd.get("model.embed_tokens.weight")
    check_claimed_sizes(d / "config.json", cfg, sd, r"^model\.layers\.(\d+)\.",
                        tuple(emb.shape) if emb is not None and emb.ndim == 2 else None)
    names = L.FLAVOUR_TENSORS[container]
    # any flavour's activation scale marks a W4A4 module, whatever the config claims
    act_keys = sorted({t.input_scale for t in L.FLAVOUR_TENSORS.values()})
    packed: Dict[str, PackedTensor] = {}
    bs, want_sdt = r.block_size, r.scale_dtype
    for key in sorted(k for k in sd if k.endswith(names.block_scales)):
        m = key[: -len(names.block_scales)]
        codes, sc = sd.pop(m + names.codes, None), sd.pop(key)
        if codes is None:
            raise CorruptFileError(f"{d}: {key} without {m}{names.codes}")
        for w4a4_key in act_keys:
            if m + w4a4_key in sd:
                raise NotNativeError(f"{d}: {m}{w4a4_key}: an activation-quantized (W4A4) module; scale adapters "
                                     f"train weight-only (W4A16) bases")
        if codes.dtype != torch.uint8 or codes.ndim != 2 or sc.dtype != want_sdt or \
                tuple(sc.shape) != (codes.shape[0], codes.shape[1] * 2 // bs):
            raise CorruptFileError(f"{d}: {m}: codes {codes.dtype} {tuple(codes.shape)} / scales {sc.dtype} "
                                   f"{tuple(sc.shape)} are not {r.label} (uint8 [out, in/2], "
                                   f"{str(want_sdt)[6:]} [out, in/{bs}])")
        g = None
        if r.has_global_scale:
            gk = names.global_scale
            s = sd.pop(m + gk, None)
            if s is None or s.dtype != torch.float32 or s.numel() != 1:
                raise CorruptFileError(f"{d}: {m}{gk} missing or not one float32")
            # a divisor G = 1/S: the engine multiplies by fl(1/G)
            g = torch.ones((), dtype=torch.float32) / s.reshape(()) if names.global_scale_divides else \
                s.reshape(()).clone()
            if not bool(torch.isfinite(g)) or float(g) <= 0:
                raise CorruptFileError(f"{d}: {m}: per-tensor scale {float(g)} is not a positive finite number")
        packed[m + WEIGHT] = PackedTensor(r.read_as, (codes.shape[0], codes.shape[1] * 2), codes.contiguous(),
                                          sc.contiguous().view(torch.uint8), g)
    if not packed:
        raise NotNativeError(f"{d}: no {r.label} tensors (no *{names.block_scales}) in the checkpoint")
    check_fused(d, packed)
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    return NativeCheckpoint(d, container, r.label, r.read_as, cfg, packed, sd, files, record=export_record(d))


def check_fused(d, packed: Dict[str, PackedTensor]) -> None:
    """vLLM/SGLang load q/k/v and gate/up into one layer with ONE per-tensor scale (the max): a base
    whose shards differ is served differently from what its own bytes say, so it is refused."""
    mods = {n[: -len(WEIGHT)] for n in packed}
    for m in sorted(mods):
        for first, rest in ((".q_proj", (".k_proj", ".v_proj")), (".gate_proj", (".up_proj",))):
            if not m.endswith(first):
                continue
            stem = m[: -len(first)]
            grp = [m] + [stem + r for r in rest if stem + r in mods]
            gs = {int(packed[x + WEIGHT].global_scale.view(torch.int32)) for x in grp
                  if packed[x + WEIGHT].global_scale is not None}
            if len(gs) > 1:
                raise BadInputError(f"{d}: fused shards {grp} carry different per-tensor scales; vLLM/SGLang decode "
                                    f"them with one (the max), so the checkpoint's own bytes are not what serves. "
                                    f"Re-export the base with shared fused scales")
