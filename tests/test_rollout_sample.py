"""Sample layout invariants and RolloutBatch assembly."""

import pytest

from rollout import RolloutBatch, Sample


def test_append_keeps_tokens_mask_logprobs_aligned():
    s = Sample(prompt="p", tokens=[1, 2, 3])
    s.set_prompt(s.tokens)
    s.append([10, 11], trainable=True, log_probs=[-0.5, -0.25], text="ab")
    s.append([20, 21, 22], trainable=False, text="env")
    s.append([30], trainable=True, log_probs=[-1.0])
    assert s.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 30]
    assert s.prompt_length == 3 and s.response_length == 6
    assert s.response_tokens == [10, 11, 20, 21, 22, 30]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    s.check()


def test_append_rejects_misaligned_logprobs():
    s = Sample(tokens=[1])
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        s.append([1, 2], trainable=True, log_probs=[0.0])


def test_check_catches_user_code_drift():
    s = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1])
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        s.check()


def test_status_is_a_string_enum_with_slime_names():
    assert Sample.Status.TRUNCATED == "truncated"
    assert {m.name for m in Sample.Status} == {"PENDING", "COMPLETED", "TRUNCATED", "ABORTED",
                                              "FAILED"}
    assert Sample().status is Sample.Status.PENDING


def test_rollout_batch_from_samples():
    a = Sample(tokens=[1, 2, 9], response_length=1, loss_mask=[1], rollout_log_probs=[-0.1],
               reward=1.5, group_index=0, weight_version=3, status=Sample.Status.COMPLETED)
    # slime-style user code: no log-probs, reward as a dict
    b = Sample(tokens=[1, 2, 8, 7], response_length=2, loss_mask=[1, 0],
               reward={"reward": -1.0, "acc": 0}, group_index=0,
               status=Sample.Status.TRUNCATED)
    batch = RolloutBatch.from_samples([a, b], {"x": 1.0})
    assert len(batch) == 2
    assert batch.tokens == [[1, 2, 9], [1, 2, 8, 7]]
    assert batch.response_lengths == [1, 2]
    assert batch.loss_masks == [[1], [1, 0]]
    assert batch.rollout_log_probs == [[-0.1], []]
    assert batch.rewards == [1.5, -1.0]
    assert batch.group_ids == [0, 0]
    assert batch.weight_versions == [3, -1]
    assert batch.statuses == ["completed", "truncated"]
    assert batch.metrics == {"x": 1.0}


def test_rollout_batch_rejects_missing_reward():
    with pytest.raises(ValueError, match="no reward"):
        RolloutBatch.from_samples([Sample(tokens=[1], index=7)])


def test_select_cuts_every_per_sample_field_in_the_given_order():
    from dataclasses import fields

    samples = []
    for i in range(4):
        s = Sample(tokens=[i, i + 10], response_length=1, loss_mask=[1],
                   rollout_log_probs=[-0.1 * i], reward=float(i), label=f"l{i}",
                   status=Sample.Status.COMPLETED, group_index=i // 2, weight_version=i)
        samples.append(s)
    batch = RolloutBatch.from_samples(samples, {"rollout/raw_reward": 1.5})
    cut = batch.select([3, 0])
    for f in fields(RolloutBatch):
        if f.name != "metrics":
            whole = getattr(batch, f.name)
            assert getattr(cut, f.name) == [whole[3], whole[0]], f.name
    assert cut.metrics == batch.metrics and cut.metrics is not batch.metrics
    assert len(batch.select([])) == 0 and batch.select(range(4)) == batch
