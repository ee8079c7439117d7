"""The supported matrix (qatfactory/exporters/matrix.py) is what the tests run: every cell is exported
and gated by exactly one parametrized test (test_exporters, _gguf, _mixtral, _tied), and the README
section is the text generated from the same list (tests/test_readme.py)."""
from __future__ import annotations

from collections import Counter

import test_exporters
import test_exporters_gemma3
import test_exporters_gguf
import test_exporters_mixtral
import test_exporters_qwen3_5
import test_exporters_tied

from qatfactory.exporters.matrix import CELLS, KINDS, MEASURED, markdown


def test_every_cell_is_gated_exactly_once():
    ran = Counter(p.values[0] for mod, lists in ((test_exporters, ["CELLS"]), (test_exporters_gguf, ["CELLS"]),
                                                 (test_exporters_mixtral, ["ST_CELLS", "GGUF_CELLS"]),
                                                 (test_exporters_tied, ["CELLS"]),
                                                 (test_exporters_gemma3, ["CELLS"]),
                                                 (test_exporters_qwen3_5, ["CELLS"]))
                  for name in lists for p in getattr(mod, name))
    assert set(ran) == set(CELLS) and all(n == 1 for n in ran.values()), \
        ({c.id for c in CELLS} - {c.id for c in ran}, [c.id for c, n in ran.items() if n > 1])
    assert len({c.id for c in CELLS}) == len(CELLS)  # ids are unique (they name the tests)


def test_the_cells_the_issue_named_are_in_it():
    ids = {c.id for c in CELLS}
    assert "vllm-compressed-tensors-qwen3-mxfp4_even-w4a16" in ids      # mxfp4_even exported and gated
    assert "llama_cpp-gguf-llama-mxfp4_even-w4a16" in ids
    assert "llama_cpp-gguf-qwen3_moe-mxfp4-w4a16" in ids                 # OCP mxfp4 in a MoE GGUF
    assert all(c.kind in KINDS for c in CELLS)
    for engine, flavour in (("vllm", "modelopt"), ("sglang", "modelopt"), ("vllm", "compressed-tensors"),
                            ("sglang", "compressed-tensors"), ("llama_cpp", "gguf")):
        cs = [c for c in CELLS if (c.engine, c.flavour) == (engine, flavour)]
        assert any(c.moe for c in cs) and any(not c.moe for c in cs) and any(c.tied for c in cs), (engine, flavour)


def test_measured_numbers_cover_every_gguf_cell():
    assert set(MEASURED) == {c.id for c in CELLS if c.engine == "llama_cpp"}
    text = markdown()
    for c in CELLS:
        if c.engine == "llama_cpp":
            assert f"`{c.id}`" in text
