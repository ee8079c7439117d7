"""Export of a ZeRO-3 student gathered one layer at a time (train/stream_export.py).

Two gloo ranks train a tiny quantized Llama under ZeRO-3 (a partitioned live teacher too) with
``export.enabled``: the trainer's own end of run gathers the student unit by unit (two decoder layers,
then the embedding and the final norm one at a time) into a CPU copy on rank 0, saves it, exports it
and runs the gate. In the same processes afterwards the reference is made the way the trainer did it
before: every parameter gathered at once (DeepSpeed's GatheredParameters over the whole model) and the
live, gathered student saved and exported in place. What must hold:

* the gate PASSes on the streamed export of every engine of the format;
* the streamed student directory and exports are byte-identical to the reference's: every file but
  qatfactory.json (its creation time and export duration differ) and the safetensors headers (their
  metadata map comes out in no fixed order: compared parsed), whose data bytes are compared whole;
* no gather held more than one unit: the largest is a decoder layer, well under the model.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rank_launch import launch

RANK = r"""
import json, sys
from pathlib import Path
import torch
from qatfactory.train.config import compose
from qatfactory.faces.ship import train_and_ship
out, engines, over = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
s = train_and_ship(compose(over))   # the trainer (its ZeRO-3 hand-over streams), then the face ships
engine = s.pop("engine")
rank = torch.distributed.get_rank()
student = engine.module
from qatfactory import quantize as Q
from qatfactory.exporters import export, verify
from qatfactory.faces.ship import gate_summary
from qatfactory.train.stream_export import cpu_student
rec = {"trainer": {"verify": s.get("verify"), "gather": getattr(s.get("student"), "gather", None),
                   "export_dir": s.get("export_dir")}}
lm, rec["gather"] = cpu_student(student.lm, rank)            # once more, for the format's other engines
if rank == 0:
    for e in engines[1:]:
        c = Q.convert(lm)
        r = export(c, str(out / f"stream-{e}"), engine=e)
        rec[e] = gate_summary(verify(r.path, c))
# the reference: the whole model gathered at once, the live student saved and exported in place
import deepspeed
engine.empty_partition_cache()
params = [p for p in student.parameters() if hasattr(p, "ds_id")]
assert params, "not a ZeRO-3 run"
with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
    if rank == 0:
        Q.save_student(student.lm, str(out / "ref-student"))
        for e in engines:
            export(Q.convert(student.lm), str(out / f"ref-{e}"), engine=e)
if rank == 0:
    (out / "record.json").write_text(json.dumps(rec, default=str))
torch.distributed.barrier()
# leave the group before exit, as `qatfactory train` does: a rank whose interpreter exits with gloo's threads
# still joined to a peer that already left can abort in its teardown ("terminate called without an active
# exception") after finishing its work
torch.distributed.destroy_process_group()
print("finished 0", flush=True)
"""

COMMON = ["method=qad", "train=cpu_tiny", "data.synthetic=16", "data.seq_len=32", "data.eval_samples=4",
          "train.eval_every=0", "train.max_steps=2", "train.lr=1e-3", "model.tiny.initializer_range=0.3",
          "train.zero_stage=3", "train.micro_batch=1", "train.save_student=true", "train.plots=false",
          "train.tensorboard=false", "method.calib_samples=2", "export.enabled=true"]


def _files(d: Path):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _safetensors(raw: bytes):
    """(header, data bytes): safetensors writes its metadata map in no fixed order, so two writes of
    the same tensors may order the header's keys differently; the parsed header and every data byte
    must be equal."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _same_export(a: Path, b: Path):
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb) and len(fa) >= 2, (sorted(fa), sorted(fb))
    for name in fa:
        if name == "qatfactory.json":
            ja, jb = json.loads(fa[name]), json.loads(fb[name])
            for j in (ja, jb):
                j.pop("created"), j.pop("export_seconds")
            assert ja == jb
        elif name.endswith(".safetensors"):
            (ha, da), (hb, db) = _safetensors(fa[name]), _safetensors(fb[name])
            assert ha == hb, name
            assert da == db, name
        else:
            assert fa[name] == fb[name], name


@pytest.mark.slow
@pytest.mark.parametrize("fmt,engines", [("nvfp4_w4a16", ["vllm", "sglang"]),
                                         pytest.param("q4_k", ["llama_cpp"], marks=pytest.mark.llama_cpp)],
                         ids=["nvfp4-vllm-sglang", "q4_k-llama_cpp"])
def test_zero3_export_gathered_per_layer_is_the_whole_model_export(tmp_path, fmt, engines):
    run_dir = tmp_path / "run"
    over = COMMON + [f"format={fmt}", f"export={engines[0]}", f"run_dir={run_dir}"]
    rcs, log = launch(tmp_path, "z3", 2, [str(tmp_path), ",".join(engines), *over], code=RANK)
    assert rcs == [0, 0], log
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["trainer"]["verify"]["verdict"] == "PASS", rec["trainer"]
    for e in engines[1:]:
        assert rec[e]["verdict"] == "PASS", rec[e]
    g = rec["trainer"]["gather"]
    assert g == rec["gather"]
    assert g["units"] == 2 + 2 and g["max_unit_numel"] < g["total_numel"] / 2, g   # 2 layers, embedding, norm
    assert Path(rec["trainer"]["export_dir"]) == run_dir / f"export-{engines[0]}"
    _same_export(run_dir / "student", tmp_path / "ref-student")
    _same_export(run_dir / f"export-{engines[0]}", tmp_path / f"ref-{engines[0]}")
    for e in engines[1:]:
        _same_export(tmp_path / f"stream-{e}", tmp_path / f"ref-{e}")
