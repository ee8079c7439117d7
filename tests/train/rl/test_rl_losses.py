"""GRPO/DAPO losses against values computed by hand (float64): advantages, ratio and clip,
k3 KL, the three normalizations, truncated completions, dynamic sampling, micro-batching."""
import math

import pytest
import torch

from qatfactory.train.rl import losses as rl

D = torch.float64


def test_group_advantages_by_hand():
    # group 1: rewards 2.2 0.2 0.2 0.0: mean 0.65, unbiased var 3.23/3, std 1.0376255
    # group 2: all 1.0 -> std 0 -> advantages 0 (not NaN)
    r = torch.tensor([2.2, 0.2, 0.2, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=D)
    a = rl.group_advantages(r, 4)
    want = [1.55 / (1.0376254944182255 + 1e-4), -0.45 / (1.0376254944182255 + 1e-4),
            -0.45 / (1.0376254944182255 + 1e-4), -0.65 / (1.0376254944182255 + 1e-4), 0, 0, 0, 0]
    assert a.tolist() == pytest.approx(want, abs=1e-12)
    assert a[0] == pytest.approx(1.4936512674471474, abs=1e-12)
    # Dr.GRPO: no division by the std
    assert rl.group_advantages(r, 4, scale=False).tolist() == pytest.approx([1.55, -.45, -.45, -.65, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="groups of 3"):
        rl.group_advantages(r, 3)


def test_ratio_and_clip_grpo_and_dapo_clip_higher():
    # ratios 1.5, 0.5 for A = +1 and A = -1
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]], dtype=D)
    old = torch.zeros_like(ratio)
    logp = torch.log(ratio).requires_grad_(True)
    adv_pos, adv_neg = torch.tensor([1.0], dtype=D), torch.tensor([-1.0], dtype=D)
    for clip_high, top in ((0.2, 1.2), (0.28, 1.28)):
        lp = logp[:, :2]
        loss, _ = rl.per_token_loss(lp, old[:, :2], adv_pos, 0.2, clip_high)
        # A>0: min(1.5, 1+eps_high) -> clipped at the top; min(0.5, 0.8) = 0.5 (a low ratio is not clipped)
        assert loss[0].tolist() == pytest.approx([-top, -0.5])
        loss_n, info = rl.per_token_loss(logp[:, 2:], old[:, 2:], adv_neg, 0.2, clip_high)
        # A<0: min(-0.5, -0.8) = -0.8 (clipped at 1-eps_low); min(-1.5, -1.2) = -1.5 (not clipped)
        assert loss_n[0].tolist() == pytest.approx([0.8, 1.5])
        assert info["clip_low"].tolist() == [[True, False]]
    # gradients: zero where clipped, -ratio*A elsewhere
    l1, i1 = rl.per_token_loss(logp[:, :2], old[:, :2], adv_pos, 0.2, 0.28)
    l2, i2 = rl.per_token_loss(logp[:, 2:], old[:, 2:], adv_neg, 0.2, 0.28)
    assert i1["clip_high"].tolist() == [[True, False]]
    (l1.sum() + l2.sum()).backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5])


def test_k3_kl_and_beta():
    logp = torch.log(torch.tensor([[0.5, 0.3]], dtype=D))
    ref = torch.log(torch.tensor([[0.25, 0.3]], dtype=D))
    assert rl.k3_kl(logp, ref)[0].tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-12)
    loss, info = rl.per_token_loss(logp, logp.detach(), torch.tensor([0.0], dtype=D), 0.2, 0.2, beta=0.04,
                                   ref_logp=ref)
    assert loss[0].tolist() == pytest.approx([0.04 * 0.1931471805599454, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="needs ref_logp"):
        rl.per_token_loss(logp, logp, torch.tensor([0.0], dtype=D), 0.2, 0.2, beta=0.1)


def test_three_normalizations_by_hand():
    loss_t = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    got = {n: float(rl.loss_terms(loss_t, mask, n)) / rl.denominator(mask, n, 4) for n in rl.LOSS_NORMS}
    assert got == {"bnpo": (1 + 2 + 3 + 4) / 4, "sequence": (2.0 + 4.0) / 2, "dr_grpo": 10 / (2 * 4)}


def test_truncated_completions_are_masked_but_counted():
    lengths, finished = torch.tensor([3, 4]), torch.tensor([True, False])
    m = rl.completion_mask(lengths, finished, 4, mask_truncated=True)
    assert m.tolist() == [[True, True, True, False], [False, False, False, False]]
    assert rl.completion_mask(lengths, finished, 4, mask_truncated=False).tolist() == \
        [[True, True, True, False], [True, True, True, True]]
    loss_t = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0]], dtype=D)
    # sequence: the truncated one still counts as a completion (TRL): (2 + 0) / 2
    assert float(rl.loss_terms(loss_t, m, "sequence")) / rl.denominator(m, "sequence") == 1.0
    assert float(rl.loss_terms(loss_t, m, "bnpo")) / rl.denominator(m, "bnpo") == 2.0


def test_dynamic_sampling_drops_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 2.2, 0.2, 0.0])
    assert rl.zero_std_groups(r, 2).tolist() == [True, False, False]
    keep = rl.keep_mask(r, 2, dynamic_sampling=True)
    assert keep.tolist() == [False, False, True, True, True, True]
    assert rl.keep_mask(r, 2, dynamic_sampling=False).all()
    loss_t = torch.arange(12, dtype=D).reshape(6, 2)
    mask = torch.ones(6, 2, dtype=torch.bool)
    # dropped completions count nowhere: dr_grpo over 4 completions x 2, sequence over 4
    assert rl.denominator(mask, "dr_grpo", 2, keep) == 8.0
    assert rl.denominator(mask, "sequence", keep=keep) == 4.0
    assert float(rl.loss_terms(loss_t, mask, "bnpo", keep)) == sum(range(4, 12))


@pytest.mark.parametrize("norm", rl.LOSS_NORMS)
def test_micro_batches_with_the_global_denominator_equal_the_whole_batch(norm):
    g = torch.Generator().manual_seed(0)
    N, T = 6, 5
    logits = torch.randn(N, T, 11, dtype=D, generator=g)
    tokens = torch.randint(0, 11, (N, T), generator=g)
    old = torch.randn(N, T, dtype=D, generator=g) * 0.1 - 2.4
    ref = torch.randn(N, T, dtype=D, generator=g) * 0.1 - 2.4
    adv = torch.randn(N, dtype=D, generator=g)
    mask = rl.completion_mask(torch.tensor([5, 3, 1, 4, 2, 5]), torch.tensor([1, 1, 1, 0, 1, 1]).bool(), T, True)
    kw = dict(clip_low=0.2, clip_high=0.28, beta=0.05, norm=norm, max_len=T)

    def full():
        z = logits.clone().requires_grad_(True)
        lp, _ = rl.token_logprobs(z, tokens)
        loss, st = rl.policy_loss(lp, old, adv, mask, ref_logp=ref, **kw)
        loss.backward()
        return loss, z.grad, st

    loss, grad, st = full()
    den = rl.denominator(mask, norm, T)
    z = logits.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2, 3, 4], [5]):
        lp, _ = rl.token_logprobs(z[rows], tokens[rows])
        lt, _ = rl.per_token_loss(lp, old[rows], adv[rows], 0.2, 0.28, 0.05, ref[rows])
        part = rl.loss_terms(lt, mask[rows], norm) / den
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(loss.detach()), abs=1e-12)
    assert torch.allclose(z.grad, grad, atol=1e-12)
    assert st["tokens"] == float(mask.sum())


def test_token_logprobs_and_entropy_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]], dtype=D))
    lp, ent = rl.token_logprobs(logits, torch.tensor([[1]]), entropy=True)
    assert float(lp) == pytest.approx(math.log(0.25))
    assert float(ent) == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    # temperature 2: softmax(log p / 2) = sqrt(p) normalised
    lp2, _ = rl.token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    s = math.sqrt(0.5) + 2 * math.sqrt(0.25)
    assert float(lp2) == pytest.approx(math.log(math.sqrt(0.5) / s))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"method.rl.loss_norm='token'; allowed"):
        rl.RLConfig(loss_norm="token").validate()
    with pytest.raises(ValueError, match="group_size=1"):
        rl.RLConfig(group_size=1).validate()
    with pytest.raises(ValueError, match="aqn"):
        rl.RLConfig(aqn=rl.AQNConfig(enabled=True, stages=2)).validate()


def test_sampler_gap_and_truncated_importance_weights_by_hand():
    # two completions of three tokens; the last token of the second is not counted
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    sampler = torch.tensor([[-1.5, -2.0, -0.1], [-0.1, -1.0, -9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    g = rl.sampler_gap(trainer, sampler, mask)
    # k3 = e^d - d - 1 with d = trainer - sampler over the five counted tokens: 0.5, 0, -0.4, 0, -2
    k3 = [math.exp(d) - d - 1 for d in (0.5, 0.0, -0.4, 0.0, -2.0)]
    assert g["tokens"] == 5 and g["k3_sum"] == pytest.approx(sum(k3), rel=1e-6)
    assert g["absdiff_sum"] == pytest.approx(2.9, rel=1e-6) and g["absdiff_max"] == pytest.approx(2.0)
    w = rl.is_weights(trainer, sampler, cap=1.5)
    assert w.tolist()[0] == pytest.approx([1.5, 1.0, math.exp(-0.4)], rel=1e-6)      # e^0.5 = 1.65 -> 1.5
    assert w.tolist()[1][:2] == pytest.approx([1.0, math.exp(-2.0)], rel=1e-6)
    # the weight scales the clipped policy term of each token, not the KL term
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([2.0])
    ref = torch.tensor([[-1.2, -2.0, -0.7]])
    plain, _ = rl.per_token_loss(logp, logp.detach(), adv, 0.2, 0.2, 0.1, ref)
    weighted, _ = rl.per_token_loss(logp, logp.detach(), adv, 0.2, 0.2, 0.1, ref, is_weight=w[:1])
    kl = rl.k3_kl(logp, ref)
    assert torch.allclose(weighted, (plain - 0.1 * kl) * w[:1] + 0.1 * kl)
    assert torch.allclose(weighted[0, 0], torch.tensor(-2.0 * 1.5 + 0.1 * float(kl[0, 0])))


def test_sampler_options_are_checked():
    with pytest.raises(ValueError, match=r"method.rl.is_correction='seq'; allowed: \['none', 'token_truncated'\]"):
        rl.RLConfig(is_correction="seq").validate()
    with pytest.raises(ValueError, match="is_cap=0.5"):
        rl.RLConfig(is_cap=0.5).validate()
    with pytest.raises(ValueError, match="with old_logprobs='rollout' the ratio already starts from the sampler"):
        rl.RLConfig(is_correction="token_truncated", old_logprobs="rollout").validate()
