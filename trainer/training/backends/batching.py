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

With shared-prefix training (``keep_groups``) steps 2 and 3 deal and pack whole groups
(when there are at least as many groups as ranks), since only samples in one micro-batch
share: dealt sample by sample, a group of 8 over 8 ranks would share nothing.

The padded layout (``build_micro_batch``, used by Megatron and with
``train.share_prompts=false``) pads rather than packs several samples into one row with
restarting position_ids, because eager/sdpa attention with a block-diagonal mask still
costs row_len^2 per row.

The shared-prefix layout (``build_shared_prefix_micro_batch``, FSDP's default) avoids
both costs: a GRPO group's common prefix (its prompt, and often a first turn all its
samples took) runs once, and the rest of each sample runs packed in one row that only
attention re-pads (``packed_attention``); log-probs are unchanged. What each layout costs,
measured: docs/performance.md ("Design figures").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Collection, Optional, Protocol, Sequence

import torch

from trainer.training.algo.losses import LossNorms


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


def micro_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int,
                  group_ids: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Length-sorted micro-batches whose padded size (rows x longest) fits ``max_tokens``.

    A sample longer than the budget gets a micro-batch of its own. With ``group_ids``,
    samples are ordered group by group (groups by their longest sample), so a group lands
    in one micro-batch unless the budget cuts it: what shared-prefix training shares is
    within a micro-batch.
    """
    order = sorted(indices, key=lambda i: (lengths[i], i))
    if group_ids is not None:
        longest: dict[int, tuple] = {}
        for i in order:  # ascending, so the last write is the group's longest sample
            longest[group_ids[i]] = (lengths[i], i)
        order.sort(key=lambda i: longest[group_ids[i]])  # stable: by length within a group
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        if current and (len(current) + 1) * max(width, lengths[i]) > max_tokens:
            out.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, lengths[i])
    if current:
        out.append(current)
    return out


def plan_step(batch: BatchLike, *, rank: int, world_size: int, global_batch_size: int | None,
              max_tokens: int, keep_groups: bool = False,
              skip: Collection[int] = frozenset()) -> list[list[list[int]]]:
    """This rank's micro-batches (lists of sample indices) for each optimizer step.

    Every rank returns the same number of micro-batches per step (padding with empty
    ones), because FSDP/Megatron collectives must be entered by all ranks. With
    ``keep_groups`` (shared-prefix training) whole groups are dealt to ranks and kept
    together in micro-batches, as long as there are at least as many groups as ranks.
    Samples in ``skip`` are left out (``step_norms`` still counts them).
    """
    lengths = [len(t) for t in batch.tokens]
    plan = []
    for mb in minibatch_ranges(len(lengths), global_batch_size):
        mb = [i for i in mb if i not in skip]
        units: dict[int, list[int]] = {}
        for i in mb:
            units.setdefault(batch.group_ids[i] if keep_groups else i, []).append(i)
        if len(units) < world_size:  # too few groups to deal whole: deal samples
            units = {i: [i] for i in mb}
        groups = list(units.values())
        cost = [sum(lengths[i] for i in g) for g in groups]
        shards = [sorted(i for k in part for i in groups[k])
                  for part in balanced_partition(range(len(groups)), cost, world_size)]
        per_rank = [micro_batches(s, lengths, max_tokens,
                                  batch.group_ids if keep_groups else None) for s in shards]
        count = max(max(len(m) for m in per_rank), 1)
        mine = per_rank[rank]
        plan.append(mine + [[] for _ in range(count - len(mine))])
    return plan


@dataclass
class SharedPrefix:
    """How a micro-batch's samples share prefixes (``build_shared_prefix_micro_batch``).

    Each sample is ``prefix + suffix``: the prefix is the longest common prefix of the
    micro-batch's samples with the same prompt (at least the prompt; often a first turn
    too), computed once; the suffixes are packed into one row without padding, and their
    attention re-pads them to ``[rows, width]`` and prepends the prefix's KV.
    """

    prefix_ids: torch.Tensor  # [U, L] distinct prefixes, right-padded
    prefix_mask: torch.Tensor  # [U, L] long
    prefix_keep: torch.Tensor  # [U, L] bool: positions that predict a response token
    prefix_index: torch.Tensor  # [B] each suffix row's prefix
    position_ids: torch.Tensor  # [1, N] of the packed suffix tokens
    keep: torch.Tensor  # [1, N] bool: packed positions that predict a response token
    slot: torch.Tensor  # [N] each packed token's place in the padded [B * width] layout
    rows: int
    width: int
    # Flat response token k is predicted by row logit_idx[k] of
    # cat(logits[packed keep], logits[prefix keep]) (both row-major).
    logit_idx: torch.Tensor  # [num response tokens]

    def to(self, device: torch.device | str) -> "SharedPrefix":
        return SharedPrefix(**_moved(self, device))


@dataclass
class MicroBatch:
    """Model inputs plus flat per-response-token tensors of a few samples.

    Padded layout (``build_micro_batch``): flat token k is predicted by
    ``logits[row_idx[k], col_idx[k]]`` and is ``input_ids[row_idx[k], col_idx[k] + 1]``.
    Shared-prefix layout (``shared`` set): ``input_ids`` is the packed suffixes [1, N] and
    ``attention_mask`` their re-padded attention mask [B, 1, width, L + width] (bool).
    The model's rows are the samples', or with ``dedupe`` one per set of identical
    samples; the flat per-token tensors always run sample after sample.
    Empty micro-batches (``num_seqs == 0``) hold one dummy token so the model still runs
    (collectives stay in step).
    """

    sample_ids: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor  # [N]
    seq_idx: torch.Tensor  # [N] sample index within this micro-batch
    loss_mask: torch.Tensor  # [N] float
    rollout_log_probs: torch.Tensor  # [N] float (0 where the sample has none)
    rollout_mask: torch.Tensor  # [N] float, 1 where the sample has engine log-probs
    row_idx: Optional[torch.Tensor] = None  # [N] padded layout
    col_idx: Optional[torch.Tensor] = None  # [N] padded layout
    shared: Optional[SharedPrefix] = None
    num_rows: int = 0  # sequences the model runs: fewer than num_seqs where samples repeat

    @property
    def num_seqs(self) -> int:
        return len(self.sample_ids)

    def to(self, device: torch.device | str) -> "MicroBatch":
        return MicroBatch(**_moved(self, device))


def _moved(obj, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor)
                else v.to(device) if isinstance(v, SharedPrefix) else v)
            for k, v in obj.__dict__.items()}


def distinct_samples(batch: BatchLike, sample_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The samples of ``sample_ids`` the model has to run: the first of each set of
    identical ones (the same tokens, split alike into prompt and response); and for each
    sample, the index of its own among them. A confident policy repeats itself: in the
    multi-turn game's GRPO groups 38% of the trained samples were distinct
    (docs/performance.md)."""
    first: dict[tuple, int] = {}
    distinct, source = [], []
    for i in sample_ids:
        key = (batch.response_lengths[i], *batch.tokens[i])
        if key not in first:
            first[key] = len(distinct)
            distinct.append(i)
        source.append(first[key])
    return distinct, source


def _model_rows(batch: BatchLike, sample_ids: Sequence[int],
                dedupe: bool) -> tuple[list[int], list[int]]:
    """The samples the model runs and each sample's index among them."""
    if dedupe:
        return distinct_samples(batch, sample_ids)
    return list(sample_ids), list(range(len(sample_ids)))


def build_micro_batch(batch: BatchLike, sample_ids: list[int], *, pad_token_id: int,
                      dedupe: bool = False) -> MicroBatch:
    """Right-padded rows for ``sample_ids``; flat index tensors built without a Python loop
    over tokens (one tensor per sample is all the list input allows). ``dedupe``: one row
    for each set of identical samples (``distinct_samples``), which every one of them reads
    its logits from; the per-token fields stay per sample, so each counts in the loss,
    and the gradient is the sum it would be with a row each."""
    if not sample_ids:
        one = torch.tensor([[pad_token_id, pad_token_id]])
        zero = torch.zeros(1, dtype=torch.long)
        return MicroBatch([], one, torch.ones_like(one), one[0, 1:].clone(), zero,
                          torch.zeros(1), torch.zeros(1), torch.zeros(1), row_idx=zero,
                          col_idx=zero)
    rows, source = _model_rows(batch, sample_ids, dedupe)
    seqs = [torch.tensor(batch.tokens[i], dtype=torch.long) for i in rows]
    row_len = torch.tensor([len(s) for s in seqs])
    resp = torch.tensor([batch.response_lengths[i] for i in sample_ids])
    input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_token_id)
    attention_mask = (torch.arange(input_ids.shape[1])[None, :] < row_len[:, None]).long()
    seq_idx, within = _flat_positions(resp)
    row_idx = torch.tensor(source)[seq_idx]
    # Response token t of a sample sits at position len - resp + t; its logits at one before.
    col_idx = (row_len[row_idx] - resp[seq_idx] - 1) + within
    targets = input_ids[row_idx, col_idx + 1]
    return MicroBatch(list(sample_ids), input_ids, attention_mask, targets, seq_idx,
                      *_token_fields(batch, sample_ids, seq_idx), row_idx=row_idx,
                      col_idx=col_idx, num_rows=len(rows))


def _flat_positions(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For flat tokens laid out sample after sample: each token's sample and its index
    within the sample."""
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    return seq_idx, torch.arange(int(lengths.sum())) - offsets[seq_idx]


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


def _shared_prefixes(batch: BatchLike, sample_ids: Sequence[int]):
    """Per distinct prompt among ``sample_ids`` (first-seen order): the longest prefix its
    samples share, leaving every sample at least one token of its own; the prompt's
    length; and each sample's prefix slot."""
    members: dict[tuple, list[int]] = {}
    for j, i in enumerate(sample_ids):
        toks = batch.tokens[i]
        members.setdefault(tuple(toks[:len(toks) - batch.response_lengths[i]]), []).append(j)
    prefixes, prompt_lens, slot = [], [], [0] * len(sample_ids)
    for u, (prompt, rows) in enumerate(members.items()):
        seqs = [batch.tokens[sample_ids[j]] for j in rows]
        end = min(len(s) for s in seqs) - 1
        n = len(prompt)
        while n < end and all(s[n] == seqs[0][n] for s in seqs):
            n += 1
        prefixes.append(seqs[0][:n])
        prompt_lens.append(len(prompt))
        for j in rows:
            slot[j] = u
    return prefixes, prompt_lens, slot


def build_shared_prefix_micro_batch(batch: BatchLike, sample_ids: list[int], *,
                                    pad_token_id: int, dedupe: bool = False) -> MicroBatch:
    """Like ``build_micro_batch``, but what samples share is computed once and nothing is
    padded outside attention.

    Samples with the same prompt (a GRPO group) share at least the prompt and often their
    first turn; that common prefix runs once per micro-batch, and the backend hands its KV
    cache (with grad) to the suffixes' attention. The suffixes run packed in one row, so
    the linear layers see no padding; only attention re-pads them (``SharedPrefix.slot``).
    Log-probs equal the per-sample layout's; the gradient of a shared token sums over the
    samples sharing it, as it would per sample. ``dedupe``: as in ``build_micro_batch``,
    identical samples share one packed suffix.
    """
    if not sample_ids:
        return build_micro_batch(batch, sample_ids, pad_token_id=pad_token_id)
    runs, source = _model_rows(batch, sample_ids, dedupe)
    prefixes, prompt_lens, slot = _shared_prefixes(batch, runs)
    prefix_len = torch.tensor([len(p) for p in prefixes])
    prompt_len = torch.tensor(prompt_lens)
    prefix_ids = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(p, dtype=torch.long) for p in prefixes], batch_first=True,
        padding_value=pad_token_id)
    pos = torch.arange(prefix_ids.shape[1])[None, :]
    prefix_mask = (pos < prefix_len[:, None]).long()
    # A prefix position predicts a response token from the prompt's last token on.
    prefix_keep = (pos >= prompt_len[:, None] - 1) & (pos < prefix_len[:, None])

    index = torch.tensor(slot)
    row_prefix = prefix_len[index]  # [B]
    suffixes = [torch.tensor(batch.tokens[i][int(n):], dtype=torch.long)
                for i, n in zip(runs, row_prefix)]
    suffix_len = torch.tensor([len(s) for s in suffixes])
    rows, width = len(suffixes), int(suffix_len.max())
    row, col = _flat_positions(suffix_len)
    keep = col < suffix_len[row] - 1  # a row's last token predicts nothing
    # Re-padded attention: each row sees its prefix's real tokens, then its suffix causally.
    q = torch.arange(width)
    own = (q[None, None, :] <= q[None, :, None]) & (q[None, None, :] < suffix_len[:, None, None])
    attention_mask = torch.cat([
        prefix_mask.bool()[index][:, None, :].expand(-1, width, -1), own], 2)[:, None]

    # Which logits predict response token t of each sample: position P + t - 1 of the
    # full sequence, in the prefix while that is < L, else in its row's packed suffix.
    resp = torch.tensor([batch.response_lengths[i] for i in sample_ids])
    seq_idx, t = _flat_positions(resp)
    row_of = torch.tensor(source)[seq_idx]
    at = prompt_len[index][row_of] + t - 1
    packed_kept = torch.cumsum(suffix_len - 1, 0) - (suffix_len - 1)  # first kept, per row
    prefix_kept = torch.cumsum(prefix_keep.sum(1), 0) - prefix_keep.sum(1)  # per prefix
    in_prefix = at < row_prefix[row_of]
    logit_idx = torch.where(
        in_prefix, int(keep.sum()) + prefix_kept[index][row_of] + t,
        packed_kept[row_of] + at - row_prefix[row_of])
    shared = SharedPrefix(
        prefix_ids=prefix_ids, prefix_mask=prefix_mask, prefix_keep=prefix_keep,
        prefix_index=index, position_ids=(row_prefix[row] + col)[None], keep=keep[None],
        slot=row * width + col, rows=rows, width=width, logit_idx=logit_idx)
    targets = torch.cat([torch.tensor(batch.tokens[i][-batch.response_lengths[i]:])
                         for i in sample_ids])
    return MicroBatch(list(sample_ids), torch.cat(suffixes)[None], attention_mask, targets,
                      seq_idx, *_token_fields(batch, sample_ids, seq_idx), shared=shared,
                      num_rows=rows)


def step_norms(batch: BatchLike, sample_range: Sequence[int],
               skip: Collection[int] = frozenset()) -> LossNorms:
    """Global loss denominators of one optimizer step (all ranks' samples). Samples in
    ``skip`` (no forward: their loss is zero) still count in the loss's denominators, so
    skipping them leaves the gradient unchanged; metrics average over the rest."""
    ran = [i for i in sample_range if i not in skip]
    with_rollout = [i for i in ran if batch.rollout_log_probs[i] and any(batch.loss_masks[i])]
    return LossNorms(num_tokens=sum(sum(batch.loss_masks[i]) for i in sample_range),
                     num_seqs=len(sample_range),
                     norm_len=max(batch.response_lengths[i] for i in sample_range),
                     num_rollout_tokens=sum(sum(batch.loss_masks[i]) for i in with_rollout),
                     metric_tokens=sum(sum(batch.loss_masks[i]) for i in ran),
                     num_rollout_seqs=len(with_rollout))
