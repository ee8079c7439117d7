"""The method seam: a method registered outside the package (tests/toy_method.py, plain SFT on the hard
labels) trains through `qatfactory train plugins=[...] method=...` in a child process, its own loss is the
one that runs, the student it saves and the export it ships pass the gate; plugins are imported only when
a command line names them."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import TEXT

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parents[1]   # tests/, where toy_method.py lives


def _cli(*args):
    exe = shutil.which("qatfactory", path=os.path.dirname(sys.executable)) or shutil.which("qatfactory")
    if exe is None:
        pytest.fail("the qatfactory console script is not installed next to this python (make install)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):   # this process's group
        env.pop(k, None)
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=300)


def _losses(d):
    return [json.loads(x)["loss"] for x in (Path(d) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("toy") / "text.txt"
    f.write_text(TEXT)
    return f


def _common(text, run_dir):
    return ["train=cpu_tiny", "format=nvfp4_w4a16", "model.dtype=float32", "model.tiny.initializer_range=0.3",
            f"data.train=[{text}]", f"data.eval=[{text}]", "data.synthetic=0", "data.seq_len=32",
            "train.max_steps=6", "train.eval_every=0", "train.save_student=true", f"run_dir={run_dir}"]


@pytest.fixture(scope="module")
def toy_run(text, tmp_path_factory):
    d = tmp_path_factory.mktemp("toy_run") / "toy"
    p = _cli("train", "plugins=[toy_method]", "method=toy_sft", *_common(text, d), "export=vllm")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return d, p


def test_a_plugin_method_trains_saves_and_ships_through_the_cli(toy_run, text, tmp_path):
    d, p = toy_run
    assert "toy_sft: 6 loss calls" in p.stdout             # its own loss ran, once per micro-batch
    assert "parity gate PASS" in p.stdout
    s = json.loads((d / "summary.json").read_text())
    assert s["method"] == "toy_sft" and s["verify"]["verdict"] == "PASS" and s["verify_ok"] is True
    assert (d / "export-vllm" / "qatfactory.json").is_file()
    assert "eval/kl" not in s["eval_last"]                 # the recipe's eval_teacher=false: no teacher loaded
    losses = _losses(d)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert s["eval_last"]["eval/ce"] < s["eval_first"]["eval/ce"]
    from qatfactory.quantize import load_student
    assert load_student(str(d / "student")).config.hidden_size == 64
    # the same objective as the built-in qat (chunked CE): the plugin's plain cross-entropy agrees
    q = tmp_path / "qat"
    p = _cli("train", "method=qat", *_common(text, q), "method.eval_teacher=false", "train.lr=1e-3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses == pytest.approx(_losses(q), rel=1e-4)


def test_an_unknown_or_unimported_method_names_the_registered_ones(tmp_path, capsys):
    from qatfactory.faces import cli
    # a method whose module nobody imported (no plugins=) is unknown, like a misspelt one
    assert cli.main(["train", "method=sft_nobody_imported", f"run_dir={tmp_path / 'x'}"]) == 3
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qatfactory train")]
    assert len(line) == 1 and "method=sft_nobody_imported: no such method; registered: ['ptq', 'qat', 'qad'" in line[0]
    assert "plugins=[your.module]" in line[0]
    assert cli.main(["train", "plugins=[no_such_module_here]", "method=qat", f"run_dir={tmp_path / 'y'}"]) == 3
    assert "plugins: cannot import 'no_such_module_here'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_eval_of_a_plugin_run_imports_the_plugin_only_when_asked(toy_run):
    d, _ = toy_run
    ck = d / "checkpoints" / "step-000006"
    p = _cli("eval", "--checkpoint", str(ck))
    assert p.returncode == 3 and "trained with plugins=['toy_method']" in p.stderr and "add plugins=[toy_method]" \
        in p.stderr
    p = _cli("eval", "--checkpoint", str(ck), "plugins=[toy_method]")
    assert p.returncode == 0, p.stderr[-3000:]
    ev = json.loads((d / "eval-step-000006.json").read_text())["eval_last"]
    assert ev["eval/ce"] == pytest.approx(json.loads((d / "summary.json").read_text())["eval_last"]["eval/ce"],
                                          rel=1e-6)


def test_register_refuses_what_is_not_a_method_and_a_taken_name():
    from qatfactory.train.methods import Method, register
    with pytest.raises(TypeError, match="Method subclass"):
        register(object)

    class Other(Method):
        name = "qad"
    with pytest.raises(ValueError, match="already registered by qatfactory.train.methods.qad.QAD"):
        register(Other)


def test_a_plugin_methods_options_are_checked_against_its_schema():
    from qatfactory.exitcodes import UsageError
    from qatfactory.train.config import compose
    import toy_method  # noqa: F401  (registers toy_sft in this process)
    cfg = compose(["plugins=[toy_method]", "method=toy_sft", "+method.options.label_smoothing=0.1"])
    from qatfactory.train.methods import get_method
    assert get_method("toy_sft").opts(cfg).label_smoothing == 0.1
    with pytest.raises(UsageError, match=r"method.options \(method=toy_sft\): .*nope"):
        compose(["plugins=[toy_method]", "method=toy_sft", "+method.options.nope=1"])
    with pytest.raises(UsageError, match=r"method.options \(method=toy_sft\): .*label_smoothing"):
        compose(["plugins=[toy_method]", "method=toy_sft", "+method.options.label_smoothing=much"])
    with pytest.raises(UsageError, match=r"method=qat takes no free options"):
        compose(["method=qat", "+method.options.x=1"])


def test_a_plugin_registers_a_typed_options_block_named_in_errors_and_help(text, tmp_path):
    # the options dataclass registered with the method becomes method.toy in the schema: set like any
    # field, a wrong key or type is refused naming every option, --help lists them, and the run trains with it
    from qatfactory.exitcodes import UsageError
    from qatfactory.train.config import compose
    from qatfactory.train.methods import get_method
    import toy_method  # noqa: F401  (registers toy_keyed in this process)
    cfg = compose(["plugins=[toy_method]", "method=toy_keyed", "method.toy.label_smoothing=0.2"], check_files=False)
    assert get_method("toy_keyed").opts(cfg).label_smoothing == 0.2
    allowed = "allowed: method.toy (method toy_keyed): label_smoothing: float = 0.0; note: str = ''"
    for bad in ("method.toy.nope=1", "method.toy.label_smoothing=much"):
        with pytest.raises(UsageError) as e:
            compose(["plugins=[toy_method]", "method=toy_keyed", bad], check_files=False)
        assert allowed in str(e.value), str(e.value)
    # a plugin imported for another run in this process adds nothing to a run that does not name it (its
    # settings, resumed or evaluated later, must not depend on what else the process imported)
    assert not hasattr(compose(["method=qad"], check_files=False).method, "toy")
    n = _cli("train", "method=qad", "method.toy.note=x", "--cfg", "job")      # no plugin imported: no block
    assert n.returncode == 3 and "Key 'toy' not in 'MethodConfig'" in n.stderr, n.stderr[-1000:]
    h = _cli("train", "plugins=[toy_method]", "method=toy_keyed", "--help")
    assert h.returncode == 0 and "toy_keyed: toy SFT whose options" in h.stdout and "[method.toy.*]" in h.stdout
    assert "method.toy (method toy_keyed):\n  label_smoothing: float = 0.0\n  note: str = ''" in h.stdout, h.stdout
    p = _cli("train", "plugins=[toy_method]", "method=toy_keyed", "method.toy.label_smoothing=0.1",
             *_common(text, tmp_path / "k"), "train.max_steps=2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "toy_sft: 2 loss calls" in p.stdout
    assert json.loads((tmp_path / "k" / "summary.json").read_text())["method"] == "toy_keyed"
    import yaml
    assert yaml.safe_load((tmp_path / "k" / "config.yaml").read_text())["method"]["toy"]["label_smoothing"] == 0.1
