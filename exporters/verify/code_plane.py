"""Gate hook for scale-only adapters (Scale-QLoRA): the merged export keeps the base's code plane.

    res = verify(out_dir, merged_student)                       # the gate, as for every export
    check_code_plane(res, out_dir, base_dir, merged_student)    # + codes byte-identical to the base export
    check_training_logits(res, merged_student, logits, prompt)  # + the training forward's logits

Called by the ship paths of method=scale_adapter (train/methods/scale_adapter.py, ``qatfactory scales``) with the
base checkpoint the adapter was trained on. Both directories are read here with the containers' own
libraries (safetensors; gguf-py, Q/K rows un-permuted with transformers' GGUF code), nothing of the
reader that trained (readers/, qatfactory.readers) or of the exporters, and compared per 4-bit tensor:

* codes: the E2M1 code of every element equal (any container: ModelOpt / compressed-tensors pairs,
  GGUF NVFP4 / MXFP4 blocks); the code-plane SHA-256 of both sides in the row, defined as in
  readers/base.py (tensors in name order: ``name \\0 rows x bytes \\0`` + E2M1 pairs, element 2i low);
* per-tensor scale as the engine applies it (ModelOpt S, compressed-tensors fl(1/G), GGUF .scale): equal;
* every dense tensor equal in value (bytewise within one container);
* the scale bytes are the only thing that differs (their changed fraction is a note).

``check_training_logits``: the training forward's logits on the gate's prompt equal, bit for bit, those
of the merged student that the gate's logits rows compared the export with (float32 on CPU).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from qatfactory.formats import ConvertedModel

from .common import compare_values, inside, names_sample, read_json, same_bits, student_logits
from .gguf import Names, find_gguf, parse_ggml_blocks
from .result import FAIL, Malformed, Missing, VerifyResult, need
from .safetensors import detect_flavour, load_tensors


class _Plane:
    """What one directory holds per 4-bit tensor: codes [rows, K] (one per byte), scale bytes, S bits."""

    def __init__(self, container: str):
        self.container = container
        self.codes: Dict[str, np.ndarray] = {}
        self.scales: Dict[str, np.ndarray] = {}
        self.S: Dict[str, Optional[int]] = {}
        self.dense: Dict[str, torch.Tensor] = {}

    def sha256(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.codes):
            c = self.codes[name]
            pairs = (c[:, 0::2] & 0x0F) | ((c[:, 1::2] & 0x0F) << 4)
            h.update(name.encode() + b"\0" + f"{pairs.shape[0]}x{pairs.shape[1]}".encode() + b"\0")
            h.update(np.ascontiguousarray(pairs, dtype=np.uint8).tobytes())
        return h.hexdigest()


def _bits(x: torch.Tensor) -> int:
    return int(torch.as_tensor(x, dtype=torch.float32).reshape(-1)[0].view(torch.int32))


def _unpack(pairs: torch.Tensor) -> np.ndarray:
    b = pairs.contiguous().numpy().astype(np.uint8)
    out = np.empty((b.shape[0], b.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = b & 0x0F, b >> 4
    return out


def _read_safetensors(d: Path) -> _Plane:
    cfg = read_json(d, "config.json")
    qc = cfg.get("quantization_config") if isinstance(cfg.get("quantization_config"), dict) else {}
    flavour = detect_flavour(d, qc)
    if flavour is None:
        raise Malformed(f"{d}: config.json names no ModelOpt / compressed-tensors quantization")
    sd = load_tensors(d)
    plane = _Plane(flavour)
    code_key = ".weight" if flavour == "modelopt" else ".weight_packed"
    for k in sorted(x for x in sd if x.endswith(".weight_scale")):
        m = k[: -len(".weight_scale")]
        if m + code_key not in sd:
            raise Malformed(f"{d}: {k} without {m}{code_key}")
        name = m + ".weight"
        plane.codes[name] = _unpack(sd.pop(m + code_key))
        plane.scales[name] = sd.pop(k).contiguous().view(torch.uint8).numpy()
        if m + ".weight_scale_2" in sd:
            plane.S[name] = _bits(sd.pop(m + ".weight_scale_2"))
        elif m + ".weight_global_scale" in sd:
            G = sd.pop(m + ".weight_global_scale").reshape(()).float()
            plane.S[name] = _bits(torch.ones((), dtype=torch.float32) / G)
        else:
            plane.S[name] = None
    plane.dense = sd
    return plane


def _read_gguf(d: Path, student: ConvertedModel) -> _Plane:
    gguf = need("gguf")
    path = find_gguf(d)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    names = Names(gguf, student)
    proc = None
    if names.permute:
        cfg = student.config
        proc = need("transformers.modeling_gguf_pytorch_utils").LlamaTensorProcessor(config={
            "num_attention_heads": int(cfg["num_attention_heads"]),
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])})

    def hf_rows(arr: np.ndarray, gname: str) -> np.ndarray:
        if proc is not None and (".attn_q." in gname or ".attn_k." in gname):
            return np.ascontiguousarray(proc.process(arr, gname).weights)
        return arr

    plane = _Plane("gguf")
    for name, p in sorted(student.packed.items()):
        gname, _ = names(name)
        t = tensors.get(gname) if gname else None
        if t is None or t.tensor_type.name not in ("NVFP4", "MXFP4"):
            raise Malformed(f"{path.name}: {gname or name} missing or not NVFP4/MXFP4")
        rows, k = p.shape
        raw = hf_rows(np.asarray(t.data, dtype=np.uint8).reshape(rows, -1), gname)
        codes, sc = parse_ggml_blocks(raw, t.tensor_type.name, k)
        plane.codes[name], plane.scales[name] = codes, sc
        st = tensors.get(gname[: -len(".weight")] + ".scale")
        plane.S[name] = None if st is None else _bits(torch.tensor(float(np.asarray(st.data, np.float32).reshape(-1)[0])))
    for name, tt in student.dense.items():
        gname, e = names(name)
        t = tensors.get(gname) if gname else None
        if t is None or e is not None:
            continue        # the gate's own dense rows say whether it is missing
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        arr = hf_rows(np.ascontiguousarray(arr.reshape(tuple(tt.shape))), gname)
        plane.dense[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    return plane


def read_plane(d, student: ConvertedModel) -> _Plane:
    d = Path(d)
    if list(d.glob("*.gguf")):
        return _read_gguf(d, student)
    inside(d, "config.json")
    return _read_safetensors(d)


def check_code_plane(res: VerifyResult, export_dir, base_dir, student: ConvertedModel) -> Dict[str, str]:
    """Rows on ``res``: the export's code plane, per-tensor scales and dense tensors equal to the base
    checkpoint's; returns both code-plane SHA-256 digests (empty when a side could not be read)."""
    out: Dict[str, str] = {}
    planes: List[Tuple[str, Optional[_Plane]]] = []
    for label, d in (("export", export_dir), ("base", base_dir)):
        try:
            planes.append((label, read_plane(d, student)))
        except Missing as e:
            res.missing("code plane", f"{label} readable", e)
            planes.append((label, None))
        except (Malformed, OSError, ValueError, KeyError) as e:
            res.add("code plane", f"{label} readable", FAIL, f"{d}: {type(e).__name__}: {str(e)[:300]}")
            planes.append((label, None))
    ex, base = planes[0][1], planes[1][1]
    if ex is None or base is None:
        return out
    out = {"export": ex.sha256(), "base": base.sha256()}
    lost, extra = set(base.codes) - set(ex.codes), set(ex.codes) - set(base.codes)
    bad = [n for n in sorted(set(base.codes) & set(ex.codes))
           if base.codes[n].shape != ex.codes[n].shape or not np.array_equal(base.codes[n], ex.codes[n])]
    detail = (f"{len(bad)} tensors' codes differ: {names_sample(bad)}" if bad else
              f"missing {names_sample(lost)}" if lost else f"not in the base {names_sample(extra)}" if extra else
              f"{len(ex.codes)} tensors, every E2M1 code equal; sha256 {out['export'][:16]}... == base")
    res.ok_or_fail("code plane", "codes == base export", not (bad or lost or extra) and out["export"] == out["base"],
                   detail + ("" if out["export"] == out["base"] else f" (export {out['export'][:16]}..., base "
                                                                        f"{out['base'][:16]}...)"),
                   source=f"{ex.container} vs {base.container} read with their libraries")
    badS = [n for n in sorted(set(base.S) & set(ex.S)) if base.S[n] != ex.S[n]]
    res.ok_or_fail("code plane", "per-tensor scales == base", not badS,
                   f"differ: {names_sample(badS)}" if badS else
                   f"{sum(v is not None for v in ex.S.values())} per-tensor scales equal as the engine applies them")
    badD, n = [], 0
    for k, t in sorted(base.dense.items()):
        if k not in ex.dense:
            continue
        n += 1
        a, b = ex.dense[k], t
        same = same_bits(a, b) if ex.container == base.container else compare_values(a.float(), b.float())[0]
        if not same:
            badD.append(k)
    res.ok_or_fail("code plane", "dense tensors == base", not badD and n > 0,
                   f"differ: {names_sample(badD)}" if badD else
                   f"{n} dense tensors " + ("byte-identical" if ex.container == base.container else "equal in value"))
    nsc = sum(v.size for v in base.scales.values())
    ch = sum(int((ex.scales[k] != v).sum()) for k, v in base.scales.items() if k in ex.scales and
             ex.scales[k].shape == v.shape)
    res.notes.append(f"scale adapter: {ch}/{nsc} block scale bytes ({100.0 * ch / max(nsc, 1):.2f}%) differ from the "
                     f"base; code plane sha256 {out['export']}")
    return out


def check_training_logits(res: VerifyResult, student: ConvertedModel, train_logits: torch.Tensor,
                          prompt: List[int]) -> bool:
    """The training forward (its logits on ``prompt``, float32) == the merged student's, bit for bit. With
    the gate's logits rows (export == student) this closes export == what trained."""
    ref = student_logits(student, prompt, {})
    got = torch.as_tensor(train_logits).float().reshape(ref.shape) if torch.as_tensor(train_logits).numel() == \
        ref.numel() else None
    if got is None:
        return res.ok_or_fail("logits", "training forward == merged student", False,
                              f"training logits of shape {tuple(torch.as_tensor(train_logits).shape)}, the prompt's "
                              f"{tuple(ref.shape)}")
    eq, mad, n = compare_values(got, ref)
    return res.ok_or_fail("logits", "training forward == merged student", eq,
                          "bit-identical (float32, CPU)" if eq else f"{n} logits differ", mad,
                          "transformers model of the merged student's decoded weights")


__all__ = ["check_code_plane", "check_training_logits", "read_plane"]
