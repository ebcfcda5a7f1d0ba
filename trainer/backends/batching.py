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

What does pay on any hardware is not repeating a GRPO group's prompt: with
``train.share_prompts`` (``build_shared_prompt_micro_batch``) each distinct prompt runs
once and its KV cache, with grad, is shared by the group's responses. Measured on the
bench_vs_trl multi-turn batch (32 games of one 79-token prompt, ~80 response tokens each,
tiny Qwen3, 1 thread): 0.72 s -> 0.45 s per train step, log-probs identical. A packed row
of [prompt | response | response ...] with a 4D mask computes the same, but eager
attention over the whole row ate the saving (1.20 s at 1024-token rows, 0.65 s at 512).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

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
    ``input_ids[row_idx[k], col_idx[k] + 1]``; with shared prompts, ``col_idx == -1`` is the
    last position of the row's prompt. Empty micro-batches (``num_seqs == 0``) hold one
    dummy token so the model still runs (collectives stay in step).
    """

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token ([B, P + T] with prompt_ids)
    row_idx: torch.Tensor  # [N]
    col_idx: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    seq_idx: torch.Tensor  # [N] sample index within this micro-batch
    loss_mask: torch.Tensor  # [N] float
    rollout_log_probs: torch.Tensor  # [N] float (0 where the sample has none)
    rollout_mask: torch.Tensor  # [N] float, 1 where the sample has engine log-probs
    # Shared prompts (build_shared_prompt_micro_batch): rows hold responses only.
    position_ids: Optional[torch.Tensor] = None  # [B, T]
    prompt_ids: Optional[torch.Tensor] = None  # [U, P] the distinct prompts, right-padded
    prompt_mask: Optional[torch.Tensor] = None  # [U, P]
    prompt_index: Optional[torch.Tensor] = None  # [B] each row's prompt

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
    return MicroBatch(list(sample_ids), input_ids, attention_mask, row_idx, col_idx, targets,
                      seq_idx, *_token_fields(batch, sample_ids, seq_idx))


def _token_fields(batch: BatchLike, sample_ids: Sequence[int], seq_idx: torch.Tensor):
    """Flat loss mask, engine log-probs and their presence mask, in sample order."""
    loss_mask = torch.tensor([m for i in sample_ids for m in batch.loss_masks[i]],
                             dtype=torch.float32)
    has_lp = [bool(batch.rollout_log_probs[i]) for i in sample_ids]
    rollout_lp = torch.tensor([p for i, has in zip(sample_ids, has_lp)
                               for p in (batch.rollout_log_probs[i] if has
                                         else [0.0] * batch.response_lengths[i])],
                              dtype=torch.float32)
    rollout_mask = torch.tensor(has_lp, dtype=torch.float32)[seq_idx]
    return loss_mask, rollout_lp, rollout_mask


def build_shared_prompt_micro_batch(batch: BatchLike, sample_ids: list[int], *,
                                    pad_token_id: int) -> MicroBatch:
    """Like ``build_micro_batch``, but each distinct prompt among ``sample_ids`` (a GRPO
    group's) is computed once: ``prompt_ids`` holds the distinct prompts, the rows of
    ``input_ids`` only the responses. The backend runs the prompts first and hands their
    KV cache, expanded to the rows, to the response forward (positions continue after the
    prompt, the mask covers prompt + response), so log-probs equal the per-sample layout's
    while the prompt's forward/backward runs once per group instead of once per sample.

    Flat token t of a row is predicted at ``col_idx`` of that row; ``col_idx == -1`` (every
    response's first token) means the last position of the row's prompt.
    """
    if not sample_ids:
        return build_micro_batch(batch, sample_ids, pad_token_id=pad_token_id)
    slot: dict[tuple, int] = {}
    prompts, index = [], []
    for i in sample_ids:
        key = tuple(batch.tokens[i][:len(batch.tokens[i]) - batch.response_lengths[i]])
        if key not in slot:
            slot[key] = len(prompts)
            prompts.append(torch.tensor(key, dtype=torch.long))
        index.append(slot[key])
    prompt_len = torch.tensor([len(p) for p in prompts])
    prompt_ids = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True,
                                                 padding_value=pad_token_id)
    prompt_mask = (torch.arange(prompt_ids.shape[1])[None, :] < prompt_len[:, None]).long()
    index_t = torch.tensor(index)
    resp = torch.tensor([batch.response_lengths[i] for i in sample_ids])
    responses = [torch.tensor(batch.tokens[i][-batch.response_lengths[i]:], dtype=torch.long)
                 for i in sample_ids]
    input_ids = torch.nn.utils.rnn.pad_sequence(responses, batch_first=True,
                                                padding_value=pad_token_id)
    width = input_ids.shape[1]
    response_mask = (torch.arange(width)[None, :] < resp[:, None]).long()
    attention_mask = torch.cat([prompt_mask[index_t], response_mask], 1)
    position_ids = prompt_len[index_t][:, None] + torch.arange(width)[None, :]
    seq_idx = torch.repeat_interleave(torch.arange(len(sample_ids)), resp)
    offsets = torch.cumsum(resp, 0) - resp
    col_idx = torch.arange(int(resp.sum())) - offsets[seq_idx] - 1
    targets = torch.cat(responses)
    return MicroBatch(list(sample_ids), input_ids, attention_mask, seq_idx, col_idx, targets,
                      seq_idx, *_token_fields(batch, sample_ids, seq_idx),
                      position_ids=position_ids, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                      prompt_index=index_t)


def step_norms(batch: BatchLike, sample_range: Sequence[int]) -> LossNorms:
    """Global loss denominators of one optimizer step (all ranks' samples)."""
    return LossNorms(num_tokens=sum(sum(batch.loss_masks[i]) for i in sample_range),
                     num_seqs=len(sample_range),
                     norm_len=max(batch.response_lengths[i] for i in sample_range),
                     num_rollout_tokens=sum(sum(batch.loss_masks[i]) for i in sample_range
                                            if batch.rollout_log_probs[i]))
