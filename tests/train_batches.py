"""Test helpers for the training side: a config, a RolloutBatch-shaped batch, and checks
shared by the backends' tests.

The real RolloutBatch lives in rollout/sample.py; training accepts any object with its
fields, so tests build this small stand-in instead of depending on the rollout package.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

from config import build_config


def Batch(tokens, response_lengths, loss_masks, rollout_log_probs, rewards, group_ids):
    """A batch object: a SimpleNamespace pickles by value, so Ray workers need no import
    of this test module to read it."""
    return SimpleNamespace(tokens=tokens, response_lengths=response_lengths,
                           loss_masks=loss_masks, rollout_log_probs=rollout_log_probs,
                           rewards=rewards, group_ids=group_ids, weight_versions=[],
                           statuses=[], metrics={})


def make_batch(*, num_groups: int = 4, group_size: int = 4, prompt_len: tuple[int, int] = (10, 20),
               response_len: tuple[int, int] = (5, 30), vocab: int = 400, seed: int = 0,
               env_tokens: bool = True, common_start: int = 0) -> SimpleNamespace:
    """``common_start``: a group's responses begin with the same tokens, up to this many
    (as when a group's first turn is the same)."""
    rng = random.Random(seed)
    b = Batch([], [], [], [], [], [])
    for g in range(num_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        start = [rng.randrange(vocab) for _ in range(common_start)]
        for _ in range(group_size):
            r = rng.randint(*response_len)
            own = [rng.randrange(vocab) for _ in range(r)]
            b.tokens.append(prompt + start[:r - 1] + own[len(start[:r - 1]):])
            b.response_lengths.append(r)
            mask = [1] * r
            if env_tokens and r > 6:  # a few environment tokens in the middle
                mask[2:4] = [0, 0]
            b.loss_masks.append(mask)
            b.rollout_log_probs.append([-6.0 + rng.random() * 0.1 if m else 0.0 for m in mask])
            b.rewards.append(float(rng.random() < 0.5))
            b.group_ids.append(g)
            b.weight_versions.append(0)
            b.statuses.append("completed")
    return b


def with_repeats(batch, *, group_size: int):
    """``batch`` with samples 1 and 3 of each group repeating sample 0's tokens (as a
    confident policy's do); each keeps its own engine log-probs and reward."""
    for first in range(0, len(batch.tokens), group_size):
        for i in (first + 1, first + 3):
            batch.tokens[i] = list(batch.tokens[first])
            batch.response_lengths[i] = batch.response_lengths[first]
            batch.loss_masks[i] = list(batch.loss_masks[first])
            # Engine log-probs of their own, one copy's far enough from the policy's for
            # a sequence-level correction to drop it.
            batch.rollout_log_probs[i] = [p - 0.15 * (i - first)
                                          for p in batch.rollout_log_probs[first]]
    return batch


def make_config(**overrides):
    """A CPU config; overrides as {"train": {...}, "algo": {...}}."""
    cache = os.environ.get("HOMEGYM_CACHE")
    base = {"cluster": {"device": "cpu"}, "rollout": {"num_engines": 1, "rollout_batch_size": 4,
                                                       "n_samples_per_prompt": 4},
            "train": {"lr": 1e-3, "ranks_per_node": 1},
            "model": {"cache_dir": os.path.join(cache, "models") if cache else None}}
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return build_config(base)


def exported_params(group) -> dict:
    """A training group's weights as exported for the engines: {HF name: tensor}."""
    return {n: t for bucket in group.named_weight_buckets(1 << 20) for n, t in bucket}


def record_gradients(group) -> None:
    """Make every FSDP rank keep, at each optimizer step from now on, the full gradient
    the optimizer is about to apply (after clipping): what a train step computed, before
    Adam turns it into an update. ``recorded_gradients`` returns them."""
    def install(actor):
        backend = actor.backend
        backend.recorded_gradients = []

        def hook(optimizer, args, kwargs):
            # FSDP re-registers its parameters on first use: name them at step time.
            names = {id(p): n for n, p in backend.model.named_parameters()}
            grads = {}
            for param_group in optimizer.param_groups:
                for p in param_group["params"]:
                    if p.grad is not None:  # full_tensor() is collective: same order on all ranks
                        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        grads[names[id(p)]] = g.detach().clone()
            backend.recorded_gradients.append(grads)

        backend.optimizer.register_step_pre_hook(hook)

    import ray

    ray.get([a.__ray_call__.remote(install) for a in group.actors])


def recorded_gradients(group) -> list[dict]:
    """Rank 0's gradients per optimizer step since ``record_gradients``: [{name: tensor}]."""
    import ray

    return ray.get(group.actors[0].__ray_call__.remote(
        lambda actor: actor.backend.recorded_gradients))


def assert_gradients_close(got: list[dict], expected: list[dict], *, rtol: float) -> None:
    """Each optimizer step's gradient, tensor by tensor: ||got - expected|| <= rtol
    ||expected|| (a norm, not elementwise: an element that cancels to ~0 has no relative
    precision)."""
    import torch

    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        assert sorted(g) == sorted(e)
        for name, ref in e.items():
            err = float((g[name] - ref).norm())
            assert err <= rtol * float(ref.norm()), \
                f"step {step} {name}: |diff| {err:.3g} > {rtol} x |grad| {float(ref.norm()):.3g}"


def assert_save_load_round_trip(group, batch, ckpt_dir: str) -> None:
    """Save, step, load: the weights come back exactly, and the same step from the
    restored state lands on the same weights (Adam moments, step counts and the LR
    schedule position came back too)."""
    import torch

    group.train_step(batch)  # optimizer state is non-trivial from here on
    group.save(ckpt_dir)
    saved = exported_params(group)
    group.train_step(batch)
    after_first = exported_params(group)
    group.load(ckpt_dir)
    assert all(torch.equal(saved[n], t) for n, t in exported_params(group).items())
    group.train_step(batch)
    for name, tensor in exported_params(group).items():
        assert torch.equal(after_first[name], tensor), name


def assert_a_fresh_checkpoint_leaves_adams_first_update_whole(group, batch, ckpt_dir: str) -> None:
    """Saved before any optimizer step, the optimizer stays fresh, and so does a group that
    loads that checkpoint: Adam's first update moves an element by lr * |g| / (|g| + eps),
    i.e. ~lr, where an optimizer given a zero-gradient step first (its step count 1, as
    torch's ``get_state_dict`` does to a stateless one) moves it ~0.74 lr (bias
    correction). ``group`` must not have stepped; ``batch`` must fit one optimizer step."""
    import torch

    def first_update() -> tuple[dict, float]:
        before = exported_params(group)
        metrics = group.train_step(batch)
        assert metrics["train/optimizer_steps"] == 1
        after = exported_params(group)
        steps = torch.cat([(after[n] - before[n]).abs().flatten() for n in before])
        # The median over elements that moved: ~lr, except where the gradient is ~0 (a
        # padding row of the embedding, say).
        return after, float(steps[steps > 0].median()) / metrics["train/lr"]

    group.save(ckpt_dir)
    stepped, ratio = first_update()
    assert ratio > 0.95, ratio
    group.load(ckpt_dir)
    again, ratio = first_update()
    assert ratio > 0.95, ratio
    for name in stepped:
        torch.testing.assert_close(again[name], stepped[name], atol=0, rtol=0, msg=name)
