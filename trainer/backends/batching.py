"""From a rollout batch (plain lists) to the tensors a training rank runs, shared by backends.

Three decisions live here, because every backend must take them identically on every
rank (FSDP and Megatron issue collectives in forward/backward, so all ranks must run the
same number of micro-batches):

1. optimizer steps: the batch is cut into contiguous mini-batches of
   ``train.global_batch_size`` samples (groups stay contiguous);
2. data parallel: each mini-batch is split across ranks balanced by token count
   (longest-first greedy), computed the same way on every rank from the full batch;
3. micro-batches: a rank's samples, sorted by length, are packed into padded rows under
   ``train.max_tokens_per_micro_batch`` (counting padding); ranks with fewer micro-batches
   get empty ones so the counts match.

Padding rather than packing several samples into one row with restarting position_ids:
measured on 2 CPU cores with the tiny Qwen3 (64 samples of 100-200 tokens, eager
attention, forward+backward), length-sorted padding took 1.24 s and packing into rows of
512/1024/2048 tokens 2.8/3.6/12.5 s, because eager/sdpa attention with a block-diagonal
mask still costs row_len^2 per row. Packing wins only with varlen flash attention (GPU).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from trainer.algo.losses import LossNorms


class BatchLike(Protocol):
    """What training reads from ``rollout.sample.RolloutBatch`` (any object with these)."""

    tokens: list[list[int]]  # prompt + response
    response_lengths: list[int]
    loss_masks: list[list[int]]  # response_length entries, 1 = model token
    rollout_log_probs: list[list[float]]  # response_length entries
    rewards: list[float]
    group_ids: list[int]


def check_batch(batch: BatchLike) -> None:
    """Raise ValueError naming the first inconsistent sample."""
    n = len(batch.tokens)
    if n == 0:
        raise ValueError("empty batch: nothing to train on")
    for name in ("response_lengths", "loss_masks", "rollout_log_probs", "rewards", "group_ids"):
        if len(getattr(batch, name)) != n:
            raise ValueError(f"batch.{name} has {len(getattr(batch, name))} entries, "
                             f"batch.tokens has {n}")
    for i, (toks, r) in enumerate(zip(batch.tokens, batch.response_lengths)):
        if not 1 <= r < len(toks):
            raise ValueError(f"sample {i}: response_length {r} must be in [1, len(tokens)-1] "
                             f"(len(tokens) = {len(toks)}; a prompt token must precede it)")
        if len(batch.loss_masks[i]) != r:
            raise ValueError(f"sample {i}: loss_mask needs response_length={r} entries")
        if len(batch.rollout_log_probs[i]) not in (0, r):
            raise ValueError(f"sample {i}: rollout_log_probs needs response_length={r} "
                             "entries (or none when the engine's log-probs were not recorded)")


def minibatch_ranges(num_samples: int, global_batch_size: int | None) -> list[range]:
    """Contiguous sample ranges, one per optimizer step."""
    size = global_batch_size or num_samples
    if num_samples % size:
        raise ValueError(f"train.global_batch_size={size} must divide the batch's "
                         f"{num_samples} samples")
    return [range(s, s + size) for s in range(0, num_samples, size)]


def balanced_partition(indices: Sequence[int], costs: Sequence[int],
                       num_parts: int) -> list[list[int]]:
    """Split ``indices`` into ``num_parts`` lists with near-equal total cost (LPT greedy).

    Deterministic (ties broken by index) so every rank computes the same split.
    """
    order = sorted(indices, key=lambda i: (-costs[i], i))
    heap = [(0, p) for p in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + costs[i], p))
    return [sorted(p) for p in parts]


def micro_batches(indices: Sequence[int], lengths: Sequence[int],
                  max_tokens: int) -> list[list[int]]:
    """Length-sorted micro-batches whose padded size (rows x longest) fits ``max_tokens``.

    A sample longer than the budget gets a micro-batch of its own.
    """
    out: list[list[int]] = []
    current: list[int] = []
    for i in sorted(indices, key=lambda i: (lengths[i], i)):
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def plan_step(batch: BatchLike, *, rank: int, world_size: int, global_batch_size: int | None,
              max_tokens: int) -> list[list[list[int]]]:
    """This rank's micro-batches (lists of sample indices) for each optimizer step.

    Every rank returns the same number of micro-batches per step (padding with empty
    ones), because FSDP/Megatron collectives must be entered by all ranks.
    """
    lengths = [len(t) for t in batch.tokens]
    plan = []
    for mb in minibatch_ranges(len(lengths), global_batch_size):
        shards = balanced_partition(list(mb), lengths, world_size)
        per_rank = [micro_batches(s, lengths, max_tokens) for s in shards]
        count = max(max(len(m) for m in per_rank), 1)
        mine = per_rank[rank]
        plan.append(mine + [[] for _ in range(count - len(mine))])
    return plan


@dataclass
class MicroBatch:
    """Padded model inputs plus flat per-response-token tensors of a few samples.

    Flat token k is predicted by ``logits[row_idx[k], col_idx[k]]`` and is
    ``input_ids[row_idx[k], col_idx[k] + 1]``. Empty micro-batches (``num_seqs == 0``)
    hold one dummy token so the model still runs (collectives stay in step).
    """

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    row_idx: torch.Tensor  # [N]
    col_idx: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    seq_idx: torch.Tensor  # [N] sample index within this micro-batch
    loss_mask: torch.Tensor  # [N] float
    rollout_log_probs: torch.Tensor  # [N] float (0 where the sample has none)
    rollout_mask: torch.Tensor  # [N] float, 1 where the sample has engine log-probs

    @property
    def num_seqs(self) -> int:
        return len(self.sample_ids)

    def to(self, device: torch.device | str) -> "MicroBatch":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return MicroBatch(**moved)


def build_micro_batch(batch: BatchLike, sample_ids: list[int], *, pad_token_id: int) -> MicroBatch:
    """Right-padded rows for ``sample_ids``; flat index tensors built without a Python loop
    over tokens (one tensor per sample is all the list input allows)."""
    if not sample_ids:
        one = torch.tensor([[pad_token_id, pad_token_id]])
        zero = torch.zeros(1, dtype=torch.long)
        return MicroBatch([], one, torch.ones_like(one), zero, zero, one[0, 1:].clone(), zero,
                          torch.zeros(1), torch.zeros(1), torch.zeros(1))
    seqs = [torch.tensor(batch.tokens[i], dtype=torch.long) for i in sample_ids]
    lengths = torch.tensor([len(s) for s in seqs])
    resp = torch.tensor([batch.response_lengths[i] for i in sample_ids])
    input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_token_id)
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    seq_idx = torch.repeat_interleave(torch.arange(len(sample_ids)), resp)
    offsets = torch.cumsum(resp, 0) - resp
    within = torch.arange(int(resp.sum())) - offsets[seq_idx]
    # Response token t of a sample sits at position len - resp + t; its logits at one before.
    col_idx = (lengths - resp - 1)[seq_idx] + within
    row_idx = seq_idx
    targets = input_ids[row_idx, col_idx + 1]
    loss_mask = torch.tensor([m for i in sample_ids for m in batch.loss_masks[i]],
                             dtype=torch.float32)
    has_lp = [bool(batch.rollout_log_probs[i]) for i in sample_ids]
    rollout_lp = torch.tensor([p for i, has in zip(sample_ids, has_lp)
                               for p in (batch.rollout_log_probs[i] if has
                                         else [0.0] * batch.response_lengths[i])],
                              dtype=torch.float32)
    rollout_mask = torch.tensor(has_lp, dtype=torch.float32)[seq_idx]
    return MicroBatch(list(sample_ids), input_ids, attention_mask, row_idx, col_idx, targets,
                      seq_idx, loss_mask, rollout_lp, rollout_mask)


def step_norms(batch: BatchLike, sample_range: Sequence[int]) -> LossNorms:
    """Global loss denominators of one optimizer step (all ranks' samples)."""
    return LossNorms(num_tokens=sum(sum(batch.loss_masks[i]) for i in sample_range),
                     num_seqs=len(sample_range),
                     norm_len=max(batch.response_lengths[i] for i in sample_range),
                     num_rollout_tokens=sum(sum(batch.loss_masks[i]) for i in sample_range
                                            if batch.rollout_log_probs[i]))
