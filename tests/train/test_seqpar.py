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
    for kind in KINDS:
        r = res[kind]
        assert abs(r["sp"] - r["ref"]) <= 1e-12 * abs(r["ref"]) and r["ref"] > 0, (kind, r)
        assert abs(r["own"] - r["ref"]) > 1e-6, (kind, r)      # a rank's own share is not the loss: the mean is
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
