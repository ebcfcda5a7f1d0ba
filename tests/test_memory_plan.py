"""The start-up memory plan: hand-computed numbers, refusals, layouts, shipped recipes."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO
from config import ConfigError, compose_config
from trainer.driver import components, memory_plan as mp
from trainer.driver.memory_plan import (BUILTIN_ARCHS, ENGINE_CONTEXT_GIB, GiB, MemoryPlanError,
                                        MiB, ModelArch, TRAIN_CONTEXT_GIB, TRAIN_NCCL_GIB,
                                        gpu_capacity, model_arch)


def plan_memory(config, **kwargs):
    """The plan of a cluster whose ranks have Transformer Engine (the recipes' stack),
    unless the test says otherwise."""
    kwargs.setdefault("transformer_engine", True)
    return mp.plan_memory(config, **kwargs)


def check_memory(config, **kwargs):
    kwargs.setdefault("transformer_engine", True)
    return mp.check_memory(config, **kwargs)

GPU_RECIPES = sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml")
                     if compose_config([f"+recipe={p.stem}"]).cluster.device == "cuda")

# A toy Qwen3-shaped model small enough to count by hand.
TOY = ModelArch("toy", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=1000, tie_word_embeddings=True)
# 2 GPUs colocated, 2 prompts x 2 samples, one optimizer step over all 4 samples.
TOY_OVERRIDES = [
    "+recipe=qwen_0_6b", "cluster.gpus_per_node=2", "rollout.num_gpus=2", "train.ranks_per_node=2",
    "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.global_batch_size=4",
    "model.max_context_len=256", "train.max_tokens_per_micro_batch=512",
    "rollout.max_response_len=16", "env.max_turns=2", "rollout.extra_config.max_turns=2",
    "rollout.max_concurrency=8", "rollout.mem_fraction_static=0.5",
]


def toy_plan(*extra: str, gib: float = 8.0):
    return plan_memory(compose_config(TOY_OVERRIDES + list(extra)), arch=TOY, gpu_memory_gib=gib)


# --------------------------------------------------------------------- hand counts
def test_megatron_colocated_numbers_by_hand():
    plan = toy_plan()
    # Parameters on one GPU (TP 1, PP 1). Per layer: q,k,v 64 x (4 + 2 + 2) x 16 = 8192,
    # o 64 x 64 = 4096, gate/up/down 3 x 64 x 128 = 24576; norms 2 x 64 + q/k norms 2 x 16.
    layer = 8192 + 4096 + 24576 + 160
    vocab = 1024  # 1000 padded to a multiple of 128 (Megatron, TP 1)
    p = 2 * layer + vocab * 64 + 64  # tied embeddings + final norm
    assert p == 139_648
    training = plan.phase("training")
    assert training.get("weights") == 2 * p                        # bf16
    assert training.get("grads") == 4 * p                          # fp32 grad buffer
    assert training.get("optimizer: fp32 main params") == 4 * p / 2  # DP 2
    assert training.get("optimizer: Adam moments") == 8 * p / 2
    # 4 samples / 2 ranks = 2 samples x 256 context = 512 tokens (= the budget);
    # response tokens: 2 samples x 2 turns x 16 = 64.
    tokens, response = 512, 64
    per_token_layer = 8 * 64 + 6 * (4 + 2) * 16 + 8 * 128  # 2112 B = 33 x hidden
    assert training.get("activations") == tokens * 2 * per_token_layer
    assert training.get("logits") == vocab * (6 * tokens + 12 * response)
    assert training.get("trainer runtime") == (TRAIN_CONTEXT_GIB + TRAIN_NCCL_GIB) * GiB
    # The released engine keeps its CUDA context and workspace (TP 1: no NCCL); weights,
    # KV cache and decode CUDA graphs are released.
    assert training.get("engine runtime") == ENGINE_CONTEXT_GIB * GiB
    for released in ("engine weights", "engine KV cache pool", "engine CUDA graphs"):
        assert training.get(released) == 0
    assert training.total == pytest.approx(
        2 * p + 4 * p + 6 * p + tokens * 2 * per_token_layer
        + vocab * (6 * tokens + 12 * response) + 1.0 * GiB + 1.0 * GiB)

    rollout = plan.phase("rollout")
    engine_weights = 2 * (2 * layer + 1000 * 64 + 64)  # SGLang: unpadded vocabulary
    assert rollout.get("engine weights") == engine_weights
    assert rollout.get("engine KV cache pool") == 0.5 * 8 * GiB - engine_weights
    # < 35 GiB GPU: 2048-token prefill chunk x 2 B x (3h + 2 (nh + nkv) hd + 3 I)
    assert rollout.get("engine prefill activations") == 2048 * 2 * (3 * 64 + 2 * 6 * 16 + 3 * 128)
    assert rollout.get("engine CUDA graphs") == 256 * 2 * MiB  # TP < 4: batch sizes <= 256
    # Between training phases Megatron offloads every storage: only the runtime stays.
    for offloaded in ("weights", "grads", "optimizer: fp32 main params", "optimizer: Adam moments"):
        assert rollout.get(offloaded) == 0
    assert rollout.total == pytest.approx(
        1.0 * GiB + 0.5 * 8 * GiB + ENGINE_CONTEXT_GIB * GiB + 256 * 2 * MiB + 2048 * 1536)
    assert plan.fits and plan.capacity == 8 * GiB


def test_megatron_state_kept_between_phases_counts_at_rollout(monkeypatch):
    from trainer.driver import memory_plan

    kept = ("weights", "grads", "optimizer: fp32 main params")  # the pre-offload.py backend
    monkeypatch.setattr(memory_plan, "MEGATRON_KEPT_WHEN_OFFLOADED", kept)
    plan = toy_plan()
    training, rollout = plan.phase("training"), plan.phase("rollout")
    for name in kept:
        assert rollout.get(name) == training.get(name) > 0
    assert rollout.get("optimizer: Adam moments") == 0


def test_fsdp_numbers_by_hand():
    plan = toy_plan("train.backend=fsdp")
    p = 1000 * 64 + 2 * (8192 + 4096 + 24576 + 160) + 64  # unpadded vocabulary
    training = plan.phase("training")
    assert training.get("weights") == 4 * p / 2  # fp32 master, sharded over 2 ranks
    assert training.get("grads") == 4 * p / 2
    assert training.get("optimizer: Adam moments") == 8 * p / 2
    assert training.get("gathered params") == 2 * p  # root + 2 layers = the whole toy
    per_token_layer = 12 * 64 + 12 * (4 + 2) * 16 + 8 * 128  # HF model: 2944 B
    assert training.get("activations") == 512 * 2 * per_token_layer
    assert training.get("logits") == 1000 * 18 * 64  # LM head at the 64 response rows
    # FSDP offloads everything between training phases.
    rollout = plan.phase("rollout")
    assert rollout.get("weights") == rollout.get("grads") == 0
    assert rollout.get("trainer runtime") == 1.0 * GiB


def test_checkpointing_keeps_one_input_per_layer():
    plan = toy_plan("train.gradient_checkpointing=true", "train.share_prompts=false")
    per_token_layer = 8 * 64 + 6 * 6 * 16 + 8 * 128
    assert plan.phase("training").get("activations") == 512 * (2 * 2 * 64 + per_token_layer)


def test_tensor_parallel_and_distributed_optimizer_split_as_documented():
    base = toy_plan()
    tp2 = toy_plan("train.tensor_model_parallel_size=2", "train.sequence_parallel=true")
    no_dist = toy_plan("train.use_distributed_optimizer=false")
    layer_tp2 = (8192 + 4096 + 24576) / 2 + 160  # norms replicated
    p = 2 * layer_tp2 + 1024 * 64 / 2 + 64  # vocab 1000 -> 1024 (multiple of 256), / TP
    assert tp2.phase("training").get("weights") == 2 * p
    assert tp2.phase("training").get("optimizer: Adam moments") == 8 * p  # DP 1
    assert tp2.phase("training").get("activations") == base.phase("training").get("activations") / 2
    p1 = base.phase("training").get("weights") / 2
    assert no_dist.phase("training").get("optimizer: Adam moments") == 8 * p1
    assert no_dist.phase("training").get("optimizer: fp32 main params") == 4 * p1


def test_kv_cache_demand_is_reported():
    plan = plan_memory(compose_config(["+recipe=qwen_4b"]))
    # 256 requests over 8 engines x 8192 tokens x (K and V x 36 layers x 8 kv heads x 128 x 2 B)
    need = 256 // 8 * 8192 * (2 * 36 * 8 * 128 * 2) / GiB
    assert need == 36.0 and "need 36.0 GiB (262k tokens)" in plan.table()


# --------------------------------------------------------------------- refusals
def test_refused_with_the_numbers_naming_the_largest_component():
    config = compose_config(["+recipe=qwen_8b", "train.gradient_checkpointing=false",
                             "train.max_tokens_per_micro_batch=16384"])
    with pytest.raises(MemoryPlanError) as err:
        check_memory(config, print_fn=lambda _: None)
    message = str(err.value)
    assert isinstance(err.value, ConfigError)  # trainer.main reports it as a config error
    plan = plan_memory(config)
    training = plan.phase("training")
    assert training.largest().name == "activations"
    assert f"largest: activations {training.get('activations') / GiB:.1f} GiB" in message
    assert "79.1 GiB" in message and "H100" in message
    for component in ("grads", "logits", "weights", "optimizer: Adam moments"):
        assert component in message
    for change in ("train.gradient_checkpointing=true", "train.max_tokens_per_micro_batch<=",
                   "tensor parallelism", "cluster.colocate=false"):
        assert change in message


def test_the_suggested_micro_batch_fits():
    overrides = ["+recipe=qwen_8b", "train.gradient_checkpointing=false",
                 "train.max_tokens_per_micro_batch=16384"]
    message = plan_memory(compose_config(overrides)).error_message()
    budget = int(message.split("train.max_tokens_per_micro_batch<=")[1].split(" ")[0])
    assert plan_memory(compose_config(overrides[:-1] + [
        f"train.max_tokens_per_micro_batch={budget}"])).fits


def test_engine_gpus_refused_when_the_static_fraction_leaves_no_room():
    plan = plan_memory(compose_config([
        "+recipe=qwen_4b", "cluster.colocate=false", "rollout.num_gpus=4",
        "train.ranks_per_node=4", "rollout.mem_fraction_static=1.0"]))
    message = plan.error_message()
    assert message and "engine GPUs" in message
    assert "largest: engine KV cache pool" in message
    assert "a lower rollout.mem_fraction_static (now 1)" in message


def test_a_layout_that_fits_prints_one_line():
    lines = []
    plan = check_memory(compose_config(["+recipe=qwen_0_6b"]), print_fn=lines.append)
    assert plan.fits and len(lines) == 1 and "memory plan (colocated): peak" in lines[0]
    assert check_memory(compose_config([])) is None  # CPU: nothing to plan


def test_memory_check_false_goes_ahead():
    config = compose_config(["+recipe=qwen_8b", "train.gradient_checkpointing=false",
                             "train.max_tokens_per_micro_batch=16384"])
    config.cluster.memory_check = False  # the proposed cluster key
    lines = []
    plan = check_memory(config, print_fn=lines.append)
    assert not plan.fits and "going ahead" in lines[-1] and "total" in lines[0]


# --------------------------------------------------------------------- layouts
def test_colocated_and_disaggregated_differ_as_expected():
    coloc = plan_memory(compose_config(["+recipe=qwen_4b"]))
    disagg = plan_memory(compose_config(["+recipe=qwen_4b", "cluster.colocate=false",
                                         "rollout.num_gpus=4", "train.ranks_per_node=4"]))
    rollout, training = coloc.phase("rollout"), coloc.phase("training")
    engines, trainers = disagg.phase("engine GPUs"), disagg.phase("training GPUs")
    # Colocated, generation shares the GPU with what the offloaded trainer keeps (its
    # runtime), and training with what the released engine keeps.
    assert rollout.get("grads") == 0 and rollout.get("trainer runtime") > 0
    assert training.get("engine runtime") > 0 and training.get("engine KV cache pool") == 0
    assert rollout.total == pytest.approx(engines.total + rollout.get("trainer runtime"))
    assert {i.name for i in training.items} == {i.name for i in trainers.items} | {"engine runtime"}
    # Disaggregated GPUs hold one role each.
    assert engines.get("weights") == 0 and trainers.get("engine runtime") == 0
    assert {"engine weights", "engine KV cache pool"} <= {i.name for i in engines.items}
    # Half the data-parallel ranks: twice the optimizer shard, twice the samples per rank.
    assert trainers.get("optimizer: Adam moments") == 2 * training.get("optimizer: Adam moments")
    assert trainers.get("weights") == training.get("weights")
    assert trainers.get("activations") == 2 * training.get("activations")


def test_memory_is_per_gpu_type():
    config = compose_config(["+recipe=qwen_8b"])
    h100, h200 = plan_memory(config), plan_memory(config, gpu="H200")
    assert (h100.gpu, h200.gpu) == ("H100", "H200")
    # The engines' static share grows with the GPU; the trainer's state does not.
    assert h200.phase("rollout").get("engine KV cache pool") > h100.phase("rollout").get(
        "engine KV cache pool")
    assert h200.phase("training").get("grads") == h100.phase("training").get("grads")


def test_gpu_capacity_from_the_config_keys_or_the_table():
    def cfg(**cluster):
        return SimpleNamespace(cluster=SimpleNamespace(**cluster))

    assert gpu_capacity(cfg()) == ("H100", 79.1)  # no key: the recipes' H100
    assert gpu_capacity(cfg(gpu_type="NVIDIA H200")) == ("H200", 139.8)
    assert gpu_capacity(cfg(gpu_type="A100-SXM4-80GB")) == ("A100", 79.1)
    assert gpu_capacity(cfg(gpu_type="a100 40gb")) == ("A100-40GB", 39.4)
    assert gpu_capacity(cfg(gpu_type="H200", gpu_memory_gib=120.0)) == ("H200", 120.0)
    with pytest.raises(ConfigError, match="cluster.gpu_type"):
        gpu_capacity(cfg(gpu_type="T4"))


# --------------------------------------------------------------------- architectures
def test_builtin_architectures_match_the_published_sizes():
    # Qwen3 model cards: total / non-embedding parameters.
    for key, total, non_embedding in (("qwen3-0.6b", 0.6, 0.44), ("qwen3-4b", 4.0, 3.6),
                                      ("qwen3-8b", 8.2, 6.95)):
        arch = BUILTIN_ARCHS[key]
        embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
        assert round(arch.num_params() / 1e9, 1) == total
        assert round((arch.num_params() - embeddings) / 1e9, 2) == pytest.approx(non_embedding, abs=0.05)  # cards round


def test_architecture_from_the_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": True}))
    config = compose_config(TOY_OVERRIDES + [f"model.path={tmp_path}"])
    arch, source = model_arch(config)
    assert arch == ModelArch(tmp_path.name, 64, 2, 4, 2, 16, 128, 1000, True)
    assert source.endswith("config.json")
    from_dir = plan_memory(config, gpu_memory_gib=8.0)
    given = toy_plan()
    assert [p.total for p in from_dir.phases] == [p.total for p in given.phases]


def test_builtin_offline_model_is_read_from_its_directory(tiny_model_path):
    config = compose_config(TOY_OVERRIDES + ["model.path=tiny-qwen3"])
    arch, source = model_arch(config)
    with open(Path(tiny_model_path) / "config.json") as f:
        hidden = json.load(f)["hidden_size"]
    assert arch.hidden_size == hidden and source.endswith("config.json")


def test_unknown_model_without_a_directory_is_a_config_error():
    config = compose_config(["+recipe=qwen_4b", "model.path=/nowhere/MyModel"])
    with pytest.raises(ConfigError, match="model.path"):
        plan_memory(config)


# --------------------------------------------------------------------- shipped recipes
@pytest.mark.parametrize("recipe", GPU_RECIPES)
@pytest.mark.parametrize("colocate", [True, False])
def test_every_gpu_recipe_plans(recipe, colocate):
    overrides = [f"+recipe={recipe}"]
    if not colocate:
        overrides += ["cluster.colocate=false", "rollout.num_gpus=4", "train.ranks_per_node=4"]
    plan = plan_memory(compose_config(overrides))
    table = plan.table()
    assert "total" in table and plan.gpu in table
    assert all(p.total > 0 for p in plan.phases)
    assert {"trainer start-up", "weight push"} <= {p.name for p in plan.phases}


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_shipped_gpu_recipes_fit(recipe):
    plan_memory(compose_config([f"+recipe={recipe}"])).check()


def test_script_prints_the_plan_and_exits_1_when_it_cannot_fit(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_plan_script",
                                                  REPO / "scripts" / "memory_plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["+recipe=qwen_4b"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: qwen_4b, Qwen3-4B" in out and "fits: peak" in out
    assert script.main(["+recipe=qwen_4b", "cluster.colocate=false", "rollout.num_gpus=4",
                        "train.ranks_per_node=4", "train.gradient_checkpointing=false"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "the start-up check would refuse it" in out
    assert script.main(["+recipe=qwen_4b", "--gpu", "H200"]) == 0
    assert "H200" in capsys.readouterr().out
    assert script.main(["+recipe=qwen_4b", "--te", "no", "cluster.colocate=false",
                        "rollout.num_gpus=4", "train.ranks_per_node=4"]) == 1
    assert "attention scores" in capsys.readouterr().out
    assert script.main(["+recipe=qwen_4b", "--te", "yes", "cluster.colocate=false",
                        "rollout.num_gpus=4", "train.ranks_per_node=4"]) == 0
    assert "fused (Transformer Engine)" in capsys.readouterr().out
    assert script.main([]) == 0  # the CPU default: nothing to plan
    assert script.main(["rollout.n_samples_per_prompt=0"]) == 2


# --------------------------------------------------------------------- hybrid (Qwen3.5)
def test_hybrid_architecture_counts_what_the_model_holds(tiny_qwen3_5_path):
    """tiny-qwen3_5 read from its directory: the parameter count (and a LoRA's on the GDN
    projections) is the transformers model's own, KV is cached for the one full-attention
    layer only, and every GDN layer keeps a recurrent state and a conv tail per sequence."""
    from transformers import AutoModelForCausalLM

    from trainer.training.backends.lora import apply_lora

    config = compose_config(TOY_OVERRIDES + ["model.path=tiny-qwen3_5"])
    arch, source = model_arch(config)
    assert source.endswith("config.json") and arch.tie_word_embeddings
    assert (arch.linear_layers, arch.attention_layers, arch.attn_output_gate) == (3, 1, True)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path)
    assert arch.num_params() == sum(p.numel() for p in model.parameters())
    targets = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj", "down_proj"]
    apply_lora(model, SimpleNamespace(rank=4, alpha=8, dropout=0.0, target_modules=targets))
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert arch.lora_params(4, targets) == adapters
    layer = model.model.layers[0].linear_attn
    assert arch.kv_bytes_per_token() == 2 * 1 * 2 * 64 * 2  # K and V, 1 layer, 2 heads, bf16
    assert arch.state_bytes_per_sequence() == 3 * (
        layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * 4 + layer.conv_dim * 3 * 2)


def test_qwen3_5_4b_recipe_plans_state_slots():
    """The seed's Qwen3.5-4B layout: ~49 MiB of GDN state per sequence (24 layers x 32 heads
    x 128 x 128 fp32 plus the conv tails), SGLang's pool split 0.9 : 1 between states and KV,
    and the recipe fits an H100."""
    arch = BUILTIN_ARCHS["qwen3.5-4b"]
    slot = arch.state_bytes_per_sequence()
    assert slot == 24 * (32 * 128 * 128 * 4 + 8192 * 3 * 2) and round(slot / MiB, 1) == 49.1
    plan = plan_memory(compose_config(["+recipe=qwen3_5_4b"])).check()
    rollout = plan.phase("rollout")
    states, kv = rollout.get("engine recurrent states"), rollout.get("engine KV cache pool")
    assert states == pytest.approx(0.9 * kv)
    assert f"{int(states // slot)} slots x 49.1 MiB" in plan.table()
    for cap in ("rollout.sglang_max_mamba_cache_size=10",
                "rollout.sglang_args=[--max-mamba-cache-size,10]"):
        fewer = plan_memory(compose_config(["+recipe=qwen3_5_4b", cap]))
        assert fewer.phase("rollout").get("engine recurrent states") == 10 * slot
        assert any("recurrent-state pool holds 10 slots" in n for n in fewer.notes)


# --------------------------------------------------------------------- start-up and push
def test_trainer_start_up_peak_by_hand():
    """A Megatron rank's start-up: fp32 build, then DDP's param_data (bf16) and grad_data
    (fp32) allocated while the bf16 parameters are alive: 2 + 2 + 4 = 8 B per parameter,
    the largest moment here; the distributed optimizer's fp32 shards come after the old
    parameters are freed (2 + 4 + 4 / DP). Colocated, the released engine keeps only its
    runtime (the memory saver took weights, KV cache and CUDA graphs)."""
    p = 139_648  # the toy's parameters per GPU (test_megatron_colocated_numbers_by_hand)
    embed = 1024 * 64
    plan = toy_plan()
    startup = plan.phase("trainer start-up")
    assert startup.get("start-up peak") == 8 * p
    assert "DDP buffers allocated" in [i.note for i in startup.items
                                       if i.name == "start-up peak"][0]
    assert startup.total == 8 * p + (TRAIN_CONTEXT_GIB + TRAIN_NCCL_GIB) * GiB \
        + ENGINE_CONTEXT_GIB * GiB
    for released in ("engine weights", "engine KV cache pool", "engine CUDA graphs"):
        assert startup.get(released) == 0
    # Without the distributed optimizer DDP keeps the parameters in place (6 B) but the
    # optimizer's fp32 main parameters are whole: 2 + 4 + 4 = 10 B.
    assert toy_plan("train.use_distributed_optimizer=false").phase(
        "trainer start-up").get("start-up peak") == 10 * p
    # fp32 weights: a 4 B param_data next to the 4 B parameters and the 4 B grads.
    assert toy_plan("model.dtype=float32").phase("trainer start-up").get("start-up peak") == 12 * p
    # The KL reference is built in fp32 next to the policy, then kept in bf16.
    kl = toy_plan("algo.kl_coef=0.1").phase("trainer start-up")
    assert kl.get("start-up peak") == max(8 * p + 4 * embed, 2 * p + 8 * p)


def test_first_push_rollout_and_start_up_run_with_the_trainer_offloaded():
    """Colocated phases before the first training step: the ranks build while the
    engines have released their memory, and the first push, the base evaluation and
    rollout 1 see the offloaded trainer (its runtime) only. qwen_4b on H100s shows why:
    engines holding their static share while the ranks build would not fit."""
    plan = plan_memory(compose_config(["+recipe=qwen_4b"]))
    assert [p.name for p in plan.phases] == ["engine start-up", "trainer start-up",
                                             "weight push", "rollout", "training"]
    startup, push, rollout = (plan.phase(n) for n in ("trainer start-up", "weight push", "rollout"))
    assert startup.get("start-up peak") / GiB == pytest.approx(30.0, abs=0.1)  # the figure
    # The old order: the ranks built next to engines that still held everything.
    old_order = plan.phase("engine start-up").total + startup.total - startup.get("engine runtime")
    assert old_order > plan.capacity and startup.total < plan.capacity
    for trainer_state in ("weights", "grads", "optimizer: fp32 main params",
                          "optimizer: Adam moments"):
        assert push.get(trainer_state) == rollout.get(trainer_state) == 0
    assert push.get("engine weights") > 0 and push.get("engine KV cache pool") == 0
    assert push.get("push bucket") == 151936 * 2560 * 2  # the embedding, whole, in bf16
    assert plan.fits


def test_disaggregated_phases_on_the_training_gpus():
    plan = plan_memory(compose_config(["+recipe=qwen_8b", "cluster.colocate=false",
                                       "rollout.num_gpus=4", "train.ranks_per_node=4"]))
    assert [p.name for p in plan.phases] == ["engine GPUs", "trainer start-up", "weight push",
                                             "training GPUs"]
    push, training = plan.phase("weight push"), plan.phase("training GPUs")
    for name in ("weights", "grads", "optimizer: Adam moments"):  # not offloaded here
        assert push.get(name) == training.get(name) > 0
    assert push.get("activations") == 0 and push.get("push bucket") > 0
    assert plan.phase("trainer start-up").get("engine runtime") == 0


def test_colocated_engines_release_their_cuda_graphs_because_their_launch_says_so(monkeypatch):
    """The decode graphs go with the memory only when the engine's launch sets
    SGLANG_MEMORY_SAVER_CUDA_GRAPH (rollout.engines.actor); the plan follows the launch."""
    from rollout.engines import actor

    config = compose_config(["+recipe=qwen_4b"])
    assert actor.releases_cuda_graphs(components.engine_spec(config, config.model.path))
    assert plan_memory(config).phase("training").get("engine CUDA graphs") == 0
    monkeypatch.setattr(actor.SGLangLaunch, "__post_init__", lambda self: None)
    kept = plan_memory(config).phase("training").get("engine CUDA graphs")
    assert kept == 256 * 2 * MiB


def test_megatron_without_transformer_engine_counts_the_score_matrix(capsys):
    """No Transformer Engine (the default install; none imports on this machine): the
    local attention's fp32 score matrix is planned, a layout it overflows is refused naming
    the fix, and one it still fits gets a warning naming it."""
    disagg = compose_config(["+recipe=qwen_4b", "cluster.colocate=false", "rollout.num_gpus=4",
                             "train.ranks_per_node=4"])
    with_te = plan_memory(disagg, transformer_engine=True)
    without = mp.plan_memory(disagg)  # detected here: not importable
    elems = 16384 * 8192 * 32  # micro-batch tokens x padded row length x heads
    assert without.phase("training GPUs").get("attention scores") == 16 * elems
    assert with_te.phase("training GPUs").get("attention scores") == 0
    with pytest.raises(MemoryPlanError) as err:
        mp.check_memory(disagg, print_fn=lambda _: None)
    assert "largest: attention scores 64.0 GiB" in str(err.value)
    assert "install Transformer Engine" in str(err.value) and "'.[te]'" in str(err.value)
    lines = []
    mp.check_memory(compose_config(["+recipe=qwen_4b"]), print_fn=lines.append)
    assert lines[-1].startswith("homegym: warning: Megatron without Transformer Engine")
    # Without checkpointing every layer keeps 6 B per element for backward.
    no_ckpt = mp.plan_memory(compose_config(["+recipe=qwen_4b",
                                             "train.gradient_checkpointing=false"]),
                             transformer_engine=False)
    half = 8192 * 8192 * 32
    assert no_ckpt.phase("training").get("attention scores") == 6 * half * 36 + 10 * half


def test_the_readme_and_docs_tables_are_the_plan():
    """The plan tables in README.md and docs/gpu.md show what the plan computes."""
    import re

    disagg = ["cluster.colocate=false", "rollout.num_gpus=4", "train.ranks_per_node=4"]
    for doc in ("README.md", "docs/gpu.md"):
        rows = re.findall(r"^\| `(qwen_\w+)`[^|]* \| (colocated|disaggregated) \| (.*) \|$",
                          (REPO / doc).read_text(), re.M)
        assert len(rows) == 4, doc
        for recipe, layout, cells in rows:
            plan = plan_memory(compose_config([f"+recipe={recipe}"]
                                              + (disagg if layout == "disaggregated" else [])))
            shown = [float(c.split()[0]) for c in cells.split(" | ") if c.strip() != "-"]
            assert shown == [round(p.total / GiB, 1) for p in plan.phases], (doc, recipe, layout)


def test_a_layout_whose_start_up_cannot_fit_is_refused_with_its_numbers():
    """Short samples make training lighter than a rank's start-up (DDP's buffers next to
    the parameters): on a GPU between the two, the start-up phase alone is refused, with
    its components and what to change."""
    config = compose_config(["+recipe=qwen_4b", "model.max_context_len=1024",
                             "train.max_tokens_per_micro_batch=1024",
                             "rollout.mem_fraction_static=0.3"])
    plan = plan_memory(config)
    startup = plan.phase("trainer start-up")
    others = max(p.total for p in plan.phases if p.name != "trainer start-up")
    assert startup.total > others
    gib = (startup.total + others) / 2 / GiB
    tight = plan_memory(config, gpu_memory_gib=gib)
    message = tight.error_message()
    assert [p.name for p in tight.phases if p.total > tight.capacity] == ["trainer start-up"]
    assert message.count("GiB per GPU, more than") == 1
    assert f"trainer start-up: {startup.total / GiB:.1f} GiB per GPU" in message
    assert f"largest: start-up peak {startup.get('start-up peak') / GiB:.1f} GiB" in message
    assert "train.use_distributed_optimizer=false" in message and "cluster.colocate=false" in message
