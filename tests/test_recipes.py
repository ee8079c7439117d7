"""Every YAML under recipes/ composes against the typed schema; bad values fail by name."""
from pathlib import Path

import pytest

from qatfactory.quantize import QuantConfig
from qatfactory.train.config import RunConfig, compose, recipes_dir

# options whose mandatory (???) fields a user must give; a data file that exists (compose checks that), and
# text for every trained model (it never falls back to random tokens)
TEXT = f"data.train=[{Path(__file__).resolve()}]"
NEEDS = {("model", "local"): ["model.path=/models/x"], ("data", "files"): [TEXT]}


def _options():
    r = recipes_dir()
    for g in sorted(p for p in r.iterdir() if p.is_dir()):
        for y in sorted(g.glob("*.yaml")):
            yield g.name, y.stem


OPTIONS = list(_options())


def test_every_group_has_recipes():
    groups = {g for g, _ in OPTIONS}
    assert {"model", "format", "method", "train", "export", "data"} <= groups
    assert len(OPTIONS) >= 20


@pytest.mark.parametrize("group,name", OPTIONS, ids=[f"{g}/{n}" for g, n in OPTIONS])
def test_recipe_composes(group, name):
    over = [f"{group}={name}"] + NEEDS.get((group, name), [])
    trained = group == "model" and not name.startswith("tiny_")
    # the recipes of models under /models name folders this machine has not got
    cfg = compose(over + ([TEXT] if trained else []), check_files=not trained or name == "smollm2_135m")
    assert isinstance(cfg, RunConfig) and isinstance(cfg.quant, QuantConfig)
    if group == "format":
        assert cfg.quant.name == name
    if group == "method":
        assert cfg.method.name == name          # one recipe per registered method, named as it


@pytest.mark.parametrize("over,check", [
    (["method=qad", "format=nvfp4_w4a16"],
     lambda c: c.method.loss.kind == "forward_kl" and c.train.lr == 5e-6 and c.train.schedule == "constant"),
    (["method=qad_lora", "format=mxfp4_w4a4"],
     lambda c: c.quant.lora.rank == 16 and c.quant.act_format == "mxfp4_rceil" and c.method.name == "qad_lora"),
    (["method=ptq", "format=q4_k"], lambda c: c.quant.weight_format == "q4_k_m" and c.quant.quantize_lm_head),
    (["method=qad_cached", "train=zero3", "model=smollm2_135m", "export=vllm", TEXT],
     lambda c: c.method.teacher == "cached" and c.train.zero_stage == 3 and c.export.enabled
     and c.model.asset == "smollm2" and c.data.synthetic == 0 and c.data.seq_len == 2048),
])
def test_documented_combinations(over, check):
    assert check(compose(over))


def test_method_recipes_map_one_to_one_to_the_registered_methods():
    from qatfactory.train.methods import BUILTIN, REGISTRY
    files = sorted(p.stem for p in (recipes_dir() / "method").glob("*.yaml"))
    assert files == sorted(m.name for m in BUILTIN)
    for name in files:
        assert REGISTRY[name].__module__ == f"qatfactory.train.methods.{name}", name    # one file per method
    # a method's option block is a field of the schema, of the method's declared type
    for m in BUILTIN:
        if m.options_key:
            assert isinstance(getattr(compose([f"method={m.name}"]).method, m.options_key), m.options), m.name


def test_unknown_method_lists_the_registered_ones():
    from qatfactory.exitcodes import UsageError
    from qatfactory.train.methods import method_names
    for over in (["method=sft9"], ["method.name=sft9"]):
        with pytest.raises(UsageError) as e:
            compose(over)
        msg = str(e.value)
        assert "sft9" in msg and str(method_names()) in msg and "plugins=[" in msg, msg


def test_recipe_files_are_the_groups_of_the_schema():
    r = recipes_dir()
    assert (r / "config.yaml").exists()
    assert Path(r).name == "recipes"


@pytest.mark.parametrize("over,msg", [
    (["method.loss.kind=kl"], r"LossConfig.kind='kl'; allowed: \['forward_kl'"),
    (["train.zero_stage=4"], r"train.zero_stage=4; allowed: \[0, 1, 2, 3\]"),
    (["train.schedule=linear"], r"train.schedule='linear'; allowed"),
    (["method=qat", "method.loss.kind=forward_kl"], r"method.name='qat' trains on CE"),
    (["method=qad", "method.loss.kind=ce"], r"qad distills from a teacher"),
    (["format=nvfp4_w4a16", "quant.weight_format=nvfp5"], r"weight_format='nvfp5' is not a registered format"),
    (["method=qad_lora", "quant.lora.rank=0"], r"needs quant.lora.rank >= 1"),
    (["data.seq_len=140000"], r"DataConfig.seq_len=140000; allowed: 2..131072"),
    (["model=local"], r"model.path"),
])
def test_bad_values_fail_by_name(over, msg):
    with pytest.raises(Exception, match=msg):
        compose(over)


def test_unknown_option_and_key_are_refused():
    with pytest.raises(Exception, match="nope"):
        compose(["method=nope"])
    with pytest.raises(Exception, match="not_a_field"):
        compose(["train.not_a_field=1"])


def test_quantconfig_presets_are_the_format_recipes():
    """One source: QuantConfig.preset(name) is the quant section the trainer composes for format=name."""
    from qatfactory.quantize import presets
    names = sorted(presets())
    fmt = sorted(n for g, n in OPTIONS if g == "format" and n != "bf16")
    assert names == fmt and {"nvfp4_w4a4", "q4_k", "mxfp4_gguf", "paretoq_2bit", "nvfp4_w4a4_kvfp8"} <= set(names)
    for n in names:
        assert QuantConfig.preset(n) == compose([f"format={n}"]).quant, n
    assert QuantConfig.preset("q4_k", quantize_embeddings=False).quantize_embeddings is False
    with pytest.raises(ValueError, match=r"unknown recipe 'bf16'.*recipes/format"):
        QuantConfig.preset("bf16")


def test_to_overrides_gives_back_the_config():
    """A RunConfig built as an object (the demo's) has a command line: compose(groups + to_overrides) == it,
    for paths with spaces and quotes, nulls, booleans, lists and small floats."""
    from qatfactory.train.config import to_dict, to_overrides, validate
    groups = ["model=local", "data=files", "format=q4_k", "method=qad_cached", "train=default"]
    cfg = compose(["format=q4_k", "method=qad_cached", "train=default"])
    cfg.model.name, cfg.model.path, cfg.model.dtype = "local", "/models/my model's dir", "float32"
    cfg.data.train, cfg.data.eval, cfg.data.max_docs, cfg.data.synthetic = ["/d/a b.jsonl", "/d/c,d.txt"], [], None, 0
    cfg.train.lr, cfg.train.plots, cfg.method.teacher_cache = 3e-05, False, "/tmp/tc=1"
    cfg.quant.kv_format, cfg.run_dir = None, "runs/x"
    cfg = validate(cfg)
    over = to_overrides(cfg, groups)
    assert "train.lr=3e-05" in over and "train.plots=false" in over and "model.dtype=float32" in over
    assert not any(o.startswith(("train.zero_stage=", "method.topk=")) for o in over)   # as the recipes say
    assert to_dict(compose(groups + over, check_files=False)) == to_dict(cfg)
