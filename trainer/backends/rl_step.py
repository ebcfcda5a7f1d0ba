"""What every backend does around its own forward/backward, written once.

Advantages for the micro-batches of one rank (group statistics need no communication:
every rank sees the whole batch; REINFORCE++ whitening all-reduces its moments), and the
reassembly of per-sample log-probs computed on different ranks.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from trainer.algo.advantages import (
    SEQUENCE_ESTIMATORS, masked_whiten, reinforce_pp_returns, sequence_advantages)
from trainer.algo.losses import kl_penalty
from trainer.backends.batching import BatchLike, MicroBatch


def micro_batch_advantages(algo, batch: BatchLike, mbs: list[MicroBatch],
                           pre: Optional[list[torch.Tensor]], ref: Optional[list[torch.Tensor]],
                           device: torch.device) -> list[torch.Tensor]:
    """Flat per-token advantages of each micro-batch of this rank (``algo``: AlgoConfig;
    ``pre``/``ref``: pre-update and reference log-probs per micro-batch, for KL)."""
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    if algo.advantage_estimator != "reinforce_pp":
        seq_adv = sequence_advantages(algo.advantage_estimator, rewards,
                                      torch.tensor(batch.group_ids))
        return [seq_adv[mb.sample_ids][mb.seq_idx].to(device) if mb.num_seqs
                else torch.zeros(1, device=device) for mb in mbs]
    returns = []
    for k, mb in enumerate(mbs):
        if mb.num_seqs == 0:
            returns.append(torch.zeros(1, device=device))
            continue
        kl = None
        if ref is not None:
            # KL of the pre-update policy against the reference, per token.
            assert pre is not None
            kl = kl_penalty(pre[k], ref[k], algo.kl_type)
        returns.append(reinforce_pp_returns(
            rewards[mb.sample_ids].to(device), mb.loss_mask.to(device),
            mb.seq_idx.to(device), kl=kl, kl_coef=algo.kl_coef, gamma=algo.gamma))
    # Whiten with moments over every rank's tokens so all ranks agree.
    moments = torch.zeros(3, dtype=torch.float64, device=device)
    for r, mb in zip(returns, mbs):
        if mb.num_seqs:
            m, r64 = mb.loss_mask.to(device).double(), r.double()
            moments += torch.stack([(r64 * m).sum(), (r64 * r64 * m).sum(), m.sum()])
    dist.all_reduce(moments)
    n = moments[2].clamp(min=1)
    mean = moments[0] / n
    std = (moments[1] / n - mean * mean).clamp(min=0).sqrt()
    return [masked_whiten(r, mb.loss_mask.to(device), mean=mean.float(), std=std.float())
            if mb.num_seqs else r for r, mb in zip(returns, mbs)]


def zero_advantage_samples(config, batch: BatchLike) -> frozenset[int]:
    """Samples whose loss and gradient are exactly zero, so training can skip their
    forward and backward: a sequence-level advantage of 0 (e.g. a GRPO group whose
    rewards are all equal) with no KL or entropy term. Empty when train.skip_zero_advantage
    is off or another term would still give them a gradient."""
    algo = config.algo
    if (not config.train.skip_zero_advantage or algo.advantage_estimator not in SEQUENCE_ESTIMATORS
            or algo.kl_coef > 0 or algo.entropy_coef > 0):
        return frozenset()
    adv = sequence_advantages(algo.advantage_estimator, torch.tensor(batch.rewards, dtype=torch.float32),
                              torch.tensor(batch.group_ids))
    return frozenset(torch.nonzero(adv == 0).flatten().tolist())


def per_sample_log_probs(mbs: list[MicroBatch], flat: list[torch.Tensor], *,
                         num_samples: int, contribute: bool = True) -> list[torch.Tensor]:
    """Split each micro-batch's flat response log-probs by sample and gather every rank's
    samples (collective), in batch order. ``contribute``: False on ranks whose results are
    duplicates (e.g. non-first tensor-parallel ranks) or absent (non-last pipeline stages)."""
    local: dict[int, torch.Tensor] = {}
    if contribute:
        for mb, lp in zip(mbs, flat):
            lp, seq_idx = lp.float().cpu(), mb.seq_idx.cpu()
            for j, sid in enumerate(mb.sample_ids):
                local[sid] = lp[seq_idx == j]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {k: v for part in gathered for k, v in part.items()}
    return [merged[i] for i in range(num_samples)]


def train_step_metrics(reduced: dict[str, float], *, grad_norms: list[float], lrs: list[float],
                       start: float, skipped: int = 0) -> dict[str, float]:
    """A train step's metrics from its all-reduced sums. Each contribution was normalised by
    its optimizer step's global counts, so sum / number of optimizer steps is the mean per
    step."""
    num_steps = len(grad_norms)
    out = {k: v / num_steps for k, v in reduced.items()}
    out["train/grad_norm"] = sum(grad_norms) / num_steps
    out["train/lr"] = lrs[-1]
    out["train/optimizer_steps"] = float(num_steps)
    out["train/skipped_samples"] = float(skipped)
    # A step whose samples were all skipped had exactly zero loss: say so, not nothing.
    for key in ("train/loss", "train/pg_loss"):
        out.setdefault(key, 0.0)
    out["perf/train_time"] = time.perf_counter() - start
    return out
