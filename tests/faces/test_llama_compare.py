"""The demo's llama.cpp section: llama-perplexity --kl-divergence of our GGUF exports and of
llama-quantize's own files against the teacher converted by llama.cpp's converter.

On SmolLM2's shapes (2 random layers, the real tokenizer): our PTQ Q4_K_M export without an
importance matrix has llama-quantize's bytes (tests/exporters/test_llama_quantize.py), so llama.cpp must give
it exactly llama-quantize's KL and perplexity; the imatrix file is another quantization."""
from __future__ import annotations

import json
import math

from qatfactory import assets
from qatfactory.faces import demo
from qatfactory.faces import llama_compare as LC
from smollm2_shapes import smollm2_dir, export_ours, require_llama_cpp


def test_llama_cpp_numbers_for_exports_and_llama_quantize(tmp_path):
    require_llama_cpp()
    hf = smollm2_dir(tmp_path / "hf", True)
    ours = export_ours(hf, tmp_path / "exports" / "q4_k-llama_cpp-gguf")
    texts = assets.wiki_splits(0)
    data = {}
    for name, docs in (("eval", texts["eval"][:12]), ("train", texts["train"][:12])):
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        data[name] = str(p)
    results = {"teacher": {"tokens": 1000.0}, "targets": {"q4_k": {
        "label": "Q4_K_M", "preset": "q4_k", "ptq": {"kl": 0.5}, "qad": {"kl": 0.25}, "ptq_gguf": str(ours),
        "exports": [{"engine": "llama_cpp", "flavour": "gguf", "ok": True, "path": str(ours.parent)}]}}}
    s = demo.Settings(seq_len=128)
    out = tmp_path / "run"
    res = demo.llama_cpp_numbers(results, hf, data, out, tmp_path / "cache", s, "auto", vs_llama_quantize=True)
    assert res["status"] == "ok", res
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == ["PTQ export", "QAD export", "llama-quantize Q4_K_M", "llama-quantize Q4_K_M + imatrix"]
    for r in rows.values():
        assert math.isfinite(r["kl"]) and r["kl"] > 0 and math.isfinite(r["ppl"]) and r["chunks"] >= 2
        assert r["token_embd.weight"] == "Q8_0" and r["types"]["Q4_K"] > 0
    same = rows["llama-quantize Q4_K_M"]
    # identical bytes -> identical logits in llama.cpp -> identical numbers
    assert (rows["PTQ export"]["kl"], rows["PTQ export"]["ppl"]) == (same["kl"], same["ppl"])
    assert rows["PTQ export"]["data_bytes"] == same["data_bytes"]
    assert rows["llama-quantize Q4_K_M + imatrix"]["kl"] != same["kl"]
    assert rows["PTQ export"]["torch_kl"] == 0.5 and rows["QAD export"]["torch_kl"] == 0.25
    md = "\n".join(LC.report_lines(res, out))
    assert f"| Q4_K_M | llama-quantize Q4_K_M | {same['bytes'] / 2**20:.1f} |" in md
    assert f"{same['kl']:.4f} | {same['ppl']:.3f}" in md and "--kl-divergence" in md
    assert (out / "plots" / "llama_cpp_kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the teacher is cached by the model directory's files
    assert len(list((tmp_path / "cache" / "llama-teacher").glob("*/teacher-f32.gguf"))) == 1


def test_report_says_why_llama_cpp_did_not_run(tmp_path):
    results = {"teacher": {"tokens": 1.0}, "targets": {"nvfp4": {"label": "NVFP4", "preset": "nvfp4_w4a16",
               "exports": [{"engine": "vllm", "flavour": "modelopt", "ok": True, "path": "x"}]}}}
    res = demo.llama_cpp_numbers(results, tmp_path, {}, tmp_path, tmp_path, demo.Settings())
    assert res["status"] == "none" and "no GGUF export" in res["reason"]
    assert LC.report_lines(res, tmp_path)[1].startswith("Not run: no GGUF export passed in this run")
    off = demo.llama_cpp_numbers(results, tmp_path, {}, tmp_path, tmp_path, demo.Settings(), "off")
    assert off["status"] == "off"
