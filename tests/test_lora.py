"""LoRA on the FSDP backend (train.lora): what trains, what the step computes, what leaves
the trainer (merged weights, the peft adapter), checkpoints and an end-to-end run."""

import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import free_port, run_main
from train_batches import (assert_save_load_round_trip, exported_params, make_batch,
                           make_config)
from config import ConfigError
from trainer.driver import components

LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def one_rank():
    """A gloo group of one, in this process, so the backends' own objects can be read."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _backend(train=None, algo=None):
    from trainer.training.backends.fsdp import FSDPBackend

    backend = FSDPBackend()
    config = make_config(train={"lr": 1e-2, **(train or {})}, algo=algo or {})
    backend.init(rank=0, world_size=1, **components.backend_args(config))
    return backend


def _param(backend, name):
    p = dict(backend.model.named_parameters())[name]
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _grads_at_step(backend) -> dict:
    """The gradients the optimizer steps on (after clipping), by parameter name."""
    grads = {}

    def hook(optimizer, args, kwargs):
        names = {id(p): n for n, p in backend.model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[names[id(p)]] = g.detach().clone()

    backend.optimizer.register_step_pre_hook(hook)
    return grads


def test_config_validation():
    assert not make_config().train.lora.enabled
    assert make_config(train={"lora": {"rank": 8}}).train.lora.enabled
    for bad, key in (({"rank": -1}, "train.lora.rank"), ({"rank": 8, "alpha": 0}, "train.lora.alpha"),
                     ({"rank": 8, "dropout": 1.0}, "train.lora.dropout"),
                     ({"rank": 8, "target_modules": []}, "train.lora.target_modules")):
        with pytest.raises(ConfigError, match=key):
            make_config(train={"lora": bad})
    with pytest.raises(ConfigError, match="train.lora.rank: .*train.backend=fsdp"):
        make_config(train={"backend": "megatron", "lora": {"rank": 8}})


def test_push_mode_adapter_on_sglang_merged_on_the_cpu_engine():
    """train.lora.push=auto sends SGLang engines the adapter (and starts them serving LoRA
    of that rank on those modules), homegym's CPU engine merged weights; an adapter push to
    the CPU engine is refused."""
    from rollout.engines.actor import SGLANG_CPU_LORA_SHIM

    lora = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    sglang = make_config(rollout={"engine": "sglang", "dtype": "bfloat16"}, train={"lora": lora})
    assert sglang.derived.lora_push == "adapter"
    spec = components.engine_spec(sglang, "/m")
    cmd = spec.command(1, None, "127.0.0.1")
    at = cmd.index("--lora-target-modules")
    assert cmd[at + 1:at + 3] == ["q_proj", "v_proj"] and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert spec.env["PYTHONPATH"].split(":")[0] == SGLANG_CPU_LORA_SHIM
    merged = make_config(rollout={"engine": "sglang", "dtype": "bfloat16"},
                         train={"lora": {**lora, "push": "merged"}})
    assert merged.derived.lora_push == "merged"
    assert "--enable-lora" not in components.engine_spec(merged, "/m").command(1, None, "127.0.0.1")
    assert make_config(train={"lora": lora}).derived.lora_push == "merged"  # the CPU engine
    assert make_config().derived.lora_push is None
    with pytest.raises(ConfigError, match="train.lora.push: adapter pushes need rollout.engine=sglang"):
        make_config(train={"lora": {**lora, "push": "adapter"}})


def test_zero_init_adapters_leave_the_model_unchanged(one_rank, tiny_model_path):
    """B = 0: the LoRA policy's log-probs and its merged weights are the base model's."""
    batch = make_batch(num_groups=2, group_size=4, seed=11)
    full, lora = _backend(), _backend({"lora": LORA})
    for a, b in zip(full.log_probs(batch), lora.log_probs(batch)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    reference = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    merged = exported_params(lora)
    assert sorted(merged) == sorted(reference)  # HF names, no adapter tensors
    for name, tensor in reference.items():
        assert torch.equal(merged[name], tensor), name


def test_only_adapters_train_and_hold_optimizer_state(one_rank, tiny_model_path):
    backend = _backend({"lora": LORA})
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # Seven target projections in each of the tiny model's layers, A and B each.
    assert len(trainable) == 2 * 7 * len(backend.model.model.layers)
    before = exported_params(backend)
    backend.train_step(make_batch(num_groups=2, group_size=4, seed=12))
    by_param = {id(p): n for n, p in backend.model.named_parameters()}
    assert {by_param[id(p)] for p in backend.optimizer.state} == trainable
    state_numel = sum(v.numel() for s in backend.optimizer.state.values()
                      for v in s.values() if v.dim() > 0)
    assert state_numel == 2 * sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    after = exported_params(backend)
    targets = tuple(f".{m}.weight" for m in backend.lora.target_modules)
    for name in before:  # adapted projections moved; embeddings and norms did not
        assert torch.equal(before[name], after[name]) != name.endswith(targets), name


def test_lora_gradient_is_the_full_gradient_projected(one_rank):
    """With B = 0 the LoRA forward is the full model's, so on the same batch the losses
    agree and, for W + s B A: dL/dB = s (dL/dW) A^T and dL/dA = s B^T (dL/dW) = 0."""
    batch = make_batch(num_groups=2, group_size=4, seed=13)
    train = {"grad_clip": 0.0}  # clipping would scale the two gradients differently
    full, lora = _backend(train), _backend({**train, "lora": LORA})
    full_grads, lora_grads = _grads_at_step(full), _grads_at_step(lora)
    m_full, m_lora = full.train_step(batch), lora.train_step(batch)
    assert m_full["train/pg_loss"] == pytest.approx(m_lora["train/pg_loss"], rel=1e-6)
    checked = 0
    for module, scaling in lora.lora_layers.items():
        g_w = full_grads[f"{module}.weight"]
        a = _param(lora, f"{module}.lora_A.default.weight")
        g_b = lora_grads[f"{module}.lora_B.default.weight"]
        torch.testing.assert_close(g_b, scaling * g_w @ a.T, rtol=1e-4, atol=1e-7, msg=module)
        assert torch.count_nonzero(lora_grads[f"{module}.lora_A.default.weight"]) == 0
        checked += g_b.abs().sum() > 0
    assert checked == len(lora.lora_layers)  # every adapter got a real gradient


def test_merged_export_is_peft_merge_of_the_saved_adapter(one_rank, tiny_model_path, tmp_path):
    """After training, the pushed (merged) weights equal peft loading the saved adapter
    onto the base model and merging it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = _backend({"lora": {**LORA, "dropout": 0.1}})
    backend.train_step(make_batch(num_groups=2, group_size=4, seed=14))
    backend.save_adapter(str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload()
    expected = peft_merged.state_dict()
    original = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    merged = exported_params(backend)
    assert sorted(merged) == sorted(original)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert sum(not torch.equal(merged[n], t) for n, t in original.items()) == len(backend.lora_layers)


def test_kl_reference_is_the_base_model(one_rank):
    """A LoRA run's KL reference is its base (adapters off, no second copy): KL is zero
    before the first update and positive after it; the adapters stay trainable."""
    batch = make_batch(num_groups=2, group_size=4, seed=15)
    backend = _backend({"lora": LORA}, {"kl_coef": 0.1})
    assert backend.ref_model is None
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    metrics = [backend.train_step(batch) for _ in range(2)]
    assert metrics[0]["train/kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics[1]["train/kl"] > 1e-6
    assert [n for n, p in backend.model.named_parameters() if p.requires_grad] == trainable


@pytest.mark.slow
def test_lora_save_load_round_trip_two_ranks(ray_local, tmp_path):
    """The full model's resume test on sharded adapters, and a fresh process resuming."""

    config = make_config(train={"ranks_per_node": 2, "lr": 1e-2, "lora": LORA})
    placement = components.placement(config)
    group = components.train_group(config, placement)
    batch = make_batch(num_groups=4, group_size=4, seed=16)
    try:
        assert_save_load_round_trip(group, batch, str(tmp_path / "ckpt"))
        group.save(str(tmp_path / "ckpt2"))
        saved = exported_params(group)
        group.train_step(batch)
        stepped = exported_params(group)
    finally:
        group.shutdown()
        placement.shutdown()
    # Adapter-sized: the checkpoint holds adapters + Adam moments, not the base weights.
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(tmp_path / "ckpt2" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in stored if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    # new ranks: base from model.path, adapters from the checkpoint
    fresh = components.train_group(config)
    try:
        fresh.load(str(tmp_path / "ckpt2"))
        assert all(torch.equal(saved[n], t) for n, t in exported_params(fresh).items())
        fresh.train_step(batch)
        assert all(torch.equal(stepped[n], t) for n, t in exported_params(fresh).items())
    finally:
        fresh.shutdown()


@pytest.mark.slow
def test_lora_run_end_to_end_checkpoint_serves_and_evaluates(ray_local, ray_address, tmp_path,
                                                             tiny_model_path):
    """`trainer.main train.lora.rank=8`: it trains, pushes merged weights, checkpoints the
    adapter (peft) and the merged export, and eval/serve load that checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.eval import evaluate_models
    from trainer.driver.checkpoint import resolve_checkpoint

    run = run_main(tmp_path, "train.lora.rank=8", "train.num_steps=2", "warmup.steps=2",
                   "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
                   "train.ranks_per_node=1", "rollout.num_engines=1", "eval.n_samples_per_prompt=1",
                   "eval.before_and_after=false", "train.save_interval=null", timeout_s=400,
                   ray_address=ray_address)
    steps = [m for m in run.metrics if "rollout/raw_reward" in m]
    assert [m["step"] for m in steps] == [1, 2], run.output[-2000:]
    assert all(m["perf/weight_sync_bytes"] > 0 for m in steps)
    ckpt = run.run_dir / "checkpoints" / "latest"
    assert resolve_checkpoint(run.run_dir) == str(ckpt.resolve() / "hf")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(ckpt / "adapter")).merge_and_unload().state_dict()
    exported = load_file(str(ckpt / "hf" / "model.safetensors"))
    original = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-7, msg=name)
    # The warm-up trained the adapters: exactly the adapted projections moved.
    moved = {n for n, t in original.items() if not torch.equal(exported[n], t)}
    assert moved and all(n.endswith("_proj.weight") for n in moved), moved
    small = ["rollout.num_engines=1", "eval.n_samples_per_prompt=1", "eval.greedy=false",
             "eval.train_split=false"]
    results = evaluate_models([str(run.run_dir)], small, quiet=True)
    (result,) = results.values()
    assert result["model_path"] == str(ckpt.resolve() / "hf")
    assert "eval/success_rate" in result["metrics"]


def test_memory_plan_counts_adapter_grads_and_optimizer_only():
    """The GPU start-up plan: with LoRA, grads and Adam moments are the adapters' and the
    KL reference takes no memory (it is the policy with adapters off)."""
    from test_memory_plan import TOY, toy_plan

    full = toy_plan("train.backend=fsdp", "algo.kl_coef=0.1").phase("training")
    lora = toy_plan("train.backend=fsdp", "algo.kl_coef=0.1", "train.lora.rank=4",
                    "train.lora.target_modules=[q_proj,down_proj]").phase("training")
    # Per layer: q_proj 64 -> 4 x 16, down_proj 128 -> 64; two layers, sharded over 2 ranks.
    adapters = 2 * 4 * ((64 + 64) + (128 + 64))
    assert TOY.lora_params(4, ["q_proj", "down_proj"]) == adapters
    assert lora.get("grads") == 4 * adapters / 2
    assert lora.get("optimizer: Adam moments") == 8 * adapters / 2
    assert lora.get("weights") == full.get("weights")  # the frozen base is still held
    assert full.get("reference model") > 0 and lora.get("reference model") == 0
