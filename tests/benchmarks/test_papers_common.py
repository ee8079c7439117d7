"""benchmarks/papers/papers_common.py, what the four QAD-report / QATFactory reproductions share: the verdict
rule on hand-built numbers, the held-out evaluator against a direct computation, re-deploying a student's
latent weights, the data files and their sha256, the time budget's schedule."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
import papers_common as C  # noqa: E402


# ----------------------------------------------------------------------------- the verdict rule
@pytest.mark.parametrize("a,b,sign,want", [
    ([1.0, 1.1], [2.0, 2.05], +1, "reproduced"),          # diff 0.975 > 2 x 0.1
    ([1.0, 1.1], [2.0, 2.05], -1, "not reproduced"),      # the same difference, the paper said the other way
    ([1.0, 1.3], [1.5, 1.5], +1, "inconclusive"),         # diff 0.35 <= 2 x 0.3
    ([1.0, 1.2], [1.4, 1.4], +1, "inconclusive"),         # diff 0.3 == 2 x 0.15 exactly: not larger
    ([0.5], [0.30, 0.31], -1, "reproduced"),              # a deterministic arm (PTQ) against two seeds
    ([1.0], [5.0], +1, "inconclusive"),                   # one seed in both arms: no spread measured
    ([], [1.0, 2.0], +1, "inconclusive"),                 # an arm that did not run
    ([float("nan"), 1.0, 1.0], [2.0, 2.0], +1, "reproduced"),   # a diverged seed is dropped, two remain
])
def test_verdict_rule_on_hand_built_numbers(a, b, sign, want):
    v = C.verdict("claim", "m", "A", a, "B", b, sign)
    assert v["verdict"] == want, v
    if "diff" in v:
        fa = [x for x in a if math.isfinite(x)]
        assert v["diff"] == pytest.approx(sum(b) / len(b) - sum(fa) / len(fa))
        assert v["threshold"] == pytest.approx(2 * max(C.spread(fa), C.spread(b)))


def test_verdict_refuses_a_sign_that_is_not_plus_or_minus_one():
    with pytest.raises(ValueError, match="expected_sign=0"):
        C.verdict("c", "m", "a", [1, 2], "b", [3, 4], 0)


# ----------------------------------------------------------------------------- evaluation
def _tiny(seed=0, scale=0.3):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, initializer_range=scale, tie_word_embeddings=True, bos_token_id=256,
                      eos_token_id=257, pad_token_id=258)
    return LlamaForCausalLM(cfg).eval()


def test_evaluator_against_a_direct_computation(tmp_path):
    from qatfactory.train.data import ByteTokenizer
    (tmp_path / "ho.jsonl").write_text('{"text": "' + "the quick brown fox jumps over the lazy dog " * 8 + '"}\n')
    teacher, student = _tiny(0), _tiny(1)
    ev = C.Evaluator(teacher, ByteTokenizer(), {"ho": str(tmp_path / "ho.jsonl")}, {"*": 48}, 3, "cpu",
                     buckets={"ho": [0, 8, 47]}, batch=2, pos_chunk=5)
    assert ev.evaluate(teacher)["ho"]["kl"] == pytest.approx(0.0, abs=1e-9)
    r = ev.evaluate(student)["ho"]
    ids = ev.sets["ho"].input_ids
    assert r["windows"] == 3 and r["tokens"] == 3 * 47
    with torch.no_grad():
        lt = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1].double(), -1)
        ls = torch.log_softmax(student(input_ids=ids).logits[:, :-1].double(), -1)
    kl = torch.nn.functional.kl_div(ls, lt, log_target=True, reduction="none").sum(-1)     # [windows, positions]
    ce = -ls.gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert r["kl"] == pytest.approx(float(kl.mean()), rel=1e-5)
    assert r["ce"] == pytest.approx(float(ce.mean()), rel=1e-5)
    assert r["top1"] == pytest.approx(float((ls.argmax(-1) == lt.argmax(-1)).double().mean()))
    assert r["kl_by_position"]["0-7"] == pytest.approx(float(kl[:, :8].mean()), rel=1e-5)
    assert r["kl_by_position"]["8-46"] == pytest.approx(float(kl[:, 8:47].mean()), rel=1e-5)
    lo, hi = r["kl_ci95"]
    assert lo <= r["kl"] <= hi


def test_latent_weights_redeployed_at_the_same_recipe_give_the_saved_student(tmp_path):
    """plain_from_student + deploy is how a W4A16-trained student is evaluated at W4A4: at its own recipe it
    must give the saved student's logits exactly (dynamic NVFP4 scales are functions of the weights)."""
    from qatfactory.quantize import QuantConfig, calibrate, load_student, prepare, save_student
    m = _tiny(2).float()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))          # not the init: as after training
    cfg = QuantConfig.preset("nvfp4_w4a16")
    prepare(m, cfg)
    calibrate(m, None, "max")
    save_student(m, str(tmp_path / "s"))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    a = load_student(str(tmp_path / "s"), dtype=torch.float32)(input_ids=ids).logits
    plain = C.plain_from_student(str(tmp_path / "s"), torch.float32, "cpu")
    b = C.deploy(plain, QuantConfig.preset("nvfp4_w4a16"), None)(input_ids=ids).logits
    assert torch.equal(a, b)
    w4a4 = C.deploy(C.plain_from_student(str(tmp_path / "s"), torch.float32, "cpu"), QuantConfig.preset("nvfp4_w4a4"),
                    [{"input_ids": ids[:1]}])
    assert not torch.equal(w4a4(input_ids=ids).logits, a)      # the activations are quantized now


# ----------------------------------------------------------------------------- data, provenance, budget
def test_data_files_and_their_sha256(tmp_path):
    from qatfactory.assets import sha256_file
    d = C.data_files(tmp_path, ("wiki_ho", "austen_ho", "gsm_text"), {"austen_ho": 5000})
    assert set(d["files"]) == {"wiki_ho", "austen_ho", "gsm_text"}
    for k, p in d["files"].items():
        assert d["sha256"][k] == sha256_file(Path(p))
    import json
    aus = [json.loads(x)["text"] for x in Path(d["files"]["austen_ho"]).read_text().splitlines()]
    assert len(aus) == 1 and len(aus[0]) == 5000 and aus[0].startswith("Persuasion")
    gsm = Path(d["files"]["gsm_text"]).read_text().splitlines()
    assert len(gsm) == 1319 and json.loads(gsm[0])["text"].startswith("Question: ")
    for name in ("wiki", "austen", "gsm8k"):
        assert len(d["packages"][name]["file_sha256"]) == 64
    with pytest.raises(ValueError, match="data split 'shakespeare'"):
        C.data_files(tmp_path, ("shakespeare",))



def test_offline_prepare_stages_every_asset_the_gpu_run_reads(tmp_path, monkeypatch):
    """papers.sh's `prepare` on the offline GPU machine: it called pipeline.setup_assets after that function had
    moved to staging.py, and the first H100 run of the four reproductions (2026-12-06) died there in 19 s. The
    carried asset folders (here: the ones this machine's cache holds, copied) go into a fresh cache, each file
    sha256 checked, Austen included; a tampered Austen file stops it. The GGUF reassembly and the model directory
    are the pipeline's own tests' business: stubbed here."""
    import json
    import shutil
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    import staging
    from qatfactory import assets
    carried = tmp_path / "carried" / "assets"
    for name in ("wiki", "gsm8k", "austen"):
        src = assets.fetch(name).parent
        shutil.copytree(src, carried / name)
    (carried / "smollm2").mkdir()
    (carried / "smollm2" / "provenance.json").write_text(json.dumps({"file_sha256": "0" * 64}))
    monkeypatch.setattr(staging, "user_cache", lambda: tmp_path / "nothing-here")
    monkeypatch.setattr(staging, "place_gguf", lambda a, target, sha: {"stub": str(target), "sha256_ok": True})
    monkeypatch.setattr(assets, "prepare_model_dir", lambda name: tmp_path / "model")
    monkeypatch.setenv("QATFACTORY_CACHE", str(tmp_path / "user"))
    info = C.prepare_offline([str(tmp_path / "carried")], tmp_path / "cache", tmp_path / "work", smoke=False)
    assert info["model_dir"] == str(tmp_path / "model")
    for name in ("wiki", "gsm8k", "austen"):
        assert info["assets"][name]["sha256_ok"] is True, name
    got = tmp_path / "cache" / "assets" / "austen" / assets.AUSTEN_FILE
    assert got.read_bytes() == (carried / "austen" / assets.AUSTEN_FILE).read_bytes()
    (carried / "austen" / assets.AUSTEN_FILE).write_text("{}")
    with pytest.raises(staging.PipelineError, match="asset austen: .* sha256"):
        C.prepare_offline([str(tmp_path / "carried")], tmp_path / "cache2", tmp_path / "work", smoke=False)
    shutil.rmtree(carried / "austen")
    with pytest.raises(staging.PipelineError, match="no austen.json"):
        C.prepare_offline([str(tmp_path / "carried")], tmp_path / "cache3", tmp_path / "work", smoke=False)

def test_provenance_has_every_field():
    p = C.provenance(C.model_record(True, None), {"packages": {}, "sha256": {}}, [0, 1], "cpu")
    assert set(C.PROVENANCE_FIELDS) <= set(p)
    assert p["seeds"] == [0, 1] and p["versions"]["torch"] == torch.__version__ and p["device"].startswith("cpu")


def test_schedule_runs_every_arm_once_per_seed_first_and_reports_the_rest(monkeypatch):
    arms = [{"name": "a"}, {"name": "b"}]
    calls, snapshots = [], []
    clock = [0.0]
    monkeypatch.setattr(C.time, "time", lambda: clock[0])
    b = C.Budget(25.0)

    def fn(arm, seed):
        calls.append((arm["name"], seed))
        clock[0] += 10.0
        if arm["name"] == "b" and seed == 0:
            raise RuntimeError("boom")
        return {"x": 1}
    out = C.run_schedule(arms, [0, 1], b, fn, lambda r: snapshots.append(len(r)), "t", default_estimate=5.0)
    # a0 (10 s), b0 fails (10 s), then 5 s left < 1.1 x 10: a1 and b1 are reported as not run
    assert calls == [("a", 0), ("b", 0)]
    assert [r["status"] for r in out] == ["done", "failed: RuntimeError: boom", "not run (time budget)",
                                          "not run (time budget)"]
    assert snapshots == [1, 2, 3, 4]                      # the report is rewritten after every arm
    assert C.failures(out) == ["b s0: failed: RuntimeError: boom"]
