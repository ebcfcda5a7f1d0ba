"""Megatron backend ranks as real Ray actors on CPU (megatron-core + cpu_shim), tiny Qwen3.

Each TrainGroup runs in its own Ray worker processes, so the torch.cuda shims never touch
the pytest process (transformers is not safe to use in a shimmed process).
"""

import os

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from train_batches import exported_params, make_batch, make_config  # noqa: E402
from trainer.driver import components

pytestmark = pytest.mark.slow

# float32 everywhere; TP/PP change only summation order (observed differences ~1e-6).
LOGP_ATOL = 1e-4


def _config(tp=1, pp=1, ranks=None, algo=None, **train):
    ranks = ranks or tp * pp
    return make_config(train={"backend": "megatron", "ranks_per_node": ranks,
                              "tensor_model_parallel_size": tp,
                              "pipeline_model_parallel_size": pp, "lr": 1e-3, **train},
                       algo=algo or {})


def _hf_log_probs(path: str, batch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for toks, r in zip(batch.tokens, batch.response_lengths):
            ids = torch.tensor([toks])
            logits = model(input_ids=ids).logits[0, -r - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -r:, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def batch():
    return make_batch(num_groups=2, group_size=4, seed=3)


@pytest.fixture(scope="module")
def hf_logps(tiny_model_path, batch):
    return _hf_log_probs(tiny_model_path, batch)


PARALLEL_ALGO = {"loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01}
PARALLEL_TRAIN = {"max_tokens_per_micro_batch": 128, "global_batch_size": 4}


def _step_results(group, batch):
    """Log-probs, the export, one train step's metrics and the export after it."""
    lps = group.log_probs(batch)
    exported = exported_params(group)
    metrics = group.train_step(batch)
    return lps, exported, metrics, exported_params(group)


@pytest.fixture(scope="module")
def single_rank_group(ray_local, tiny_model_path, batch, tmp_path_factory):
    """The module's one-rank group and, taken before any test touches it, the single-rank
    reference for the parallel layouts (``_step_results``). The step is then undone by
    loading a checkpoint saved before it (weights, counters, RNG, a fresh optimizer:
    test_megatron_checkpoint), so the tests get the group as built."""
    group = components.train_group(_config(algo=PARALLEL_ALGO, **PARALLEL_TRAIN))
    built = str(tmp_path_factory.mktemp("megatron-built"))
    try:
        group.save(built)
        reference = _step_results(group, batch)
        group.load(built)
        yield group, reference
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def tp1(single_rank_group):
    return single_rank_group[0]


def test_log_probs_equal_hf(tp1, batch, hf_logps):
    """Megatron (fused per-group QKV, qk_layernorm, tied embeddings) == transformers."""
    mg = tp1.log_probs(batch)
    for a, b in zip(mg, hf_logps):
        torch.testing.assert_close(a, b, atol=LOGP_ATOL, rtol=0)


def test_export_round_trips_to_hf_checkpoint(tp1, tiny_model_path):
    bucket_bytes = 200_000
    buckets = tp1.named_weight_buckets(bucket_bytes)
    assert len(buckets) > 1
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= bucket_bytes \
            or len(bucket) == 1
    exported = {n: t for b in buckets for n, t in b}
    reference = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


# How far the two-step train step below moves when only the order of its float32 sums
# changes: the largest difference over five reorderings of the single-rank step (micro-
# batch budgets of 64 and 256 tokens, TP=2, PP=2, DP=2) measured on an AMD EPYC (AVX2),
# times 5. Step 1's gradient differs by rounding only (grad norm: 3e-6 relative), but
# Adam's first update is ~lr * sign(g), so an element whose gradient is ~0 moves by up to
# 2 lr on rounding alone, and step 2's loss, KL and weights inherit that: measured
# |pg_loss| diff 1.3e-6 (of 3.4e-3), |ppo_kl| diff 6.1e-7 (of 6.6e-5), entropy 4.8e-7,
# grad norm (mean of both steps) 9.1e-6, and a weight tensor's update differing by at
# most 1.0e-3 of its norm (an elementwise bound cannot hold: 1.4e-4 = 0.14 lr seen).
STEP_ATOL = {"train/pg_loss": 7e-6, "train/ppo_kl": 3e-6, "train/entropy": 2.5e-6,
             "train/grad_norm": 5e-5}
UPDATE_RTOL = 5e-3


def _parallel_results(batch, tp, pp, ranks):
    group = components.train_group(_config(tp, pp, ranks=ranks, algo=PARALLEL_ALGO,
                                           **PARALLEL_TRAIN))
    try:
        return _step_results(group, batch)
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def single_rank(single_rank_group):
    """The single-rank reference, once for the three layouts below."""
    return single_rank_group[1]


@pytest.mark.parametrize("tp,pp,ranks", [(2, 1, 2), (1, 2, 2), (1, 1, 2)],
                         ids=["tp2", "pp2", "dp2"])
def test_model_parallel_equals_single_rank(single_rank, batch, hf_logps, tp, pp, ranks):
    """TP=2, PP=2 and DP=2 (two Ray actors each) give one rank's log-probs, export and
    train step (two optimizer steps, several micro-batches)."""
    (l1, e1, m1, p1), (l2, e2, m2, p2) = single_rank, _parallel_results(batch, tp, pp, ranks)
    for a, b, h in zip(l1, l2, hf_logps):
        torch.testing.assert_close(b, a, atol=LOGP_ATOL, rtol=0)
        torch.testing.assert_close(b, h, atol=LOGP_ATOL, rtol=0)
    assert sorted(e1) == sorted(e2)
    assert all(torch.equal(e1[n], e2[n]) for n in e1)
    for key, atol in STEP_ATOL.items():
        assert m1[key] == pytest.approx(m2[key], rel=0, abs=atol), key
    assert m1["train/optimizer_steps"] == m2["train/optimizer_steps"] == 2
    # Every sample ran (all distinct, none skipped with an entropy bonus), counted once
    # however many ranks hold a copy of its outputs.
    assert m1["train/computed_sample_frac"] == pytest.approx(1.0)
    assert m2["train/computed_sample_frac"] == pytest.approx(1.0)
    for name in p1:  # the update, as a whole per tensor (see STEP_ATOL)
        update = float((p1[name] - e1[name]).norm())
        diff = float((p2[name] - p1[name]).norm())
        assert diff <= UPDATE_RTOL * update, (name, diff, update)


def test_train_step_decreases_loss_on_fixed_batch(tp1, batch):
    """SFT steps lower the NLL; an RL step raises the advantage-weighted log-likelihood."""
    from trainer.training.algo.advantages import grpo_advantages

    adv = grpo_advantages(torch.tensor(batch.rewards), torch.tensor(batch.group_ids))

    def surrogate():
        return float(sum(a * lp.mean() for a, lp in zip(adv, tp1.log_probs(batch))))

    before = surrogate()
    metrics = tp1.train_step(batch)
    assert surrogate() > before
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm", "train/lr",
                "perf/train_time"):
        assert key in metrics, key
    losses = [tp1.sft_step(batch)["train/sft_loss"] for _ in range(3)]
    assert losses[2] < losses[1] < losses[0]


def test_megatron_trains_through_trainer_main_with_engines_and_weight_sync(tmp_path, tiny_model_path,
                                                                            ray_address):
    """README: `train.backend=megatron` is a full run: `python -m trainer.main` with CPU
    engines, TP=2 ranks, one RL step and its weight sync (read back and checked against
    what was sent by WeightSync), then the hf/ export of the trained weights."""
    from conftest import run_main

    run = run_main(tmp_path, "train.backend=megatron", "train.ranks_per_node=2",
                   "train.tensor_model_parallel_size=2", "train.num_steps=1",
                   "warmup.steps=4", "rollout.num_engines=1", "rollout.rollout_batch_size=2",
                   "rollout.n_samples_per_prompt=4", "eval.before_and_after=false",
                   "train.share_prompts=false", timeout_s=600,
                   ray_address=ray_address)
    steps = [m for m in run.metrics if "rollout/raw_reward" in m]
    assert [m["step"] for m in steps] == [1]
    base = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    # The step's push carried the whole model (float32 bytes of every exported tensor).
    assert steps[0]["perf/weight_sync_bytes"] >= sum(t.numel() * 4 for t in base.values()
                                                     if t.dtype == torch.float32) * 0.9
    trained = load_file(str(run.run_dir / "checkpoints" / "latest" / "hf" / "model.safetensors"))
    assert set(trained) <= set(base)
    assert any(not torch.equal(trained[k], base[k]) for k in trained)
