"""The backend-neutral batching plan and LR schedule (no model, no process group)."""

import math

import pytest
import torch

from train_batches import make_batch, with_repeats
from trainer.training.backends.batching import (
    balanced_partition, build_micro_batch, build_shared_prefix_micro_batch, check_batch,
    distinct_samples, micro_batches, minibatch_ranges, plan_step, step_norms)
from trainer.training.backends.schedule import lr_at


def test_balanced_partition_is_deterministic_and_balanced():
    costs = [10, 9, 8, 7, 3, 2, 1]
    parts = balanced_partition(range(7), costs, 2)
    loads = sorted(sum(costs[i] for i in p) for p in parts)
    assert loads == [20, 20]
    assert parts == balanced_partition(range(7), costs, 2)


def test_micro_batches_respect_padded_token_budget():
    lengths = [5, 50, 10, 12, 48]
    mbs = micro_batches(range(5), lengths, 100)
    assert mbs == [[0, 2, 3], [4, 1]]  # 3 x 12 <= 100 ; 2 x 50 <= 100
    assert micro_batches([0, 1], [300, 5], 100) == [[1], [0]]  # too long: alone


def test_plan_gives_every_rank_the_same_number_of_micro_batches():
    batch = make_batch(num_groups=2, group_size=4, seed=1)
    plans = [plan_step(batch, rank=r, world_size=3, global_batch_size=4, max_tokens=60)
             for r in range(3)]
    assert len({len(p) for p in plans}) == 1 and len(plans[0]) == 2  # two optimizer steps
    for step in range(2):
        assert len({len(p[step]) for p in plans}) == 1
        owned = sorted(i for p in plans for mb in p[step] for i in mb)
        assert owned == list(range(4 * step, 4 * step + 4))  # each sample exactly once


def test_keep_groups_deals_whole_groups_and_keeps_them_in_one_micro_batch():
    batch = make_batch(num_groups=4, group_size=4, response_len=(5, 60), seed=3)
    lengths = [len(t) for t in batch.tokens]
    budget = 4 * max(lengths)  # a group always fits, two rarely
    plans = [plan_step(batch, rank=r, world_size=2, global_batch_size=None,
                       max_tokens=budget, keep_groups=True)[0] for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    owned = sorted(i for plan in plans for mb in plan for i in mb)
    assert owned == list(range(16))
    for plan in plans:
        for mb in plan:
            groups = {batch.group_ids[i] for i in mb}
            assert all(sum(g == h for h in batch.group_ids) == sum(
                batch.group_ids[i] == g for i in mb) for g in groups), mb  # whole groups
    # Plain length order interleaves the groups at this budget.
    plain = plan_step(batch, rank=0, world_size=1, global_batch_size=None, max_tokens=budget)[0]
    assert any(len({batch.group_ids[i] for i in mb}) > len(mb) // 4 for mb in plain)
    # Fewer groups than ranks: samples are dealt instead, and every rank gets some.
    one = make_batch(num_groups=1, group_size=4, seed=3)
    shares = [plan_step(one, rank=r, world_size=2, global_batch_size=None, max_tokens=10_000,
                        keep_groups=True)[0] for r in range(2)]
    assert all(sum(map(len, s)) == 2 for s in shares)


def test_minibatch_ranges_must_divide():
    assert minibatch_ranges(8, 4) == [range(0, 4), range(4, 8)]
    assert minibatch_ranges(8, None) == [range(0, 8)]
    with pytest.raises(ValueError, match="global_batch_size"):
        minibatch_ranges(8, 3)


def test_micro_batch_indices_point_at_response_tokens():
    batch = make_batch(num_groups=1, group_size=3, seed=2)
    mb = build_micro_batch(batch, [2, 0], pad_token_id=0)
    flat_targets = [tok for i in (2, 0) for tok in batch.tokens[i][-batch.response_lengths[i]:]]
    assert mb.targets.tolist() == flat_targets
    assert torch.equal(mb.input_ids[mb.row_idx, mb.col_idx + 1], mb.targets)
    assert mb.loss_mask.tolist() == [m for i in (2, 0) for m in batch.loss_masks[i]]
    assert mb.attention_mask.sum().item() == len(batch.tokens[2]) + len(batch.tokens[0])
    norms = step_norms(batch, range(3))
    assert norms.num_tokens == sum(map(sum, batch.loss_masks)) and norms.num_seqs == 3


def assert_logits_precede_targets(batch, ids, s):
    """logit_idx picks, for every target, the logits of the position just before it."""
    predictor_pos = torch.cat([s.position_ids[s.keep],
                               torch.arange(s.prefix_ids.shape[1]).expand_as(s.prefix_ids)[
                                   s.prefix_keep]])[s.logit_idx]
    target_pos = torch.cat([torch.arange(len(batch.tokens[i]) - batch.response_lengths[i],
                                         len(batch.tokens[i])) for i in ids])
    assert torch.equal(predictor_pos + 1, target_pos)


def test_shared_prefix_micro_batch_keeps_one_copy_of_each_prefix():
    batch = make_batch(num_groups=3, group_size=3, prompt_len=(5, 12), seed=4, common_start=6)
    ids = [7, 0, 4, 1, 8]  # groups 2, 0, 1, 0, 2: three distinct prompts, in first-seen order
    mb = build_shared_prefix_micro_batch(batch, ids, pad_token_id=0)
    s = mb.shared
    assert len(s.prefix_ids) == 3 and s.prefix_index.tolist() == [0, 1, 2, 1, 0]
    # Each prefix is the longest its samples share: the prompt and their common start
    # (group 1 has one sample here: all of it but its last token).
    for r, i in enumerate(ids):
        u = int(s.prefix_index[r])
        prefix = s.prefix_ids[u][s.prefix_mask[u].bool()].tolist()
        mates = [batch.tokens[j] for j, v in zip(ids, s.prefix_index.tolist()) if v == u]
        assert batch.tokens[i][:len(prefix)] == prefix
        if len(mates) > 1:
            prompt = len(batch.tokens[i]) - batch.response_lengths[i]
            assert len(prefix) > prompt
            assert len({tuple(m[:len(prefix) + 1]) for m in mates}) > 1
        else:
            assert len(prefix) == len(batch.tokens[i]) - 1
    # The packed row holds exactly the suffixes, at their positions in the full sequence.
    suffix_tokens = sum(len(batch.tokens[i]) for i in ids) - sum(
        int(s.prefix_mask[u].sum()) for u in s.prefix_index.tolist())
    assert mb.input_ids.shape == (1, suffix_tokens)
    assert mb.attention_mask.shape == (5, 1, s.width, s.prefix_ids.shape[1] + s.width)
    assert_logits_precede_targets(batch, ids, s)
    flat = build_micro_batch(batch, ids, pad_token_id=0)
    for name in ("targets", "seq_idx", "loss_mask", "rollout_log_probs", "rollout_mask"):
        assert torch.equal(getattr(mb, name), getattr(flat, name)), name


@pytest.mark.parametrize("build", [build_micro_batch, build_shared_prefix_micro_batch])
def test_identical_samples_share_a_row_and_keep_their_own_loss_fields(build):
    batch = with_repeats(make_batch(num_groups=2, group_size=4, prompt_len=(5, 12), seed=4,
                                    common_start=3), group_size=4)
    ids = [3, 0, 5, 1, 6, 2, 4, 7]
    distinct, source = distinct_samples(batch, ids)
    # Group 0 is samples 0-3 (0, 1, 3 alike), group 1 samples 4-7 (4, 5, 7 alike).
    assert distinct == [3, 5, 6, 2] and source == [0, 0, 1, 0, 2, 3, 1, 1]
    each = build(batch, ids, pad_token_id=0)
    once = build(batch, ids, pad_token_id=0, dedupe=True)
    for name in ("targets", "seq_idx", "loss_mask", "rollout_log_probs", "rollout_mask"):
        assert torch.equal(getattr(once, name), getattr(each, name)), name
    if build is build_micro_batch:
        assert once.input_ids.shape[0] == 4 and each.input_ids.shape[0] == 8
        assert torch.equal(once.input_ids[once.row_idx, once.col_idx + 1], once.targets)
        return
    s = once.shared
    assert s.rows == 4 and each.shared.rows == 8
    prefix_tokens = s.prefix_mask.sum(1)[s.prefix_index]
    suffix_tokens = sum(len(batch.tokens[i]) for i in distinct) - prefix_tokens.sum()
    assert once.input_ids.shape[1] == suffix_tokens
    assert_logits_precede_targets(batch, ids, s)


def test_shared_prefix_attention_mask_sees_prefix_then_own_suffix():
    batch = make_batch(num_groups=1, group_size=3, prompt_len=(4, 4), response_len=(3, 6),
                       seed=3)
    mb = build_shared_prefix_micro_batch(batch, [0, 1, 2], pad_token_id=0)
    s, mask = mb.shared, mb.attention_mask[:, 0]
    prefix_len = int(s.prefix_mask[0].sum())
    for r in range(3):
        n = len(batch.tokens[r]) - prefix_len
        assert mask[r, :, :prefix_len].all() and not mask[r, :, prefix_len:s.prefix_ids.shape[1]].any()
        own = mask[r, :n, s.prefix_ids.shape[1]:]
        assert torch.equal(own, torch.ones(n, s.width, dtype=torch.bool).tril()[:, :s.width]
                           & (torch.arange(s.width) < n))


def test_check_batch_names_the_bad_sample():
    batch = make_batch(num_groups=1, group_size=2)
    batch.loss_masks[1] = batch.loss_masks[1][:-1]
    with pytest.raises(ValueError, match="sample 1"):
        check_batch(batch)


def test_lr_schedules():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=12)
    assert [lr_at(s, schedule="constant", **kw) for s in (0, 1, 2, 11)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_at(7, schedule="linear", **kw) == pytest.approx(0.55)
    cosine_mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))
    assert lr_at(7, schedule="cosine", **kw) == pytest.approx(cosine_mid)
    assert lr_at(12, schedule="cosine", **kw) == pytest.approx(0.1)


def test_samples_may_lack_rollout_log_probs():
    batch = make_batch(num_groups=1, group_size=2, seed=4)
    batch.rollout_log_probs[0] = []
    check_batch(batch)
    mb = build_micro_batch(batch, [0, 1], pad_token_id=0)
    r0 = batch.response_lengths[0]
    assert mb.rollout_mask.tolist() == [0.0] * r0 + [1.0] * batch.response_lengths[1]
    assert step_norms(batch, range(2)).num_rollout_tokens == sum(batch.loss_masks[1])
