"""benchmarks/papers/scale_qlora.py: --smoke runs every arm, merge, gate and swap end to end on a random tiny
model (plumbing only: it measures nothing about Scale-QLoRA); and, on a tiny task with a realistic LoRA
(rho ~ 2.5%), the naive merge measurably loses the adaptation while the QAT-LoRA and scale merges keep it
exactly."""
import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sq():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "benchmarks" / "papers"))
    try:
        import scale_qlora
        yield scale_qlora
    finally:
        sys.path.pop(0)
        torch.set_num_threads(n)


def test_scale_qlora_smoke(tmp_path, sq):
    assert sq.main(["--smoke", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "scale_qlora.json").read_text())
    assert rep["smoke"] is True and [r["format"] for r in rep["results"]] == ["nvfp4", "mxfp4"]
    for r in rep["results"]:
        arms = r["arms"]
        assert sorted(arms) == sorted(sq.ARMS)
        sc, qa, ln = arms["scale"], arms["qat_lora"], arms["lora_naive"]
        # scale-only: codes untouched, merged == unmerged bit for bit, the gate PASSes
        assert sc["change"]["codes_changed"] == 0 and sc["change"]["sha_base"] == sc["change"]["sha_merged"]
        assert sc["change"]["scales_changed"] > 0 and sc["merged_logits_max_abs_diff"] == 0
        assert sc["merged"] == sc["unmerged"] and sc["gate"]["verdict"] == "PASS", sc["gate"]
        # QAT-LoRA: the code plane is re-derived, but the merge is the training forward
        assert qa["merged_logits_max_abs_diff"] == 0 and qa["change"]["codes_changed"] > 0
        assert sorted(qa["rule_sensitivity"]) == sorted(sq.VARIANTS[r["format"]])
        assert ln["change"]["sha_base"] != ln["change"]["sha_merged"] and ln["rho"] > 0
        s = r["swap"]
        assert s["scale_copy_cached_s"] > 0 and s["reload_artifact_s"] > 0 and r["swap_remerge_s"] > 0
        assert 0 < sc["scale_file_fraction"] < 0.15
    md = (tmp_path / "scale_qlora.md").read_text()
    assert "SMOKE" in md and md.count("| nvfp4 |") == 4 + 3 + 1
    assert (tmp_path / "scale_qlora.png").stat().st_size > 1000


def test_naive_merge_loses_the_adaptation_the_others_keep_it(tmp_path, sq):
    from transformers import AutoTokenizer

    from qatfactory import native as N
    items = sq.gsm8k_items(16, 0)
    md = sq.smoke_model_dir(tmp_path, items["train"])
    tok = AutoTokenizer.from_pretrained(str(md))
    dev = torch.device("cpu")
    tr = sq.samples(tok, items["train"], "gsm8k", 320, tmp_path / "tr.jsonl")

    def nll(m):
        return sq.evaluate(m, tok, tr, [], [], 1, 8, dev)["nll"]
    for fmt, keep_max in (("nvfp4", 0.2), ("mxfp4", 0.35)):
        ck = N.read_native(sq.native_base(md, fmt, tmp_path))
        base_cm = N.converted_with_scales(ck, {n: p.scales for n, p in ck.packed.items()})
        base = nll(N.build_model(ck))
        a = argparse.Namespace(lora_rank=16, lora_alpha=32, steps=20, batch=4, lora_lr=2e-4, seed=0,
                               scale_lr_nvfp4=3e-2, scale_lr_mxfp4=2e-1)
        ln = sq.arm_lora_naive(ck, base_cm, tok, tr, a, dev)
        gain, kept = base - nll(ln["model"]), base - nll(sq.dense_model(ln["merge"](), dev))
        assert 0.01 < ln["rho"] < 0.05 and gain > 0.05, (fmt, ln["rho"], gain)
        assert kept < keep_max * gain, (fmt, gain, kept)          # the merge erased most of what was learned
        # QAT-LoRA: the merge is the training forward (at this LR it has not crossed a rounding threshold yet:
        # fake_quant(W + s B A) is still the base, the STE stall of a weight-space adapter on an on-grid base)
        qa = sq.arm_qat_lora(ck, base_cm, tok, tr, a, dev)
        assert nll(sq.dense_model(qa["merge"](), dev)) == nll(qa["model"]) <= base
        a.steps = 6
        sc = sq.arm_scale(ck, base_cm, tok, tr, a, dev)
        merged = N.build_model(N.read_native(ck.path))
        N.apply_scales(merged, ck, _scale_file(N, sc["model"], ck, tmp_path / f"{fmt}.scales.safetensors"))
        assert nll(merged) == nll(sc["model"]) < base


def _scale_file(N, model, ck, path):
    N.save_scale_file(model, ck, path)
    return path
