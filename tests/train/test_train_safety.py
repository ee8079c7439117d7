"""The trainer loses nothing, runs nothing from a checkpoint, and says what is wrong in one line.

Each case for `qatfactory train` / `qatfactory eval`: another run's directory, a user's
directory, an export directory that is not ours, a resume with other numerics, a newest checkpoint
that is incomplete, a torn metrics line, leftovers of an interrupted write, a pickle payload planted
in a checkpoint, a path planted in trainer_state.json, bad overrides, a failing run, too little of
the model quantized, a failing gate at the end of training, and a real kill -9 inside a checkpoint
save (a child process), after which resume=auto continues bit for bit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from test_train import BASE, _losses, _run

from qatfactory.faces import cli

REPO = Path(__file__).resolve().parents[2]
Q = ["method=qat", "format=nvfp4_w4a16", "model.tiny.initializer_range=0.3", "model.dtype=float32"]


def _tree(d: Path):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def _with(over):
    """Q with the keys of ``over`` replaced (Hydra refuses two values for one key)."""
    keys = {o.split("=", 1)[0] for o in over}
    return [q for q in Q if q.split("=", 1)[0] not in keys] + list(over)


def _train(capsys, *over):
    """`qatfactory train` in this process: (exit code, stdout + stderr)."""
    capsys.readouterr()
    rc = cli.main(["train", *BASE, *over])
    c = capsys.readouterr()
    return rc, c.out + c.err


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 4-step quantized run with checkpoints at 2 and 4 (and its losses)."""
    d = tmp_path_factory.mktemp("done") / "run"
    _run(d, *Q, "train.max_steps=4", "train.save_every=2", "train.keep_last=3")
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ----------------------------------------------------------------------------- data loss
def test_a_new_run_never_overwrites_another_run(done_run, tmp_path, capsys):
    d = _copy(done_run, tmp_path / "run")
    before = _tree(d)
    rc, err = _train(capsys, *Q, f"run_dir={d}")
    assert rc == 4
    line = [ln for ln in err.splitlines() if ln.startswith("qatfactory train:")]
    assert len(line) == 1 and "already holds a run" in line[0] and "resume=auto" in line[0] and str(d) in line[0]
    assert _tree(d) == before


def test_a_run_never_writes_into_a_user_directory(tmp_path, capsys, monkeypatch):
    user = tmp_path / "home"
    user.mkdir()
    (user / "photo.jpg").write_bytes(b"\xff\xd8 jpeg")
    rc, err = _train(capsys, *Q, f"run_dir={user}")
    assert rc == 4 and "not a qatfactory run directory" in err
    assert _tree(user) == {"photo.jpg": b"\xff\xd8 jpeg"}
    # an unnamed run never reuses a name: two runs in the same second get two directories
    monkeypatch.chdir(tmp_path)
    a = _run_unnamed()
    b = _run_unnamed()
    assert a != b and Path(a).is_dir() and Path(b).is_dir()


def _run_unnamed():
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    s = run(compose(BASE + ["method=qat", "format=bf16", "train.max_steps=1", "train.save_final=false"]))
    s.pop("engine").destroy()
    return s["run_dir"]


def test_export_dir_that_is_not_ours_is_refused_before_training(done_run, tmp_path, capsys):
    user = tmp_path / "out"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    rc, err = _train(capsys, *Q, "export=vllm", f"export.out_dir={user}", f"run_dir={tmp_path / 'r'}")
    assert rc == 4 and "export.out_dir" in err and "not written by qatfactory" in err
    assert _tree(user) == {"keep.txt": b"mine"}
    assert not (tmp_path / "r" / "checkpoints").exists()              # refused before any training
    # the run directory itself, or a directory holding it, is never an export target
    d = _copy(done_run, tmp_path / "run")
    before = _tree(d)
    for target in (d, tmp_path):
        rc, err = _train(capsys, *Q, "export=vllm", f"export.out_dir={target}", f"run_dir={d}", "resume=auto",
                         "train.max_steps=5")
        assert rc == 4 and "export.out_dir" in err, err[-2000:]
    assert _tree(d) == before


# ----------------------------------------------------------------------------- silently wrong
def test_resume_with_other_numerics_is_refused_by_field(done_run, tmp_path, capsys):
    d = _copy(done_run, tmp_path / "run")
    before = _tree(d)
    for over, field in ((["format=mxfp4_w4a16"], "quant.weight_format: 'nvfp4' -> 'mxfp4'"),
                        (["quant.scale_strategy=learnable"], "quant.scale_strategy"),
                        (["method=qad"], "method.name"),
                        (["model.tiny.hidden_size=32"], "model.tiny.hidden_size"),
                        (["train.micro_batch=1"], "train.micro_batch")):
        rc, err = _train(capsys, *_with(over), f"run_dir={d}", "resume=auto", "train.max_steps=6")
        assert rc == 4, (over, err[-1500:])
        assert "trained with other settings" in err and field in err, (field, err[-1500:])
    assert _tree(d) == before
    # other data / seed: goes on with a warning, and config.yaml keeps the original run's settings
    cy = (d / "config.yaml").read_text()
    rc, err = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=5", "train.seed=7",
                     "data.synthetic=20")
    assert rc == 0 and "train.seed: 0 -> 7" in err and "data.synthetic: 16 -> 20" in err
    assert (d / "config.yaml").read_text() == cy
    assert "seed: 7" in (d / "config.resume-step-000004.yaml").read_text()


def test_too_little_quantized_is_refused(tmp_path, capsys):
    # Q4_K_M on rows of 48 and 100: no ggml block size divides them, the policy keeps them in f16
    small = ["model.tiny.hidden_size=48", "model.tiny.intermediate_size=100", "format=q4_k", "method=qat"]
    rc, err = _train(capsys, *small, f"run_dir={tmp_path / 'q'}")
    assert rc == 4 and "0.0% of the" in err and "min_coverage=0.5" in err
    rc, err = _train(capsys, *small, "quant.min_coverage=0", "train.max_steps=1", f"run_dir={tmp_path / 'q0'}")
    assert rc == 0 and "quantized 0.0% of the" in err, err[-2000:]      # accepted when asked for, and said
    rc, err = _train(capsys, *Q, "quant.min_coverage=2", f"run_dir={tmp_path / 'bad'}")
    assert rc == 3 and "QuantConfig.min_coverage=2" in err


def test_gpt2_conv1d_is_not_prepared_silently():
    from transformers import GPT2Config, GPT2LMHeadModel

    from qatfactory.quantize import CoverageError, QuantConfig, prepare
    m = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    with pytest.raises(CoverageError, match="c_attn.weight .* Conv1D"):
        prepare(m, QuantConfig.preset("nvfp4_w4a16"))
    assert not any(type(x).__name__ == "QuantLinear" for x in m.modules())   # left as it was


# ----------------------------------------------------------------------------- resume=auto
def test_resume_auto_skips_an_incomplete_newest_checkpoint(done_run, tmp_path, capsys):
    ref = _losses(done_run)
    for damage in ("rng", "state", "ds"):
        d = _copy(done_run, tmp_path / f"run-{damage}")
        last = d / "checkpoints" / "step-000004"
        if damage == "rng":
            (last / "rng-rank0.safetensors").unlink()
        elif damage == "state":
            (last / "trainer_state.json").write_text('{"step": 4, "posi')     # torn
        else:
            shutil.rmtree(last / "ds")
        # and a torn last line of metrics.jsonl (a kill in the middle of a write)
        with open(d / "metrics.jsonl", "a") as f:
            f.write('{"step": 5, "lo')
        rc, err = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=4")
        assert rc == 0, err[-2000:]
        assert "skipping" in err and "step-000004" in err and "resuming from" in err
        got = _losses(d)                                               # parses: the torn line is gone
        assert got[3] == ref[3] and got[4] == ref[4], (damage, got, ref)
    # no complete checkpoint at all: refused with each reason, nothing deleted
    d = _copy(done_run, tmp_path / "none")
    for c in (d / "checkpoints").iterdir():
        (c / "trainer_state.json").unlink()
    before = _tree(d)
    rc, err = _train(capsys, *Q, f"run_dir={d}", "resume=auto")
    assert rc == 4 and "no complete checkpoint" in err and "step-000002" in err
    assert _tree(d) == before


def test_leftovers_of_interrupted_writes_are_tidied(done_run, tmp_path, capsys):
    d = _copy(done_run, tmp_path / "run")
    ck = d / "checkpoints"
    # a cut swap of step 4: the complete checkpoint sits in .old-*, step-000004 is gone
    os.rename(ck / "step-000004", ck / ".step-000004.old-abcd1234")
    # an unfinished write of step 6
    (ck / ".step-000006.tmp-00000006" / "ds").mkdir(parents=True)
    rc, err = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=4")
    assert rc == 0, err[-2000:]
    assert "restored" in err and ".step-000004.old-abcd1234" in err and ".step-000006.tmp-00000006" in err
    assert f"resumed from {ck / 'step-000004'} at step 4" in err
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000004"]


# ----------------------------------------------------------------------------- code execution
class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))          # unpickling it creates the marker file


def _plant(f: Path, marker: Path) -> None:
    torch.save({"module": _Payload(marker), "pad": torch.zeros(3)}, f)


def test_pickle_payload_in_a_checkpoint_never_runs(done_run, tmp_path, capsys):
    d = _copy(done_run, tmp_path / "run")
    f = d / "checkpoints" / "step-000004" / "ds" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "PWNED"
    _plant(f, marker)
    probe = tmp_path / "probe.pt"                     # the payload is live: an unsafe load runs it
    _plant(probe, tmp_path / "probe-ran")
    torch.load(probe, weights_only=False)  # noqa: S614 - proves the planted file is a real payload
    assert (tmp_path / "probe-ran").exists()
    rc, err = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=5")
    assert rc == 4 and not marker.exists()
    assert "mp_rank_00_model_states.pt: refused to load: it would import ['io.open']" in err, err
    assert "config.resume" not in err and not list(d.glob("config.resume*"))   # refused before anything is written
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(d / "checkpoints" / "step-000004")]) == 4
    assert not marker.exists() and "refused to load" in capsys.readouterr().err
    # an old-style pickled RNG file planted beside the checkpoint is never read
    g = d / "checkpoints" / "step-000002"
    _plant(g / "rng-rank0.pt", marker)
    assert cli.main(["eval", "--checkpoint", str(g)]) == 0 and not marker.exists()


@pytest.mark.slow
def test_pickle_payload_in_zero2_optimizer_states_never_runs(tmp_path, capsys):
    d = tmp_path / "z2"
    _run(d, *Q, "train.zero_stage=2", "train.max_steps=2")
    f = next((d / "checkpoints" / "step-000002" / "ds").glob("*optim_states.pt"))
    marker = tmp_path / "PWNED"
    _plant(f, marker)
    rc, err = _train(capsys, *Q, "train.zero_stage=2", f"run_dir={d}", "resume=auto", "train.max_steps=3")
    assert rc == 4 and not marker.exists() and "optim_states.pt: refused to load" in err


def test_eval_never_follows_a_path_from_the_checkpoint(done_run, tmp_path, capsys):
    d = _copy(done_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    c = d / "checkpoints" / "step-000004"
    st = json.loads((c / "trainer_state.json").read_text())
    st["config"]["run_dir"] = str(elsewhere)
    st["config"]["export"]["out_dir"] = str(elsewhere / "export")
    (c / "trainer_state.json").write_text(json.dumps(st))
    cy = (d / "config.yaml").read_text()
    assert cli.main(["eval", "--checkpoint", str(c)]) == 0
    assert not elsewhere.exists()
    assert json.loads((d / "eval-step-000004.json").read_text())["steps"] == 4
    assert (d / "config.yaml").read_text() == cy                        # an eval writes no config
    # a checkpoint outside a run layout needs --out; the result goes only there
    loose = _copy(c, tmp_path / "loose")
    assert cli.main(["eval", "--checkpoint", str(loose)]) == 3
    assert cli.main(["eval", "--checkpoint", str(loose), "--out", str(tmp_path / "res")]) == 0
    assert (tmp_path / "res" / "eval-step-000004.json").is_file() and not elsewhere.exists()


# ----------------------------------------------------------------------------- one-line errors
def test_bad_overrides_and_failures_are_one_line_with_their_exit_code(tmp_path, capsys, monkeypatch):
    for over, code, text in ((["train.max_steps=abc"], 3, "train.max_steps=abc"),
                             (["+train.bogus=1"], 3, "Key 'bogus' not in 'TrainConfig'"),
                             (["format=nvfp5"], 3, "format=nvfp5: no such recipe; allowed: ["),
                             (["train.lr=-1"], 3, "train.lr=-1.0; allowed: a number > 0"),
                             (["model=local", "model.path=/nonexistent/model"], 4, "/nonexistent/model")):
        rc, err = _train(capsys, *over, f"run_dir={tmp_path / 'x'}")
        lines = [ln for ln in err.splitlines() if ln.startswith("qatfactory train")]
        assert rc == code and len(lines) == 1 and text in lines[0], (over, rc, err[-2000:])
        assert "Traceback" not in err
    # an error inside the run: one line, exit 5; QATFACTORY_DEBUG=1 adds the traceback
    import qatfactory.train.methods.base as E

    def boom(*a, **k):
        raise RuntimeError("the evaluation exploded")
    monkeypatch.setattr(E, "evaluate", boom)
    rc, err = _train(capsys, *Q, f"run_dir={tmp_path / 'y'}")
    assert rc == 5 and "RUN_FAILED: RuntimeError: the evaluation exploded" in err and "Traceback" not in err
    monkeypatch.setenv("QATFACTORY_DEBUG", "1")
    rc, err = _train(capsys, *Q, f"run_dir={tmp_path / 'z'}")
    assert rc == 5 and "Traceback" in err and "the evaluation exploded" in err


# ----------------------------------------------------------------------------- the gate at the end
def test_a_failing_gate_fails_the_training_and_marks_the_export(tmp_path, capsys, monkeypatch):
    """A real export, a real gate: one weight byte is flipped on its way to disk, the gate FAILs,
    `qatfactory train` exits 1, the export is moved to <dir>.FAILED with FAILED.json, the summary
    says why; the student is kept."""
    import qatfactory.exporters.vllm as V
    real = V.save_sharded

    def tampered(tensors, out, **kw):
        k = next(n for n in sorted(tensors) if n.endswith("o_proj.weight"))
        t = tensors[k].clone()
        t.view(torch.uint8).reshape(-1)[0] ^= 0x11
        return real({**tensors, k: t}, out, **kw)
    monkeypatch.setattr(V, "save_sharded", tampered)
    d = tmp_path / "run"
    rc, err = _train(capsys, *Q, "export=vllm", "train.max_steps=1", "train.save_student=true", f"run_dir={d}")
    assert rc == 1, err[-2000:]
    assert not (d / "export-vllm").exists()
    failed = d / "export-vllm.FAILED"
    rec = json.loads((failed / "FAILED.json").read_text())
    assert rec["verdict"] == "FAIL" and any("o_proj" in r for r in rec["reasons"])
    s = json.loads((d / "summary.json").read_text())
    assert s["verify"]["verdict"] == "FAIL" and s["export_dir"] == str(failed) and s["verify_ok"] is False
    assert "parity gate FAIL" in err and str(failed) in err
    assert (d / "student" / "model.safetensors").is_file()
    # the next run (the gate intact) exports again and passes; the .FAILED one stays for inspection
    monkeypatch.setattr(V, "save_sharded", real)
    rc, err = _train(capsys, *Q, "export=vllm", "train.max_steps=2", "train.save_student=true", f"run_dir={d}",
                     "resume=auto")
    assert rc == 0, err[-2000:]
    assert (d / "export-vllm" / "qatfactory.json").is_file()


def test_gate_verdicts_map_to_exit_codes():
    from types import SimpleNamespace as NS

    from qatfactory.faces.ship import gate_summary
    ok = NS(ok=True, checks=[NS(tensor="t", check="bytes", status="ok", detail="")])
    assert gate_summary(ok)["verdict"] == "PASS" and cli._gate_code({"verify": gate_summary(ok)}) == 0
    inc = NS(ok=False, verdict="INCOMPLETE",
             checks=[NS(tensor="t", check="compressed-tensors", status="INCOMPLETE", detail="pip install x")])
    g = gate_summary(inc)
    assert g["verdict"] == "INCOMPLETE" and "pip install x" in g["reasons"][0] and cli._gate_code({"verify": g}) == 2
    bad = NS(ok=False, checks=[NS(tensor="w", check="bytes", status="FAIL", detail="differs")])
    assert gate_summary(bad)["verdict"] == "FAIL" and cli._gate_code({"verify": gate_summary(bad)}) == 1
    # ok=True with a verdict that is not PASS can never pass
    odd = NS(ok=True, verdict="FAIL", checks=[])
    assert gate_summary(odd)["verdict"] == "FAIL"


# ----------------------------------------------------------------------------- kill -9 in a checkpoint save
CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from qatfactory import _fsutil
    from qatfactory.train.config import compose
    from qatfactory.train.loop import run
    step_to_die = int(sys.argv[1])
    real = _fsutil.swap_in
    def swap_in(tmp, target):
        # everything of the checkpoint is written into tmp; kill before it is swapped in
        if os.path.basename(str(target)) == f"step-{{step_to_die:06d}}":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tmp, target)
    _fsutil.swap_in = swap_in
    run(compose(sys.argv[2:]))
    print("finished")
""")


@pytest.mark.slow
def test_kill9_during_a_checkpoint_save_then_resume_is_bit_exact(done_run, tmp_path, capsys):
    from test_train import BASE as B
    over = B + Q + ["train.max_steps=4", "train.save_every=2", "train.keep_last=3", f"run_dir={tmp_path / 'k'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):   # this process's group
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(REPO / "tests")), "4", *over],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-3000:])
    ck = tmp_path / "k" / "checkpoints"
    assert sorted(x.name for x in ck.iterdir()) == [".step-000004.tmp-00000004", "step-000002"]
    rc, err = _train(capsys, *Q, "train.max_steps=4", "train.save_every=2", "train.keep_last=3",
                     f"run_dir={tmp_path / 'k'}", "resume=auto")
    assert rc == 0, err[-2000:]
    assert ".step-000004.tmp-00000004" in err                       # named and removed
    ref, got = _losses(done_run), _losses(tmp_path / "k")
    assert got == ref, (got, ref)
    assert sorted(x.name for x in ck.iterdir()) == ["step-000002", "step-000004"]
    from safetensors.torch import load_file
    a = load_file(str(done_run / "checkpoints" / "step-000004" / "rng-rank0.safetensors"))
    b = load_file(str(ck / "step-000004" / "rng-rank0.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_teacher_cache_reads_only_its_own_shards(tmp_path):
    from safetensors.torch import save_file

    from qatfactory.distill.teachers import CachedTeacher
    outside = tmp_path / "outside.safetensors"
    save_file({"sample_ids": torch.arange(2), "logprobs": torch.zeros(2, 4, 2), "indices": torch.zeros(2, 4, 2,
                                                                                                   dtype=torch.int32)},
              str(outside))
    c = tmp_path / "cache"
    c.mkdir()
    (c / "meta.json").write_text(json.dumps({"fingerprint": "x", "seq_len": 4, "k": 2, "n_samples": 2,
                                             "shards": ["../outside.safetensors"]}))
    with pytest.raises(ValueError, match=r"shard name '../outside.safetensors' is not a shard of this directory"):
        CachedTeacher(str(c))
    (c / "meta.json").write_text(json.dumps({"fingerprint": "x", "seq_len": 4, "k": 2, "n_samples": 2,
                                             "shards": ["shard-00000.safetensors"]}))
    (c / "shard-00000.safetensors").write_bytes(b"\x00" * 5)          # truncated: named
    with pytest.raises(ValueError, match="shard-00000.safetensors: not a readable safetensors file"):
        CachedTeacher(str(c))


def test_temporary_files_left_in_the_run_directory_are_removed(done_run, tmp_path, capsys):
    d = _copy(done_run, tmp_path / "run")
    for n in (".config.yaml.ab12cd34.tmp", "metrics.tmp", ".summary.json.zz99yy88.tmp"):
        (d / n).write_text("half")
    (d / "notes.tmp").write_text("a user's file with a similar name: kept")
    rc, err = _train(capsys, *Q, f"run_dir={d}", "resume=auto", "train.max_steps=4")
    assert rc == 0 and err.count("left by an interrupted write") == 3
    assert sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp")) == ["notes.tmp"]


def _tiny_teacher_and_samples():
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.distill.teachers import LiveTeacher
    from qatfactory.train.data import synthetic_samples
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
    return LiveTeacher(m, torch.float32), synthetic_samples(4, 8, 64, 0)


def test_teacher_cache_write_never_deletes_a_folder_that_is_not_a_cache(tmp_path):
    from qatfactory._fsutil import NotOursError
    from qatfactory.distill.teachers import CachedTeacher, precompute_topk
    teacher, samples = _tiny_teacher_and_samples()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own")
    with pytest.raises(NotOursError, match="is not written by qatfactory.*Nothing was changed"):
        precompute_topk(teacher, samples, str(mine), 4)
    assert _tree(mine) == {"notes.txt": b"the user's own"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]          # no temporary folder left either
    # a cache (ours: its meta.json carries the cache's key) is replaced, and so is one written before that key
    c = tmp_path / "cache"
    precompute_topk(teacher, samples, str(c), 4)
    meta = json.loads((c / "meta.json").read_text())
    assert meta["qatfactory_teacher_cache"] == 1 and CachedTeacher(str(c)).k == 4
    del meta["qatfactory_teacher_cache"]
    (c / "meta.json").write_text(json.dumps(meta))
    precompute_topk(teacher, samples, str(c), 2)
    assert CachedTeacher(str(c)).k == 2


def test_teacher_cache_option_on_a_users_folder_is_refused_and_left_alone(tmp_path, capsys):
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    (root / "train" / "tokens.txt").write_text("a user's training text that happens to sit in DIR/train")
    rc, err = _train(capsys, *_with(["method=qad_cached", "format=bf16"]), f"run_dir={tmp_path / 'run'}",
                     f"method.teacher_cache={root}")
    assert rc == 4, err
    assert f"method.teacher_cache: {root / 'train'} is not empty and is not written by qatfactory" in err
    assert _tree(root) == {"train/tokens.txt": b"a user's training text that happens to sit in DIR/train"}


def test_a_model_directory_is_never_written_over_a_users_folder(tmp_path):
    from qatfactory import _fsutil, assets
    mine = tmp_path / "tok"
    mine.mkdir()
    (mine / "vocab.txt").write_text("not a qatfactory directory")
    with pytest.raises(_fsutil.NotOursError, match="model directory: .* is not written by qatfactory"):
        assets.prepare_tokenizer_dir("smollm2", out=mine)
    assert _tree(mine) == {"vocab.txt": b"not a qatfactory directory"}
    # the shared cache's tokenizer directory (written through the same path the first time any test asks)
    made = assets.prepare_tokenizer_dir("smollm2")
    assert _fsutil.kind_of(made) == "asset" and (made / "tokenizer.json").is_file()
