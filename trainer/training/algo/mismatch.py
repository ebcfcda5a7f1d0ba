"""Train/rollout mismatch metrics of an RL step, from log-probs the loss computes anyway.

Two kinds, because they reduce over ranks differently:

- means and fractions (``mismatch_sums``): each micro-batch adds its share, divided by the
  step's global counts, so the backend's SUM all-reduce gives the step's value;
- order statistics (max |log p_train - log p_rollout|, quantiles p1/p50/p99/max of the
  importance ratio per token and per sequence): each rank keeps its log-ratios in a
  ``RatioSketch``; ranks exchange ``sketch()`` (every value up to ``SKETCH_SIZE`` per rank,
  else that many evenly spaced order statistics weighted by the count each stands for,
  always including the rank's min and max), and ``ratio_metrics`` reads the merged
  quantiles: exact when no rank had more than ``SKETCH_SIZE`` values, else within 1 /
  ``SKETCH_SIZE`` in rank; the max is always exact.

Every value is over model tokens (loss_mask 1) of samples that carry engine log-probs;
the ratio is pi_trainer / pi_engine with pi_trainer the pre-update policy.
"""

from __future__ import annotations

from typing import Optional

import torch

from trainer.training.algo.corrections import Corrected

SKETCH_SIZE = 4096
QUANTILES = (("p1", 0.01), ("p50", 0.5), ("p99", 0.99))
PREFIX = "mismatch/"


def mismatch_sums(log_ratio: torch.Tensor, mask: torch.Tensor, corrected: Optional[Corrected],
                  *, num_tokens: int, num_seqs: int) -> dict[str, torch.Tensor]:
    """This micro-batch's share of the step's mean |log-ratio| and k3 KL (over ``num_tokens``
    rollout tokens), and, with an active correction (``corrected``), of the fractions of
    tokens and of sequences (over ``num_seqs``) it masked or clipped.

    k3 = rho - 1 - log rho with rho = pi_trainer / pi_engine is Schulman's unbiased,
    non-negative estimator of KL(pi_engine || pi_trainer) from the engine's samples.
    """
    lr = log_ratio.detach().double()
    m = mask.to(lr.dtype)
    tokens, seqs = max(num_tokens, 1), max(num_seqs, 1)
    out = {f"{PREFIX}logprob_abs_diff": (lr.abs() * m).sum() / tokens,
           f"{PREFIX}k3_kl": ((torch.expm1(lr) - lr) * m).sum() / tokens}
    if corrected is not None:
        out[f"{PREFIX}token_masked_frac"] = corrected.token_masked.sum() / tokens
        out[f"{PREFIX}token_clipped_frac"] = corrected.token_clipped.sum() / tokens
        out[f"{PREFIX}seq_masked_frac"] = corrected.seq_masked.sum() / seqs
        out[f"{PREFIX}seq_clipped_frac"] = corrected.seq_clipped.sum() / seqs
        out[f"{PREFIX}correction_weight"] = (corrected.weights.double() * m).sum() / tokens
    return {k: v.float() for k, v in out.items()}


def sum_metric_keys(active_correction: bool) -> frozenset[str]:
    """Every name ``mismatch_sums`` can emit."""
    keys = {"logprob_abs_diff", "k3_kl"}
    if active_correction:
        keys |= {"token_masked_frac", "token_clipped_frac", "seq_masked_frac",
                 "seq_clipped_frac", "correction_weight"}
    return frozenset(PREFIX + k for k in keys)


class RatioSketch:
    """One rank's log importance ratios of a step: per model token and per sequence."""

    def __init__(self) -> None:
        self._tokens: list[torch.Tensor] = []
        self._seqs: list[torch.Tensor] = []

    def add(self, token_log_ratio: torch.Tensor, seq_log_ratio: torch.Tensor,
            token_keep: Optional[torch.Tensor] = None,
            seq_keep: Optional[torch.Tensor] = None) -> None:
        """Log-ratios and which of them count (None: all). Kept on their device as they
        are: selecting on a GPU would wait for it, once per micro-batch; ``sketch`` selects
        on the CPU once per step."""
        for parts, values, keep in ((self._tokens, token_log_ratio, token_keep),
                                    (self._seqs, seq_log_ratio, seq_keep)):
            keep = torch.ones_like(values, dtype=torch.bool) if keep is None else keep
            parts.append((values.detach().float(), keep.detach()))

    def sketch(self, size: int = SKETCH_SIZE) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{"token"|"seq": (sorted values, weights)} on CPU, at most ``size`` of each."""
        out = {}
        for name, parts in (("token", self._tokens), ("seq", self._seqs)):
            values = (torch.cat([v.cpu()[k.cpu()] for v, k in parts]) if parts
                      else torch.zeros(0))
            out[name] = _sketch(values, size)
        return out


def _sketch(values: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.double().sort().values
    n = values.numel()
    if n <= size:
        return values, torch.ones(n, dtype=torch.float64)
    picks = torch.linspace(0, n - 1, size, dtype=torch.float64).round().long()
    return values[picks], torch.full((size,), n / size, dtype=torch.float64)


def merge_sketches(parts: list[dict]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Union of several ranks' ``RatioSketch.sketch()`` (None entries: ranks that hold none)."""
    out = {}
    for name in ("token", "seq"):
        pieces = [p[name] for p in parts if p is not None and p[name][0].numel()]
        if not pieces:
            out[name] = (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64))
            continue
        values = torch.cat([v for v, _ in pieces])
        weights = torch.cat([w for _, w in pieces])
        order = values.argsort()
        out[name] = (values[order], weights[order])
    return out


def _quantile(values: torch.Tensor, weights: torch.Tensor, q: float) -> float:
    if bool((weights == 1).all()):
        return float(torch.quantile(values, q))  # exact: every value is here
    cumulative = weights.cumsum(0)
    index = int(torch.searchsorted(cumulative, q * float(cumulative[-1])).clamp(max=len(values) - 1))
    return float(values[index])


def ratio_metrics(merged: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """max |log-ratio| and the ratio quantiles of the merged sketches (empty sketches: none)."""
    out: dict[str, float] = {}
    for name, (log_values, weights) in merged.items():
        if not log_values.numel():
            continue
        if name == "token":
            out[f"{PREFIX}logprob_abs_diff_max"] = float(log_values.abs().max())
        # exp is monotone: a quantile of the ratio is exp of the log-ratio's (exact case:
        # interpolated between the same two neighbours, in log space).
        for label, q in QUANTILES:
            out[f"{PREFIX}{name}_ratio_{label}"] = float(torch.exp(torch.tensor(
                _quantile(log_values, weights, q), dtype=torch.float64)))
        out[f"{PREFIX}{name}_ratio_max"] = float(torch.exp(log_values[-1]))
    return out
