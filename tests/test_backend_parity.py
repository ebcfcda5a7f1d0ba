"""The train and SFT steps of both backends (one shared loop, ``rl_step.StepLoop``, over
each backend's hooks) compute the same thing: FSDP and Megatron agree with each other,
and their first step's loss and gradient norm equal plain autograd of the objective over
the whole batch at once (no micro-batches, no ranks).

Each backend runs one rank in its own child process (Megatron's cpu_shim must not touch
the pytest process).
"""

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from train_batches import make_batch, make_config, with_repeats
from config.derived import total_optimizer_steps
from trainer.driver import components

TESTS = Path(__file__).resolve().parent
LR = 1e-3
# Several micro-batches per step (max_tokens), a reference model (kl_coef), an entropy
# term, a per-sequence aggregation (normalised by the step's global sample count), a
# sequence-level rollout correction that drops some samples, and an LR decaying over
# total_optimizer_steps = 3.
TRAIN = {"lr": LR, "min_lr": 0.0, "max_tokens_per_micro_batch": 96, "num_steps": 3,
         "lr_schedule": "cosine"}
ALGO = {"loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01, "kl_coef": 0.05,
        "rollout_correction": "geo_mask", "correction_low": 0.8, "correction_high": 1.25}


def _batch():
    # Repeated samples run once in both backends (train.dedupe_samples); plain autograd
    # runs each.
    return with_repeats(make_batch(num_groups=2, group_size=4, seed=3), group_size=4)


def _export(b) -> dict:
    return {n: t for bucket in b.named_weight_buckets(1 << 20) for n, t in bucket}


def _steps_child(backend: str, out: str) -> None:
    """Child: one rank trains RL, SFT, RL on the same batch; saves metrics and the
    exported weights before each step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if backend == "megatron":
        from trainer.training.backends.megatron.backend import MegatronBackend as Backend
    else:
        from trainer.training.backends.fsdp import FSDPBackend as Backend
    b = Backend()
    b.init(rank=0, world_size=1, **components.backend_args(make_config(train={"backend": backend,
                                                                              **TRAIN}, algo=ALGO)))
    batch = _batch()
    res = {"w0": _export(b), "rl1": b.train_step(batch), "w1": _export(b)}
    res["sft"] = b.sft_step(batch)
    res["rl2"] = b.train_step(batch)
    res["w2"] = _export(b)
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("parity")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]),
               OMP_NUM_THREADS="1")
    procs = {}
    for backend in ("fsdp", "megatron"):
        code = f"import test_backend_parity as t; t._steps_child({backend!r}, {str(tmp / backend)!r})"
        procs[backend] = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True)
    for backend, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{backend}:\n{output[-6000:]}"
    return {k: torch.load(tmp / k, weights_only=False) for k in procs}


def _plain_step(weights: dict, batch, *, sft: bool) -> tuple[dict, float]:
    """Metrics and gradient norm of the objective over the whole batch as one piece, by
    plain autograd on a transformers model holding ``weights`` (HF names)."""
    from transformers import AutoModelForCausalLM

    from rollout.models import resolve_model_path
    from trainer.training.algo.advantages import sequence_advantages
    from trainer.training.algo.losses import entropy_from_logits, token_log_probs
    from trainer.training.algo.mismatch import RatioSketch, merge_sketches, ratio_metrics
    from trainer.training.algo.objective import TokenInputs, policy_objective, sft_objective
    from trainer.training.backends.batching import step_norms

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen3"),
                                                 dtype=torch.float32, attn_implementation="eager")
    loaded = model.load_state_dict(weights, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied
    model.train()
    logits, targets = [], []
    for toks, r in zip(batch.tokens, batch.response_lengths):
        ids = torch.tensor([toks])
        logits.append(model(input_ids=ids).logits[0, -r - 1:-1].float())
        targets.append(ids[0, -r:])
    logits, targets = torch.cat(logits), torch.cat(targets)
    logp = token_log_probs(logits, targets)
    mask = torch.tensor([m for ms in batch.loss_masks for m in ms], dtype=torch.float32)
    seq_idx = torch.cat([torch.full((r,), i) for i, r in enumerate(batch.response_lengths)])
    norms = step_norms(batch, range(len(batch.tokens)))
    algo = make_config(algo=ALGO).algo
    if sft:
        loss, metrics = sft_objective(logp, mask, norms)
    else:
        adv = sequence_advantages(algo.advantage_estimator, torch.tensor(batch.rewards),
                                  torch.tensor(batch.group_ids))
        inputs = TokenInputs(
            loss_mask=mask, seq_idx=seq_idx, num_seqs=len(batch.tokens), advantages=adv[seq_idx],
            old_log_probs=None,
            rollout_log_probs=torch.tensor([x for lps in batch.rollout_log_probs for x in lps]),
            rollout_mask=torch.ones_like(mask),
            ref_log_probs=logp.detach())  # the reference is the initial policy
        ratios = RatioSketch()
        loss, metrics = policy_objective(algo, inputs, logp, entropy_from_logits(logits), norms,
                                         ratios)
        metrics.update(ratio_metrics(merge_sketches([ratios.sketch()])))
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()
                         if p.grad is not None))
    return {k: float(v) for k, v in metrics.items()}, norm


def test_total_optimizer_steps_counts_the_steps_of_every_rollout():
    rollout = SimpleNamespace(rollout_batch_size=4, n_samples_per_prompt=8)
    assert total_optimizer_steps(rollout, SimpleNamespace(num_steps=5, global_batch_size=None)) == 5
    assert total_optimizer_steps(rollout, SimpleNamespace(num_steps=5, global_batch_size=8)) == 20
    assert total_optimizer_steps(rollout, SimpleNamespace(num_steps=0, global_batch_size=8)) == 1


@pytest.mark.slow
def test_fsdp_and_megatron_steps_equal_plain_autograd(results):
    fsdp, mega = results["fsdp"], results["megatron"]
    batch = _batch()
    for step in ("rl1", "sft", "rl2"):
        f = {k: v for k, v in fsdp[step].items() if not k.startswith("perf/")}
        m = {k: v for k, v in mega[step].items() if not k.startswith("perf/")}
        assert sorted(f) == sorted(m), step
        for key in f:
            assert f[key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), (step, key)
    # The LR schedule: cosine from LR to 0 over total_optimizer_steps=3 (step 1: 1/3 of it).
    assert [fsdp[s]["train/lr"] for s in ("rl1", "rl2")] == [LR, LR * 0.75]
    assert fsdp["sft"]["train/lr"] == make_config().warmup.lr
    # Both start from the checkpoint; after 3 optimizer steps they still agree (Adam
    # amplifies rounding of near-zero gradients: a tenth of an update per step).
    for w in ("w0", "w2"):
        assert fsdp[w].keys() == mega[w].keys()
        for name, t in fsdp[w].items():
            torch.testing.assert_close(mega[w][name], t, atol=0.1 * LR * 3, rtol=0, msg=name)

    plain, norm = _plain_step(fsdp["w0"], batch, sft=False)
    assert 0 < plain["mismatch/seq_masked_frac"] < 1  # the correction dropped some samples
    mismatch = [k for k in plain if k.startswith("mismatch/")]
    assert "mismatch/token_ratio_p99" in mismatch and "mismatch/seq_ratio_p1" in mismatch
    for backend in (fsdp, mega):
        for key in ("train/pg_loss", "train/loss", "train/entropy", "train/kl",
                    "train/ppo_kl", *mismatch):
            assert backend["rl1"][key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
        assert backend["rl1"]["train/grad_norm"] == pytest.approx(norm, rel=1e-4)
    plain, norm = _plain_step(fsdp["w1"], batch, sft=True)
    for backend in (fsdp, mega):
        assert backend["sft"]["train/sft_loss"] == pytest.approx(plain["train/sft_loss"], rel=1e-5)
        assert backend["sft"]["train/grad_norm"] == pytest.approx(norm, rel=1e-4)
