"""Policy losses, KL estimators and aggregation against values computed by hand (the
rollout corrections, CISPO and SAPO: tests/test_algo_offpolicy.py)."""

import math
import pytest
import torch

from trainer.training.algo.losses import (
    LossNorms, aggregate, entropy_from_logits, gspo_loss, kl_penalty, ppo_clip_loss,
    token_log_probs, token_log_probs_and_entropy)
from trainer.training.algo.objective import TokenInputs, policy_objective, sft_objective
from config import AlgoConfig


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_ppo_clip_higher_and_clipfrac():
    # ratios 1.5, 0.5, 1.1 ; advantages +1, -1, +1 ; eps_low 0.2, eps_high 0.28
    logp = torch.log(t(1.5, 0.5, 1.1))
    old = torch.zeros(3)
    loss, clipped = ppo_clip_loss(logp, old, t(1, -1, 1), eps_low=0.2, eps_high=0.28)
    # tok0: max(-1.5, -1.28) = -1.28 (clipped) ; tok1: max(0.5, 0.8) = 0.8 (clipped)
    # tok2: max(-1.1, -1.1) = -1.1 (not clipped)
    assert torch.allclose(loss, t(-1.28, 0.8, -1.1), atol=1e-6)
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_ppo_dual_clip_caps_negative_advantage_loss():
    logp = torch.log(t(5.0, 5.0))
    loss, clipped = ppo_clip_loss(logp, torch.zeros(2), t(-1, 1), eps_low=0.2, eps_high=0.2,
                                  dual_clip_c=3.0)
    # A=-1: max(5, 1.2) = 5, capped at c*|A| = 3 ; A=+1: max(-5, -1.2) = -1.2
    assert torch.allclose(loss, t(3.0, -1.2))
    assert clipped.tolist() == [1.0, 1.0]


def test_ppo_gradient_with_ratio_one_is_the_policy_gradient():
    logp = t(-1.0, -2.0).requires_grad_()
    loss, _ = ppo_clip_loss(logp, logp.detach(), t(2, -3), eps_low=0.2, eps_high=0.2)
    loss.sum().backward()
    assert torch.allclose(logp.grad, t(-2, 3))


def test_gspo_sequence_ratio_is_geometric_mean_over_model_tokens():
    # sample 0: log-ratios 0.2, 0.4 (model) and 5 (env token, ignored) -> s = exp(0.3)
    logp = t(0.2, 0.4, 5.0, 0.0).requires_grad_()
    old = torch.zeros(4)
    mask = t(1, 1, 0, 1)
    seq = torch.tensor([0, 0, 0, 1])
    loss, clipped = gspo_loss(logp, old, t(1, 1, 1, -1), mask, seq, 2, eps_low=0.5, eps_high=0.5)
    s = math.exp(0.3)
    assert torch.allclose(loss[:2], t(-s, -s))
    assert torch.allclose(loss[3], t(1.0))
    (loss * mask).sum().backward()
    # d/dlogp_t of -s * exp(logp_t - sg(logp_t)) = -s
    assert torch.allclose(logp.grad, t(-s, -s, 0, 1))
    assert clipped.tolist() == [0, 0, 0, 0]


def test_kl_estimators():
    logp, ref = t(-1.0), t(-1.5)  # log r = 0.5
    assert torch.allclose(kl_penalty(logp, ref, "k1"), t(0.5))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), t(0.125))
    k3 = math.exp(-0.5) + 0.5 - 1
    assert torch.allclose(kl_penalty(logp, ref, "k3"), t(k3))
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), t(k3))
    assert kl_penalty(t(0.0), t(-100.0), "low_var_kl").item() == 10.0  # clamped
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(logp, ref, "k4")


def test_aggregation_modes():
    values = t(1, 2, 3, 4, 10)
    mask = t(1, 1, 1, 1, 0)
    seq = torch.tensor([0, 0, 0, 1, 1])  # sample 0: 1,2,3 ; sample 1: 4 (and env 10)
    norms = LossNorms(num_tokens=4, num_seqs=2, norm_len=5)
    agg = lambda mode: aggregate(values, mask, seq, 2, mode=mode, norms=norms).item()  # noqa: E731
    assert agg("token_mean") == pytest.approx(10 / 4)
    assert agg("seq_mean_token_mean") == pytest.approx((2 + 4) / 2)
    assert agg("seq_mean_token_sum") == pytest.approx(10 / 2)
    assert agg("seq_mean_token_sum_norm") == pytest.approx(10 / (2 * 5))
    # Global norms make two halves sum to the whole.
    half = aggregate(values[:3], mask[:3], seq[:3], 1, mode="seq_mean_token_mean", norms=norms)
    rest = aggregate(values[3:], mask[3:], seq[3:] - 1, 1, mode="seq_mean_token_mean", norms=norms)
    assert (half + rest).item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(values, mask, seq, 2, mode="sum", norms=norms)


def test_token_log_probs_and_entropy():
    logits = torch.log(t(0.5, 0.25, 0.25)).unsqueeze(0)
    assert torch.allclose(token_log_probs(logits, torch.tensor([1])), torch.log(t(0.25)))
    assert torch.allclose(entropy_from_logits(logits), t(1.5 * math.log(2)))


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_log_probs_and_entropy_from_one_log_softmax_match_the_definitions(entropy_grad):
    """Values and gradients against float64 by the definitions. The functions compute in
    float32, so each may be off by the rounding of a few float32 operations on numbers of
    the size of the log-probs: 8 float32 epsilons of that size."""
    g = torch.Generator().manual_seed(0)
    logits64 = 3 * torch.randn(64, 50, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 50, (64,), generator=g)
    weights = torch.randn(64, generator=g, dtype=torch.float64)

    def loss_and_grad(fn, logits):
        logits = logits.clone().requires_grad_()
        logp, entropy = fn(logits)
        loss = (weights.to(logp.dtype) * logp).sum() + (entropy.sum() if entropy_grad else 0)
        (grad,) = torch.autograd.grad(loss, logits)
        return logp.detach().double(), entropy.detach().double(), grad.double(), entropy

    def definitions(logits):
        p = logits.softmax(-1)
        return p[torch.arange(64), targets].log(), -(p * p.log()).sum(-1)

    *want, _ = loss_and_grad(definitions, logits64)
    *got, entropy = loss_and_grad(lambda x: token_log_probs_and_entropy(
        x, targets, entropy_grad=entropy_grad), logits64.float())
    assert entropy.requires_grad == entropy_grad
    tol = 8 * torch.finfo(torch.float32).eps * want[0].abs().max().item()
    for name, a, b in zip(("log-probs", "entropy", "gradient"), got, want):
        assert (a - b).abs().max().item() <= tol, name
    # The two-pass functions it replaces agree with it to the same bound.
    two_pass = (token_log_probs(logits64.float(), targets), entropy_from_logits(logits64.float()))
    for a, b in zip(two_pass, got[:2]):
        assert (a.double() - b).abs().max().item() <= tol


def _algo(**kw):
    return AlgoConfig(**{"kl_type": "k1", **kw})


def test_policy_objective_combines_terms_and_metrics():
    logp = t(-1.0, -2.0, -1.0)
    inputs = TokenInputs(loss_mask=t(1, 1, 0), seq_idx=torch.tensor([0, 0, 1]), num_seqs=2,
                         advantages=t(1, 1, -1), old_log_probs=None,
                         rollout_log_probs=t(-1.5, -2.0, 0.0), ref_log_probs=t(-1.5, -2.5, 0.0))
    norms = LossNorms(num_tokens=2, num_seqs=2, norm_len=2)
    algo = _algo(kl_coef=0.1, entropy_coef=0.01, rollout_correction="token_tis",
                 correction_high=10.0)
    loss, m = policy_objective(algo, inputs, logp, t(2.0, 4.0, 100.0), norms)
    # pg per token = -1 * ratio(=1) * TIS weight exp(old - rollout) = [-e^0.5, -1]
    pg = (-math.exp(0.5) - 1) / 2
    kl = (0.5 + 0.5) / 2
    ent = (2 + 4) / 2
    assert m["train/pg_loss"].item() == pytest.approx(pg, rel=1e-5)
    assert m["train/kl"].item() == pytest.approx(kl)
    assert m["train/entropy"].item() == pytest.approx(ent)
    assert m["mismatch/logprob_abs_diff"].item() == pytest.approx(0.25)
    assert m["mismatch/correction_weight"].item() == pytest.approx((math.exp(0.5) + 1) / 2, rel=1e-5)
    assert loss.item() == pytest.approx(pg + 0.1 * kl - 0.01 * ent, rel=1e-5)


def test_sft_objective_is_mean_nll_over_model_tokens():
    loss, _ = sft_objective(t(-1.0, -3.0, -100.0), t(1, 1, 0), LossNorms(2, 1, 3))
    assert loss.item() == pytest.approx(2.0)


def test_samples_without_rollout_log_probs_get_no_tis_and_no_mismatch():
    logp = t(-1.0, -1.0)
    inputs = TokenInputs(loss_mask=t(1, 1), seq_idx=torch.tensor([0, 1]), num_seqs=2,
                         advantages=t(1, 1), old_log_probs=None,
                         rollout_log_probs=t(-2.0, 0.0), rollout_mask=t(1, 0))
    norms = LossNorms(num_tokens=2, num_seqs=2, norm_len=1, num_rollout_tokens=1)
    _, m = policy_objective(_algo(rollout_correction="token_tis", correction_high=100.0),
                            inputs, logp, None, norms)
    assert m["mismatch/logprob_abs_diff"].item() == pytest.approx(1.0)
    # The sample without engine log-probs is not corrected (weight 1) and not a rollout token.
    assert m["mismatch/correction_weight"].item() == pytest.approx(math.e, rel=1e-5)
