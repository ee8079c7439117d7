"""method=scale_adapter end to end on CPU: `qatfactory train method=scale_adapter model.path=<native export>`
lowers the loss by moving block scale bytes only; the merged export PASSes the gate with the code-plane hook
(codes == the base's, logits == the training forward, atol 0); two gloo ranks under ZeRO-2 (the deepspeed
launcher) agree with one process on the same global batch; bad input is one line with its exit code."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_exporters_helpers import student

from qatfactory import exitcodes as X
from qatfactory import native as N
from qatfactory.exporters import export

REPO = Path(__file__).resolve().parents[2]
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens 0123456789"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale_train")
    export(student("llama", "nvfp4"), d / "base", engine="vllm", flavour="compressed-tensors")
    (d / "data.txt").write_text("\n".join(TEXT * 40))
    return d


def _common(d):
    return ["method=scale_adapter", f"model.path={d / 'base'}", "train=cpu_tiny", f"data.train=[{d / 'data.txt'}]",
            "data.text_split=lines", "data.seq_len=16", "data.eval_samples=4", "train.eval_every=0", "train.lr=3e-2"]


def _metrics(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_train_merge_export_passes_the_gate_with_the_code_plane_hook(base, tmp_path):
    from qatfactory.faces.ship import train_and_ship as run
    from qatfactory.train.config import compose
    # no trust region here (max_changed=1): the random toy gains from moving many bytes, and a merge with
    # many new bytes tests the gate harder; the limit has its own test below
    s = run(compose(_common(base) + ["train.max_steps=12", "train.micro_batch=4", "export=vllm",
                                     "method.scale.max_changed=1", "export.flavour=compressed-tensors",
                                     f"run_dir={tmp_path / 'r'}"]))
    s.pop("engine").destroy()
    assert s["verify"]["verdict"] == "PASS", s["verify"]
    assert s["code_plane"]["export"] == s["code_plane"]["base"] == N.read_native(base / "base").code_plane_sha256()
    assert s["eval_last"]["eval/ce"] < s["eval_first"]["eval/ce"] - 0.02, (s["eval_first"], s["eval_last"])
    steps = [r for r in _metrics(tmp_path / "r") if "loss" in r]
    assert len(steps) == 12 and all(0 <= r["scales/changed"] <= 1 for r in steps)
    assert s["eval_first"]["scales/changed"] == 0 and s["eval_last"]["scales/changed"] > 0.05
    # the scale file is the merge: on the base it computes what the export holds
    ck = N.read_native(base / "base")
    out = N.read_native(s["export_dir"])
    tens, meta = N.load_scale_file(s["scale_file"], ck)
    assert meta["base_code_plane_sha256"] == s["code_plane_sha256"]
    for n, p in out.packed.items():
        assert torch.equal(p.codes, ck.packed[n].codes) and torch.equal(p.scales, tens[n])
    assert s["scale_file_bytes"] < 0.1 * s["checkpoint_bytes"]


@pytest.fixture(scope="module")
def mx_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale_train_mx")
    export(student("llama", "mxfp4"), d / "base", engine="vllm", flavour="compressed-tensors")
    (d / "data.txt").write_text("\n".join(TEXT * 40))
    return d


@pytest.mark.parametrize("zero", [0, 1])
def test_mxfp4_changed_bytes_stay_within_max_changed_and_the_masters_see_it(mx_base, tmp_path, capsys, zero):
    # MXFP4 (E8M0): the loop pulls offsets back after every step (nn.scale_adapter.limit_changed); under
    # ZeRO-1 (fp32 master copies in the optimizer) the masters must hold the pulled-back offsets too, or the
    # next step would undo the pull-back from the optimizer's side
    from deepspeed.utils import safe_get_full_fp32_param

    from qatfactory.nn import scale_adapter as SA
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    cap = 0.02
    s = run(compose(_common(mx_base) + ["train.max_steps=8", "train.micro_batch=4", "train.lr=2e-1",
                                        f"train.zero_stage={zero}", f"method.scale.max_changed={cap}",
                                        f"run_dir={tmp_path / 'r'}"]))
    eng = s.pop("engine")
    assert "changed scale bytes: at most 2.00% of the blocks" in capsys.readouterr().out
    steps = [r for r in _metrics(tmp_path / "r") if "loss" in r]
    assert len(steps) == 8 and all(r["scales/changed"] <= cap for r in steps)
    assert sum(r["scales/pulled_back"] for r in steps) > 0 and s["eval_last"]["scales/changed"] > cap / 2
    lm = s["student"].model
    for p in SA.parameters(lm):      # stage 0 in fp32: no master copies, the torch optimizer steps theta itself
        fp = safe_get_full_fp32_param(p)
        assert (fp is None) == (zero == 0)
        assert fp is None or torch.equal(fp.cpu().view_as(p), p.detach().float().cpu())
    eng.destroy()
    tens, _ = N.load_scale_file(s["scale_file"], N.read_native(mx_base / "base"))
    assert sum(int((tens[k] != p.scales).sum()) for k, p in N.read_native(mx_base / "base").packed.items()) \
        <= cap * sum(t.numel() for t in tens.values())


def _port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


@pytest.mark.slow
def test_zero2_two_gloo_ranks_equal_one_process(base, tmp_path):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    if launcher is None:
        pytest.fail("the deepspeed launcher is not on PATH (deepspeed is a test dependency)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    over = _common(base) + ["train.max_steps=4"]
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(_port()), "--module", "qatfactory.train", *over,
           "train.zero_stage=2", "train.micro_batch=2", f"run_dir={tmp_path / 'z2'}"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    z2 = json.loads((tmp_path / "z2" / "summary.json").read_text())
    assert z2["world_size"] == 2 and z2["eval_last"]["scales/changed"] > 0
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    one = run(compose(over + ["train.micro_batch=4", f"run_dir={tmp_path / 'one'}"]))
    one.pop("engine").destroy()
    a = [r["loss"] for r in _metrics(tmp_path / "z2") if "loss" in r]
    b = [r["loss"] for r in _metrics(tmp_path / "one") if "loss" in r]
    assert len(a) == len(b) == 4 and a == pytest.approx(b, rel=1e-4), (a, b)
    ta, _ = N.load_scale_file(tmp_path / "z2" / "scales.safetensors")
    tb, _ = N.load_scale_file(tmp_path / "one" / "scales.safetensors")
    moved = sum(int((ta[k] != tb[k]).sum()) for k in ta)
    assert moved <= 0.01 * sum(t.numel() for t in ta.values()), moved   # Adam near its first steps: float noise


def test_bad_input_one_line_with_its_exit_code(base, tmp_path, capsys):
    from qatfactory.faces.cli import train_main
    from qatfactory.exporters.verify.common import model_from_state_dict, student_weights
    cm = student("llama", "nvfp4")
    hf = tmp_path / "hf"
    model_from_state_dict(cm.config, student_weights(cm)).save_pretrained(hf)
    cases = [([f"model.path={hf}"], X.BAD_INPUT, "not a native 4-bit"),
             ([f"model.path={base / 'base'}", "method.scale.target=mxfp4"], X.BAD_INPUT, "format mismatch"),
             ([f"model.path={base / 'base'}", "train.zero_stage=3"], X.USAGE, "zero_stage=3 is not supported"),
             ([f"model.path={base / 'base'}", "method.scale.param=full"], X.USAGE, "method.scale.param='full'"),
             (["model.path=null"], X.BAD_INPUT, "needs model.path")]
    for over, code, msg in cases:
        rc = train_main(_common(base) + over + [f"run_dir={tmp_path / 'bad'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == code and msg in err[-1], (over, rc, err[-3:])
        assert not (tmp_path / "bad").exists()        # refused before a run directory is made
