"""Per-token policy losses, KL penalties, importance weights and loss aggregation.

Pure tensor functions over *flat* token tensors (every response token of a micro-batch
concatenated; ``seq_idx[k]`` is the sample of token k), so that no function here loops
over samples in Python and both training backends share one implementation.

Aggregation divides by *global* counts (tokens or samples of the whole optimizer step,
over every micro-batch and data-parallel rank) passed in as :class:`LossNorms`: summing
the per-micro-batch losses then gives exactly the loss of the whole step, so gradient
accumulation and 1-vs-N ranks agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainer.training.algo.advantages import segment_sum
from config import KLType, LossAgg, choices


@dataclass(frozen=True)
class LossNorms:
    """Global denominators of one optimizer step.

    num_tokens: model tokens (loss_mask 1) in the step; num_seqs: samples in the step;
    norm_len: the constant length Dr.GRPO divides token sums by (the step's longest
    response), so the loss does not favour short or long answers; num_rollout_tokens and
    num_rollout_seqs: model tokens, and samples with model tokens, that ran forward and
    carry engine log-probs (the denominators of the mismatch metrics; None = num_tokens,
    num_seqs); metric_tokens: model tokens of the samples that ran forward (the
    denominator of token-mean metrics when zero-advantage samples are skipped; None =
    num_tokens).
    """

    num_tokens: int
    num_seqs: int
    norm_len: int
    num_rollout_tokens: Optional[int] = None
    metric_tokens: Optional[int] = None
    num_rollout_seqs: Optional[int] = None

    def __post_init__(self) -> None:
        if min(self.num_tokens, self.num_seqs, self.norm_len) < 0:
            raise ValueError(f"LossNorms must be non-negative: {self}")


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row of ``logits`` [N, V]; computed in float32 for stability."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of each row of ``logits`` [N, V]."""
    return _entropy(torch.log_softmax(logits.float(), dim=-1))


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def token_log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                                entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_log_probs`` and ``entropy_from_logits`` from one log-softmax over the
    vocabulary instead of two (tiny-qwen3's train step: 0.970x the CPU,
    ``scripts/bench_train_step.py --compare vocab``). The entropy is differentiable only
    with ``entropy_grad`` (an entropy term in the loss); otherwise it is a metric."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return picked, _entropy(logp)
    with torch.no_grad():
        return picked, _entropy(logp)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log r (unbiased, high variance), k2 = (log r)^2 / 2, k3 = (r' - 1) - log r' with
    r' = ref/pi (unbiased, always >= 0). low_var_kl is k3 with the log-ratio and the result
    clamped as in verl, so one token with a huge ratio cannot blow up the step.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"algo.kl_type: must be one of {', '.join(KL_ESTIMATORS)} (got {kind!r})")
    return KL_ESTIMATORS[kind](logp - ref_logp)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    inv = -log_ratio
    return inv.exp() - inv - 1.0


KL_ESTIMATORS: dict[KLType, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio.square(),
    "k3": _k3,
    "low_var_kl": lambda log_ratio: _k3(log_ratio.clamp(-20.0, 20.0)).clamp(-10.0, 10.0),
}
assert tuple(KL_ESTIMATORS) == choices(KLType)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                  eps_low: float, eps_high: float, dual_clip_c: float | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, with clip-higher and optional dual clip.

    loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); with dual clip (c > 1) a
    negative-advantage token's loss is further capped at -c A, so a huge ratio on a bad
    token cannot dominate. Returns (loss, clipped) with clipped a float 0/1 per token.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = torch.minimum(loss, cap)
        neg = advantages < 0
        was_clipped = torch.where(neg & (loss > cap), torch.ones_like(was_clipped), was_clipped)
        loss = torch.where(neg, dual, loss)
    return loss, was_clipped


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int, *,
              eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (token form): sequence ratio s_i = exp(mean_t(logp - old_logp)) over model tokens.

    Each token uses sg[s_i] * exp(logp_t - sg[logp_t]) whose value is s_i and whose
    gradient is s_i * grad logp_t, i.e. the geometric-mean sequence ratio of the GSPO
    paper, clipped per sequence. Returns per-token (loss, clipped) like ppo_clip_loss.
    """
    mask = loss_mask.to(logp.dtype)
    counts = segment_sum(mask, seq_idx, num_seqs).clamp(min=1)
    mean_log_ratio = segment_sum((logp - old_logp) * mask, seq_idx, num_seqs) / counts
    seq_ratio = mean_log_ratio.exp().detach()[seq_idx]
    ratio = seq_ratio * torch.exp(logp - logp.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
               eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log p.

    The importance ratio is clipped and treated as a constant weight, and the gradient runs
    through log p, so a clipped token still contributes gradient (PPO-clip drops it). The
    paper leaves the lower side unbounded (eps_low >= 1 does that here). Returns per-token
    (loss, clipped) like ppo_clip_loss.
    """
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * logp, (weight != ratio).float()


def sapo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
              tau_pos: float, tau_neg: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO (Qwen, arXiv 2511.20347): -f(r) A with the smooth gate f(r) = 4/tau sigmoid(tau (r - 1)).

    In place of the hard clip, the gradient weight f'(r) r = 4 sigma (1 - sigma) r is 1 on
    policy and decays smoothly as r leaves 1; tau is tau_pos for A > 0 and tau_neg (larger:
    negative updates are damped faster) otherwise. Nothing is clipped: the second value is
    zeros. The log-ratio is clamped to +-20 as in verl, where the gate is flat anyway, so
    an extreme ratio cannot turn the gradient into inf * 0.
    """
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * advantages, torch.zeros_like(ratio)


def aggregate(values: torch.Tensor, loss_mask: torch.Tensor, seq_idx: torch.Tensor,
              num_seqs: int, *, mode: str, norms: LossNorms) -> torch.Tensor:
    """Reduce per-token values to this micro-batch's share of the step loss.

    token_mean: sum over all model tokens / global tokens (long answers weigh more).
    seq_mean_token_mean: per-sample token mean, then / global samples (GRPO paper).
    seq_mean_token_sum: per-sample token sum / global samples.
    seq_mean_token_sum_norm: token sum / (global samples x norm_len) (Dr.GRPO).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"algo.loss_agg: must be one of {', '.join(AGGREGATIONS)} (got {mode!r})")
    mask = loss_mask.to(values.dtype)
    return AGGREGATIONS[mode](values * mask, mask, seq_idx, num_seqs, norms)


def _seq_mean_token_mean(masked, mask, seq_idx, num_seqs, norms):
    counts = segment_sum(mask, seq_idx, num_seqs).clamp(min=1)
    return (segment_sum(masked, seq_idx, num_seqs) / counts).sum() / max(norms.num_seqs, 1)


def _token_mean(masked, mask, seq_idx, num_seqs, norms):
    return masked.sum() / max(norms.num_tokens, 1)


def _seq_mean_token_sum(masked, mask, seq_idx, num_seqs, norms):
    return masked.sum() / max(norms.num_seqs, 1)


def _seq_mean_token_sum_norm(masked, mask, seq_idx, num_seqs, norms):
    return masked.sum() / max(norms.num_seqs * norms.norm_len, 1)


# (masked values, mask, seq_idx, num_seqs, norms) -> this micro-batch's share of the loss.
AGGREGATIONS: dict[LossAgg, Callable[..., torch.Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}
assert tuple(AGGREGATIONS) == choices(LossAgg)
