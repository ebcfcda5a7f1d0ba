"""The training objective of one micro-batch, shared by every backend.

A backend runs the model and hands over flat per-token log-probs (and entropies); this
module turns them into the loss to back-propagate plus metric contributions. Every
contribution is already divided by the step's *global* counts, so the backend only sums
them over micro-batches and all-reduces (SUM) over data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainer.training.algo.advantages import segment_sum
from trainer.training.algo.corrections import apply_correction
from trainer.training.algo.losses import (
    LossNorms, aggregate, cispo_loss, gspo_loss, kl_penalty, ppo_clip_loss, sapo_loss)
from trainer.training.algo.mismatch import RatioSketch, mismatch_sums
from config import PolicyLoss, choices


@dataclass
class TokenInputs:
    """Flat per-token inputs of one micro-batch (all response tokens, sample by sample)."""

    loss_mask: torch.Tensor  # float 0/1
    seq_idx: torch.Tensor  # long, sample index within the micro-batch
    num_seqs: int
    advantages: torch.Tensor  # per token (sequence advantages broadcast)
    old_log_probs: Optional[torch.Tensor]  # None: one update per rollout, ratio == 1
    rollout_log_probs: torch.Tensor
    ref_log_probs: Optional[torch.Tensor] = None
    # 1 where the sample has engine log-probs (custom generate code may not record them);
    # None = every token has them.
    rollout_mask: Optional[torch.Tensor] = None


def _token_mean(values: torch.Tensor, mask: torch.Tensor, norms: LossNorms) -> torch.Tensor:
    count = norms.metric_tokens if norms.metric_tokens is not None else norms.num_tokens
    return (values.detach() * mask).sum() / max(count, 1)


def _ppo(algo, inputs: "TokenInputs", log_probs, old, mask, eps_high):
    return ppo_clip_loss(log_probs, old, inputs.advantages, eps_low=algo.eps_clip,
                         eps_high=eps_high, dual_clip_c=algo.dual_clip_c)


def _gspo(algo, inputs: "TokenInputs", log_probs, old, mask, eps_high):
    return gspo_loss(log_probs, old, inputs.advantages, mask, inputs.seq_idx, inputs.num_seqs,
                     eps_low=algo.eps_clip, eps_high=eps_high)


def _cispo(algo, inputs: "TokenInputs", log_probs, old, mask, eps_high):
    return cispo_loss(log_probs, old, inputs.advantages, eps_low=algo.eps_clip, eps_high=eps_high)


def _sapo(algo, inputs: "TokenInputs", log_probs, old, mask, eps_high):
    return sapo_loss(log_probs, old, inputs.advantages, tau_pos=algo.sapo_tau_pos,
                     tau_neg=algo.sapo_tau_neg)


# RL policy losses: per-token (loss, clipped); "sft" is sft_objective's.
POLICY_LOSSES: dict[PolicyLoss, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "ppo": _ppo, "gspo": _gspo, "cispo": _cispo, "sapo": _sapo}
assert set(POLICY_LOSSES) | {"sft"} == set(choices(PolicyLoss))


def policy_objective(algo, inputs: TokenInputs, log_probs: torch.Tensor,
                     entropy: Optional[torch.Tensor], norms: LossNorms,
                     ratios: Optional[RatioSketch] = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RL loss (policy loss x rollout correction + KL + entropy bonus) of one micro-batch.

    ``algo`` is the ``AlgoConfig``. ``entropy`` may be None when algo.entropy_coef is 0
    and the caller does not want the metric. ``ratios``, when given, collects this
    micro-batch's log importance ratios for the step's quantile metrics.
    """
    mask = inputs.loss_mask.to(log_probs.dtype)
    # With one optimizer step per rollout the "old" policy is the current one: using
    # logp.detach() gives ratio exp(0) = 1 with the correct gradient, without a forward.
    old = inputs.old_log_probs if inputs.old_log_probs is not None else log_probs.detach()
    eps_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip
    if algo.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"algo.policy_loss: {algo.policy_loss!r} is not an RL loss "
                         "(use sft_objective for supervised steps)")
    pg, clipped = POLICY_LOSSES[algo.policy_loss](algo, inputs, log_probs, old, mask, eps_high)

    metrics: dict[str, torch.Tensor] = {}
    # The mismatch between the engine that sampled and the trainer, over model tokens of
    # samples with engine log-probs (custom generate code may not record them).
    has_rollout = (inputs.rollout_mask.to(log_probs.dtype) if inputs.rollout_mask is not None
                   else torch.ones_like(mask))
    rollout_mask = mask * has_rollout
    log_ratio = (old.detach() - inputs.rollout_log_probs) * rollout_mask
    low, high = algo.correction_bounds
    corrected = apply_correction(algo.rollout_correction, log_ratio, rollout_mask,
                                 inputs.seq_idx, inputs.num_seqs, low=low, high=high)
    pg = pg * corrected.weights
    num_rollout = (norms.num_rollout_tokens if norms.num_rollout_tokens is not None
                   else norms.num_tokens)
    num_rollout_seqs = (norms.num_rollout_seqs if norms.num_rollout_seqs is not None
                        else norms.num_seqs)
    metrics.update(mismatch_sums(
        log_ratio, rollout_mask, corrected if algo.rollout_correction != "none" else None,
        num_tokens=num_rollout, num_seqs=num_rollout_seqs))
    if ratios is not None:
        counts = segment_sum(rollout_mask, inputs.seq_idx, inputs.num_seqs)
        ratios.add(log_ratio, segment_sum(log_ratio, inputs.seq_idx, inputs.num_seqs),
                   rollout_mask > 0, counts > 0)
    agg = dict(mode=algo.loss_agg, norms=norms)
    pg_loss = aggregate(pg, mask, inputs.seq_idx, inputs.num_seqs, **agg)
    loss = pg_loss
    metrics["train/pg_loss"] = pg_loss.detach()
    metrics["train/pg_clipfrac"] = _token_mean(clipped, mask, norms)
    metrics["train/ppo_kl"] = _token_mean(old - log_probs, mask, norms)

    if inputs.ref_log_probs is not None:
        kl = kl_penalty(log_probs, inputs.ref_log_probs, algo.kl_type)
        metrics["train/kl"] = _token_mean(kl, mask, norms)
        # REINFORCE++ already put the KL into the reward; a second loss term would count it twice.
        if algo.kl_coef > 0 and algo.advantage_estimator != "reinforce_pp":
            loss = loss + algo.kl_coef * aggregate(kl, mask, inputs.seq_idx, inputs.num_seqs, **agg)
    if entropy is not None:
        metrics["train/entropy"] = _token_mean(entropy, mask, norms)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * aggregate(entropy, mask, inputs.seq_idx,
                                                        inputs.num_seqs, **agg)
    metrics["train/loss"] = loss.detach()
    return loss, metrics


def sft_objective(log_probs: torch.Tensor, loss_mask: torch.Tensor, norms: LossNorms,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean negative log-likelihood over model tokens of the whole step."""
    mask = loss_mask.to(log_probs.dtype)
    loss = -(log_probs * mask).sum() / max(norms.num_tokens, 1)
    return loss, {"train/sft_loss": loss.detach()}
