"""The README's and docs' promises stay true: the two commands, and the generated tables match their sources."""
import re
from pathlib import Path

from qatfactory.exporters.matrix import markdown as matrix_markdown
from qatfactory.formats.__main__ import markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_shows_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_formats_table_matches_registry():
    text = (ROOT / "docs" / "formats.md").read_text()
    m = re.search(r"<!-- formats-table -->\n(.*?)\n<!-- /formats-table -->", text, re.S)
    assert m, "docs/formats.md lost its formats table markers"
    assert m.group(1).strip() == markdown_table().strip(), (
        "docs/formats.md formats table is out of date: regenerate it with `python -m qatfactory.formats`")


def test_reliability_table_has_every_exit_code():
    """docs/reliability.md's one table names every exit code of qatfactory.exitcodes with its meaning."""
    from qatfactory.exitcodes import TABLE
    text = (ROOT / "docs" / "reliability.md").read_text()
    m = re.search(r"<!-- reliability-table -->\n(.*?)\n<!-- /reliability-table -->", text, re.S)
    assert m, "docs/reliability.md lost its reliability table markers"
    rows = m.group(1)
    for code, name, meaning in TABLE:
        assert f"| exit {code} | {name} | {meaning} |" in rows, (code, name)
    assert rows.count("| exit ") == len(TABLE)
    assert "weights_only=True" in rows and "FAILED.json" in rows


def test_support_matrix_is_the_tested_cells():
    """The README's supported matrix is generated from the same cells the gate tests run."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- support-matrix -->\n(.*?)\n<!-- /support-matrix -->", text, re.S)
    assert m, "README lost its support-matrix markers"
    assert m.group(1).strip() == matrix_markdown().strip(), (
        "README support matrix is out of date: regenerate it with `python -m qatfactory.exporters.matrix`")


def test_verdict_words_and_exit_codes_match():
    from qatfactory import exitcodes as X
    text = (ROOT / "README.md").read_text()
    for word, code in (("PASS", X.OK), ("FAIL", X.FAIL), ("INCOMPLETE", X.INCOMPLETE)):
        assert f"**{word}** (exit {code})" in text, word
    assert f"exit {X.BAD_INPUT}" in text


def test_engine_run_numbers_match_the_results_file():
    """The matrix's 'loaded by the engine itself' column quotes the last GPU run: its numbers must be
    the ones in that run's engines.json (benchmarks/results/engines_h200_20261201, all six vLLM cells)."""
    import json
    from qatfactory.exporters.matrix import ENGINE_RUNS
    d = json.loads((ROOT / "benchmarks" / "results" / "engines_h200_20261201" / "engines.json").read_text())["cells"]
    assert all(c["vllm"]["loaded"] for c in d.values()) and len(d) == 6
    for flavour, cells in (("compressed-tensors", ("nvfp4-w4a16-ct", "mxfp4-w4a16-ct")),
                           ("modelopt", ("nvfp4-w4a16-modelopt",))):
        txt = ENGINE_RUNS[("vllm", flavour)]
        for cell in cells:
            s, tp = d[cell]["student"], d[cell]["throughput_vs_bf16"]
            assert f"{s['kl_vs_vllm']:.4f}"[:6] in txt and f"{s['kl_vs_ptq']:.2f}" in txt, cell
            assert f"{s['greedy_vs_vllm']['token_match']:.3f}" in txt and f"{s['top1_agree']:.3f}" in txt, cell
            assert f"{tp['1']:.2f}x / {tp['64']:.2f}x" in txt, cell
    for flavour, cell in (("compressed-tensors", "mxfp4-w4a4-ct"), ("modelopt", "nvfp4-w4a4-modelopt")):
        txt, c = ENGINE_RUNS[("vllm", flavour)], d[cell]
        assert f"{c['student weights only']['kl_vs_vllm']:.4f}" in txt and f"{c['student']['kl_vs_vllm']:.2f}" in txt
        assert f"{c['throughput_vs_bf16']['1']:.2f}x / {c['throughput_vs_bf16']['64']:.2f}x" in txt, cell
    m, txt = d["moe-nvfp4-w4a16-ct"], ENGINE_RUNS[("vllm", "compressed-tensors")]
    assert f"{m['student']['kl_vs_vllm']:.5f}" in txt and f"{m['student']['top1_agree']:.3f}" in txt


def test_sglang_column_quotes_its_run():
    """SGLang's ModelOpt entry quotes the 2026-12-06 run (the Llama-768 cell: KL to the weight-only forward, its
    PTQ baseline, top-1, throughput, the bf16 SmolLM2's speeds) and the 2026-12-03 failure of SmolLM2's shapes."""
    import json
    from qatfactory.exporters.matrix import ENGINE_RUNS
    d = json.loads((ROOT / "benchmarks" / "results" / "engines_sglang_h100_20261206" / "engines.json").read_text())
    txt = ENGINE_RUNS[("sglang", "modelopt")]
    sg = d["cells"]["llama768-nvfp4-w4a4-modelopt"]["sglang"]
    assert sg["record"]["loaded"] and sg["record"]["sglang"] == "0.5.17" and txt.startswith("yes: SGLang 0.5.17")
    assert sg["verdict_basis"] == "student weights only" and sg["engine_runs_trained_numbers"] is True
    w = sg["student weights only"]
    assert f"KL {w['kl_vs_sglang']:.5f} to the student's weight-only forward" in txt
    assert f"PTQ baseline {w['kl_vs_ptq']:.4f}" in txt and f"top-1 {w['top1_agree']:.3f}" in txt
    tp = sg["throughput_vs_bf16"]
    assert f"{tp['1']:.2f}x / {tp['64']:.2f}x" in txt
    bf = d["sglang_bf16"]["throughput"]
    assert f"{bf['1']['tokens_per_s']:.0f} / {bf['64']['tokens_per_s']:,.0f} tok/s" in txt
    old = json.loads((ROOT / "benchmarks" / "results" / "engines_sglang_h200_20261203" / "engines.json").read_text())
    assert old["cells"]["nvfp4-w4a4-modelopt"]["sglang"]["record"]["loaded"] is False
    log = (ROOT / "benchmarks" / "results" / "engines_sglang_h200_20261203" / "sglang_nvfp4_w4a4_modelopt.log").read_text()
    assert "Invalid thread config" in log and "MKN = [64, 576, 960]" in log and "K = 576, N = 960" in txt
