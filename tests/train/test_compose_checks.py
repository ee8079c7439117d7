"""Bad settings and bad input files are refused before anything is built, in one line with their exit code.

`qatfactory train`: every number in its range (exit 3 before a run directory exists); `data.train=[...]`
selects your files, a missing one is named, a trained model never trains or calibrates on random tokens
unless asked; exports the format cannot hold, GGUF for an RL adapter and architectures the GGUF writer
does not know are refused at composition. Files: config.json claiming sizes its weights do not hold, nested
200,000 deep or holding NaN, and a damaged student record end with exit 4 naming the file and the field,
without building the model they describe."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from test_train import BASE

from qatfactory.faces import cli
from qatfactory import exitcodes as X


def _train(capsys, *over):
    capsys.readouterr()
    rc = cli.main(["train", *over])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("qatfactory train")]
    return rc, lines, err


def _refused(capsys, tmp_path, over, code, *texts):
    run = tmp_path / "run"
    rc, lines, err = _train(capsys, *over, f"run_dir={run}")
    assert rc == code and len(lines) == 1, (over, rc, err[-1500:])
    for t in texts:
        assert t in lines[0], (over, lines[0])
    assert "Traceback" not in err and not run.exists(), over      # refused before a run directory is made


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A saved 2-layer random Llama with the byte tokenizer: a 'trained' model folder (model.path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.train.data import ByteTokenizer
    d = tmp_path_factory.mktemp("hf") / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(d)
    ByteTokenizer().save_pretrained(d)
    return d


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text("The quick brown fox jumps over the lazy dog.\n" * 200)
    return p


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("over,text", [
    ("train.betas=[1.5,0.9]", "train.betas=[1.5, 0.9]; allowed: two numbers in [0, 1)"),
    ("train.seed=-1", "train.seed=-1; allowed: an int in 0..4294967295"),
    ("train.weight_decay=-1", "train.weight_decay=-1.0; allowed: a number >= 0"),
    ("train.lr=inf", "train.lr=inf; allowed: a finite number"),
    ("train.clip=nan", "train.clip=nan; allowed: a finite number"),
    ("method.calib_samples=-3", "method.calib_samples=-3; allowed: an int >= 1"),
    ("method.loss.temperature=inf", "method.loss.temperature=inf; allowed: a finite number"),
    ("model.tiny.vocab_size=100", "model.tiny.vocab_size=100, smaller than the byte tokenizer's 259 tokens"),
])
def test_a_bad_number_is_refused_at_composition(capsys, tmp_path, over, text):
    _refused(capsys, tmp_path, BASE + [over], X.USAGE, text)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_the_weights_load(hf_dir, tmp_path, text,
                                                                                   monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from qatfactory.train.config import compose
    from qatfactory.train.data import ByteTokenizer
    from qatfactory.train.runtime import build_model
    small = tmp_path / "small"
    LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(small)
    ByteTokenizer().save_pretrained(small)
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    cfg = compose(["model=local", f"model.path={small}", f"data.train=[{text}]"])
    with pytest.raises(X.CorruptFileError, match=r"small/config.json: vocab_size = 200, smaller than the "
                                                 r"tokenizer's 259 tokens"):
        build_model(cfg)               # the folder's own tokenizer: a bad input folder (exit 4)
    cfg = compose(["model=local", f"model.path={small}", f"model.tokenizer={hf_dir}", f"data.train=[{text}]"])
    with pytest.raises(X.UsageError, match=r"model.tokenizer: .*vocab_size = 200, smaller than the tokenizer's 259"):
        build_model(cfg)               # a tokenizer named on the command line: a bad setting (exit 3)
    assert loads == []                 # no weights were read


# ----------------------------------------------------------------------------- data
def test_data_train_selects_your_files(text):
    from qatfactory.train.config import compose
    cfg = compose([f"data.train=[{text}]"])
    assert cfg.data.train == [str(text)] and cfg.data.synthetic == 0 and cfg.data.seq_len == 2048
    cfg = compose(["data=long_8k", f"data.train=[{text}]"])
    assert cfg.data.synthetic == 0 and cfg.data.seq_len == 8192
    assert compose([]).data.synthetic == 64           # no files named: the tiny model's random tokens
    with pytest.raises(X.UsageError, match=r"data.train=.* with data.synthetic=64 \(data=synthetic\): random tokens "
                                           r"would replace your files"):
        compose(["data=synthetic", f"data.train=[{text}]"])


def test_a_missing_data_file_is_named(capsys, tmp_path, text):
    _refused(capsys, tmp_path, ["train=cpu_tiny", f"data.train=[{text},{tmp_path}/nope.jsonl]"], X.USAGE,
             f"data.train: {tmp_path}/nope.jsonl does not exist")
    _refused(capsys, tmp_path, BASE + [f"data.eval=[{tmp_path}/held.txt]"], X.USAGE,
             f"data.eval: {tmp_path}/held.txt does not exist")


def test_a_trained_model_never_falls_back_to_random_tokens(capsys, tmp_path, hf_dir, text):
    from qatfactory.train.config import compose
    for over in (["model=local", f"model.path={hf_dir}"],
                 ["method=ptq", "format=q4_k", "model=local", f"model.path={hf_dir}"],
                 ["model=smollm2_135m"]):
        _refused(capsys, tmp_path, ["train=cpu_tiny", *over], X.USAGE,
                 "data.synthetic=64 (the default data group: random tokens)", "data=synthetic on the command line")
    # asked for by name: random tokens (benchmarks, the QAD report's random-token arm)
    assert compose(["model=local", f"model.path={hf_dir}", "data=synthetic"]).data.synthetic == 64
    assert compose(["model=local", f"model.path={hf_dir}", "data.synthetic=8"]).data.synthetic == 8
    # your text: trained on it
    assert compose(["model=local", f"model.path={hf_dir}", f"data.train=[{text}]"]).data.synthetic == 0
    # RL reads prompts, not data
    assert compose(["model=local", f"model.path={hf_dir}", "method=grpo"]).method.name == "grpo"
    # a model folder that is not there is a bad input (exit 4), named
    _refused(capsys, tmp_path, ["model=local", f"model.path={tmp_path}/gone"], X.BAD_INPUT, f"{tmp_path}/gone")
    _refused(capsys, tmp_path, BASE + [f"model.tokenizer={tmp_path}/tok"], X.BAD_INPUT,
             f"model.tokenizer='{tmp_path}/tok' does not exist")
    _refused(capsys, tmp_path, BASE + [f"method.teacher_path={tmp_path}/t"], X.BAD_INPUT,
             f"method.teacher_path='{tmp_path}/t' does not exist")


def test_a_real_model_trains_on_the_named_text(tmp_path, hf_dir, text):
    """The README's pattern without data=files: the run reads the file (its held-out tail), not random tokens."""
    from qatfactory.train.config import compose
    from qatfactory.train.data import ByteTokenizer, load_data
    cfg = compose(["model=local", f"model.path={hf_dir}", f"data.train=[{text}]", "data.seq_len=32",
                   "data.eval_samples=2"])
    tr, _ = load_data(cfg.data, ByteTokenizer(), 259, 0)
    assert bytes(int(i) for i in tr.input_ids[0] if i < 256).decode() in text.read_text() * 2


# ----------------------------------------------------------------------------- exports known not to fit
def test_an_export_the_format_cannot_hold_is_refused_before_training(capsys, tmp_path, hf_dir, text):
    _refused(capsys, tmp_path, BASE + ["format=q4_k", "export=vllm"], X.USAGE,
             "export=vllm with format=q4_k: format 'q4_k' declares no safetensors layout",
             "allowed with export=vllm: format=[", "'nvfp4_w4a16'", "this format exports with export=['llama_cpp']")
    # following the advice of the exporter's embedding refusal leads nowhere: refused the same way, at once
    _refused(capsys, tmp_path, BASE + ["format=q4_k", "export=sglang", "quant.quantize_embeddings=false"], X.USAGE,
             "export=sglang with format=q4_k: format 'q4_k' declares no safetensors layout")
    _refused(capsys, tmp_path, BASE + ["format=mxfp4_gguf", "export=vllm"], X.USAGE, "declares no safetensors layout")
    # the default container variant of export=vllm (ModelOpt) holds NVFP4 only
    _refused(capsys, tmp_path, BASE + ["format=mxfp4_w4a16", "export=vllm"], X.USAGE,
             "export.flavour=null (export=vllm writes modelopt then) cannot hold format 'mxfp4'",
             "allowed: export.flavour=compressed-tensors")
    _refused(capsys, tmp_path, BASE + ["format=nvfp4_w4a16", "export=sglang", "export.flavour=onnx"], X.USAGE,
             "export.flavour='onnx' is no flavour of export=sglang; allowed: ['modelopt', 'compressed-tensors']")
    from qatfactory.train.config import compose
    # the advice of each refusal composes
    for over in (["format=nvfp4_w4a16", "export=vllm"], ["format=q4_k", "export=llama_cpp"],
                 ["format=mxfp4_w4a16", "export=vllm", "export.flavour=compressed-tensors"]):
        assert compose(over).export.enabled
    for m in ("dapo", "grpo"):
        _refused(capsys, tmp_path, ["train=cpu_tiny", f"method={m}", "format=q4_k", "export=llama_cpp"], X.USAGE,
                 f"method={m} with export=llama_cpp", "GGUF LoRA adapters are not supported")
    assert compose(["method=dapo", "format=q4_k", "export=llama_cpp", "method.rl.export_lora=merge"]).export.enabled
    # an architecture the GGUF writer does not know, read from config.json before anything is built
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    _refused(capsys, tmp_path, ["train=cpu_tiny", "model=local", f"model.path={gpt}", f"data.train=[{text}]",
                                "format=q4_k", "export=llama_cpp"], X.USAGE,
             "export=llama_cpp with model_type='gpt2'", "'qwen3_moe'")


# ----------------------------------------------------------------------------- config.json and sizes
def _copy(src: Path, dst: Path, **config) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    c = json.loads((dst / "config.json").read_text())
    c.update(config)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_config_sizes_are_checked_against_the_weights_before_a_model_is_built(capsys, tmp_path, hf_dir, text):
    from qatfactory._inputs import check_model_config
    cases = [({"num_hidden_layers": 4000}, "num_hidden_layers = 4000, but the safetensors files hold layers 0..1; "
                                           "allowed: 2"),
             ({"vocab_size": 2 ** 40}, f"vocab_size = {2 ** 40}, but the safetensors files hold "
                                       f"model.embed_tokens.weight of shape [259, 32]; allowed: 259"),
             ({"hidden_size": 4096}, "hidden_size = 4096"),
             ({"intermediate_size": 1 << 20}, "intermediate_size = 1048576, but the safetensors files hold "
                                              "model.layers.0.mlp.gate_proj.weight of shape [64, 32]; allowed: 64"),
             ({"rms_norm_eps": float("nan")}, "rms_norm_eps = nan; allowed: a finite number"),
             ({"num_attention_heads": -2}, "num_attention_heads = -2; allowed: an int >= 1")]
    for i, (bad, msg) in enumerate(cases):
        d = _copy(hf_dir, tmp_path / f"m{i}", **bad)
        with pytest.raises(X.CorruptFileError, match=None) as e:
            check_model_config(d)
        assert msg in str(e.value) and str(d / "config.json") in str(e.value), str(e.value)
    d = _copy(hf_dir, tmp_path / "deep")
    (d / "tokenizer_config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(X.CorruptFileError, match=r"tokenizer_config.json: JSON nested deeper than 64 levels"):
        check_model_config(d)
    # through the command: exit 4 in seconds, not a 4,000-layer model first
    d = tmp_path / "m0"
    t0 = time.time()
    rc, lines, err = _train(capsys, "train=cpu_tiny", "model=local", f"model.path={d}", f"data.train=[{text}]",
                            "format=bf16", f"run_dir={tmp_path / 'r'}")
    assert rc == X.BAD_INPUT and "num_hidden_layers = 4000" in lines[-1], err[-1500:]
    assert time.time() - t0 < 30


def test_json_is_read_with_depth_and_size_limits(tmp_path):
    from qatfactory._inputs import loads, read_json
    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(X.CorruptFileError, match=r"nested deeper than 64 levels"):
        loads(deep, "config.json")
    (tmp_path / "config.json").write_text('{"a": ' + deep + "}")
    with pytest.raises(X.CorruptFileError, match=r"config.json: JSON nested deeper"):
        read_json(tmp_path / "config.json")
    (tmp_path / "big.json").write_text(" " * 2048 + "{}")
    with pytest.raises(X.CorruptFileError, match=r"big.json: 2,050 bytes; allowed: at most 1,024"):
        read_json(tmp_path / "big.json", max_bytes=1024)
    # strings holding brackets are not nesting
    assert loads(json.dumps({"t": "[" * 1000, "u": ["]\\\"[" * 100]}), "x")["t"] == "[" * 1000
    with pytest.raises(X.CorruptFileError, match=r"x: a.b\[1\] = inf; allowed: a finite number"):
        loads('{"a": {"b": [1, Infinity]}}', "x")


# ----------------------------------------------------------------------------- the student record
@pytest.fixture(scope="module")
def student(tmp_path_factory, hf_dir):
    from transformers import AutoModelForCausalLM

    from qatfactory.quantize import QuantConfig, calibrate, prepare, save_student
    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    prepare(m, QuantConfig.preset("mxfp4_w4a16"))
    calibrate(m, None, "max")
    d = tmp_path_factory.mktemp("st") / "student"
    save_student(m, str(d))
    return d


@pytest.mark.parametrize("record,field", [
    ("this is not JSON", "not valid JSON"),
    ('["a list"]', "the document is a JSON list; allowed: a JSON object"),
    ('{"quant_config": "nvfp4", "dtype": "float32"}', "quant_config = 'nvfp4'; allowed: a JSON object"),
    ('{"quant_config": {"weight_format": 7, "rules": 3}, "dtype": "float32"}', "quant_config is not a valid"),
    ("DTYPE", "dtype = 'Tensor'; allowed: ['float32', 'bfloat16', 'float16']"),
    ("NAN", "config.json: rms_norm_eps = nan; allowed: a finite number"),
])
def test_a_damaged_student_is_refused_by_file_and_field(student, tmp_path, capsys, record, field):
    from qatfactory.faces.export import main
    d = tmp_path / "student"
    d.mkdir()
    for f in student.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    q = d / "qatfactory_quant.json"
    if record == "DTYPE":
        r = json.loads(q.read_text())
        r["dtype"] = "Tensor"
        q.write_text(json.dumps(r))
    elif record == "NAN":
        c = json.loads((d / "config.json").read_text())
        c["rms_norm_eps"] = float("nan")
        (d / "config.json").write_text(json.dumps(c))
    else:
        q.write_text(record)
    capsys.readouterr()
    rc = main(["export", str(d), "--engine", "vllm", "--flavour", "compressed-tensors", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == X.BAD_INPUT and len(err) == 1 and field in err[0], err
    assert ("config.json" if record == "NAN" else "qatfactory_quant.json") in err[0]
    assert not (tmp_path / "o").exists()


def test_a_malformed_training_file_is_exit_4_naming_the_record(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    cases = [(['{"text": "fine"}', '{"txt": "typo"}'], f"data: {bad} record 1 has neither 'text' nor"),
             (['{"text": "fine"}', "[1, 2]"], f"data: {bad} record 1 is a JSON list; allowed: an object"),
             (['{"messages": "hello"}'], "field 'messages' = 'hello'; allowed: a list of"),
             (['{"text": "fine"}', "{oops"], f"data: {bad}:2: not valid JSON"),
             (['{"text": ' + "[" * 500 + "]" * 500 + "}"], f"data: {bad}:1: JSON nested deeper")]
    for i, (lines, text) in enumerate(cases):
        bad.write_text("\n".join(lines) + "\n")
        rc, out, err = _train(capsys, "train=cpu_tiny", "format=bf16", "method=qat", f"data.train=[{bad}]",
                              "data.seq_len=8", f"run_dir={tmp_path / f'r{i}'}")
        assert rc == X.BAD_INPUT and text in out[-1], (text, err[-1500:])
        assert "Traceback" not in err


def test_eval_of_a_checkpoint_composed_before_these_checks(tmp_path, text):
    """A run composed when random tokens won over data.train (and whose export these checks would refuse) is
    evaluated as it trained: on its random tokens, exporting nothing."""
    from test_train import _run
    d = tmp_path / "run"
    _run(d, "train.max_steps=2", "format=nvfp4_w4a16")
    c = d / "checkpoints" / "step-000002"
    st = json.loads((c / "trainer_state.json").read_text())
    st["config"]["data"]["train"] = [str(text)]
    st["config"]["export"].update({"enabled": True, "engine": "vllm", "flavour": "onnx"})
    (c / "trainer_state.json").write_text(json.dumps(st))
    assert cli.main(["eval", "--checkpoint", str(c)]) == 0
    assert json.loads((d / "eval-step-000002.json").read_text())["steps"] == 2
