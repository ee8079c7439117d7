"""A GGUF claiming sizes its tensors do not hold (200 million blocks over 2, a million heads, a
vocabulary larger than its embedding) is refused before the gate builds anything from the metadata:
one FAIL row naming the key, the claimed value and what the tensors hold, in seconds and without
allocating what the file claims. The gate runs in a child process with a deadline and a memory cap,
so the old behaviour (building the claimed model) fails the test instead of hanging it (the child is forked
from an interpreter that has imported the libraries: rank_launch.run_preloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from rank_launch import run_preloaded
from tamper_helpers import exported, gguf_rw

TESTS = Path(__file__).resolve().parents[1]   # the child imports the shared helpers from tests/
MX = "llama_cpp-gguf-qwen3-mxfp4-w4a16"     # 1 block, hidden 256, 4 heads x 64, 2 kv heads, vocab 320
QK = "llama_cpp-gguf-llama-q4_k_m-w4a16"    # no key_length: heads x (hidden / heads) rows

_CHILD = r"""
import json, resource, sys, pickle
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))   # what the honest work needs, with room
sys.path.insert(0, sys.argv[3])
from qatfactory.exporters import verify
cm = pickle.load(open(sys.argv[2], "rb"))
v = verify(sys.argv[1], cm)
json.dump({"verdict": v.verdict, "rows": [[c.tensor, c.check, c.status, c.detail] for c in v.checks]},
          open(sys.argv[4], "w"))
"""


def _gate_in_child(tmp_path, cm, out):
    import pickle
    pk = tmp_path / "student.pkl"
    pk.write_bytes(pickle.dumps(cm))
    res, log = tmp_path / "res.json", tmp_path / "gate.log"
    # a child process of its own (its memory cap, killed past the deadline), forked with the libraries imported
    rc = run_preloaded(_CHILD, [str(out), str(pk), str(TESTS), str(res)], log, timeout=120)
    assert rc == 0, log.read_text()[-2000:]
    return json.loads(res.read_text())


@pytest.mark.parametrize("cell_id,key,value,held", [
    (MX, "qwen3.block_count", 200_000_000, "the tensors hold 1 blocks"),
    (MX, "qwen3.attention.head_count", 1 << 20, "blk.0.attn_q.weight holds 256 rows"),
    (MX, "qwen3.attention.head_count_kv", 1 << 20, "blk.0.attn_k.weight holds 128 rows"),
    (MX, "qwen3.vocab_size", (1 << 32) - 1, "token_embd.weight holds 320 rows"),
    (MX, "qwen3.embedding_length", 1 << 30, "token_embd.weight holds rows of 256"),
    (QK, "llama.feed_forward_length", 1 << 30, "blk.0.ffn_up.weight holds 256 rows"),
])
def test_size_claims_beyond_the_tensors_are_refused_before_building(tmp_path, cell_id, key, value, held):
    cm, out = exported(tmp_path, cell_id)
    r = gguf_rw(out / "model.gguf")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    del r
    got = _gate_in_child(tmp_path, cm, out)
    assert got["verdict"] == "FAIL", got
    row = [x for x in got["rows"] if x[:2] == ["model.gguf", "sizes == tensors"]]
    assert row and row[0][2] == "FAIL", got["rows"]
    assert f"{key}={value} claimed" in row[0][3] and held in row[0][3], row[0][3]
    # nothing after the refusal ran: no tokenizer run, no model built, no llama.cpp
    assert not [x for x in got["rows"] if x[0] in ("logits", "tokenizer")], got["rows"]


def test_huge_context_length_is_a_metadata_fail_not_an_allocation(tmp_path):
    """No tensor holds the context length: the value is compared with the student's, and llama.cpp is
    opened at the prompts' context, so a claimed 2^31 positions allocates nothing."""
    cm, out = exported(tmp_path, MX)
    r = gguf_rw(out / "model.gguf")
    f = r.fields["qwen3.context_length"]
    f.parts[f.data[0]][0] = 1 << 31
    del r
    got = _gate_in_child(tmp_path, cm, out)
    assert got["verdict"] == "FAIL"
    meta = [x for x in got["rows"] if x[:2] == ["metadata", "hyperparameters == student"]]
    assert meta[0][2] == "FAIL" and "qwen3.context_length=2147483648" in meta[0][3], got["rows"]
    runtime = [x for x in got["rows"] if x[:2] == ["logits", "llama.cpp runtime"]]
    assert runtime and runtime[0][2] == "ok", runtime
