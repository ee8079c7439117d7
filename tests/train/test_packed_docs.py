"""Packed documents that attend only within themselves (data.doc_mask): position ids restart at each document,
and a packed sample gives the logits, teacher outputs and evaluation sums of its documents run one by one."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qatfactory.distill.losses import LossConfig
from qatfactory.distill.teachers import LiveTeacher, split_causal_lm
from qatfactory.train.data import ByteTokenizer, DataConfig, build_samples
from qatfactory.train.student import StudentLM, backbone_kwargs

V = 259
EOS = ByteTokenizer.eos_token_id


def _llama(seed, attn="sdpa"):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        attn_implementation=attn)).eval()


def _docs_file(tmp_path, docs):
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return p


def test_position_ids_restart_at_each_document_and_sample(tmp_path):
    p = _docs_file(tmp_path, ["abc", "de", "fghij", "k"])         # with EOS: 4 + 3 + 6 + 2 = 15 tokens
    s = build_samples([str(p)], ByteTokenizer(), DataConfig(train=[str(p)], seq_len=5, doc_mask=True))
    # "abc<eos>" "de<eos>" "fghij<eos>" "k<eos>"; a document cut by a sample boundary restarts at 0 too
    assert s.pos.tolist() == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2], [0, 1, 2, 0, 1]]
    assert s.input_ids[0].tolist() == [97, 98, 99, EOS, 100]
    assert "position_ids" in s.select([1]) and s.attn.eq(1).all()
    plain = build_samples([str(p)], ByteTokenizer(), DataConfig(train=[str(p)], seq_len=5))
    assert plain.pos is None and "position_ids" not in plain.select([1])
    assert torch.equal(plain.input_ids, s.input_ids) and plain.fingerprint() != s.fingerprint()
    with pytest.raises(ValueError, match=r"doc_mask=true with pack=false"):
        DataConfig(train=[str(p)], pack=False, doc_mask=True)
    with pytest.raises(ValueError, match=r"doc_mask=true with synthetic=8"):
        DataConfig(synthetic=8, doc_mask=True)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_sequence_gives_each_documents_own_logits(attn):
    m = _llama(0, attn)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (6, 1, 9, 4)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    backbone, head = split_causal_lm(m)
    with torch.no_grad():
        packed = head(backbone(input_ids=ids, use_cache=False, **backbone_kwargs(torch.ones_like(ids), pos))[0])[0]
        alone = torch.cat([m(input_ids=d[None], use_cache=False).logits[0] for d in docs])
        crossing = m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # without the restarts the later documents see the earlier ones: the comparison has teeth
    assert (crossing[6:] - alone[6:]).abs().max() > 1e-2


def test_student_teacher_and_evaluation_sums_of_a_packed_sample_are_its_documents(tmp_path):
    student, teacher_model = _llama(0), _llama(7)
    p = _docs_file(tmp_path, ["the quick brown", "fox", "jumps over the lazy dog", "again and again"])
    s = build_samples([str(p)], ByteTokenizer(), DataConfig(train=[str(p)], seq_len=48, doc_mask=True))
    b = s.select([0])
    ids, pos = b["input_ids"], b["position_ids"]
    mask = b["mask"] & (pos != 0)          # a document's first token is no target of the one before it
    lt = LiveTeacher(teacher_model, torch.float32)
    lm = StudentLM(student, LossConfig(chunk_tokens=7)).eval()
    with torch.no_grad(), lt.outputs(ids, b["attn"], pos) as t:
        got = lm(ids, b["attn"], mask, t, metrics=True, position_ids=pos)
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    want = torch.zeros(4, dtype=torch.float64)
    for a, e in zip(starts[:-1], starts[1:]):
        d = ids[:, a:e]
        with torch.no_grad(), lt.outputs(d, torch.ones_like(d)) as t:
            want += lm(d, torch.ones_like(d), torch.ones_like(d, dtype=torch.bool), t, metrics=True)
    assert got[0] == want[0] == ids.shape[1] - len(starts) + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad(), lt.outputs(ids, b["attn"]) as t:
        crossing = lm(ids, b["attn"], mask, t, metrics=True)
    assert abs(float(crossing[1] - want[1])) > 1e-3      # the KL sum differs when attention crosses documents


def test_a_tiny_run_trains_on_packed_documents(tmp_path):
    from qatfactory.faces.ship import train_and_ship
    from qatfactory.train.config import compose
    p = _docs_file(tmp_path, [f"document {i}: " + "word " * (3 + i % 7) for i in range(60)])
    base = ["train=cpu_tiny", "data=files", f"data.train=[{p}]", "data.seq_len=64", "data.eval_samples=2",
            "train.max_steps=2", "train.eval_every=0", "train.save_student=false", "train.save_final=false",
            "method=qat", "method.eval_teacher=false"]
    losses = {}
    for dm in ("false", "true"):
        run = tmp_path / f"run-{dm}"
        s = train_and_ship(compose(base + [f"data.doc_mask={dm}", f"run_dir={run}"]))
        s.pop("engine").destroy()
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses[dm] = [r["loss"] for r in recs if "loss" in r]
    assert len(losses["true"]) == 2 and all(x == x for x in losses["true"])
    assert abs(losses["true"][0] - losses["false"][0]) > 1e-4      # the trainer's forward took the restarts


def test_long_recipes_pack_documents_apart(tmp_path):
    from qatfactory.train.config import compose
    p = _docs_file(tmp_path, ["x"])
    for name, n in (("long_32k", 32768), ("long_128k", 131072)):
        d = compose([f"data={name}", f"data.train=[{p}]"]).data
        assert d.seq_len == n and d.pack and d.doc_mask, name


def test_the_teacher_cache_of_packed_documents_is_written_with_their_restarts(tmp_path):
    from qatfactory.distill.teachers import CachedTeacher, precompute_topk
    p = _docs_file(tmp_path, ["one two three", "four", "five six seven eight", "nine ten"])
    s = build_samples([str(p)], ByteTokenizer(), DataConfig(train=[str(p)], seq_len=24, doc_mask=True))
    lt = LiveTeacher(_llama(7), torch.float32)
    precompute_topk(lt, s, str(tmp_path / "cache"), k=5, batch_size=2)
    got = CachedTeacher(str(tmp_path / "cache"), expect_fingerprint=s.fingerprint()).get([0])
    with torch.no_grad(), lt.outputs(s.input_ids[:1], s.attn[:1], s.pos[:1]) as t:
        want = torch.log_softmax(t.hidden @ t.weight.t(), -1).topk(5, -1)
    torch.testing.assert_close(got.logprobs, want.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.indices, want.indices)
