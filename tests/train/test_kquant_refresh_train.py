"""quant.kquant_refresh_every=4 through the trainer: the search runs on steps 0 and 4 only, the
export of the trained student passes the parity gate (llama.cpp's own runtime included) and holds
llama.cpp's quantization of the final weights, and a resume in the middle of a block, across the next
refresh, is bit-exact (the kept scales are checkpointed with the module state).

Oracle for the bytes: libggml-python 0.20.2 (``ggml_quantize_chunk``, llama.cpp's quantizer) on the
final weights and the run's importance matrix."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import ggml_oracle
from test_train import _losses, _run
from qatfactory.nn import QuantLinear, kquant_refresh

pytestmark = pytest.mark.llama_cpp   # the gate runs llama.cpp's runtime (in make test)

# hidden 256 / MLP 320 under the Q4_K_M policy: q4_k, q6_k (the last layer's attn_v, the tied 259x256 table),
# q5_0 with the imatrix (the first layer's 320-wide ffn_down) and q8_0 (the last layer's ffn_down: no search)
K4 = ["method=qad", "format=q4_k", "quant.kquant_refresh_every=4", "model.tiny.hidden_size=256",
      "model.tiny.intermediate_size=320", "model.dtype=float32", "train.max_steps=7"]
GGUF_NAMES = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _sites(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)
            and m.weight_quant.fmt.searches_scales(m.weight_quant._imatrix() is not None)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("kq") / "full"
    kquant_refresh.reset_stats()
    s = _run(d, *K4, "export=llama_cpp", "train.save_student=true")
    return d, s, kquant_refresh.stats()


def test_the_search_runs_every_4_steps_and_the_export_is_the_engines_quantization(full_run):
    d, s, st = full_run
    model = s["student"].model
    sites = _sites(model)
    assert len(sites) >= 13
    # steps 0 and 4 search, steps 1-3 and 5-6 keep the scales (evaluations search outside the count)
    assert st == {"searches": 2 * len(sites), "kept": 5 * len(sites)}, (st, len(sites))
    assert s["verify_ok"] is True, s.get("verify")
    reader = gguf.GGUFReader(str(Path(s["export_dir"]) / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    checked = set()
    for name, m in sites:
        if m.tied_to is not None:
            continue
        layer, leaf = name.split(".layers.")[1].split(".", 1)
        if leaf not in GGUF_NAMES:
            continue       # q/k rows are permuted for llama.cpp's rope; their bytes are the gate's to check
        t = tensors[f"blk.{layer}.{GGUF_NAMES[leaf]}.weight"]
        fmt = m.weight_format
        assert t.tensor_type.name.lower() == fmt
        w = m.weight.detach().float().numpy()
        want = ggml_oracle.quantize(w, fmt, m.weight_quant.imatrix.numpy())
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), name
        checked.add(fmt)
    emb = model.model.embed_tokens
    want = ggml_oracle.quantize(emb.weight.detach().float().numpy(), emb.weight_format,
                                emb.weight_quant.imatrix.numpy())
    assert np.array_equal(np.asarray(tensors["token_embd.weight"].data).reshape(want.shape), want)
    assert checked | {emb.weight_format} == {"q4_k", "q6_k", "q5_0"}, checked
    # `qatfactory verify` on the export against the saved student (reloaded with its kept-scale buffers)
    from qatfactory.faces import cli
    rc = cli.main(["verify", s["export_dir"], "--against", s["student_dir"], "--json", str(d / "v.json")])
    v = json.loads((d / "v.json").read_text())
    assert rc == 0 and v["verdict"] == "PASS", v
    assert [c["status"] for c in v["checks"] if c["check"] == "llama.cpp runtime"] == ["ok"], v["checks"]


def test_resume_inside_a_block_and_across_a_refresh_is_bit_exact(full_run, tmp_path):
    d, s, _ = full_run
    ref = _losses(d)
    r = tmp_path / "resumed"
    _run(r, *[o for o in K4 if not o.startswith("train.max_steps")], "train.max_steps=2")
    # the checkpoint after 2 steps holds the scales step 0's search kept
    from qatfactory.train.checkpoint import safe_torch_load
    mod = safe_torch_load(r / "checkpoints" / "step-000002" / "ds" / "mp_rank_00_model_states.pt")["module"]
    steps = {k: int(v) for k, v in mod.items() if k.endswith("weight_quant.kq_step")}
    assert steps and set(steps.values()) == {0}, steps
    kquant_refresh.reset_stats()
    out = _run(r, *K4, "resume=auto")
    n = len(_sites(out["student"].model))
    # steps 2, 3 under the checkpointed scales, 4 searches, 5 and 6 kept again
    assert kquant_refresh.stats() == {"searches": n, "kept": 4 * n}
    got = _losses(r)
    for k in range(3, 8):
        assert got[k] == ref[k], (k, got, ref)
    a = s["student"].model.state_dict()
    b = out["student"].model.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    st = json.loads((r / "checkpoints" / "step-000007" / "trainer_state.json").read_text())
    assert st["step"] == 7


def test_evaluations_between_steps_search_afresh_and_leave_training_as_it_was(full_run, tmp_path):
    """An evaluation after every step runs the full search (outside the optimizer step) and fills the
    step cache with it; the next step must not reuse that: the losses are those of the run without
    evaluations, and each evaluation is the one a K = 1 student with these weights gets."""
    d, s, _ = full_run
    ref = _losses(d)
    e = _run(tmp_path / "ev", *K4, "train.eval_every=1")
    assert _losses(tmp_path / "ev") == ref
    evals = [r for r in e["eval_history"] if r["step"] in (2, 3)]
    assert len(evals) == 2
    # the evaluation after step 7 (the end) equals the uninterrupted run's final one, which a K = 1
    # evaluation of the same weights gives (the search runs outside the steps)
    assert e["eval_last"]["eval/kl"] == s["eval_last"]["eval/kl"]
