"""The driver end to end: weight sync round trip, a short real run, resume after a kill.

Everything is real: Ray, the CPU engines behind sglang-router, FSDP2 ranks over gloo,
wandb in offline mode.
"""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

from conftest import REPO, clean_env, compose_config, read_jsonl, run_main
from trainer.driver import components

pytestmark = pytest.mark.slow

# A short run: small warm-up, 2 prompts x 4 samples per step, one sampled eval pass.
# The warm-up's lr is 3x the default so that its 20 steps leave a policy whose groups differ
# in reward. At 1e-3 ~90% of sampled episodes were format errors (-2 each), 7 of 13 steps
# over three runs had no reward signal, and one run (in CI) had none after its first; at
# 3e-3 16 of 16 steps over four runs had one (AMD EPYC).
SHORT = ["warmup.steps=20", "warmup.lr=3e-3", "rollout.rollout_batch_size=2",
         "rollout.n_samples_per_prompt=4", "eval.n_samples_per_prompt=1"]


def main_cmd(*overrides):
    return [sys.executable, "-m", "trainer.main", *SHORT, *overrides]


def test_weight_sync_round_trip(ray_local, tiny_model_path):
    """After a push the engine samples from the trainer's new weights (its log-probs equal
    the trainer's), and a corrupted bucket is refused with the old version kept."""
    from transformers import AutoTokenizer

    from rollout.demos import make_demos
    from rollout.sample import RolloutBatch
    from trainer.weight_sync.push import WeightSyncError, read_back

    config = compose_config("train.ranks_per_node=1", "rollout.num_engines=1")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    engines = components.engine_group(config)
    group = components.train_group(config)
    try:
        sync = components.weight_sync(config, group, engines)
        demos = make_demos(tok, 16, seed=3, **components.rollout_sections(config))
        for s in demos:
            s.reward = 0.0
        demo_batch = RolloutBatch.from_samples(demos)
        for _ in range(3):  # move the weights well away from the engine's copy
            group.sft_step(demo_batch)

        prompt = demos[0].tokens[:demos[0].prompt_length]

        def engine_sample():
            out = requests.post(f"{engines.router_url}/generate", timeout=60, json={
                "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 6}}).json()
            ids = out["output_ids"]
            return ids, torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])

        def trainer_log_probs(ids):
            batch = RolloutBatch(tokens=[prompt + ids], response_lengths=[len(ids)],
                                 loss_masks=[[1] * len(ids)], rollout_log_probs=[[]],
                                 rewards=[0.0], group_ids=[0], weight_versions=[0],
                                 statuses=["completed"], labels=[None])
            return group.log_probs(batch)[0].float()

        ids, before = engine_sample()
        assert (trainer_log_probs(ids) - before).abs().max() > 1e-3  # engine still on old weights

        metrics = sync.push(version=1)
        assert metrics["perf/weight_sync_bytes"] > 0
        assert metrics["perf/weight_sync_checked_tensors"] > 0
        assert engines.weight_versions() == ["1"]
        ids, after = engine_sample()
        assert torch.allclose(trainer_log_probs(ids), after, atol=1e-4)

        # The read-back check compares what the engine holds with what was sent.
        held = group.named_weight_buckets(sync.bucket_bytes)[0]
        norm = dict(held)["model.norm.weight"]
        assert read_back(engines.clients, {"model.norm.weight": norm[:4]}, 1) == 1
        with pytest.raises(WeightSyncError, match="differs from what was pushed"):
            read_back(engines.clients, {"model.norm.weight": norm[:4] + 1e-3}, 1)
        # A push that leaves its checks to the caller reads them back in verify.
        assert "perf/weight_sync_checked_tensors" not in sync.push(version=1, verify=False)
        assert sync.verify(version=1)["perf/weight_sync_checked_tensors"] > 0
        sync.push(version=1, verify=False)
        sync._unchecked["model.norm.weight"] += 1e-3  # as if the engine held other weights
        with pytest.raises(WeightSyncError, match="differs from what was pushed"):
            sync.verify(version=1)
        # A verification that sees an engine on the wrong version fails loudly.
        with pytest.raises(WeightSyncError):
            sync.verify(version=2)
    finally:
        group.shutdown()
        engines.shutdown()


def expected_data_order(config, num_steps):
    """The group labels each step trains on, straight from the data source."""
    from transformers import AutoTokenizer

    from rollout.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(config.model.path))
    data = components.data_source(config, "train", tok)
    return [[data.next_group()[0].label for _ in range(config.rollout.rollout_batch_size)]
            for _ in range(num_steps)]


def test_a_killed_run_resumes_the_same_run_which_learns_and_writes_its_run_dir(tmp_path,
                                                                              tiny_model_path,
                                                                              ray_address):
    """A short run (warm-up, evaluation before and after, a checkpoint every second step)
    is killed whole (SIGKILL to its process group) once step 2's checkpoint is complete, then
    started again with the same command: it resumes the same run (same wandb run, the data
    order continued exactly) and the run as a whole learned something and left a complete
    run directory (checkpoints, evaluation table, curves, config, offline wandb)."""
    out = tmp_path / "out"
    # eval.interval=4: the last step's evaluation is the trained one, not a repeat of it.
    # One engine: nothing here depends on how many there are.
    overrides = ["train.num_steps=4", "train.save_interval=2", "eval.interval=4",
                 "rollout.num_engines=1"]
    run = out / "killed"
    proc = subprocess.Popen(main_cmd(*overrides, "logging.run_name=killed", f"logging.output_dir={out}",
                                     "logging.wandb_mode=offline"),
                            cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    try:
        while not (run / "checkpoints" / "step_000002" / "COMPLETE").exists():
            assert proc.poll() is None, "run ended before step 2's checkpoint"
            assert time.time() < deadline, "no checkpoint of step 2 within 10 minutes"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
        proc.wait()
    wandb_id = (run / "wandb_id.txt").read_text()
    done = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    last = int(done[-1].split("_")[1])
    assert last < 4, "the run finished before it was killed"

    # The first launch had a Ray of its own (killed with it); the resume joins the session's.
    resumed = run_main(tmp_path, *SHORT, *overrides, run_name="killed", ray_address=ray_address,
                       wandb_mode="offline")
    assert f"at step {last}" in resumed.output
    assert (run / "wandb_id.txt").read_text() == wandb_id  # same wandb run, resumed
    rows = [r for r in resumed.metrics if "rollout/raw_reward" in r]  # both launches
    assert [r["step"] for r in rows][-(4 - last):] == list(range(last + 1, 5))
    assert {r["step"] for r in rows} == {1, 2, 3, 4}
    # Identical data order: the last record of each step matches the data source's order.
    order = {r["step"]: r["labels"] for r in read_jsonl(run / "data_order.jsonl")}
    config = compose_config(*SHORT, *overrides)
    assert [order[s] for s in range(1, 5)] == expected_data_order(config, 4)

    # The run as a whole.
    for r in rows:
        assert math.isfinite(r["rollout/raw_reward"]) and r["perf/weight_sync_bytes"] > 0
    # A step whose rewards are all equal has no advantage to train on (skipped); some
    # step after the first must have had a signal, or the comparison below would not
    # involve RL.
    trained = [r for r in rows if "mismatch/logprob_abs_diff" in r]  # samples ran
    assert all(math.isfinite(r["train/pg_loss"]) for r in trained)
    assert {r["step"] for r in trained} & {2, 3, 4}, [r.get("train/skipped_samples") for r in rows]
    # The train/rollout mismatch, every step that trained: fp32 engines and trainer agree
    # to float rounding, and the colocated loop is never stale (resumed steps included).
    for r in trained:
        assert r["mismatch/logprob_abs_diff"] < 1e-4 and r["mismatch/k3_kl"] < 1e-6
        assert 0.999 < r["mismatch/token_ratio_p1"] <= r["mismatch/token_ratio_p99"] < 1.001
        assert r["mismatch/seq_ratio_max"] < 1.01 and r["mismatch/staleness_max"] == 0
    # The console's step line shows the mismatch gap on a step that trained.
    assert "step 4/4" in resumed.output
    resumed_trained = any("mismatch/logprob_abs_diff" in r for r in rows[-(4 - last):])
    assert (" | gap " in resumed.output) == resumed_trained
    ckpts = run / "checkpoints"
    exported = {s: load_file(str(ckpts / f"step_{s:06d}" / "hf" / "model.safetensors"))
                for s in (2, 4)}
    base = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert set(exported[4]) <= set(base)
    # The RL updates themselves moved the policy, not only the warm-up's SFT before them:
    # the export after step 4 differs from the one after step 2 (both past the warm-up).
    assert any(not torch.equal(exported[4][k], exported[2][k]) for k in exported[4])
    assert (ckpts / "latest").resolve().name == "step_000004"
    # The evaluations before (first launch, kept in its checkpoints) and after (second).
    table = (run / "eval_table.md").read_text()
    assert "| base |" in table and "| trained |" in table and "| step_4 |" not in table
    printed = [line for line in resumed.output.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| trained ") for line in printed)
    assert max(len(line) for line in printed) <= 100  # the console's table fits a terminal
    from PIL import Image

    with Image.open(run / "curves.png") as png:  # reward, success, evals per step
        assert png.format == "PNG"
        png.verify()
    assert (run / "config.yaml").exists() and list((run / "wandb").glob("offline-run-*"))


class _Spy:
    """Delegates to a real object and records which of ``names`` were called, in order."""

    def __init__(self, target, names, log):
        self._target, self._names, self._log = target, set(names), log

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if name not in self._names:
            return value

        def call(*args, **kwargs):
            self._log.append((name, args[0] if args else kwargs.get("tags")))
            return value(*args, **kwargs)
        return call


class _ManagerSpy(_Spy):
    """The rollout manager's handle, recording each ``generate_ref.remote`` call."""

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if name not in self._names:
            return value
        log = self._log

        class Method:
            def remote(self, *args, **kwargs):
                log.append((name, args[0] if args else None))
                return value.remote(*args, **kwargs)
        return Method()


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_colocated_run_starts_and_takes_turns_in_order(ray_local, tmp_path, monkeypatch, backend):
    """Colocated start-up and turns (trainer.driver.runtime, trainer.weight_sync.
    engine_updates): the engines release their memory before the ranks are built (checked
    on the engine itself when the ranks start), the ranks offload once built, and the first
    push, the base evaluation and the first rollout all run with the ranks offloaded; each
    step releases the engines, onloads, trains, offloads, then resumes weights, pushes,
    resumes the KV cache (and the warm-up takes the same turn). Real runtime (Ray, CPU
    engine, FSDP or Megatron ranks on CPU); the engine group, train group, weight sync and
    manager are wrapped to record their calls, and Megatron's ranks are asked whether their
    state is really offloaded at each recorded moment."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    from rollout.engines.group import EngineGroup
    from trainer.driver.loop import Driver
    from trainer.driver.runtime import Runtime
    from trainer.training.train_group import TrainGroup

    config = compose_config("train.num_steps=1", "rollout.rollout_batch_size=1",
                            "rollout.n_samples_per_prompt=2", "eval.n_samples_per_prompt=1",
                            "eval.greedy=false", "rollout.num_engines=1",
                            "train.ranks_per_node=1", f"train.backend={backend}",
                            "train.share_prompts=false", "logging.wandb_mode=disabled",
                            "warmup.steps=1", "warmup.batch_size=2")
    log: list = []
    groups: list = []

    def offloaded() -> list:
        """Each rank's own answer (Megatron keeps the state; FSDP on CPU has none)."""
        if backend != "megatron" or not groups:
            return []
        return ray_local.get([a.__ray_call__.remote(lambda actor: actor.backend.offloader.offloaded)
                              for a in groups[0].actors])

    real_init = TrainGroup.__init__

    def init(self, *args, **kwargs):
        infos = [c.server_info() for c in runtime.engines.clients]
        log.append(("ranks built", [i["released"] for i in infos]))
        real_init(self, *args, **kwargs)
        groups.append(self)

    def recorded(cls, name):
        real = getattr(cls, name)

        def call(self, *args, **kwargs):
            log.append((name, None))
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, call)

    monkeypatch.setattr(TrainGroup, "__init__", init)
    recorded(EngineGroup, "release_memory")
    recorded(TrainGroup, "offload")
    recorded(TrainGroup, "onload")
    runtime = Runtime(config, tmp_path)
    with runtime as rt:
        assert offloaded() in ([], [True])  # built, then offloaded
        log.append(("start-up done", offloaded()))
        rt.engines = _Spy(rt.engines, {"resume_memory"}, log)
        rt.weights = _Spy(rt.weights, {"push"}, log)
        rt.manager = _ManagerSpy(rt.manager, {"generate_ref"}, log)
        driver = Driver(config, tmp_path, rt)
        real_eval = driver.evaluate

        def evaluate(name, *, step):
            log.append(("evaluate " + name, offloaded()))
            return real_eval(name, step=step)

        driver.evaluate = evaluate
        real_push = rt.weights._target.push

        def push(version, *args, **kwargs):
            log.append(("ranks at push", offloaded()))
            return real_push(version, *args, **kwargs)

        rt.weights._target.push = push
        try:
            driver.run()
        finally:
            rt.manager = rt.manager._target  # the runtime kills the real actor on exit
    off = [True] if backend == "megatron" else []
    push = [("resume_memory", ["weights"]), ("push", 0), ("ranks at push", off),
            ("resume_memory", ["kv_cache", "cuda_graph"])]
    turn = [("release_memory", None), ("onload", None), ("offload", None)]
    assert log == [
        ("release_memory", None), ("ranks built", [True]), ("offload", None),
        ("start-up done", off), *push, ("evaluate initial", off), *turn, *push,
        ("evaluate base", off), ("generate_ref", 1),
        ("release_memory", None), ("onload", None), ("offload", None),
        ("resume_memory", ["weights"]), ("push", 1), ("ranks at push", off),
        ("resume_memory", ["kv_cache", "cuda_graph"]), ("evaluate trained", off)]


def _plasma_objects(ray_module) -> int:
    """Objects in the local object store (Ray's own memory summary; no state API here:
    the test cluster runs without a dashboard)."""
    import re

    from ray._private.internal_api import memory_summary

    summary = memory_summary(ray_module.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"Plasma memory usage .*?, (\d+) objects", summary).group(1))


def _owner_worker(ref) -> str:
    """The id of the worker process that owns ``ref`` (the one that put it)."""
    from ray.core.generated.common_pb2 import Address

    return Address.FromString(ref.owner_address()).worker_id.hex()


def test_rollout_batches_reach_the_ranks_by_reference_and_are_freed(ray_local, tmp_path):
    """The driver never holds a rollout batch: the training ranks get an ObjectRef that the
    rollout manager put (not the driver: a driver-side ray.get + put would own it), the
    data-order record still has the trained tokens' digest, and once the steps are done
    the object store holds no more objects than before them. Real runtime; the train
    group's train_step is wrapped to record what it was handed."""
    from trainer.driver.loop import Driver
    from trainer.driver.runtime import Runtime

    config = compose_config("train.num_steps=2", "rollout.rollout_batch_size=1",
                            "rollout.n_samples_per_prompt=2", "eval.before_and_after=false",
                            "rollout.num_engines=1", "train.ranks_per_node=1")
    seen: list = []
    with Runtime(config, tmp_path) as rt:
        manager_worker = ray_local.get(rt.manager.__ray_call__.remote(
            lambda _: ray_local.get_runtime_context().get_worker_id()))
        assert manager_worker != ray_local.get_runtime_context().get_worker_id()
        real_train_step = rt.train_group.train_step

        def train_step(batch):
            # Keep no reference: the object must be freeable once the step is done.
            seen.append({"type": type(batch).__name__,
                         "owner": _owner_worker(batch)
                         if isinstance(batch, ray_local.ObjectRef) else None,
                         "stored": _plasma_objects(ray_local)})
            return real_train_step(batch)

        rt.train_group.train_step = train_step
        before = _plasma_objects(ray_local)
        driver = Driver(config, tmp_path, rt)  # alive to the end, as in a run
        driver.push_weights(0)  # the run's first push: the engines released theirs at start-up
        steps = [s for s, _ in driver.colocated_steps(0)]
        assert steps == [1, 2]
        assert [s["type"] for s in seen] == ["ObjectRef", "ObjectRef"]
        assert all(s["owner"] == manager_worker for s in seen), (manager_worker, seen)
        assert all(s["stored"] > before for s in seen)  # the batch was in the store
        deadline = time.monotonic() + 60
        while _plasma_objects(ray_local) > before:
            assert time.monotonic() < deadline, (
                f"{_plasma_objects(ray_local)} objects stored after the run, {before} before")
            time.sleep(0.2)
        del driver
    order = read_jsonl(tmp_path / "data_order.jsonl")
    assert [r["step"] for r in order] == [1, 2]
    assert all(len(r["tokens_sha256"]) == 16 for r in order)
