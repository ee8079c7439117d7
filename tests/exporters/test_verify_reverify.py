"""No false alarm: an untouched export, verified again later against its student -- wherever that
student folder now lives -- PASSes. The config comparison leaves out the keys that say where a
config was read from (``_name_or_path``), which the published config.json no longer carries, and
treats ``dtype`` / ``torch_dtype`` as the one setting they are."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from tamper_helpers import edit_json, exported

from qatfactory.exporters import verify

CTM = "vllm-compressed-tensors-qwen3-mxfp4-w4a16"
MO = "vllm-modelopt-llama-nvfp4-w4a4"


def _config_row(v):
    return next(c for c in v.checks if c.tensor == "config.json" and c.check == "model config == student")


def test_student_loaded_from_another_folder_and_dtype_alias(tmp_path):
    cm, out = exported(tmp_path, CTM)
    assert verify(out, cm).verdict == "PASS"
    other = copy.copy(cm)
    # the same student as transformers reads it back from a folder: a load path and the new dtype name
    other.config = dict(cm.config, _name_or_path=str(tmp_path / "moved" / "student"), dtype="bfloat16")
    other.config.pop("torch_dtype", None)
    v = verify(out, other)
    assert v.verdict == "PASS", v.table()
    assert _config_row(v).status == "ok"
    # a dtype that is not the student's is still a difference, under either name
    edit_json(out / "config.json", lambda c: c.update(torch_dtype="float16"))
    v = verify(out, other, logits=False)
    assert _config_row(v).status == "FAIL" and "float16" in _config_row(v).detail, v.table()


def test_exported_config_has_no_local_path(tmp_path):
    from tamper_helpers import cell
    from test_exporters_helpers import cell_student

    import qatfactory.exporters as E
    cm = copy.copy(cell_student(cell(MO)))
    cm.config = dict(cm.config, _name_or_path="/home/someone/private/student")
    E.export(cm, tmp_path / "e", engine="vllm", flavour="modelopt")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert "_name_or_path" not in cfg
    assert verify(tmp_path / "e", cm).verdict == "PASS"
    # an export written before (it carried the path) is no false alarm either: engines do not read the key
    edit_json(tmp_path / "e" / "config.json", lambda c: c.update(_name_or_path="/home/someone/private/student"))
    v = verify(tmp_path / "e", cm)
    assert v.verdict == "PASS" and any("_name_or_path" in n for n in v.notes), v.table()


def test_train_cli_export_reverifies_against_the_runs_student(tmp_path):
    """``qatfactory train ... export=vllm train.save_student=true``: the export its run gated verifies
    PASS again against run_dir/student (as `qatfactory verify --against` loads it), and against a
    byte-identical copy of that folder elsewhere."""
    from qatfactory.faces.export import load_converted
    from qatfactory.faces.ship import train_and_ship
    from qatfactory.train.config import compose
    cfg = compose(["train=cpu_tiny", "data.synthetic=16", "data.seq_len=32", "data.eval_samples=4",
                   "train.eval_every=0", "train.max_steps=1", "train.lr=1e-3", f"run_dir={tmp_path / 'r'}",
                   "method=qad", "format=nvfp4_w4a16", "export=vllm", "train.save_student=true"])
    s = train_and_ship(cfg)
    s.pop("engine").destroy()
    assert s["verify_ok"] is True
    assert "_name_or_path" not in json.loads(Path(s["export_dir"], "config.json").read_text())
    v = verify(s["export_dir"], load_converted(s["student_dir"]))
    assert v.verdict == "PASS", v.table()
    moved = tmp_path / "elsewhere" / "student"
    shutil.copytree(s["student_dir"], moved)
    v = verify(s["export_dir"], load_converted(str(moved)))
    assert v.verdict == "PASS", v.table()
