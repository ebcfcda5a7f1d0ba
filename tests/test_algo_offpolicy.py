"""Off-policy correctness, pure tensors: each rollout correction, CISPO and SAPO against
values computed by hand (forward and gradient, masked and clipped tokens included), the
mismatch metrics and their cross-rank quantile sketch, and the config rules around them.

Each correction's case holds ratios above its upper bound, below its lower bound (or below
1 where it has none) and inside, so a correction whose mask or clip acts on the wrong
side gives other weights and fails.
"""

import math

import pytest
import torch

from trainer.training.algo.corrections import CORRECTIONS, apply_correction
from trainer.training.algo.losses import LossNorms, cispo_loss, ppo_clip_loss, sapo_loss
from trainer.training.algo.mismatch import (RatioSketch, merge_sketches, mismatch_sums, ratio_metrics,
                                   sum_metric_keys)
from trainer.training.algo.objective import TokenInputs, policy_objective
from config import AlgoConfig, ConfigError, RolloutCorrection, build_config, choices
from trainer.driver.metrics import mismatch_summary
from trainer.driver.mismatch_watch import MismatchWatch, staleness_metrics


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# Three samples, flat. rho = pi_trainer / pi_engine per token:
#   sample 0: 4, 0.25, 2      (product 2,    geometric mean 2^(1/3) = 1.26)
#   sample 1: 1.5, 1, [env]   (product 1.5,  geometric mean 1.2247); the environment token
#             (loss_mask 0) has rho = 100 and must count nowhere
#   sample 2: 0.5, 0.5        (product 0.25, geometric mean 0.5)
RHO = (4.0, 0.25, 2.0, 1.5, 1.0, 100.0, 0.5, 0.5)
MASK = t(1, 1, 1, 1, 1, 0, 1, 1)
SEQ = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
ADV = t(1, -1, 2, 1, -1, 5, 1, 1)
MODEL_TOKENS = 7

# correction -> (bounds, per-token weight (env token: 1), tokens masked, tokens clipped)
CASES = {
    "none": ({}, (1, 1, 1, 1, 1, 1, 1, 1), (), ()),
    "token_tis": ({"correction_high": 3.0}, (3, 0.25, 2, 1.5, 1, 1, 0.5, 0.5), (), (0,)),
    "token_mis": ({"correction_high": 3.0}, (0, 0.25, 2, 1.5, 1, 1, 0.5, 0.5), (0,), ()),
    "icepop": ({"correction_low": 0.4, "correction_high": 3.0},
               (0, 0, 2, 1.5, 1, 1, 0.5, 0.5), (0, 1), ()),
    "seq_tis": ({"correction_high": 1.8}, (1.8, 1.8, 1.8, 1.5, 1.5, 1, 0.25, 0.25), (), (0, 1, 2)),
    "seq_mis": ({"correction_high": 1.8}, (0, 0, 0, 1.5, 1.5, 1, 0.25, 0.25), (0, 1, 2), ()),
    "geo_mask": ({"correction_low": 0.6, "correction_high": 1.25},
                 (0, 0, 0, 1, 1, 1, 0, 0), (0, 1, 2, 6, 7), ()),
}


def test_every_registered_correction_has_a_hand_computed_case():
    assert set(CASES) == set(CORRECTIONS) == set(choices(RolloutCorrection))


def _objective(algo: AlgoConfig, logp: torch.Tensor, norms: LossNorms, ratios=None):
    inputs = TokenInputs(loss_mask=MASK, seq_idx=SEQ, num_seqs=3, advantages=ADV,
                         old_log_probs=None,
                         rollout_log_probs=logp.detach() - torch.log(t(*RHO)))
    return policy_objective(algo, inputs, logp, None, norms, ratios)


@pytest.mark.parametrize("name", list(CASES))
def test_correction_weights_gradient_and_fractions(name):
    bounds, weights, masked, clipped = CASES[name]
    algo = AlgoConfig(rollout_correction=name, **bounds)
    logp = t(-1.0, -2.0, -0.5, -1.5, -3.0, -0.1, -2.5, -1.0).requires_grad_()
    norms = LossNorms(num_tokens=MODEL_TOKENS, num_seqs=3, norm_len=3)
    loss, m = _objective(algo, logp, norms)
    loss.backward()
    w = t(*weights)
    # One update per rollout: ratio 1 to the pre-update policy, so the PPO term per token is
    # -A w and its gradient -A w / (model tokens); environment tokens get none.
    expected_grad = -ADV * w * MASK / MODEL_TOKENS
    torch.testing.assert_close(logp.grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert m["train/pg_loss"].item() == pytest.approx(float((-ADV * w * MASK).sum()) / MODEL_TOKENS,
                                                      rel=1e-5)
    seqs_masked = {int(SEQ[i]) for i in masked}
    seqs_clipped = {int(SEQ[i]) for i in clipped}
    if name == "none":
        assert not any(k.endswith("_frac") for k in m)
        return
    assert m["mismatch/token_masked_frac"].item() == pytest.approx(len(masked) / MODEL_TOKENS)
    assert m["mismatch/token_clipped_frac"].item() == pytest.approx(len(clipped) / MODEL_TOKENS)
    assert m["mismatch/seq_masked_frac"].item() == pytest.approx(len(seqs_masked) / 3)
    assert m["mismatch/seq_clipped_frac"].item() == pytest.approx(len(seqs_clipped) / 3)
    assert m["mismatch/correction_weight"].item() == pytest.approx(
        float((w * MASK).sum()) / MODEL_TOKENS, rel=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_corrections_ignore_tokens_outside_the_mask(name):
    """An environment token's log-ratio (here log 100) enters no product, mean or flag."""
    bounds, weights, masked, clipped = CASES[name]
    low, high = AlgoConfig(rollout_correction=name, **bounds).correction_bounds
    out = apply_correction(name, torch.log(t(*RHO)), MASK, SEQ, 3, low=low, high=high)
    torch.testing.assert_close(out.weights, t(*weights))
    assert out.token_masked.nonzero().flatten().tolist() == list(masked)
    assert out.token_clipped.nonzero().flatten().tolist() == list(clipped)


def test_mismatch_metrics_by_hand():
    """Mean |log-ratio|, k3 = rho - 1 - log rho, over model tokens only; the quantiles of
    the token and sequence ratios; max |log-ratio|."""
    logp = t(-1.0, -2.0, -0.5, -1.5, -3.0, -0.1, -2.5, -1.0)
    ratios = RatioSketch()
    _, m = _objective(AlgoConfig(), logp, LossNorms(MODEL_TOKENS, 3, 3), ratios)
    rho = [r for r, keep in zip(RHO, MASK.tolist()) if keep]
    assert m["mismatch/logprob_abs_diff"].item() == pytest.approx(
        sum(abs(math.log(r)) for r in rho) / 7, rel=1e-5)
    assert m["mismatch/k3_kl"].item() == pytest.approx(
        sum(r - 1 - math.log(r) for r in rho) / 7, rel=1e-5)
    q = ratio_metrics(merge_sketches([ratios.sketch()]))
    assert q["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(4), rel=1e-6)
    assert q["mismatch/token_ratio_max"] == pytest.approx(4.0, rel=1e-6)
    assert q["mismatch/token_ratio_p50"] == pytest.approx(1.0, rel=1e-6)  # median of 7
    assert q["mismatch/seq_ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert q["mismatch/seq_ratio_p50"] == pytest.approx(1.5, rel=1e-6)
    # p1 of 7 sorted values lies 6% of the way from the smallest (0.25) to the next (0.5),
    # interpolated in log space.
    assert q["mismatch/token_ratio_p1"] == pytest.approx(0.25 * 2 ** 0.06, rel=1e-5)
    assert set(m) >= sum_metric_keys(False)


def test_quantile_sketches_merged_over_ranks_equal_the_union():
    """Small per-rank counts travel whole: exact. Large ones are sketched: within 1/size
    in rank, and the max (and min) stay exact."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, generator=gen), torch.randn(500, generator=gen) * 0.1 + 0.3
    ranks = []
    for values in (a, b):
        s = RatioSketch()
        s.add(values, values[:10])
        ranks.append(s.sketch())
    union = torch.cat([a, b]).double()
    merged = ratio_metrics(merge_sketches(ranks + [None]))  # None: a rank that sends nothing
    for label, q in (("p1", 0.01), ("p50", 0.5), ("p99", 0.99)):
        assert merged[f"mismatch/token_ratio_{label}"] == pytest.approx(
            math.exp(float(torch.quantile(union, q))), rel=1e-9)
    assert merged["mismatch/token_ratio_max"] == pytest.approx(math.exp(float(union.max())))
    size = 64
    sketched = ratio_metrics(merge_sketches([_holding(a).sketch(size), _holding(b).sketch(size)]))
    ordered = union.sort().values
    for label, q in (("p1", 0.01), ("p50", 0.5), ("p99", 0.99)):
        value = math.log(sketched[f"mismatch/token_ratio_{label}"])
        rank = int((ordered <= value + 1e-12).sum()) / len(ordered)
        assert abs(rank - q) <= 1 / size + 1 / len(ordered), label
    assert sketched["mismatch/token_ratio_max"] == pytest.approx(math.exp(float(union.max())))
    assert sketched["mismatch/logprob_abs_diff_max"] == pytest.approx(float(union.abs().max()))


def _holding(values):
    s = RatioSketch()
    s.add(values, values[:1])
    return s


def test_mismatch_sums_count_against_the_global_denominators():
    lr = torch.log(t(2.0, 0.5))
    m = mismatch_sums(lr, t(1, 1), None, num_tokens=4, num_seqs=2)
    assert m["mismatch/logprob_abs_diff"].item() == pytest.approx(2 * math.log(2) / 4)
    assert set(m) == sum_metric_keys(False)


def test_cispo_clips_a_stop_gradient_weight_and_keeps_clipped_tokens_gradient():
    """CISPO (MiniMax-M1): loss -sg(clip(r)) A log p. r = 1.5 (A>0) and 0.5 (A<0) are
    clipped to 1.28 and 0.8 but still get gradient -w A (PPO-clip gives them none)."""
    old = torch.zeros(3)
    logp = torch.log(t(1.5, 0.5, 1.1)).requires_grad_()
    adv = t(1, -1, 1)
    loss, clipped = cispo_loss(logp, old, adv, eps_low=0.2, eps_high=0.28)
    w = t(1.28, 0.8, 1.1)
    torch.testing.assert_close(loss, -w * adv * logp.detach())
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -w * adv)  # no gradient through the ratio
    ppo_logp = torch.log(t(1.5, 0.5, 1.1)).requires_grad_()
    ppo_clip_loss(ppo_logp, old, adv, eps_low=0.2, eps_high=0.28)[0].sum().backward()
    assert ppo_logp.grad.tolist()[:2] == [0.0, 0.0]


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_gate_and_gradient_by_hand():
    """SAPO: loss -(4/tau) sigmoid(tau (r - 1)) A, tau_pos for A > 0 and tau_neg otherwise;
    gradient -A 4 s (1 - s) r (1 on policy). Swapped temperatures give other values."""
    r, adv, taus = (1.5, 0.5, 1.0), (1.0, -1.0, 2.0), (1.0, 3.0, 1.0)
    logp = torch.log(t(*r)).requires_grad_()
    loss, clipped = sapo_loss(logp, torch.zeros(3), t(*adv), tau_pos=1.0, tau_neg=3.0)
    gates = [4 / tau * _sigmoid(tau * (x - 1)) for x, tau in zip(r, taus)]
    torch.testing.assert_close(loss, t(*[-g * a for g, a in zip(gates, adv)]))
    assert clipped.tolist() == [0.0, 0.0, 0.0]
    loss.sum().backward()
    grads = [-a * 4 * _sigmoid(tau * (x - 1)) * (1 - _sigmoid(tau * (x - 1))) * x
             for x, a, tau in zip(r, adv, taus)]
    torch.testing.assert_close(logp.grad, t(*grads))
    assert logp.grad[2].item() == pytest.approx(-2.0)  # on policy: the plain policy gradient


@pytest.mark.parametrize("loss_name", ["cispo", "sapo"])
def test_new_losses_run_through_the_objective_with_a_correction(loss_name):
    algo = AlgoConfig(policy_loss=loss_name, rollout_correction="token_mis", correction_high=3.0)
    logp = t(-1.0, -2.0, -0.5, -1.5, -3.0, -0.1, -2.5, -1.0).requires_grad_()
    loss, m = _objective(algo, logp, LossNorms(MODEL_TOKENS, 3, 3))
    loss.backward()
    # On policy both are the policy gradient -A: the masked token (rho = 4) gets none.
    assert logp.grad[0].item() == 0.0
    assert logp.grad[2].item() == pytest.approx(-2 * 2 / MODEL_TOKENS, rel=1e-5)


# ---------------------------------------------------------------- config rules
@pytest.mark.parametrize("kwargs,key,rule", [
    ({"rollout_correction": "token_tis", "correction_low": 0.5}, "algo.correction_low",
     "has no low bound"),
    ({"rollout_correction": "none", "correction_high": 2.0}, "algo.correction_high",
     "has no high bound"),
    ({"rollout_correction": "icepop", "correction_low": 1.2}, "algo.correction_low", r"\[0, 1\)"),
    ({"rollout_correction": "seq_mis", "correction_high": 0.9}, "algo.correction_high", "> 1"),
    ({"rollout_correction": "tis"}, "algo.rollout_correction", "token_tis"),
    ({"mismatch_warn": {"kl": 0.1}}, "algo.mismatch_warn", "k3_kl"),
    ({"policy_loss": "sapo", "sapo_tau_neg": 0.0}, "algo.sapo_tau_neg", "> 0"),
])
def test_correction_config_errors_name_key_and_rule(kwargs, key, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        AlgoConfig(**kwargs)
    assert str(info.value).startswith(key)


def test_bounds_default_per_correction_and_tis_clip_is_an_alias():
    assert AlgoConfig(rollout_correction="icepop").correction_bounds == (0.5, 5.0)
    assert AlgoConfig(rollout_correction="geo_mask", correction_high=1.02).correction_bounds == (0.99, 1.02)
    with pytest.warns(FutureWarning, match="algo.rollout_correction=token_tis algo.correction_high=3.0"):
        algo = AlgoConfig(tis_clip=3.0)
    assert (algo.rollout_correction, algo.correction_bounds) == ("token_tis", (None, 3.0))
    with pytest.raises(ConfigError, match="algo.tis_clip"):
        AlgoConfig(tis_clip=3.0, rollout_correction="icepop")


# ---------------------------------------------------------------- the driver's side
def test_staleness_metrics():
    m = staleness_metrics([3, 2, 2, -1], version=3)  # -1: start-up weights, not stale
    assert m == {"mismatch/staleness_mean": 0.5, "mismatch/staleness_max": 1.0}


def test_mismatch_watch_warns_once_per_metric_naming_value_and_keys(caplog):
    watch = MismatchWatch(AlgoConfig(mismatch_warn={"k3_kl": 0.01, "staleness_max": 1}))
    assert watch.check(1, {"mismatch/k3_kl": 0.005, "mismatch/staleness_max": 1.0}) == []
    with caplog.at_level("WARNING", logger="homegym"):
        first = watch.check(2, {"mismatch/k3_kl": 0.03, "mismatch/staleness_max": 2.0})
    assert len(first) == 2 and len(caplog.records) == 2
    k3 = next(w for w in first if "k3_kl" in w)
    assert "mismatch/k3_kl = 0.03" in k3 and "algo.mismatch_warn.k3_kl = 0.01" in k3
    assert "algo.rollout_correction (now none)" in k3 and "rollout.dtype" in k3
    stale = next(w for w in first if "staleness_max =" in w)
    assert "algo.max_staleness" in stale and "algo.stale_policy" in stale
    assert watch.check(3, {"mismatch/k3_kl": 0.5, "mismatch/staleness_max": 3.0}) == []


def test_console_summary_of_the_mismatch():
    line = mismatch_summary({"mismatch/logprob_abs_diff": 0.01234, "mismatch/logprob_abs_diff_max": 0.5,
                             "mismatch/k3_kl": 1.5e-4, "mismatch/token_masked_frac": 0.02,
                             "mismatch/staleness_mean": 0.75, "mismatch/staleness_max": 2.0})
    assert line == "gap 0.0123 max 0.500 k3 1.5e-04 cut 2.0% stale 0.75"
    assert mismatch_summary({"rollout/raw_reward": 1.0}) == ""


def test_set_algo_swaps_the_loss_settings_of_a_live_rank():
    """StepLoop.set_algo (TrainGroup.set_algo; bench_offpolicy compares corrections on
    live ranks) replaces the algo section the next step reads; a KL term needs the
    reference model that only init creates."""
    import torch.distributed as dist

    from conftest import free_port
    from train_batches import make_config
    from trainer.driver import components
    from trainer.training.backends.fsdp import FSDPBackend

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    try:
        backend = FSDPBackend()
        backend.init(rank=0, world_size=1, **components.backend_args(make_config()))
        backend.set_algo(AlgoConfig(rollout_correction="icepop", policy_loss="sapo"))
        assert (backend.algo.rollout_correction, backend.algo.policy_loss) == ("icepop", "sapo")
        with pytest.raises(ValueError, match="reference model"):
            backend.set_algo(AlgoConfig(kl_coef=0.1))
    finally:
        if created:
            dist.destroy_process_group()
