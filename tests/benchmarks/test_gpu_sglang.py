"""SGLang on the H200 (tools/gpu/carry_plan.py, engines_sglang.py, engines.py's SGLang rows):
everything of it that runs without a GPU or SGLang. The carry plan (parts fill the room the vLLM calls
leave, every call under 64 MiB), the bundle's split/reassembly and the tampering it must catch, the
parsing of SGLang's prompt log-probabilities into vLLM's layout, the per-model orchestration (records,
logs, a hung model's whole process group killed), and the report's SGLang table."""
import argparse
import json
import os
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
sys.path.insert(0, str(REPO / "tools" / "gpu"))
import carry_plan as CP  # noqa: E402
import engines  # noqa: E402
import engines_sglang as ES  # noqa: E402

MIB = 2 ** 20


# ------------------------------------------------------------------ carry plan
def test_cut_fills_the_rooms_in_call_order_then_goes_in_extra_calls_before_the_vllm_call():
    rooms = [9 * MIB, 14 * MIB, 10 * 1024, 14 * MIB]          # the third is too small to be worth a part
    parts = CP.cut(30 * MIB, rooms)
    assert sum(p["size"] for p in parts) == 30 * MIB
    assert [p["ride"] for p in parts] == [1, 2, 4]
    assert [p["size"] for p in parts] == [9 * MIB, 14 * MIB, 7 * MIB]
    # more than the rooms hold: the rest in slots len(rooms)+1.., parts of at most 60 MiB
    big = CP.cut(150 * MIB, [MIB, MIB])
    assert [p["ride"] for p in big] == [1, 2, 3, 4, 5]
    assert [p["size"] for p in big] == [MIB, MIB, 60 * MIB, 60 * MIB, 28 * MIB]
    assert CP.cut(5, [0, 0]) == [{"size": 5, "ride": 3}]
    # ...and those slots become stash calls before the last base call (the vLLM call), which moves back
    assert [p["ride"] for p in CP.final_calls(big, 2)] == [1, 5, 2, 3, 4]
    assert [p["ride"] for p in CP.final_calls(parts, 4)] == [1, 2, 4]       # nothing extra: unchanged


def _sparse(p: Path, n: int) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(n)


def _staged_root(tmp_path: Path) -> Path:
    """The files the six vLLM calls carry, at the sizes staged on 2026-12-01 (sparse: no disk used)."""
    root = tmp_path / "repo"
    sizes = {".whl/a.whl": 29 * MIB, ".vllm/deps/d.whl": 18 * MIB, ".vllm/vllm.manifest": 468,
             ".gpu/assets/wiki/w.json": 7 * MIB, ".gpu/smollm2.gguf.parts.json": 432,
             ".gpu/smollm2.gguf.part-aa": 49181216, ".gpu/smollm2.gguf.part-ab": 49181216,
             ".vllm/vllm.zip.part-aa": 60 * MIB, ".vllm/vllm.zip.part-ab": 60 * MIB, ".vllm/vllm.zip.part-ac": 59583091}
    for rel, n in sizes.items():
        _sparse(root / rel, n)
    return root


def _bundle(tmp_path: Path, names=("alpha-1.0-py3-none-any.whl", "beta-2.0-py3-none-any.whl"), n=3 * MIB):
    w = tmp_path / "wheels"
    w.mkdir(exist_ok=True)
    for i, name in enumerate(names):
        (w / name).write_bytes(os.urandom(4096) + bytes([i]) * (n + i))
    b = tmp_path / "sglang.tar"
    with tarfile.open(b, "w") as tf:
        for name in names:
            tf.add(w / name, arcname=name)
    return b, w


def test_plan_folds_the_sglang_parts_into_the_vllm_calls_and_checks_every_call(tmp_path, capsys):
    root = _staged_root(tmp_path)
    tree = int(2.8 * MIB)
    rooms = CP.rooms(root, tree)
    assert rooms[3] < 2 * MIB and rooms[1] > 10 * MIB       # a vLLM part leaves little, a GGUF part much
    b, w = _bundle(tmp_path, n=18 * MIB)                     # ~36 MiB: fits the rooms of calls 1-6
    (root / CP.SGLANG_DIR).mkdir()
    recs = CP.split(b, root / CP.SGLANG_DIR, CP.cut(b.stat().st_size, rooms))
    CP.write_manifest(root / CP.SGLANG_DIR / CP.MANIFEST, b, w, recs, "0.5.17", ["pydantic"], [])
    calls = CP.calls(root, tree)
    assert len(calls) == 7 and calls[-1]["cmd"] == CP.SGLANG_CALL and calls[-1]["carry"] == []
    assert all(c["ok"] and c["bytes"] < CP.CAP for c in calls), [(c["bytes"] / MIB, c["carry"]) for c in calls]
    assert f"{CP.SGLANG_DIR}/{CP.MANIFEST}" in calls[0]["carry"]
    carried = [p for c in calls for p in c["carry"] if "sglang.tar.part-" in p]
    assert carried == [f"{CP.SGLANG_DIR}/{r['name']}" for r in recs]
    assert CP.sglang_complete_by(root) <= 6
    assert CP.main(["plan", "--root", str(root), "--tree", str(tree)]) == 0
    assert "after call" in capsys.readouterr().out
    # a working tree grown past the margin: the plan says which call no longer fits, and fails
    assert CP.main(["plan", "--root", str(root), "--tree", str(tree + 2 * MIB)]) == 1
    assert "TOO BIG" in capsys.readouterr().out


def _pack(root, tmp_path, tree, n):
    b, w = _bundle(tmp_path, n=n)
    (root / CP.SGLANG_DIR).mkdir(exist_ok=True)
    parts = CP.cut(b.stat().st_size, CP.rooms(root, tree))
    extra = max([p["ride"] - len(CP.BASE_CALLS) for p in parts] + [0])
    recs = CP.split(b, root / CP.SGLANG_DIR, CP.final_calls(parts))
    CP.write_manifest(root / CP.SGLANG_DIR / CP.MANIFEST, b, w, {"parts": recs, "extra_calls": extra}, "0.5.17", [], [])
    return recs


def test_plan_puts_what_does_not_fit_in_a_stash_call_before_the_vllm_call(tmp_path, capsys):
    """SGLang's install and JIT warm-up start in the vLLM call: every part must be carried by then."""
    root = _staged_root(tmp_path)
    tree = int(2.8 * MIB)
    recs = _pack(root, tmp_path, tree, 22 * MIB)               # ~44 MiB: more than the rooms hold
    calls = CP.calls(root, tree)
    assert [c["cmd"] for c in calls] == [c for _, c in CP.BASE_CALLS[:-1]] + [CP.STASH_CALL] + \
        [CP.BASE_CALLS[-1][1], CP.SGLANG_CALL]
    assert calls[5]["carry"] and all(p.startswith(".sglang/sglang.tar.part-") for p in calls[5]["carry"])
    assert calls[-1]["carry"] == [] and all(c["ok"] for c in calls)
    assert CP.warm_call(root, tree) == 7 and CP.sglang_complete_by(root, tree) <= 7
    carried = sorted(p for c in calls for p in c["carry"] if "sglang.tar.part-" in p)
    assert carried == sorted(f"{CP.SGLANG_DIR}/{r['name']}" for r in recs)
    assert CP.main(["plan", "--root", str(root), "--tree", str(tree)]) == 0
    assert "after call 7 (call 7, the vLLM call" in capsys.readouterr().out


def test_carried_jit_caches_ride_before_the_warm_up(tmp_path):
    root = _staged_root(tmp_path)
    tree = int(2.8 * MIB)
    _pack(root, tmp_path, tree, 22 * MIB)
    _sparse(root / CP.JIT_DIR / "tvmffi.tgz", 4 * MIB)
    calls = CP.calls(root, tree)
    assert CP.JIT_DIR in calls[5]["carry"] and len(calls) == 8          # in the stash call's room
    # without such a call (everything fit in the rooms), a stash call of its own, again before the vLLM call
    root2 = _staged_root(tmp_path / "b")
    _pack(root2, tmp_path / "b", tree, 17 * MIB)
    _sparse(root2 / CP.JIT_DIR / "tvmffi.tgz", 4 * MIB)
    calls = CP.calls(root2, tree)
    assert [c["carry"] for c in calls if CP.JIT_DIR in c["carry"]] == [[CP.JIT_DIR]]
    assert calls[5]["carry"] == [CP.JIT_DIR] and calls[6]["cmd"] == CP.BASE_CALLS[-1][1]
    assert CP.sglang_complete_by(root2, tree) < CP.warm_call(root2, tree) == 7
    assert all(c["ok"] for c in calls)


def test_split_then_assemble_gives_the_wheels_back_and_catches_tampering(tmp_path):
    b, w = _bundle(tmp_path)
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    recs = CP.split(b, parts_dir, CP.cut(b.stat().st_size, [2 * MIB, 2 * MIB]))
    assert len(recs) == 3 and sum(r["size"] for r in recs) == b.stat().st_size
    man = CP.write_manifest(parts_dir / CP.MANIFEST, b, w, recs, "0.5.17", [], [])
    assert CP.main(["ready", "--parts", str(parts_dir)]) == 0
    got = CP.assemble(parts_dir, man, tmp_path / "out1")
    assert sorted(p.name for p in got) == sorted(p.name for p in w.glob("*.whl"))
    for p in got:
        assert p.read_bytes() == (w / p.name).read_bytes()
    # a flipped byte in one part: named, nothing unpacked from it
    part = parts_dir / recs[1]["name"]
    data = bytearray(part.read_bytes())
    data[1000] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=recs[1]["name"]):
        CP.assemble(parts_dir, man, tmp_path / "out2")
    assert not (tmp_path / "out2").exists() or not list((tmp_path / "out2").glob("*.whl"))
    # a part not carried yet
    part.unlink()
    assert CP.main(["ready", "--parts", str(parts_dir)]) == 1
    with pytest.raises(FileNotFoundError, match=recs[1]["name"]):
        CP.assemble(parts_dir, man, tmp_path / "out3")


def test_assemble_refuses_members_its_manifest_does_not_name(tmp_path):
    b, w = _bundle(tmp_path)
    (tmp_path / "evil.whl").write_bytes(b"x")
    with tarfile.open(b, "a") as tf:                         # a member with a path, appended after packing
        tf.add(tmp_path / "evil.whl", arcname="../evil.whl")
    (tmp_path / "evil.whl").write_bytes(b"original")
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    recs = CP.split(b, parts_dir, CP.cut(b.stat().st_size, []))
    man = CP.write_manifest(parts_dir / CP.MANIFEST, b, w, recs, "0.5.17", [], [])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="unexpected member '../evil.whl'"):
        CP.assemble(parts_dir, man, out)
    assert (tmp_path / "evil.whl").read_bytes() == b"original"      # nothing written outside the destination
    assert list(out.iterdir()) == []                                 # nor inside: every member checked first


def test_manifest_records_what_was_slimmed(tmp_path):
    b, w = _bundle(tmp_path, names=("sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl", "other-1-py3-none-any.whl"))
    (w / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl.orig-sha256").write_text("ab" * 32 + "\n")
    man = CP.write_manifest(tmp_path / "m.json", b, w, [], "0.5.17", ["pydantic"],
                            ["sglang_kernel-:sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/*"])
    k = next(x for x in man["wheels"] if x["file"].startswith("sglang_kernel-"))
    assert k["removed"] == ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/*"] and k["pypi_sha256"] == "ab" * 32
    assert "removed" not in next(x for x in man["wheels"] if x["file"].startswith("other-"))
    assert json.loads((tmp_path / "m.json").read_text()) == man


# ------------------------------------------------------------------ SGLang's output, parsed
def _out(row, topk, shuffle=False, first=None):
    top = [first]
    for t in range(1, len(row)):
        pos = [(-0.1 * (j + 1) - 0.01 * t, (row[t] + j) % 50, None) for j in range(topk + 2)]
        top.append(list(reversed(pos)) if shuffle else pos)
    return {"output_ids": [1], "meta_info": {"input_top_logprobs": top,
                                             "input_token_logprobs": [(None, row[0], None)] +
                                                                     [(-0.5, t, None) for t in row[1:]]}}


def test_top_logprobs_arrays_has_vllms_layout_best_first():
    rows = [[3, 7, 9, 11], [5, 5, 6, 2]]
    lp, ix = ES.top_logprobs_arrays([_out(rows[0], 4, shuffle=True), _out(rows[1], 4)], rows, 4)
    assert lp.shape == ix.shape == (2, 3, 4)
    assert (lp[:, :, :-1] >= lp[:, :, 1:]).all()                 # best first, whatever order SGLang gave
    assert ix[0, 0, 0] == 7 and ix[1, 2, 0] == 2                  # position t-1 holds token t's distribution
    assert abs(lp[0, 1, 0] - (-0.1 - 0.02)) < 1e-6


def test_top_logprobs_arrays_refuses_what_does_not_line_up():
    rows = [[3, 7, 9, 11]]
    with pytest.raises(ValueError, match="positions"):
        ES.top_logprobs_arrays([_out(rows[0][:3], 4)], rows, 4)          # logprob_start_len not 0
    with pytest.raises(ValueError, match="other tokens"):
        ES.top_logprobs_arrays([_out([3, 7, 9, 12], 4)], rows, 4)
    with pytest.raises(ValueError, match="of 8 top logprobs"):
        ES.top_logprobs_arrays([_out(rows[0], 4)], rows, 8)               # fewer than asked for
    with pytest.raises(ValueError, match="outputs for"):
        ES.top_logprobs_arrays([], rows, 4)


def test_engine_kwargs():
    g = ES.engine_kwargs("/m", 512, "cudagraphs")
    e = ES.engine_kwargs("/m", 512, "eager")
    for kw in (g, e):
        assert kw["attention_backend"] == "triton" and kw["sampling_backend"] == "pytorch"
        assert kw["grammar_backend"] == "none" and kw["skip_tokenizer_init"] and kw["disable_radix_cache"]
        assert kw["context_length"] == 1024 and kw["trust_remote_code"] is False
    assert g["cuda_graph_max_bs_decode"] == 64 and "disable_cuda_graph" not in g
    assert e["disable_cuda_graph"] is True
    assert ES.engine_kwargs("/m", 2048, "eager")["context_length"] == 2064
    with pytest.raises(ValueError, match="mode"):
        ES.engine_kwargs("/m", 512, "fa3")


def test_describe_reads_the_records_evidence():
    v = {"server": {"quantization": None, "fp4_gemm_runner_backend": "auto"},
         "log_evidence": ["Load weight begin. quant=modelopt_fp4, quant_algo=NVFP4"],
         "jit_modules": {"present": ["sgl_kernel_jit_gptq_marlin_bf16_t_0123456789abcdef__arch_sm_90a__tvmffi_0.1.11",
                                     "sgl_kernel_jit_rope_0123456789abcdef__arch_sm_90a__tvmffi_0.1.11"],
                         "built_here": ["sgl_kernel_jit_rope_0123456789abcdef__arch_sm_90a__tvmffi_0.1.11"]}}
    d = ES.describe(v)
    assert d[0].startswith("quantization=modelopt_fp4 / fp4_gemm_runner_backend=auto") and "marlin" in d[0]
    assert d[1] == "JIT gptq_marlin_bf16_t (built earlier)"
    assert ES.describe({"server": {"quantization": None}}) == []


# ------------------------------------------------------------------ orchestration, with a stand-in engine
FAKE_ONE = textwrap.dedent('''
    import json, os, subprocess, sys, time
    a = sys.argv
    out, model = a[a.index("--out") + 1], a[a.index("--model") + 1]
    print("Load weight end. quant=modelopt_fp4 mem usage=0.09 GB", flush=True)
    if model.endswith("hang"):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])   # SGLang's scheduler stand-in
        open(os.path.join(os.path.dirname(out), "child.pid"), "w").write("started")
        time.sleep(120)
    if model.endswith("refuse"):
        print("ValueError: ModelOpt currently only supports: FP8, NVFP4, NVFP4_AWQ", flush=True)
        sys.exit(1)
    json.dump({"loaded": True, "mode": "cudagraphs", "greedy": [[1]], "throughput": {"1": {"tokens_per_s": 1.0}},
               "server": {"quantization": "modelopt_fp4"}}, open(out, "w"))
''')


def _work(tmp_path, cells):
    work = tmp_path / "w"
    work.mkdir()
    st = {"prep": {"model_dir": str(tmp_path / "bf16")},
          "cells": {n: {"export_dir": str(tmp_path / d)} for n, d in cells.items()}}
    (work / "students.json").write_text(json.dumps(st))
    (work / "tokens.json").write_text(json.dumps({"heldout": [[1, 2]], "prompts": [[1]], "seq_len": 2}))
    script = tmp_path / "fake_engines.py"
    script.write_text(FAKE_ONE)
    return work, str(script)


def _a(work, cells, timeout=60):
    return argparse.Namespace(work=str(work), sglang_cells=cells, warm_wait=5, topk=4, sglang_timeout=timeout)


def test_phase_sglang_records_each_model_and_skips_what_is_done(tmp_path):
    work, script = _work(tmp_path, {"nvfp4-w4a4-modelopt": "e1", "nvfp4-w4a16-modelopt": "e2refuse"})
    ES.phase_sglang(_a(work, ["nvfp4-w4a4-modelopt", "nvfp4-w4a16-modelopt", "mxfp4-w4a4-ct"]), script)
    ok = json.loads((work / "nvfp4-w4a4-modelopt" / "sglang.json").read_text())
    assert ok["loaded"] and ok["kernels"][0].startswith("quantization=modelopt_fp4")
    assert any("mem usage" in line for line in ok["log_evidence"])
    bad = json.loads((work / "nvfp4-w4a16-modelopt" / "sglang.json").read_text())
    assert bad["loaded"] is False and bad["exit"] == 1 and "NVFP4_AWQ" in " ".join(bad["error"])
    assert "NVFP4_AWQ" in (work / "nvfp4-w4a16-modelopt" / "sglang.log").read_text()
    assert (work / "bf16" / "sglang.json").exists() and not (work / "mxfp4-w4a4-ct").exists()
    # a second call keeps what loaded and measured, tries the refused one again
    mtime = (work / "nvfp4-w4a4-modelopt" / "sglang.json").stat().st_mtime_ns
    ES.phase_sglang(_a(work, ["nvfp4-w4a4-modelopt"]), script)
    assert (work / "nvfp4-w4a4-modelopt" / "sglang.json").stat().st_mtime_ns == mtime


def test_phase_sglang_kills_a_hung_models_whole_process_group(tmp_path):
    work, script = _work(tmp_path, {"nvfp4-w4a4-modelopt": "ehang"})
    t = time.time()
    ES.phase_sglang(_a(work, ["nvfp4-w4a4-modelopt"], timeout=8), script)
    assert time.time() - t < 60
    rec = json.loads((work / "nvfp4-w4a4-modelopt" / "sglang.json").read_text())
    assert rec["loaded"] is False and rec["exit"] == -9
    assert (work / "nvfp4-w4a4-modelopt" / "child.pid").exists()
    # the stand-in scheduler (a grandchild, `sleep 120`) is gone with its group
    for _ in range(50):
        alive = [l for l in os.popen("ps -eo stat=,args=").read().splitlines()
                 if "time.sleep(120)" in l and "-c" in l and not l.startswith("Z")]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, alive
    assert "timed out after 8 s" in (work / "nvfp4-w4a4-modelopt" / "sglang.log").read_text()


def test_every_model_waits_for_a_running_jit_warm_up(tmp_path):
    """bf16 too: its RMSNorm (FlashInfer's norm), activation, RoPE and KV store are JIT modules the warm-up builds."""
    work, script = _work(tmp_path, {"nvfp4-w4a4-modelopt": "e1"})
    (work / "sglang-warm.pid").write_text(str(os.getpid()))             # a warm-up that is still building
    (work / "sglang-warm.json").write_text(json.dumps({"done": False}))
    a = _a(work, ["nvfp4-w4a4-modelopt"])
    a.warm_wait = 2
    ES.phase_sglang(a, script)
    assert not (work / "bf16" / "sglang.json").exists()                 # left for the next call, no record
    assert not (work / "nvfp4-w4a4-modelopt" / "sglang.json").exists()
    (work / "sglang-warm.json").write_text(json.dumps({"done": True, "modules": {"gptq_marlin_bf16": 1.0}}))
    ES.phase_sglang(a, script)
    assert json.loads((work / "bf16" / "sglang.json").read_text())["loaded"]
    assert json.loads((work / "nvfp4-w4a4-modelopt" / "sglang.json").read_text())["loaded"]


def test_wait_warm_returns_the_record_or_gives_up(tmp_path):
    assert ES.wait_warm(tmp_path, 5) is None                              # no warm-up ever started
    (tmp_path / "sglang-warm.pid").write_text(str(os.getpid()))            # alive...
    (tmp_path / "sglang-warm.json").write_text(json.dumps({"done": True, "modules": {"gptq_marlin_bf16": 81.0}}))
    t = time.time()
    assert ES.wait_warm(tmp_path, 30)["modules"] == {"gptq_marlin_bf16": 81.0}   # ...but done: no waiting
    assert time.time() - t < 5
    (tmp_path / "sglang-warm.json").write_text(json.dumps({"done": False}))
    t = time.time()
    assert ES.wait_warm(tmp_path, 3) == {"done": False}                   # still running: waits its timeout
    assert 2.5 < time.time() - t < 15


# ------------------------------------------------------------------ report
def test_parse_checks_the_sglang_cells():
    a = engines.parse(["sglang"])
    assert a.sglang_cells == list(engines.DEFAULT_SGLANG_CELLS) and a.sglang_timeout == 240
    assert engines.parse(["sglang", "--sglang-cells", "nvfp4-w4a4-modelopt,mxfp4-w4a4-ct"]).sglang_cells == \
        ["nvfp4-w4a4-modelopt", "mxfp4-w4a4-ct"]
    with pytest.raises(SystemExit):
        engines.parse(["sglang", "--sglang-cells", "nvfp4-w4a4"])


def test_markdown_gains_an_sglang_table_only_for_cells_it_ran():
    stu = {"kl_vs_vllm": 0.01, "kl_vs_ptq": 0.2, "max_abs_logprob_diff_top8": 0.1, "top1_agree": 0.99,
           "greedy_vs_vllm": {"token_match": 0.9}}
    sg = {"record": {"loaded": True, "mode": "cudagraphs", "kernels": ["quantization=modelopt_fp4 (auto -> marlin)"]},
          "student": {"kl_vs_sglang": 0.03, "kl_vs_ptq": 0.2, "max_abs_logprob_diff_top8": 0.2, "top1_agree": 0.98,
                      "greedy_vs_sglang": {"token_match": 0.8}},
          "student weights only": {"kl_vs_sglang": 0.002, "kl_vs_ptq": 0.1},
          "throughput_vs_bf16": {"1": 1.1, "64": 0.7}, "verdict_basis": "student weights only",
          "engine_runs_trained_numbers": True}
    refused = {"record": {"loaded": False, "init_errors": ["cudagraphs: ValueError: only FP8, NVFP4, NVFP4_AWQ"]}}
    rep = {"date": "d", "bf16": {"vllm": "0.24.0", "gpu": "H200", "throughput": {}},
           "sglang_bf16": {"sglang": "0.5.17", "gpu": "H200", "throughput": {"1": {"tokens_per_s": 300.0}}},
           "topk": 128, "tokens": {"sequences": 8, "seq_len": 512, "prompts": 16, "gen_tokens": 64},
           "cells": {"nvfp4-w4a4-modelopt": {"vllm": {"loaded": True, "kernels": ["Marlin"]}, "student": stu,
                                             "verdict_basis": "student", "engine_runs_trained_numbers": True,
                                             "sglang": sg},
                     "nvfp4-w4a16-modelopt": {"vllm": {"loaded": True}, "student": stu, "sglang": refused},
                     "mxfp4-w4a4-ct": {"vllm": {"loaded": False, "error": "x"}}}}
    md = engines.markdown(rep)
    vllm_part, sg_part = md.split("SGLang 0.5.17 on H200")
    assert "| KL(student‖vLLM) |" in vllm_part and "| mxfp4-w4a4-ct |" in vllm_part
    assert "| KL(student‖SGLang) |" in sg_part and "300 tok/s at batch 1" in sg_part
    assert "| mxfp4-w4a4-ct |" not in sg_part                                # SGLang did not run it
    row = next(l for l in sg_part.splitlines() if l.startswith("| nvfp4-w4a4-modelopt |"))
    assert "| 0.03000 | 0.20000 |" in row and "| 1.10 / 0.70 |" in row and "yes (vs the weight-only forward)" in row
    assert "| nvfp4-w4a4-modelopt vs its weight-only forward | | | 0.00200 |" in sg_part
    assert "| nvfp4-w4a16-modelopt: refused | | cudagraphs: ValueError: only FP8, NVFP4, NVFP4_AWQ" in sg_part
    assert "not loaded" in next(l for l in sg_part.splitlines() if l.startswith("| nvfp4-w4a16-modelopt |"))
    assert "SGLang" not in engines.markdown(dict(rep, cells={"mxfp4-w4a4-ct": rep["cells"]["mxfp4-w4a4-ct"]}))
