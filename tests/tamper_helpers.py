"""Helpers for the tampering tests (no tests in here): export a matrix cell, edit the files the way
a hostile or careless user would, and hide a third-party library."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

import torch

from test_exporters_helpers import cell_student

from qatfactory.exporters import export
from qatfactory.exporters.matrix import CELLS


def cell(cell_id: str):
    return next(c for c in CELLS if c.id == cell_id)


def exported(tmp_path: Path, cell_id: str, name: str = "e", **kw):
    c = cell(cell_id)
    cm = cell_student(c)
    out = tmp_path / name
    export(cm, out, engine=c.engine, flavour=c.flavour, **kw)
    return cm, out


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def edit_tensors(out: Path, fn: Callable[[Dict[str, torch.Tensor]], None], fname: str = "model.safetensors") -> None:
    from safetensors.torch import load_file, save_file
    sd = load_file(str(out / fname))
    sd = {k: v.clone() for k, v in sd.items()}
    fn(sd)
    save_file(sd, str(out / fname), metadata={"format": "pt"})


def hide(monkeypatch, *modules: str) -> None:
    """Make ``import <module>`` (and every submodule) fail for the rest of the test."""
    for m in modules:
        for k in [k for k in sys.modules if k == m or k.startswith(m + ".")]:
            monkeypatch.setitem(sys.modules, k, None)
        monkeypatch.setitem(sys.modules, m, None)


def rows(v, status: Optional[str] = None):
    return {(c.tensor, c.check) for c in v.checks if status is None or c.status == status}


# ------------------------------------------------------------------------------ GGUF
def rewrite_gguf(path: Path, drop: Iterable[str] = (), extra: Optional[Dict[str, "object"]] = None,
                 kv: Optional[Dict[str, object]] = None, drop_kv: Iterable[str] = (),
                 retype: Optional[Dict[str, "object"]] = None) -> None:
    """Copy a GGUF with gguf-py's writer, leaving out tensors in ``drop`` and keys in ``drop_kv``,
    adding F32 ``extra`` tensors, overriding metadata ``kv`` (same value type) and declaring the
    bytes of the tensors in ``retype`` as another GGML type."""
    import numpy as np
    import gguf

    reader = gguf.GGUFReader(str(path))
    tmp = path.with_suffix(".tmp")
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(tmp), arch)
    kv = dict(kv or {})
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in set(drop_kv):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, kv.pop(f.name, f.contents()), vt, sub_type=sub)
    keep = [t for t in reader.tensors if t.name not in set(drop)]
    extra = {k: np.asarray(v, dtype=np.float32) for k, v in (extra or {}).items()}
    for t in keep:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, (retype or {}).get(t.name, t.tensor_type))
    for k, v in extra.items():
        w.add_tensor_info(k, v.shape, v.dtype, v.nbytes, gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in keep:
        w.write_tensor_data(t.data)
    for v in extra.values():
        w.write_tensor_data(v)
    w.close()
    tmp.replace(path)


def gguf_rw(path: Path):
    """A GGUFReader on a writable memory map: edits to .data / field parts land in the file."""
    import gguf
    return gguf.GGUFReader(str(path), "r+")
