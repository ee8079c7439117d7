"""A vLLM / SGLang export whose config.json claims sizes its tensors do not hold (4,000 layers over 1,
a million heads, a vocabulary beyond the embedding) is refused before the gate builds a model from that
config: one FAIL row naming the key, the claim and what the tensors hold, in seconds (the gate runs in
a child process with a deadline and a memory cap, so building the claimed model fails the test)."""
from __future__ import annotations

import pytest
from tamper_helpers import edit_json, exported
from test_verify_gguf_sizes import _gate_in_child

CTM = "vllm-compressed-tensors-qwen3-mxfp4-w4a16"
MO = "vllm-modelopt-llama-nvfp4-w4a4"


@pytest.mark.parametrize("cell_id,key,value,held", [
    (MO, "num_hidden_layers", 4000, "the tensors hold 1 layers"),
    (CTM, "num_hidden_layers", 4000, "the tensors hold 1 layers"),
    (MO, "num_attention_heads", 1 << 20, "layer 0's q_proj holds 256 rows"),
    (CTM, "vocab_size", 1 << 40, "model.embed_tokens holds 320 rows"),
    (MO, "intermediate_size", 1 << 30, "layer 0's mlp.up_proj holds 256 rows"),
])
def test_config_size_claims_beyond_the_tensors(tmp_path, cell_id, key, value, held):
    cm, out = exported(tmp_path, cell_id)
    edit_json(out / "config.json", lambda c: c.update({key: value}))
    got = _gate_in_child(tmp_path, cm, out)
    assert got["verdict"] == "FAIL", got
    row = [x for x in got["rows"] if x[:2] == ["config.json", "sizes == tensors"]]
    assert row and row[0][2] == "FAIL", got["rows"]
    assert f"{key}={value} claimed" in row[0][3] and held in row[0][3], row[0][3]
    assert not [x for x in got["rows"] if x[0] == "modules"], got["rows"]   # no skeleton was built
