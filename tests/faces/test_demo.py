"""`qatfactory demo` end to end on a tiny random Llama (a BPE tokenizer trained on real Wikipedia text):
PTQ -> QAD with the trainer -> exports -> parity gate -> report.md, results.json and plots."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from qatfactory.faces import demo


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from qatfactory import assets
    try:
        texts = assets.wiki_splits(0)["train"][:200]
    except RuntimeError as e:      # no PyPI and no cache: the demo's data cannot exist either
        pytest.skip(f"Wikipedia asset unavailable: {e}")
    from tiny_llm import tiny_llama, train_bpe
    d = tmp_path_factory.mktemp("tiny_llama")
    tok = train_bpe(d, texts, 600)
    tiny_llama(tok, intermediate_size=256, max_position_embeddings=512).to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def demo_run(tiny_model_dir, tmp_path_factory, monkeypatch_module):
    cache = tmp_path_factory.mktemp("cache")
    # keep the real assets (wiki wheel) but write the demo's data and teacher caches elsewhere
    from qatfactory import assets
    real = assets.cache_dir()
    for sub in ("assets", "wheels", "llama.cpp"):
        if (real / sub).exists():
            (cache / sub).symlink_to(real / sub)
    monkeypatch_module.setenv("QATFACTORY_CACHE", str(cache))
    out = tmp_path_factory.mktemp("run") / "demo"
    rc = demo.main(["--quick", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "4", "--lr", "1e-3"])
    return rc, out, cache


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_demo_report_numbers_gates_and_plots(demo_run):
    rc, out, _ = demo_run
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["targets"]) == {"nvfp4", "mxfp4", "q4_k"}
    assert res["teacher"]["kl"] == pytest.approx(0.0, abs=1e-6)   # the teacher against itself
    for key, r in res["targets"].items():
        for stage in ("ptq", "qad"):
            for m in ("kl", "ce", "ppl", "top1"):
                assert math.isfinite(r[stage][m]), (key, stage, m)
            assert r[stage]["kl"] > 0 and r[stage]["tokens"] == res["teacher"]["tokens"] > 0
        # the trainer's own first/last evaluation saw the same held-out tokens
        assert r["trainer"]["steps"] == 4
        assert 4.0 < r["bits"]["bits_quantized"] < 7.0
        for e in r["exports"]:
            assert e["ok"] is True, (key, e)
            assert Path(e["path"]).is_dir() and e["serve"]
    # the q4_k target takes llama.cpp's fallback: hidden 64 rows are not a multiple of 256
    assert "q5_0" in res["targets"]["q4_k"]["bits"]["params_by_format"]
    engines = {(e["engine"], e["flavour"]) for r in res["targets"].values() for e in r["exports"]}
    assert engines == {("vllm", "modelopt"), ("vllm", "compressed-tensors"), ("sglang", "modelopt"),
                       ("llama_cpp", "gguf")}
    md = (out / "report.md").read_text()
    for r in res["targets"].values():
        assert f"{r['ptq']['kl']:.4f}" in md and f"{r['qad']['kl']:.4f}" in md
    assert "vllm serve" in md and "sglang.launch_server" in md and "llama-server" in md
    assert md.count("| PASS |") == sum(len(r["exports"]) for r in res["targets"].values()) == 5
    # llama.cpp's own numbers: its converter does not know this test tokenizer, and the report says so
    assert res["llama_cpp"]["status"] == "failed", res["llama_cpp"]
    assert "BPE pre-tokenizer was not recognized" in res["llama_cpp"]["reason"]
    assert "## llama.cpp's own numbers for the GGUF exports\n\nNot run: RuntimeError: llama.cpp convert_hf_to_gguf" in md
    for png in ("ptq_vs_qad.png", "qad_loss.png"):
        assert (out / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_live_teacher_eval_matches_trainer(demo_run):
    """The live-teacher trainer evaluates the same held-out samples with the same teacher: its
    final KL is the demo's QAD KL (an independent check of the report's evaluation)."""
    _, out, _ = demo_run
    r = json.loads((out / "results.json").read_text())["targets"]["nvfp4"]
    assert r["trainer"]["eval_last"]["eval/kl"] == pytest.approx(r["qad"]["kl"], rel=1e-3)
    assert r["trainer"]["eval_first"]["eval/kl"] == pytest.approx(r["ptq"]["kl"], rel=1e-3)


def test_demo_caches_data_and_teacher(demo_run):
    _, _, cache = demo_run
    assert len(list((cache / "demo-data").glob("*/meta.json"))) == 1
    assert len(list((cache / "teacher-cache").glob("*/train/meta.json"))) == 1


def test_rescore_scores_a_finished_run_again_where_it_now_lies(demo_run, tmp_path, capsys):
    """`qatfactory demo --rescore RUN_DIR` (what benchmarks/llama_cpp_vs_quantize.py --rescore runs): no
    training; llama.cpp's numbers again, results.json and report.md rewritten in RUN_DIR only, the exports
    found under RUN_DIR/exports even when the run was copied elsewhere."""
    import shutil
    _, out, _ = demo_run
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    before = (out / "results.json").read_bytes(), (out / "report.md").read_bytes()
    (moved / "report.md").unlink()
    res0 = json.loads((moved / "results.json").read_text())
    res0["llama_cpp"] = {"status": "stale"}
    (moved / "results.json").write_text(json.dumps(res0))
    # llama.cpp's converter does not know the tiny test tokenizer: scored again, it says so again (exit 1)
    assert demo.main(["--rescore", str(moved), "--vs-llama-quantize"]) == 1
    assert "llama.cpp numbers not measured" in capsys.readouterr().err
    res = json.loads((moved / "results.json").read_text())
    assert res["llama_cpp"]["status"] == "failed" and "BPE pre-tokenizer" in res["llama_cpp"]["reason"]
    assert res["targets"]["q4_k"]["qad"] == res0["targets"]["q4_k"]["qad"]       # no training
    gg = [e for e in res["targets"]["q4_k"]["exports"] if e["engine"] == "llama_cpp"][0]
    assert Path(gg["path"]).parent == moved / "exports" and (Path(gg["path"]) / "model.gguf").is_file()
    md = (moved / "report.md").read_text()
    assert f"{res['targets']['q4_k']['qad']['kl']:.4f}" in md and "Not run: RuntimeError: llama.cpp" in md
    assert ((out / "results.json").read_bytes(), (out / "report.md").read_bytes()) == before


def test_rescore_refuses_what_is_not_a_finished_run(tmp_path, capsys):
    assert demo.main(["--rescore", str(tmp_path)]) == 4              # exitcodes.BAD_INPUT
    assert "no results.json" in capsys.readouterr().err
    (tmp_path / "results.json").write_text('{"settings": {}}')
    assert demo.main(["--rescore", str(tmp_path)]) == 4
    err = capsys.readouterr().err
    assert "results.json: field 'model_dir' missing" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "results.json").read_text() == '{"settings": {}}' and not (tmp_path / "report.md").exists()


def test_demo_train_command_reproduces_its_config(tmp_path):
    """The trainer config the demo builds as an object is the one its report's command line composes."""
    import shlex

    from qatfactory.train.config import compose, to_dict
    s = demo.settings_from(demo.parse_args(["--quick", "--lr", "1e-3"]))
    for dt in ("float32", "bfloat16"):
        s.dtype = dt
        data = {"train": str(tmp_path / "a dir" / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")}
        for f in data.values():          # the command composes as a run: the files it names exist
            Path(f).parent.mkdir(parents=True, exist_ok=True)
            Path(f).touch()
        (tmp_path / "model").mkdir(exist_ok=True)
        for key, t in demo.TARGETS.items():
            cfg, over = demo.train_config(t, s, tmp_path / "model", data, tmp_path / "run", tmp_path / "tc", "cpu")
            assert cfg.method.name == ("qad" if t.teacher == "live" else "qad_cached")
            assert cfg.train.lr == float(f"{s.lr * t.lr_scale:g}") and cfg.data.train == [data["train"]]
            assert to_dict(compose(shlex.split(" ".join(shlex.quote(o) for o in over)))) == to_dict(cfg), key


@pytest.mark.parametrize("argv,msg", [
    (["--targets", "nvfp5"], "allowed: \\['nvfp4', 'mxfp4', 'q4_k', 'mxfp4_gguf', 'nvfp4_gguf'\\]"),
    (["--steps", "0"], "--steps=0; allowed: an int >= 1"),
    (["--lr", "-1"], "--lr=-1.0; allowed"),
])
def test_demo_bad_arguments(argv, msg, capsys):
    assert demo.main(argv) == 3         # exitcodes.USAGE
    import re
    assert re.search(msg, capsys.readouterr().err)


def test_demo_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        demo.run_demo(demo.settings_from(demo.parse_args(["--quick"])), tmp_path, tmp_path / "out")


def test_expected_time_comes_from_the_newest_finished_run_with_the_same_settings(tmp_path):
    from qatfactory.faces.demo import Settings, previous_run_seconds
    s = Settings()
    other = Settings(steps=s.steps + 1)
    for name, st, sec in (("demo-20260101-000000", s, 100.0), ("demo-20260102-000000", s, 200.0),
                          ("demo-20260103-000000", other, 300.0)):
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({"settings": vars(st), "seconds": sec}))
    (tmp_path / "demo-20260104-000000").mkdir()          # an unfinished run: no results.json
    assert previous_run_seconds(tmp_path, s, tmp_path / "x") == (200.0, str(tmp_path / "demo-20260102-000000"))
    assert previous_run_seconds(tmp_path, s, tmp_path / "demo-20260102-000000")[0] == 100.0
    assert previous_run_seconds(tmp_path, Settings(steps=99), tmp_path / "x") is None


def test_time_measurements_leave_the_teacher_untouched(tiny_model_dir):
    """The estimate's training step (forward, loss, backward, AdamW at lr 0) must not change a bit of
    the teacher it runs on, nor its requires_grad / train flags / grads; the fake-quant timing runs
    for the Q4_K_M policy (imatrix path) and an FP4 preset."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (4, 32), generator=g)
    held = demo.HeldOut.__new__(demo.HeldOut)      # one batch of teacher outputs, as fill_teacher leaves it
    held.samples, held.mb, held.device = None, 4, "cpu"
    b = {"input_ids": ids, "attn": torch.ones_like(ids), "mask": torch.ones_like(ids, dtype=torch.bool)}
    held.batches = lambda: iter([(0, b)])
    with torch.no_grad():
        h = m.model(input_ids=ids).last_hidden_state
    held.teacher_h, held.teacher_w = [h], m.lm_head.weight.detach().clone()
    t = demo.train_step_seconds(m, held, 2)
    assert t > 0
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert not any(p.requires_grad for p in m.parameters()) and not m.training
    assert all(p.grad is None for p in m.parameters())
    assert demo.fake_quant_seconds(m, "q4_k") > 0 and demo.fake_quant_seconds(m, "nvfp4_w4a16") > 0


# ----------------------------------------------------------------------------- compute dtype and threads
def test_demo_in_fp32_where_bf16_would_be_emulated(tiny_model_dir, tmp_path, monkeypatch):
    """--dtype float32 (what auto picks on a CPU without fast bf16): teacher, PTQ and the trainer's
    student compute in fp32, the student keeps fp32 weights, the exports pass the gate, and the
    report says which dtype and how many threads were used."""
    from qatfactory import assets
    cache = tmp_path / "cache"
    cache.mkdir()
    real = assets.cache_dir()
    for sub in ("assets", "wheels"):
        if (real / sub).exists():
            (cache / sub).symlink_to(real / sub)
    monkeypatch.setenv("QATFACTORY_CACHE", str(cache))
    out = tmp_path / "demo"
    rc = demo.main(["--quick", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2", "--targets", "nvfp4",
                    "--dtype", "float32"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    c = res["compute"]
    assert c["dtype"] == "float32" and "asked for" in c["why"] and c["threads"] >= 1 and c["threads_why"]
    assert res["settings"]["dtype"] == "float32"
    assert "model.dtype=float32" in res["targets"]["nvfp4"]["train_command"]
    assert "train.precision=fp32" in res["targets"]["nvfp4"]["train_command"]
    from safetensors import safe_open
    with safe_open(str(out / "qad-nvfp4" / "student" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert all(e["ok"] is True for e in res["targets"]["nvfp4"]["exports"])
    md = (out / "report.md").read_text()
    assert "Compute: float32" in md and "intra-op thread" in md and "teacher fp32" in md
    # an existing --out is never overwritten
    assert demo.main(["--quick", "--model", str(tiny_model_dir), "--out", str(out)]) == 4


def test_compute_dtype_follows_the_measurement_and_is_cached(tmp_path, monkeypatch):
    from qatfactory import cpu
    monkeypatch.setenv("QATFACTORY_CACHE", str(tmp_path))
    monkeypatch.delenv("QATFACTORY_DTYPE", raising=False)
    speed = {"bfloat16": 0.9, "float32": 34.0}           # a 2-core EPYC without AVX512_BF16
    monkeypatch.setattr(cpu, "matmul_gflops", lambda dt, **k: speed[dt])
    d = cpu.compute_dtype("cpu")
    assert d["dtype"] == "float32" and "emulated" in d["why"] and d["bf16_gflops"] == 0.9
    assert json.loads((tmp_path / "cpu-compute-dtype.json").read_text())["dtype"] == "float32"

    def no_measure(*a, **k):
        raise AssertionError("measured again although cached")
    monkeypatch.setattr(cpu, "matmul_gflops", no_measure)
    assert cpu.compute_dtype("cpu")["dtype"] == "float32"             # from the cache
    speed.update(bfloat16=1245.0, float32=200.0)                        # AMX (this dev machine)
    monkeypatch.setattr(cpu, "matmul_gflops", lambda dt, **k: speed[dt])
    assert cpu.compute_dtype("cpu", cache=False)["dtype"] == "bfloat16"
    assert cpu.compute_dtype("cuda")["dtype"] == "bfloat16"
    assert cpu.compute_dtype("cpu", "float32")["dtype"] == "float32"
    monkeypatch.setenv("QATFACTORY_DTYPE", "bfloat16")
    assert cpu.compute_dtype("cpu")["dtype"] == "bfloat16"
    monkeypatch.setenv("QATFACTORY_DTYPE", "fp8")
    with pytest.raises(ValueError, match="allowed: auto, bfloat16, float32"):
        cpu.compute_dtype("cpu")
    assert cpu.native_bf16({"avx2", "amx_bf16"}) and not cpu.native_bf16({"avx2", "avx512f"})


def test_the_real_measurement_ranks_what_this_cpu_does():
    """On this machine (AMX / AVX512_BF16) bf16 is faster; the measurement must see that, and its
    choice must agree with the flags whenever they are decisive (no fast bf16 without them)."""
    from qatfactory import cpu
    bf, fp = cpu.matmul_gflops("bfloat16"), cpu.matmul_gflops("float32")
    assert bf > 0 and fp > 0
    if not cpu.native_bf16():
        assert bf < fp                                     # emulated bf16 is never the faster one
    d = cpu.compute_dtype("cpu", cache=False)
    assert d["dtype"] == ("bfloat16" if d["bf16_gflops"] >= d["fp32_gflops"] else "float32")


def test_threads_fit_the_load(monkeypatch):
    from qatfactory import cpu
    busy, how = cpu._busy_cores(0.2)                 # the real sample: a number of cores, from /proc/stat here
    assert 0.0 <= busy <= len(os.sched_getaffinity(0)) + 0.01 and how.startswith("/proc/stat")
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert cpu.choose_threads()["threads"] == 1 and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.setattr(cpu, "_busy_cores", lambda: (1.0, "test"))        # one core busy elsewhere
        t = cpu.choose_threads()
        assert t["threads"] == 1 and torch.get_num_threads() == 1 and "1.0 busy" in t["why"]
        monkeypatch.setattr(cpu, "_busy_cores", lambda: (0.1, "test"))        # idle
        assert cpu.choose_threads()["threads"] == 2 and torch.get_num_threads() == 2
        monkeypatch.setattr(cpu, "_busy_cores", lambda: (5.0, "test"))        # overloaded: still one
        assert cpu.choose_threads()["threads"] == 1
    finally:
        torch.set_num_threads(before)
