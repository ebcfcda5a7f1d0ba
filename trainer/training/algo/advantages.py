"""Advantage estimators: pure tensor functions, no model, no process group.

Sequence-level estimators (GRPO, Dr.GRPO, RLOO, REINFORCE) map one scalar reward per
sample to one scalar advantage per sample; the loss broadcasts it over the sample's
response tokens. REINFORCE++ is token-level: a per-token reward (the KL penalty on every
token plus the task reward on the last model token), discounted returns-to-go, then
whitened over every response token of the batch.

Token-level tensors here are *flat*: all response tokens of all samples concatenated,
with ``seq_idx[k]`` naming the sample that token k belongs to. This avoids padding and
per-sample Python loops (segment sums are one ``index_add_``).
"""

from __future__ import annotations

from typing import Callable

import torch

from config import AdvantageEstimator, choices


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample group size, group sum and group sum of squares (any group order)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    total = zeros.index_add(0, inverse, rewards)
    total_sq = zeros.index_add(0, inverse, rewards * rewards)
    return count[inverse], total[inverse], total_sq[inverse]


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps); Dr.GRPO drops the std (``normalize_std=False``).

    The std is the unbiased one (as in the GRPO paper's reference code and TRL); a group of
    one sample has advantage 0.
    """
    count, total, total_sq = _group_stats(rewards, group_ids)
    mean = total / count
    adv = rewards - mean
    if normalize_std:
        var = (total_sq - count * mean * mean) / (count - 1).clamp(min=1)
        adv = adv / (var.clamp(min=0).sqrt() + eps)
    # A group whose rewards are all equal carries no signal. Its float mean is not always
    # exactly its reward (8 x 1.7 / 8 != 1.7 in float32), and dividing that rounding error
    # by std + eps would turn it into advantages of up to ~0.2: zero them exactly.
    return torch.where((count > 1) & ~uniform_groups(rewards, group_ids), adv, torch.zeros_like(adv))


def uniform_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per sample: True where every reward of its group is the same."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    init = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    high = init.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    low = init.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    return (high == low)[inverse]


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the *other* rewards in its group (0 for a group of one)."""
    count, total, _ = _group_stats(rewards, group_ids)
    others = (total - rewards) / (count - 1).clamp(min=1)
    return torch.where(count > 1, rewards - others, torch.zeros_like(rewards))


# Sequence-level estimators: (rewards, group_ids) -> one advantage per sample. The only
# other estimator, reinforce_pp, is token-level (reinforce_pp_returns + masked_whiten).
SEQUENCE_ESTIMATORS: dict[AdvantageEstimator, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": lambda rewards, group_ids: grpo_advantages(rewards, group_ids, normalize_std=False),
    "rloo": rloo_advantages,
    "reinforce": lambda rewards, group_ids: rewards.clone(),
}
TOKEN_ESTIMATORS = ("reinforce_pp",)
assert set(SEQUENCE_ESTIMATORS) | set(TOKEN_ESTIMATORS) == set(choices(AdvantageEstimator))


def sequence_advantages(estimator: AdvantageEstimator, rewards: torch.Tensor,
                        group_ids: torch.Tensor) -> torch.Tensor:
    """One advantage per sample for the sequence-level estimators."""
    if estimator not in SEQUENCE_ESTIMATORS:
        raise ValueError(f"algo.advantage_estimator: {estimator!r} is not sequence-level; "
                         f"choose one of {', '.join(SEQUENCE_ESTIMATORS)}")
    return SEQUENCE_ESTIMATORS[estimator](rewards, group_ids)


def segment_sum(values: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sum of a flat token tensor per sample."""
    out = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_idx, values)


def last_token_mask(loss_mask: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Flat bool mask of each sample's last model token (its last loss_mask=1 token).

    Samples without any model token get no mark (their reward cannot be attributed).
    """
    positions = torch.arange(loss_mask.numel(), device=loss_mask.device)
    marked = torch.where(loss_mask > 0, positions, torch.full_like(positions, -1))
    last = torch.full((num_seqs,), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, seq_idx, marked, reduce="amax")
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    out[last[last >= 0]] = True
    return out


def discounted_returns(token_rewards: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int, *,
                       gamma: float) -> torch.Tensor:
    """Returns-to-go ``G_t = sum_{k>=t} gamma^(k-t) r_k`` within each sample (flat tensors).

    Tokens of one sample must be contiguous and in order (as the flat layout guarantees).
    gamma = 1 is a reverse segmented cumsum; gamma < 1 scales by gamma^-t within the
    sample, done in float64 to keep gamma^-t exact enough for responses of a few thousand
    tokens at the gammas people use (>= 0.99).
    """
    x = token_rewards.double()
    starts = torch.zeros(num_seqs, dtype=torch.long, device=x.device)
    counts = torch.bincount(seq_idx, minlength=num_seqs)
    starts[1:] = counts.cumsum(0)[:-1]
    local_t = torch.arange(x.numel(), device=x.device) - starts[seq_idx]
    if gamma != 1.0:
        x = x * torch.pow(torch.tensor(gamma, dtype=torch.float64), local_t.double())
    if x.numel() == 0:
        return token_rewards.clone()
    exclusive = x.cumsum(0) - x  # sum of all tokens before t, across samples
    # Subtract what precedes the sample's first token to get a within-sample prefix sum.
    sample_offset = exclusive[starts.clamp(max=x.numel() - 1)][seq_idx]
    rtg = segment_sum(x, seq_idx, num_seqs)[seq_idx] - (exclusive - sample_offset)
    if gamma != 1.0:
        rtg = rtg / torch.pow(torch.tensor(gamma, dtype=torch.float64), local_t.double())
    return rtg.to(token_rewards.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, mean: torch.Tensor | None = None,
                  std: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over masked tokens; pass ``mean``/``std`` when they are global.

    Data-parallel ranks each hold part of the batch: they all-reduce (sum, sum of
    squares, count) and pass the global moments in, so every rank whitens identically.
    """
    if mean is None or std is None:
        mean, std = masked_moments(values, mask)
    return (values - mean) / (std + eps) * mask


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) std of the masked entries."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1)
    mean = (values * m).sum() / n
    var = ((values - mean) ** 2 * m).sum() / n
    return mean, var.sqrt()


def reinforce_pp_returns(rewards: torch.Tensor, loss_mask: torch.Tensor, seq_idx: torch.Tensor,
                         *, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                         gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ token returns before whitening (flat tensors).

    Token reward = -kl_coef * kl_t on every model token, plus the sample's reward on its
    last model token; environment tokens (loss_mask 0) carry no reward of their own.
    Whiten the result with :func:`masked_whiten` (global moments across ranks).
    """
    num_seqs = rewards.numel()
    mask = loss_mask.to(rewards.dtype)
    token_r = torch.zeros_like(mask)
    if kl is not None and kl_coef > 0:
        token_r = token_r - kl_coef * kl.detach().to(rewards.dtype) * mask
    last = last_token_mask(loss_mask, seq_idx, num_seqs)
    token_r = token_r + torch.where(last, rewards[seq_idx], torch.zeros_like(token_r))
    return discounted_returns(token_r, seq_idx, num_seqs, gamma=gamma) * mask
