"""Rollout corrections: how the policy gradient accounts for the engines having sampled
from another policy than the trainer's.

The engine's numerics differ from the trainer's (bf16 kernels, other fusions, MoE routing)
and, in the async loop, its weights may be some policy versions old. Every token then has
an importance ratio rho_t = pi_trainer(y_t) / pi_engine(y_t), in log space
``log_ratio = old_log_probs - rollout_log_probs`` (pi_trainer is the pre-update policy,
whose log-probs the loss has anyway). Each correction turns these ratios into a per-token
weight on the policy-gradient term (no gradient through it): a truncated ratio (TIS), the
ratio where it lies in bounds and 0 outside (MIS, ICEPOP), or a 0/1 mask (geometric
masking), per token or per sequence (rho_seq = prod_t rho_t over the sample's model tokens).

A masked token keeps its place in the loss's denominators (``LossNorms`` are counted before
any correction), as in slime, so masking removes a token's gradient without scaling up the
others'. Pure tensor functions over the flat token layout of ``trainer.algo.losses``; the
registry below is keyed by ``config.RolloutCorrection`` and each entry names its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainer.training.algo.advantages import segment_sum
from config import RolloutCorrection, choices


@dataclass
class Corrected:
    """A correction's output over one micro-batch's flat tokens.

    ``weights``: per token, multiplies the policy-gradient term (no gradient; 0 where masked).
    The flags say what the correction did, per token and per sequence: a sequence counts as
    masked or clipped when any of its tokens was.
    """

    weights: torch.Tensor
    token_masked: torch.Tensor  # bool [N]
    token_clipped: torch.Tensor  # bool [N]
    seq_masked: torch.Tensor  # bool [num_seqs]
    seq_clipped: torch.Tensor  # bool [num_seqs]


def _log(bound: Optional[float], default: float) -> float:
    """log of a ratio bound; a missing bound is +-inf (never crossed)."""
    if bound is None:
        return default
    return math.log(bound) if bound > 0 else -math.inf


def _per_seq(token_flags: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return segment_sum(token_flags.float(), seq_idx, num_seqs) > 0


def _token_result(weights, masked, clipped, mask, seq_idx, num_seqs) -> Corrected:
    on = mask > 0
    masked, clipped = masked & on, clipped & on
    return Corrected(weights=weights, token_masked=masked, token_clipped=clipped,
                     seq_masked=_per_seq(masked, seq_idx, num_seqs),
                     seq_clipped=_per_seq(clipped, seq_idx, num_seqs))


def _seq_result(seq_weights, seq_masked, seq_clipped, mask, seq_idx) -> Corrected:
    on = mask > 0
    return Corrected(weights=seq_weights[seq_idx], token_masked=seq_masked[seq_idx] & on,
                     token_clipped=seq_clipped[seq_idx] & on, seq_masked=seq_masked,
                     seq_clipped=seq_clipped)


def _seq_log_ratio(log_ratio, mask, seq_idx, num_seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: sum of the model tokens' log-ratios (log rho_seq) and their count."""
    m = mask.to(log_ratio.dtype)
    return segment_sum(log_ratio * m, seq_idx, num_seqs), segment_sum(m, seq_idx, num_seqs)


def no_correction(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    none = torch.zeros_like(log_ratio, dtype=torch.bool)
    return _token_result(torch.ones_like(log_ratio), none, none, mask, seq_idx, num_seqs)


def token_tis(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    """Token-level truncated IS: w_t = min(rho_t, high).

    Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (2025); verl ``rollout_is=token``, slime ``--use-tis``, SkyRL ``tis_ratio_type=token``,
    TRL ``token_truncate``."""
    top = _log(high, math.inf)
    clipped = log_ratio > top
    return _token_result(torch.exp(log_ratio.clamp(max=top)), torch.zeros_like(clipped), clipped,
                         mask, seq_idx, num_seqs)


def token_mis(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    """Token-level masked IS: w_t = rho_t where rho_t <= high, else 0 (the token is dropped).

    AReaL's decoupled PPO ``behav_imp_weight_cap``; TRL ``token_mask``; Liu, Li et al., "When
    Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"
    (2025), token-level MIS."""
    masked = log_ratio > _log(high, math.inf)
    weights = torch.where(masked, torch.zeros_like(log_ratio), torch.exp(log_ratio.clamp(max=20.0)))
    return _token_result(weights, masked, torch.zeros_like(masked), mask, seq_idx, num_seqs)


def icepop(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    """ICEPOP: w_t = rho_t where low <= rho_t <= high, else 0 (two-sided token mask).

    Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (Ring-1T, arXiv 2510.18855), alpha = 0.5, beta = 5; slime
    ``icepop_function``."""
    masked = (log_ratio < _log(low, -math.inf)) | (log_ratio > _log(high, math.inf))
    weights = torch.where(masked, torch.zeros_like(log_ratio), torch.exp(log_ratio.clamp(max=20.0)))
    return _token_result(weights, masked, torch.zeros_like(masked), mask, seq_idx, num_seqs)


def seq_tis(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    """Sequence-level truncated IS: every token of a sample gets min(rho_seq, high).

    verl ``rollout_is=sequence``; SkyRL ``tis_ratio_type=sequence`` (its cap 5.0); TRL
    ``sequence_truncate``."""
    top = _log(high, math.inf)
    s, _ = _seq_log_ratio(log_ratio, mask, seq_idx, num_seqs)
    clipped = s > top
    return _seq_result(torch.exp(s.clamp(max=top)), torch.zeros_like(clipped), clipped, mask,
                       seq_idx)


def seq_mis(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    """Sequence-level masked IS: rho_seq where rho_seq <= high, else the whole sample is
    dropped.

    Liu, Li et al., "When Speed Kills Stability" (2025), Seq-MIS; TRL ``sequence_mask``
    (TRL's default correction)."""
    s, _ = _seq_log_ratio(log_ratio, mask, seq_idx, num_seqs)
    masked = s > _log(high, math.inf)
    weights = torch.where(masked, torch.zeros_like(s), torch.exp(s.clamp(max=20.0)))
    return _seq_result(weights, masked, torch.zeros_like(masked), mask, seq_idx)


def geo_mask(log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected:
    """Geometric sequence masking: a sample whose per-token geometric mean ratio
    exp(mean_t log rho_t) leaves [low, high] is dropped; the rest keep weight 1.

    Unlike the product, the geometric mean does not grow with length, so long answers are
    not dropped for length alone. verl's geometric rejection sampling (``seq_mean_k1``),
    SkyRL ``sequence_mask_metric=geometric`` (bounds 0.99-1.01), slime ``rs_level=geometric``;
    Liu, Li et al., "When Speed Kills Stability", part 3."""
    s, count = _seq_log_ratio(log_ratio, mask, seq_idx, num_seqs)
    mean = s / count.clamp(min=1)
    masked = ((mean < _log(low, -math.inf)) | (mean > _log(high, math.inf))) & (count > 0)
    weights = (~masked).to(log_ratio.dtype)
    return _seq_result(weights, masked, torch.zeros_like(masked), mask, seq_idx)


# (log_ratio, mask, seq_idx, num_seqs, low, high) -> Corrected. ``mask``: model tokens
# whose sample has engine log-probs; ``low``/``high``: AlgoConfig.correction_bounds.
CORRECTIONS: dict[RolloutCorrection, Callable[..., Corrected]] = {
    "none": no_correction,
    "token_tis": token_tis,
    "token_mis": token_mis,
    "seq_tis": seq_tis,
    "seq_mis": seq_mis,
    "geo_mask": geo_mask,
    "icepop": icepop,
}
assert tuple(CORRECTIONS) == choices(RolloutCorrection)


def apply_correction(name: str, log_ratio: torch.Tensor, mask: torch.Tensor,
                     seq_idx: torch.Tensor, num_seqs: int, *, low: Optional[float],
                     high: Optional[float]) -> Corrected:
    """``CORRECTIONS[name]`` on detached log-ratios; tokens outside ``mask`` get weight 1."""
    if name not in CORRECTIONS:
        raise ValueError(f"algo.rollout_correction: must be one of {', '.join(CORRECTIONS)} "
                         f"(got {name!r})")
    log_ratio = log_ratio.detach()
    out = CORRECTIONS[name](log_ratio, mask, seq_idx, num_seqs, low, high)
    out.weights = torch.where(mask > 0, out.weights, torch.ones_like(out.weights)).detach()
    return out
