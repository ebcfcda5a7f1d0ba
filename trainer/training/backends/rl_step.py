"""The train step and the SFT step, written once for every backend.

``StepLoop`` is the outer loop of both: plan the micro-batches, old/reference log-probs,
advantages, then per optimizer step its LR, the loss of each micro-batch
(``trainer.training.algo.objective``), the optimizer step and the metrics. A backend subclasses it
and supplies the hooks: how micro-batches are planned and built, how the model runs on
them (forward and backward), the optimizer step and the metrics all-reduce.

Also here: advantages for the micro-batches of one rank (group statistics need no
communication: every rank sees the whole batch; REINFORCE++ whitening all-reduces its
moments), and the reassembly of per-sample log-probs computed on different ranks.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from trainer.training.algo.advantages import (
    SEQUENCE_ESTIMATORS, masked_whiten, reinforce_pp_returns, sequence_advantages)
from trainer.training.algo.losses import kl_penalty
from trainer.training.algo.mismatch import (
    RatioSketch, merge_sketches, ratio_metrics, sum_metric_keys)
from trainer.training.algo.objective import TokenInputs, policy_objective, sft_objective
from trainer.training.backends.batching import (
    BatchLike, MicroBatch, check_batch, minibatch_ranges, step_norms)
from trainer.training.backends.schedule import lr_at


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


def zero_advantage_samples(algo, train, batch: BatchLike) -> frozenset[int]:
    """Samples whose loss and gradient are exactly zero, so training can skip their
    forward and backward: a sequence-level advantage of 0 (e.g. a GRPO group whose
    rewards are all equal) with no KL or entropy term. Empty when train.skip_zero_advantage
    is off or another term would still give them a gradient."""
    if (not train.skip_zero_advantage or algo.advantage_estimator not in SEQUENCE_ESTIMATORS
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


SFT_METRIC_KEYS = frozenset({"train/sft_loss"})


def rl_metric_keys(algo, *, with_reference: bool) -> frozenset[str]:
    """Every metric name an RL step's micro-batches can add up with ``algo`` (AlgoConfig):
    ``policy_objective``'s and the step's own ``train/computed_sample_frac``."""
    keys = {"train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/loss", "train/entropy",
            "train/computed_sample_frac"}
    keys |= sum_metric_keys(algo.rollout_correction != "none")
    if with_reference:
        keys.add("train/kl")
    return frozenset(keys)


def gathered_ratio_metrics(ratios: RatioSketch, *, contribute: bool) -> dict[str, float]:
    """The step's max and quantile mismatch metrics over every rank's tokens (collective:
    every rank calls it; ``contribute`` False sends nothing, e.g. non-first TP ranks)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ratios.sketch() if contribute else None)
    return ratio_metrics(merge_sketches(gathered))


# loss_of(j, mb, log_probs, entropy) -> the loss of micro-batch j of an optimizer step.
LossOf = Callable[[int, MicroBatch, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _add(sums: dict, metrics: dict) -> None:
    for name, value in metrics.items():
        sums[name] = sums.get(name, 0.0) + value.detach()


class StepLoop:
    """``train_step`` and ``sft_step`` of a backend, over its hooks (the ``_`` methods
    below that raise). The backend's ``init`` sets the sections ``train``, ``algo`` and
    ``warmup``, ``device``, ``optimizer``, ``optimizer_steps`` (RL steps: the LR schedule's
    position), ``sft_steps`` and ``total_optimizer_steps``
    (``config.derived.total_optimizer_steps``)."""

    # ----------------------------------------------------------------- hooks
    def _begin_step(self) -> None:
        """Before a step touches the model (e.g. bring offloaded state back)."""

    def _plan(self, batch: BatchLike, global_batch_size: Optional[int],
              skip=frozenset()) -> list[list[list[int]]]:
        """This rank's micro-batches (sample ids) per optimizer step (``plan_step``)."""
        raise NotImplementedError

    def _micro_batch(self, batch: BatchLike, sample_ids: list[int]) -> MicroBatch:
        raise NotImplementedError

    def _ref_log_probs(self, mbs: list[MicroBatch]) -> Optional[list[torch.Tensor]]:
        """The reference model's flat log-probs per micro-batch; None without one."""
        raise NotImplementedError

    def _policy_log_probs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """The current policy's flat log-probs per micro-batch, without grad."""
        raise NotImplementedError

    def _accumulate(self, mbs: list[MicroBatch], loss_of: LossOf, *, with_entropy: bool,
                    entropy_grad: bool = False) -> None:
        """Forward and backward of one optimizer step's micro-batches, gradients synced
        over data-parallel ranks at the end. ``loss_of``'s losses are normalised by the
        step's global counts, so gradients must add up as their plain SUM over
        micro-batches and ranks (undo any averaging the backend does)."""
        raise NotImplementedError

    def _optimizer_step(self) -> float:
        """Clip, step; returns the global grad norm (before clipping)."""
        raise NotImplementedError

    def _all_reduce_metrics(self, sums: dict[str, torch.Tensor],
                            keys: frozenset[str]) -> dict[str, float]:
        """SUM over data-parallel ranks of the metric sums. ``keys``: every name this
        step can emit (for ranks that compute no loss, e.g. early pipeline stages)."""
        raise NotImplementedError

    def _owns_outputs(self) -> bool:
        """Whether this rank's per-token results (log-probs, mismatch ratios) are its own:
        False where they duplicate another rank's or do not exist (Megatron: all but the
        first tensor-parallel rank of the last pipeline stage)."""
        return True

    # ----------------------------------------------------------------- steps
    def set_algo(self, algo) -> None:
        """Swap the loss settings (an ``AlgoConfig``) between steps, so a sweep or a
        benchmark compares algorithms on live ranks. Whether a reference model exists was
        decided at ``init`` by ``kl_coef``, so a KL term cannot be switched on here."""
        if algo.kl_coef > 0 and self.algo.kl_coef == 0:
            raise ValueError("set_algo: algo.kl_coef > 0 needs a reference model, which "
                             "ranks started with kl_coef=0 do not have")
        self.algo = algo

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, batch: BatchLike) -> dict[str, float]:
        """RL update on the whole rollout batch (``global_batch_size`` samples per
        optimizer step)."""
        start = time.perf_counter()
        check_batch(batch)
        self._begin_step()
        algo, train = self.algo, self.train
        if algo.policy_loss == "sft":
            return self.sft_step(batch)
        ranges = minibatch_ranges(len(batch.tokens), train.global_batch_size)
        skip = zero_advantage_samples(algo, train, batch)
        plan = self._plan(batch, train.global_batch_size, skip)
        mbs = [[self._micro_batch(batch, ids) for ids in step] for step in plan]
        flat_mbs = [mb for step in mbs for mb in step]

        # Old log-probs come from a forward before any update when there are several
        # optimizer steps per rollout; with one step, logp.detach() is exact and free.
        ref = self._ref_log_probs(flat_mbs)
        kl_in_reward = algo.advantage_estimator == "reinforce_pp" and ref is not None
        pre = (self._policy_log_probs(flat_mbs)
               if len(ranges) > 1 or kl_in_reward else None)
        old = pre if len(ranges) > 1 else None
        advantages = micro_batch_advantages(algo, batch, flat_mbs, pre, ref, self.device)

        sums: dict[str, torch.Tensor] = {}
        ratios = RatioSketch()
        grad_norms, lrs = [], []
        base = 0  # index of the step's first micro-batch in flat_mbs
        for step_range, step_mbs in zip(ranges, mbs):
            norms = step_norms(batch, step_range, skip)
            lr = lr_at(self.optimizer_steps, lr=train.lr, min_lr=train.min_lr,
                       schedule=train.lr_schedule, warmup_steps=train.lr_warmup_steps,
                       total_steps=self.total_optimizer_steps)
            self._set_lr(lr)

            def loss_of(j, mb, logp, entropy, base=base, norms=norms):
                if mb.num_seqs == 0:  # padding micro-batch: runs for the collectives only
                    return logp.sum() * 0.0
                k, dev = base + j, self.device
                inputs = TokenInputs(
                    loss_mask=mb.loss_mask.to(dev), seq_idx=mb.seq_idx.to(dev),
                    num_seqs=mb.num_seqs, advantages=advantages[k],
                    old_log_probs=old[k] if old is not None else None,
                    rollout_log_probs=mb.rollout_log_probs.to(dev),
                    rollout_mask=mb.rollout_mask.to(dev),
                    ref_log_probs=ref[k] if ref is not None else None)
                loss, metrics = policy_objective(algo, inputs, logp, entropy, norms, ratios)
                # The share of the step's samples the model ran: not the skipped ones with
                # zero advantage, each set of identical ones once (train.dedupe_samples).
                metrics["train/computed_sample_frac"] = logp.new_tensor(
                    mb.num_rows / norms.num_seqs)
                _add(sums, metrics)
                return loss

            self._accumulate(step_mbs, loss_of, with_entropy=True,
                             entropy_grad=algo.entropy_coef > 0)
            grad_norms.append(self._optimizer_step())
            lrs.append(lr)
            self.optimizer_steps += 1
            base += len(step_mbs)
        keys = rl_metric_keys(algo, with_reference=ref is not None)
        reduced = self._all_reduce_metrics(sums, keys)
        out = train_step_metrics(reduced, grad_norms=grad_norms, lrs=lrs, start=start,
                                 skipped=len(skip))
        out.update(gathered_ratio_metrics(ratios, contribute=self._owns_outputs()))
        return out

    def sft_step(self, batch: BatchLike) -> dict[str, float]:
        """One supervised optimizer step at ``warmup.lr`` (the RL LR schedule is untouched):
        mean NLL over loss_mask tokens."""
        start = time.perf_counter()
        check_batch(batch)
        self._begin_step()
        mbs = [self._micro_batch(batch, ids) for ids in self._plan(batch, None)[0]]
        norms = step_norms(batch, range(len(batch.tokens)))
        self._set_lr(self.warmup.lr)
        sums: dict[str, torch.Tensor] = {}

        def loss_of(j, mb, logp, entropy):
            if mb.num_seqs == 0:
                return logp.sum() * 0.0
            loss, metrics = sft_objective(logp, mb.loss_mask.to(self.device), norms)
            _add(sums, metrics)
            return loss

        self._accumulate(mbs, loss_of, with_entropy=False)
        grad_norm = self._optimizer_step()
        self.sft_steps += 1
        out = self._all_reduce_metrics(sums, SFT_METRIC_KEYS)
        out.update({"train/grad_norm": grad_norm, "train/lr": self.warmup.lr,
                    "perf/train_time": time.perf_counter() - start})
        return out
