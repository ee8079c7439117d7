"""benchmarks/kv_cache.py --smoke: data, calibration with the KV pass, the three KV arms through the
trainer, the fp8 arm's export + parity gate, report and plot, end to end on a random tiny model
(plumbing only: the smoke measures nothing about KV caches). The engine checks need a GPU and must say
that they did not run."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _keep_env(monkeypatch, name):
    """Whatever the test does to os.environ[name], the value before it is back afterwards."""
    old = os.environ.get(name)
    monkeypatch.setenv(name, "" if old is None else old)     # records the value before (or its absence)
    if old is None:
        monkeypatch.delenv(name)


def test_kv_cache_benchmark_smoke(tmp_path, one_thread, monkeypatch):
    # the smoke sets QATFACTORY_CACHE in this process (benchmarks/gpu/engines.py); restored after the test,
    # or the tests after it look for llama.cpp's runtime in this test's temporary cache
    _keep_env(monkeypatch, "QATFACTORY_CACHE")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kv_cache
    finally:
        sys.path.pop(0)
    assert kv_cache.main(["--smoke", "--seqs", "32", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "kv_cache.json").read_text())
    assert rep["smoke"] is True
    arms = {r["kv"]: r for r in rep["results"]}
    assert sorted(arms) == sorted(kv_cache.ARMS) and all(r["seq"] == 32 and r["steps"] == 2 for r in arms.values())
    for r in arms.values():
        for phase in ("ptq", "qad"):
            assert r[phase]["kl"] > 0 and r[phase]["ppl"] > 1 and r[phase]["tokens"] > 0
        assert ("quant.kv_format=" + r["kv"] in r["command"]) == (r["kv"] != "none")
    # the same held-out tokens and calibration: quantizing the cache moves the PTQ student away
    assert arms["fp8_e4m3"]["ptq"]["kl"] != arms["none"]["ptq"]["kl"]
    assert arms["nvfp4_kv"]["ptq"]["kl"] > arms["none"]["ptq"]["kl"]
    assert arms["fp8_e4m3"]["verify"]["verdict"] == "PASS" and "verify" not in arms["none"]
    ex = json.loads((Path(arms["fp8_e4m3"]["export_dir"]) / "qatfactory.json").read_text())
    assert ex["kv_cache"]["format"] == "fp8_e4m3" and ex["kv_cache"]["attention"] == "none"
    assert ex["kv_cache"]["serve_flags"] == "--kv-cache-dtype fp8"
    # the attention rule the fp8 arm trained with (auto = none: the cache write only) is in its command; a run
    # directory names a rule only when there is one (-fa3, -triton)
    assert "quant.kv_attention=none" in arms["fp8_e4m3"]["command"] and arms["fp8_e4m3"]["run_dir"].endswith("-fp8_e4m3")
    if not torch.cuda.is_available():
        assert rep["engine_checks"]["vllm_op"]["run"] is False and "no CUDA device" in rep["engine_checks"]["vllm_op"]["why"]
        assert rep["vllm_serve"]["run"] is False
    md = (tmp_path / "kv_cache.md").read_text()
    assert md.count("| 32 |") == 3 and "SMOKE" in md and "not run" in md
    assert (tmp_path / "kv_cache.png").stat().st_size > 1000


def test_served_run_labels_make_file_names_and_the_bf16_control_is_on_by_default():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kv_cache
    finally:
        sys.path.pop(0)
    assert kv_cache._slug("FLASH_ATTN, bf16 cache") == "FLASH_ATTN-bf16-cache"
    assert kv_cache._slug("TRITON_ATTN") == "TRITON_ATTN"
    assert kv_cache.parse(["--out", "o"]).vllm_bf16_control is True
    assert kv_cache.parse(["--out", "o", "--no-vllm-bf16-control"]).vllm_bf16_control is False


def test_kl_by_position_buckets_and_the_served_table_shows_them():
    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kv_cache
    finally:
        sys.path.pop(0)
    kl = torch.zeros(2, 600)
    kl[:, :128] = 1.0
    kl[0, 128:512] = 2.0          # the other row stays 0: that bucket's mean is 1.0
    kl[:, 512:] = 4.0
    by = kv_cache.kl_by_position(kl)
    assert by == {"0-127": 1.0, "128-511": 1.0, "512-599": 4.0}
    assert list(kv_cache.kl_by_position(torch.ones(1, 100))) == ["0-99"]
    cell = {"trained_with": "fa3", "backends": {"FLASH_ATTN": {"backend_in_log": "FLASH_ATTN"}},
            "kl": {"FLASH_ATTN": {"student (bf16 KV)": {"kl": 0.5, "kl_by_position": by}}}}
    rep = {"smoke": True, "date": "d", "results": [], "engine_checks": {}, "vllm_serve": {"cells": {"600": cell}}}
    md = kv_cache.markdown(rep)
    assert "| student's forward | 0-127 | 128-511 | 512-599 |" in md
    assert "| FLASH_ATTN | student (bf16 KV) | 1.00000 | 1.00000 | 4.00000 |" in md


def test_served_attention_scales_are_compared_with_the_exports_layer_by_layer(tmp_path, monkeypatch):
    """What vLLM's attention layers hold after loading (engines._attention_scales, read on a stand-in module
    tree here) against the export's k/v scale tensors: equal floats pass, a layer left at vLLM's 1.0 default
    or missing is named."""
    from safetensors.torch import save_file
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import engines
    import kv_cache as K
    ks, vs = [0.0123, 0.0456], [0.0078, 0.0311]
    save_file({f"model.layers.{i}.self_attn.{n}_proj.{n}_scale": torch.tensor(x, dtype=torch.float32)
               for i in range(2) for n, x in (("k", ks[i]), ("v", vs[i]))}, str(tmp_path / "model.safetensors"))

    class Attn(torch.nn.Module):
        def __init__(self, k, v):
            super().__init__()
            self._k_scale_float, self._v_scale_float, self._q_scale_float = k, v, 1.0
            self._prob_scale = torch.tensor(1.0)
            self.kv_cache_dtype = "fp8_e4m3"

    def tree(scales):
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleList()
        for k, v in scales:
            blk = torch.nn.Module()
            blk.self_attn = torch.nn.Module()
            blk.self_attn.attn = Attn(k, v)
            m.layers.append(blk)
        return m

    f32 = [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in zip(ks, vs)]
    served = engines._attention_scales(tree(f32))
    assert sorted(served) == ["layers.0.self_attn.attn", "layers.1.self_attn.attn"]
    assert served["layers.1.self_attn.attn"] == {"k": f32[1][0], "v": f32[1][1], "q": 1.0, "prob": 1.0,
                                                 "kv_cache_dtype": "fp8_e4m3"}
    ok = K.served_scales_vs_export(served, tmp_path)
    assert ok["all_equal"] and ok["layers_in_export"] == ok["layers_served"] == 2 and ok["max_rel_diff"] == 0.0
    assert ok["served_q_scales"] == [1.0] and ok["served_kv_cache_dtypes"] == ["fp8_e4m3"] and ok["scales_used"]
    bad = K.served_scales_vs_export(engines._attention_scales(tree([f32[0], (1.0, 1.0)])), tmp_path)
    assert not bad["all_equal"] and {(r["layer"], r["scale"]) for r in bad["mismatches"]} == {(1, "k"), (1, "v")}
    assert bad["n_mismatches"] == 2
    assert bad["max_rel_diff"] == pytest.approx(1 / f32[1][1] - 1, rel=1e-6)
    short = K.served_scales_vs_export(engines._attention_scales(tree(f32[:1])), tmp_path)
    assert not short["all_equal"] and short["layers_served"] == 1
    assert {(r["layer"], r["served"]) for r in short["mismatches"]} == {(1, None)}


def test_served_and_student_are_read_against_the_teacher_on_the_same_partition():
    """The second reading: served model and student, each against the teacher. With the whole vocabulary
    as the top-k, the coarse KL is the full KL, which torch's kl_div computes independently; a served model
    that is the student scores exactly the student's KL (minus 0), one further from the teacher scores
    more, and the report prints both."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    try:
        import engines
        import kv_cache
    finally:
        del sys.path[:2]
    g = torch.Generator().manual_seed(0)
    V = 11
    teacher = torch.log_softmax(torch.randn(2, 5, V, generator=g), -1)
    student = torch.log_softmax(teacher + 0.3 * torch.randn(2, 5, V, generator=g), -1)
    worse = torch.log_softmax(teacher + 1.0 * torch.randn(2, 5, V, generator=g), -1)
    served = {"same as the student": student.topk(V, -1)[::-1], "further": worse.topk(V, -1)[::-1]}
    r = kv_cache.vs_teacher(teacher, student, served, V, engines.coarse_kl)
    full = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
    assert r["student"] == pytest.approx(float(full), rel=1e-5)
    assert r["served"]["same as the student"]["minus_student"] == pytest.approx(0.0, abs=1e-6)
    far = torch.nn.functional.kl_div(worse, teacher, log_target=True, reduction="none").sum(-1).mean()
    assert r["served"]["further"]["kl"] == pytest.approx(float(far), rel=1e-5)
    assert r["served"]["further"]["minus_student"] > 0
    # a coarser top-k is a lower bound of the full KL (data processing), read the same way for both sides
    r3 = kv_cache.vs_teacher(teacher, student, {"k3": worse.topk(3, -1)[::-1]}, 3, engines.coarse_kl)
    assert 0 <= r3["student"] <= r["student"] + 1e-6 and 0 <= r3["served"]["k3"]["kl"] <= float(far) + 1e-6
    cell = {"trained_with": "fa3", "backends": {"FLASH_ATTN": {"backend_in_log": "FLASH_ATTN"}},
            "kl": {"FLASH_ATTN": {"student (fa3 emulation)": {"kl": 0.02}}}, "vs_teacher": r}
    md = kv_cache.markdown({"smoke": True, "date": "d", "results": [], "engine_checks": {},
                            "vllm_serve": {"cells": {"5": cell}}})
    assert "The student's own forward (kv_attention=fa3): " in md and "| X = vLLM run | KL(teacher \\|\\| X) |" in md
    assert f"| further | {kv_cache._f(far.item())} |" in md


def test_vllm_serve_reads_the_teacher_with_stand_ins_for_the_gpu_and_vllm(tmp_path, monkeypatch):
    """vllm_serve's own wiring of the teacher reading, on CPU: CUDA and the vLLM child process are stood in
    for (a tiny random Llama as student and teacher, a fixed top-k as what vLLM served), and vs_teacher is
    fed the forward the student was trained with (fa3 here; the stand-in makes every emulation a different
    forward) and the teacher's, on the served tokens."""
    import subprocess
    import types

    import numpy as np
    import transformers
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import engines
    import kv_cache as K
    from qatfactory import quantize as Q
    from qatfactory.nn import kv_cache as KVN

    def tiny(seed):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1)
        return transformers.LlamaForCausalLM(cfg).eval()

    toks = [[1, 5, 3, 7, 2, 9, 4, 6], [2, 2, 8, 1, 0, 3, 5, 7]]
    ix = torch.arange(4).expand(2, 7, 4).contiguous()
    lp = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.05])).expand(2, 7, 4).contiguous()
    attn_seen = []

    def fake_run(cmd, env=None, capture_output=True, text=True, timeout=None):
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps({"loaded": True, "mode": "offline", "vllm": "stand-in"}))
        np.savez(out.with_suffix(".npz"), ix=ix.numpy(), lp=lp.numpy())
        return types.SimpleNamespace(stdout="Using FLASH_ATTN attention backend", stderr="", returncode=0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(engines, "heldout_ids", lambda prep, ns: {"heldout": toks})
    monkeypatch.setattr(Q, "load_student", lambda d, dtype=None: tiny(1).to(dtype))
    def set_attention(m, att):      # each emulation a different forward, so the one read is observable
        attn_seen.append(att)
        with torch.no_grad():
            m.lm_head.weight.mul_({"fa3": 1.0, "triton": 0.5, "none": 3.0}[att])
    monkeypatch.setattr(KVN, "set_attention", set_attention)
    monkeypatch.setattr(KVN, "detach", lambda m: attn_seen.append(None))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda d, dtype=None: tiny(2).to(dtype))
    a = types.SimpleNamespace(vllm_site="stand-in", work=tmp_path, topk=4, vllm_backends=["FLASH_ATTN"],
                              vllm_bf16_control=False, eval_seqs=2, smoke=True, micro=None)
    results = [{"kv": "fp8_e4m3", "export_dir": str(tmp_path), "student_dir": "S", "seq": 8, "attention": "fa3"}]
    out = K.vllm_serve(a, results, {8: {"model_dir": "M"}})
    cell = out["cells"]["8"]
    assert "student (fa3 emulation)" in cell["kl"]["FLASH_ATTN"] and "fa3" in attn_seen
    ids = torch.tensor(toks)
    with torch.no_grad():
        t = torch.log_softmax(tiny(2).to(torch.bfloat16)(input_ids=ids).logits.float(), -1)[:, :-1]
        s = torch.log_softmax(tiny(1).to(torch.bfloat16)(input_ids=ids).logits.float(), -1)[:, :-1]
    want = K.vs_teacher(t, s, {"FLASH_ATTN": (ix, lp)}, 4, engines.coarse_kl)
    assert cell["vs_teacher"]["student"] == pytest.approx(want["student"], rel=1e-6)
    assert cell["vs_teacher"]["served"]["FLASH_ATTN"]["kl"] == pytest.approx(want["served"]["FLASH_ATTN"]["kl"], rel=1e-6)
    assert cell["vs_teacher"]["student"] > 0 and "Against the teacher" in K.markdown(
        {"smoke": True, "date": "d", "results": [], "engine_checks": {}, "vllm_serve": out})
