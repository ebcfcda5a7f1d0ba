"""FSDP2 training ranks as real Ray actors over gloo: equivalence, learning, checkpoints, export."""

import contextlib
import os
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

from train_batches import (assert_a_fresh_checkpoint_leaves_adams_first_update_whole,
                           assert_gradients_close, assert_save_load_round_trip, exported_params,
                           make_batch, make_config, record_gradients, recorded_gradients,
                           with_repeats)
from trainer.driver import components
from trainer.training.train_group import TrainGroup

pytestmark = pytest.mark.slow


def _surrogate(group: TrainGroup, batch) -> float:
    """Sum over samples of advantage x mean response log-prob (what the step increases)."""
    from trainer.training.algo.advantages import grpo_advantages

    adv = grpo_advantages(torch.tensor(batch.rewards), torch.tensor(batch.group_ids))
    lps = group.log_probs(batch)
    return float(sum(a * lp.mean() for a, lp in zip(adv, lps)))


@pytest.fixture(scope="module")
def group2(ray_local, tiny_model_path):
    config = make_config(train={"ranks_per_node": 2, "lr": 1e-3})
    placement = components.placement(config)
    group = components.train_group(config, placement)
    yield group
    group.shutdown()
    placement.shutdown()


def test_export_buckets_match_hf_checkpoint(group2, tiny_model_path):
    bucket_bytes = 200_000
    buckets = group2.named_weight_buckets(bucket_bytes)
    assert len(buckets) > 1
    for bucket in buckets:  # a bucket exceeds the budget only when one tensor does
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) <= bucket_bytes or len(bucket) == 1
    exported = {n: t for bucket in buckets for n, t in bucket}
    streamed = list(group2.iter_weight_buckets(bucket_bytes))
    assert [[n for n, _ in b] for b in streamed] == [[n for n, _ in b] for b in buckets]
    reference = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


def test_buckets_gathered_in_the_engine_dtype_are_the_full_tensors_cast(group2):
    """Weight sync gathers shards already cast to the engines' dtype: bitwise the fp32
    full tensors cast, under the same names, on every rank."""
    import ray

    def gathered(actor_self, dtype):
        return {n: t for b in actor_self.backend.named_weight_buckets(1 << 20, dtype=dtype)
                for n, t in b}

    def on_every_rank(dtype):  # collective: every rank drains its iterator
        return ray.get([a.__ray_call__.remote(gathered, dtype) for a in group2.actors])

    full = on_every_rank(None)
    cast = on_every_rank(torch.bfloat16)
    assert sorted(cast[0]) == sorted(full[0])
    for rank_full, rank_cast in zip(full, cast):
        for name, tensor in rank_full.items():
            assert tensor.dtype == torch.float32, name
            assert rank_cast[name].dtype == torch.bfloat16, name
            assert torch.equal(rank_cast[name], tensor.to(torch.bfloat16)), name


# Two optimizer steps (old log-probs from a forward) and small micro-batches, so the ranks
# run several micro-batches, some of them empty padding ones.
PARITY_TRAIN = {"global_batch_size": 8, "max_tokens_per_micro_batch": 96, "lr": 1e-3}


@contextlib.contextmanager
def built_groups(configs: dict, tmp_path_factory):
    """{key: (group, a checkpoint of it saved as built)} for {key: config}; shut down on exit."""
    groups = {}
    try:
        for key, config in configs.items():
            group = components.train_group(config)
            groups[key] = group, str(tmp_path_factory.mktemp(f"built-{key}"))
            group.save(groups[key][1])
        yield groups
    finally:
        for group, _ in groups.values():
            group.shutdown()


@pytest.fixture(scope="module")
def one_and_two_ranks(ray_local, tiny_model_path, tmp_path_factory):
    """{1: (group, built), 2: (group, built)}: a one-rank and a two-rank group with
    ``PARITY_TRAIN``, each saved as built. They start with a KL term, so that every algo
    set on them can have one (``set_algo`` cannot add the reference model)."""
    configs = {ranks: make_config(train={**PARITY_TRAIN, "ranks_per_node": ranks},
                                  algo={"kl_coef": 0.05}) for ranks in (1, 2)}
    with built_groups(configs, tmp_path_factory) as groups:
        yield groups


@pytest.mark.parametrize("algo", [
    {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.05, "entropy_coef": 0.01},
    # Token-level advantages whitened over both ranks, KL in the reward, GSPO, ICEPOP with
    # bounds that mask some tokens.
    {"advantage_estimator": "reinforce_pp", "policy_loss": "gspo", "kl_coef": 0.05,
     "kl_type": "k3", "rollout_correction": "icepop", "correction_low": 0.9,
     "correction_high": 1.1, "loss_agg": "seq_mean_token_sum_norm"},
], ids=["ppo-kl-entropy", "reinforce_pp-gspo-icepop"])
def test_two_ranks_equal_one_rank(one_and_two_ranks, algo):
    batch = make_batch(num_groups=4, group_size=4, seed=3)
    algo_config = make_config(train=PARITY_TRAIN, algo=algo).algo
    results = {}
    for ranks, (group, built) in one_and_two_ranks.items():
        group.load(built)  # as built, the optimizer fresh
        group.set_algo(algo_config)
        metrics = group.train_step(batch)
        results[ranks] = (metrics, exported_params(group))
    (m1, p1), (m2, p2) = results[1], results[2]
    # The mismatch metrics: sums all-reduced, quantiles and maxima from both ranks' sketches.
    mismatch = [k for k in m1 if k.startswith("mismatch/")]
    assert sorted(mismatch) == sorted(k for k in m2 if k.startswith("mismatch/"))
    assert {"mismatch/token_ratio_p1", "mismatch/seq_ratio_max",
            "mismatch/logprob_abs_diff_max"} <= set(mismatch)
    if "rollout_correction" in algo:
        assert 0 < m1["mismatch/token_masked_frac"] < 1
    for key in ("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm", "train/ppo_kl",
                *mismatch):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["train/optimizer_steps"] == 2
    # grad_norm above pins the gradient scale (Adam's update is scale-invariant). Adam
    # divides by sqrt(v) ~ |g|, so the few elements with near-zero gradients amplify
    # summation-order rounding: allow 5% of one update (lr), far below a wrong update.
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], atol=0.05 * PARITY_TRAIN["lr"], rtol=0,
                                   msg=name)


@pytest.fixture(scope="module")
def one_rank(ray_local, tiny_model_path, tmp_path_factory):
    """``one_rank(share_prompts)``: a one-rank group (lr 1e-3, an entropy bonus) per setting,
    saved as built; each call hands it back as built, by loading that checkpoint (the
    optimizer fresh again: the checkpoint test below)."""
    configs = {share: make_config(train={"share_prompts": share, "lr": 1e-3},
                                  algo={"entropy_coef": 0.01}) for share in (False, True)}
    with built_groups(configs, tmp_path_factory) as groups:
        def get(share: bool) -> TrainGroup:
            group, built = groups[share]
            group.load(built)
            return group

        yield get


def test_shared_prefixes_equal_per_sample_rows(one_rank):
    """train.share_prompts (a group's common prefix -- prompt and shared first tokens --
    runs once, its KV expanded to the packed suffixes) computes what one sample per row
    does: log-probs, metrics, the update."""
    batch = make_batch(num_groups=3, group_size=4, prompt_len=(8, 20), seed=6, common_start=5)
    results = {}
    for share in (False, True):
        group = one_rank(share)
        log_probs = group.log_probs(batch)
        metrics = group.train_step(batch)
        results[share] = (log_probs, metrics, exported_params(group))
    (lp0, m0, p0), (lp1, m1, p1) = results[False], results[True]
    for a, b in zip(lp0, lp1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        assert m0[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    for name in p0:  # see test_two_ranks_equal_one_rank on the tolerance
        torch.testing.assert_close(p0[name], p1[name], atol=0.05 * 1e-3, rtol=0, msg=name)


# How far the same step's results move when only the order of its float32 sums changes,
# measured on an AMD EPYC (AVX2) on the zero-advantage batch below: 1 vs 2 ranks and
# micro-batch budgets of 64/96/512 tokens. Largest relative spread: 1.9e-6 of a weight
# tensor's gradient norm, 1.3e-6 of the grad norm, 5e-7 of pg_loss. 5x that.
REORDER_RTOL = 1e-5


def test_zero_advantage_samples_are_skipped_without_changing_the_update(ray_local, tiny_model_path):
    """Groups whose rewards are all equal (zero GRPO advantage, no KL/entropy) run no
    forward/backward, and the gradient, loss and grad norm are those of training them.

    The gradient is compared, not the weights after the step: Adam's first step is
    ~lr * sign(g), so an element whose gradient is ~0 moves by up to 2 lr on summation
    rounding alone (5e-5 = 0.05 lr seen between two micro-batch sizes of one config)."""
    batch = make_batch(num_groups=4, group_size=4, seed=11)
    for g in (1, 3):  # two groups without signal; one of them at a reward that float32
        # means do not reproduce exactly (1.7)
        for i in range(4 * g, 4 * g + 4):
            batch.rewards[i] = 1.7 if g == 1 else 0.0
    results = {}
    for skip in (False, True):
        group = components.train_group(make_config(train={"ranks_per_node": 2,
                                                          "skip_zero_advantage": skip,
                                              "max_tokens_per_micro_batch": 96}))
        try:
            record_gradients(group)
            metrics = group.train_step(batch)
            results[skip] = (metrics, recorded_gradients(group))
        finally:
            group.shutdown()
    (m0, g0), (m1, g1) = results[False], results[True]
    assert (m0["train/skipped_samples"], m1["train/skipped_samples"]) == (0, 8)
    assert m0["train/computed_sample_frac"] == pytest.approx(1.0)
    assert m1["train/computed_sample_frac"] == pytest.approx(0.5)
    for key in ("train/pg_loss", "train/grad_norm"):
        assert m0[key] == pytest.approx(m1[key], rel=REORDER_RTOL), key
    assert_gradients_close(g1, g0, rtol=REORDER_RTOL)
    assert m1["train/grad_norm"] > 0  # the other two groups still trained


def test_identical_samples_run_once_without_changing_the_update(ray_local, tiny_model_path):
    """train.dedupe_samples: samples that repeat another's tokens ride on its forward and
    backward (in the shared-prefix layout, the default); log-probs, loss, grad norm and
    gradient are those of running each, to the float noise of reordered sums."""
    batch = with_repeats(make_batch(num_groups=3, group_size=4, seed=12, common_start=4),
                         group_size=4)
    results = {}
    for dedupe in (False, True):
        group = components.train_group(make_config(train={"dedupe_samples": dedupe,
                                                          "lr": 1e-3}))
        try:
            record_gradients(group)
            log_probs = group.log_probs(batch)
            metrics = group.train_step(batch)
            results[dedupe] = (log_probs, metrics, recorded_gradients(group))
        finally:
            group.shutdown()
    (lp0, m0, g0), (lp1, m1, g1) = results[False], results[True]
    # Samples 1 and 3 of each group of 4 repeat sample 0: half of the samples that train
    # run (groups without signal are skipped whole).
    ran = 1 - m0["train/skipped_samples"] / len(batch.tokens)
    assert m0["train/skipped_samples"] == m1["train/skipped_samples"] < len(batch.tokens)
    assert m0["train/computed_sample_frac"] == pytest.approx(ran)
    assert m1["train/computed_sample_frac"] == pytest.approx(ran / 2)
    for a, b in zip(lp0, lp1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
        assert m0[key] == pytest.approx(m1[key], rel=REORDER_RTOL), key
    assert_gradients_close(g1, g0, rtol=REORDER_RTOL)


def test_a_checkpoint_before_the_first_step_leaves_adams_first_update_whole(one_rank, tmp_path):
    """torch's get_state_dict, which saving calls, initialises a stateless optimizer with a
    zero-gradient step: saved fresh, the optimizer must stay fresh (train_batches)."""
    assert_a_fresh_checkpoint_leaves_adams_first_update_whole(
        one_rank(True), make_batch(num_groups=4, group_size=4, seed=5), str(tmp_path / "fresh"))


def test_a_checkpoint_of_the_per_tensor_adamw_loads_into_the_fused_one(one_rank, tmp_path):
    """A checkpoint's optimizer param groups carry the implementation flags they were saved
    with; one from an optimizer on torch's per-tensor loop (as homegym's were before it
    chose the fused kernel) still trains on the fused one once loaded."""
    group = one_rank(False)
    actor = group.actors[0]

    def flags(self) -> list:
        return [(g["fused"], g["foreach"]) for g in self.backend.optimizer.param_groups]

    def per_tensor(self) -> None:
        for g in self.backend.optimizer.param_groups:
            g.update(fused=None, foreach=None)

    assert set(ray.get(actor.__ray_call__.remote(flags))) == {(True, None)}
    ray.get(actor.__ray_call__.remote(per_tensor))
    group.train_step(make_batch(num_groups=4, group_size=4, seed=5))
    group.save(str(tmp_path / "per-tensor"))
    group.load(str(tmp_path / "per-tensor"))
    assert set(ray.get(actor.__ray_call__.remote(flags))) == {(True, None)}


def test_train_step_improves_objective_and_sft_lowers_nll(group2):
    batch = make_batch(num_groups=4, group_size=4, seed=5)
    before = _surrogate(group2, batch)
    group2.offload()  # on CPU a documented no-op; the round trip must leave training intact
    group2.onload()
    metrics = group2.train_step(batch)
    assert _surrogate(group2, batch) > before
    for key in ("train/pg_loss", "train/pg_clipfrac", "train/entropy", "train/grad_norm",
                "train/lr", "train/ppo_kl", "mismatch/logprob_abs_diff", "perf/train_time"):
        assert key in metrics, key
    losses = [group2.sft_step(batch)["train/sft_loss"] for _ in range(3)]
    assert losses[2] < losses[0]


def test_save_load_restores_params_and_optimizer(group2, tmp_path):
    assert_save_load_round_trip(group2, make_batch(num_groups=4, group_size=4, seed=7),
                                str(tmp_path / "ckpt"))


def test_shutdown_leaves_no_shared_memory_behind(group2):
    """Two ranks on one host gather weights through /dev/shm and stage pushes there; a rank
    killed while such a buffer is mapped leaves the file there for good (it is memory), so
    shutdown frees both first. (The module's group, shut down here: this test comes last.)"""
    group = group2
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in group.actors])
    group.named_weight_buckets(200_000)

    def stage(actor):  # what a push to the hf engines stages (trainer.weight_sync.push)
        from trainer.weight_sync import push as weights

        weights._STAGING.flatten(0, [("x", torch.ones(1000))])
    ray.get([a.__ray_call__.remote(stage) for a in group.actors])

    def files() -> list[str]:
        return sorted(f for f in os.listdir("/dev/shm")
                      if any(f.startswith(f"torch_{pid}_") for pid in pids))

    assert files(), "the weights were not gathered through shared memory"
    group.shutdown()
    deadline = time.monotonic() + 30
    while files() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert files() == []
