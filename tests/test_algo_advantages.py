"""Advantage estimators against values computed by hand."""

import math

import pytest
import torch

from trainer.training.algo.advantages import (
    discounted_returns, grpo_advantages, last_token_mask, masked_whiten, reinforce_pp_returns,
    rloo_advantages, sequence_advantages)


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_grpo_group_mean_and_unbiased_std():
    # group 0: rewards 1, 0, 1, 0 -> mean 0.5, unbiased std sqrt(1/3)
    # group 1: rewards 2, 4 -> mean 3, std sqrt(2)
    adv = grpo_advantages(t(1, 0, 1, 0, 2, 4), torch.tensor([0, 0, 0, 0, 1, 1]))
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    expected = t(0.5 / s0, -0.5 / s0, 0.5 / s0, -0.5 / s0, -1 / s1, 1 / s1)
    assert torch.allclose(adv, expected, atol=1e-5)


def test_grpo_groups_need_not_be_contiguous_and_equal_rewards_give_zero():
    adv = grpo_advantages(t(1, 5, 1, 5), torch.tensor([7, 3, 7, 3]))
    assert torch.equal(adv, torch.zeros(4))


@pytest.mark.parametrize("reward", [1.7, 1.8, 0.1, 1.9])
@pytest.mark.parametrize("n", [8, 16])
def test_grpo_group_of_equal_non_representable_rewards_has_exactly_zero_advantage(reward, n):
    # n x reward / n is not reward in float32 for these: the rounding error divided by
    # std + eps would otherwise give advantages of up to ~0.24.
    adv = grpo_advantages(torch.full((n + 2,), reward).index_fill(0, torch.tensor([n, n + 1]), 0.0)
                          .index_fill(0, torch.tensor([n + 1]), 1.0),
                          torch.tensor([0] * n + [1, 1]))
    assert torch.equal(adv[:n], torch.zeros(n))
    assert adv[n] < 0 < adv[n + 1]


def test_dr_grpo_has_no_std():
    adv = sequence_advantages("dr_grpo", t(1, 0, 0, 0), torch.tensor([0, 0, 0, 0]))
    assert torch.allclose(adv, t(0.75, -0.25, -0.25, -0.25))


def test_rloo_leave_one_out():
    # sample 0: 3 - mean(1, 2) = 1.5 ; sample 1: 1 - mean(3, 2) = -1.5 ; sample 2: 2 - 2 = 0
    adv = rloo_advantages(t(3, 1, 2, 9), torch.tensor([0, 0, 0, 1]))
    assert torch.allclose(adv, t(1.5, -1.5, 0.0, 0.0))  # a group of one has no baseline


def test_reinforce_is_the_raw_reward():
    assert torch.equal(sequence_advantages("reinforce", t(1, -2), torch.tensor([0, 0])), t(1, -2))


def test_unknown_estimator_is_a_value_error():
    with pytest.raises(ValueError, match="advantage_estimator"):
        sequence_advantages("ppo_gae", t(1), torch.tensor([0]))


def test_last_token_mask_skips_environment_tokens():
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 1])  # sample 0: 4 tokens, sample 1: 3 tokens
    seq = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert last_token_mask(mask, seq, 2).tolist() == [False, False, False, True, False, False, True]


def test_discounted_returns_per_sample():
    r = t(1, 2, 3, 10, 20)
    seq = torch.tensor([0, 0, 0, 1, 1])
    assert torch.allclose(discounted_returns(r, seq, 2, gamma=1.0), t(6, 5, 3, 30, 20))
    # gamma 0.5: [1 + .5*2 + .25*3, 2 + .5*3, 3, 10 + .5*20, 20]
    assert torch.allclose(discounted_returns(r, seq, 2, gamma=0.5), t(2.75, 3.5, 3, 20, 20))


def test_reinforce_pp_reward_on_last_model_token_and_kl_per_token():
    rewards = t(1.0, -1.0)
    mask = torch.tensor([1, 1, 0, 1, 1])
    seq = torch.tensor([0, 0, 0, 1, 1])
    kl = t(0.5, 0.5, 9.0, 1.0, 0.0)  # the environment token's KL must not count
    ret = reinforce_pp_returns(rewards, mask, seq, kl=kl, kl_coef=0.1)
    # sample 0 token rewards: [-0.05, 1 - 0.05, 0] -> returns [0.9, 0.95, (env) 0]
    # sample 1 token rewards: [-0.1, -1]           -> returns [-1.1, -1]
    assert torch.allclose(ret, t(0.9, 0.95, 0.0, -1.1, -1.0), atol=1e-6)
    white = masked_whiten(ret, mask.float())
    vals = t(0.9, 0.95, -1.1, -1.0)
    expected = (vals - vals.mean()) / vals.std(unbiased=False)
    assert torch.allclose(white[mask.bool()], expected, atol=1e-5)
    assert white[2] == 0
