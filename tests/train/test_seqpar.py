"""Ulysses sequence parallelism (qatfactory/train/seqpar.py, DeepSpeed's UlyssesSPAttentionHF): on two gloo
ranks, each holding half of a sequence, the mean loss and the mean gradients equal those of one rank running
the whole sequence (float64, so only summation order differs)."""
import json

import pytest

from rank_launch import launch

from qatfactory.train import seqpar


KINDS = ("forward_kl", "topk_kl", "ce")


@pytest.mark.slow
def test_two_ranks_give_one_ranks_loss_and_gradients(tmp_path):
    out = tmp_path / "res.json"
    code = open(__file__.replace("test_seqpar.py", "seqpar_rank.py")).read()
    rcs, logs = launch(tmp_path, "sp", 2, [str(out), ",".join(KINDS)], code=code, timeout=400)
    assert rcs == [0, 0], logs
    res = json.loads(out.read_text())
    assert res["shard"] == [2, 12]                     # each rank held half of the 24 tokens
    # a plain head, and an NVFP4-quantized one (its forward runs on loss chunks of the shard)
    assert sorted(k for k in res if k != "shard") == sorted(p + k for p in ("", "qhead-") for k in KINDS)
    for kind in (k for k in res if k != "shard"):
        r = res[kind]
        assert abs(r["sp"] - r["ref"]) <= 1e-12 * abs(r["ref"]) and r["ref"] > 0, (kind, r)
        assert abs(r["own"] - r["ref"]) > 1e-6, (kind, r)      # a rank's own share is not the loss: the mean is
        assert "lm_head.weight" in r["grad_rel"] or "model.embed_tokens.weight" in r["grad_rel"]
        worst = max(r["grad_rel"].values())
        assert worst < 1e-10, (kind, r["grad_rel"])


def test_shard_takes_targets_before_cutting():
    import torch
    ids = torch.arange(8).view(1, 8)
    mask = torch.ones(1, 8, dtype=torch.bool)
    a = seqpar.shard(ids, mask, torch.ones_like(ids), 0, 2)
    b = seqpar.shard(ids, mask, torch.ones_like(ids), 1, 2)
    assert a["targets"].tolist() == [[1, 2, 3, 4]] and b["targets"].tolist() == [[5, 6, 7, -100]]
    assert b["position_ids"].tolist() == [[4, 5, 6, 7]] and b["target_mask"].tolist() == [[True] * 3 + [False]]
    with pytest.raises(ValueError, match=r"train.sequence_parallel=3: a sample of 8 tokens"):
        seqpar.shard(ids, mask, torch.ones_like(ids), 0, 3)


@pytest.mark.slow
def test_the_trainer_on_two_sequence_parallel_ranks_steps_as_one_rank(tmp_path):
    # `qatfactory train train.sequence_parallel=2` on two gloo ranks (one sequence-parallel group, data-parallel
    # degree 1) against the same run on one rank: each step's loss and the held-out evaluation agree to float32
    # summation order
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qatfactory.faces.ship import train_and_ship
    from qatfactory.train.config import compose
    from rank_launch import losses
    tdir = tmp_path / "teacher"
    torch.manual_seed(123)
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(tdir)
    over = ["train=cpu_tiny", "data.synthetic=8", "data.seq_len=32", "data.eval_samples=3", "train.max_steps=3",
            "train.lr=1e-3", "train.eval_every=0", "train.save_student=false", "train.save_final=false",
            "method=qad", "format=nvfp4_w4a16", f"method.teacher_path={tdir}", "method.loss.ce_weight=0.1",
            "method.loss.chunk_tokens=12"]
    one = train_and_ship(compose(over + [f"run_dir={tmp_path / 'one'}"]))
    one.pop("engine").destroy()
    rcs, log = launch(tmp_path, "sp2", 2, over + ["train.sequence_parallel=2", f"run_dir={tmp_path / 'sp'}"])
    assert rcs == [0, 0], log
    assert "sequence parallel (Ulysses): 2 ranks per sequence, 16 tokens each, data-parallel degree 1" in log
    a, b = losses(tmp_path / "one"), losses(tmp_path / "sp")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=2e-5), (k, a, b)
    ev = json.loads((tmp_path / "sp" / "summary.json").read_text())
    for key in ("eval/kl", "eval/ce", "eval/tokens"):
        assert ev["eval_last"][key] == pytest.approx(one["eval_last"][key], rel=2e-5), key


@pytest.mark.parametrize("over,text", [
    (["train.sequence_parallel=0"], "train.sequence_parallel=0; allowed: an int >= 1"),
    (["train.sequence_parallel=3"], "train.sequence_parallel=3 with data.seq_len=64; allowed: a seq_len that splits"),
    (["train.sequence_parallel=2", "method=grpo"], "train.sequence_parallel=2 with method=grpo; allowed: 1"),
])
def test_bad_sequence_parallel_settings_are_refused_at_composition(over, text):
    from qatfactory.exitcodes import UsageError
    from qatfactory.train.config import compose
    with pytest.raises(UsageError) as e:
        compose(["train=cpu_tiny", *over])
    assert text in str(e.value) and "\n" not in str(e.value)


def test_sequence_parallel_refuses_packed_document_masks(tmp_path):
    from qatfactory.exitcodes import UsageError
    from qatfactory.train.config import compose
    p = tmp_path / "a.txt"
    p.write_text("hello world " * 50)
    with pytest.raises(UsageError, match=r"train.sequence_parallel=2 with data.doc_mask=true"):
        compose(["train=cpu_tiny", "data=files", f"data.train=[{p}]", "data.seq_len=64", "data.doc_mask=true",
                 "train.sequence_parallel=2"])
    assert compose(["train=cpu_tiny", "train.sequence_parallel=2"]).train.sequence_parallel == 2


def test_a_world_that_sequence_parallel_groups_do_not_divide_is_refused(capsys, tmp_path):
    from qatfactory import exitcodes as X
    from qatfactory.faces import cli
    run = tmp_path / "run"
    capsys.readouterr()
    rc = cli.main(["train", "train=cpu_tiny", "train.sequence_parallel=2", f"run_dir={run}"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("qatfactory train")]
    assert rc == X.USAGE and len(lines) == 1, err[-1500:]
    assert "train.sequence_parallel=2 with 1 ranks; allowed: a divisor of the number of ranks" in lines[0]
    assert not run.exists()


def test_a_cached_teachers_outputs_are_sliced_to_the_shard():
    import torch

    from qatfactory.distill.losses import TopKTeacherOut
    from qatfactory.train.student import Teacher

    class Cache:
        def get(self, ids):
            lp = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
            return TopKTeacherOut(lp, lp.long())

    ids = torch.arange(16).view(2, 8)
    b = {"input_ids": ids, "mask": torch.ones(2, 8, dtype=torch.bool), "attn": torch.ones_like(ids),
         "sample_ids": torch.tensor([0, 1])}
    part = seqpar.shard_batch(b, 1, 2)
    with Teacher(None, Cache(), None).batch("train", part, "cpu") as t:
        assert t.logprobs.shape == (2, 4, 3) and t.logprobs[0, 0, 0].item() == 4 * 3
