"""Config composition and validation: every shipped config composes, mistakes are named."""

import dataclasses
import subprocess
import sys
import pytest
from omegaconf import OmegaConf

from conftest import REPO, compose_config
from config import ConfigError, HomegymConfig, to_dict

RECIPES = sorted(p.stem for p in (REPO / "conf" / "recipe").glob("*.yaml"))
GROUPS = {g: sorted(p.stem for p in (REPO / "conf" / g).glob("*.yaml"))
          for g in ("model", "cluster", "algo", "env")}


def test_default_is_the_cpu_recipe():
    default = compose_config()
    explicit = compose_config("+recipe=number_guess_cpu")
    # The same run; only the name differs (no recipe: named after env and model).
    assert dataclasses.replace(default, recipe_name="number_guess_cpu") == explicit
    assert (default.derived.label, explicit.derived.label) == ("number_guess-tiny-qwen3",
                                                            "number_guess_cpu")
    assert default.cluster.device == "cpu" and default.rollout.engine == "hf"
    assert default.model.path == "tiny-qwen3"
    assert default.derived.num_engines == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(recipe):
    config = compose_config(f"+recipe={recipe}")
    assert config.recipe_name == recipe


def test_recipes_shipped():
    assert {"number_guess_cpu", "qwen_4b", "qwen_0_6b", "qwen_8b"} <= set(RECIPES)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "cluster" and option != "cpu":
        # A GPU cluster needs a GPU rollout + training layout to be valid.
        overrides.append("+recipe=qwen_4b")
        overrides[0] = f"cluster={option}"
    if (group, option) == ("env", "custom"):
        overrides.append("env.name=arithmetic")  # the option leaves the name to the user
    config = compose_config(*overrides)
    assert isinstance(config, HomegymConfig)
    # Every value the option file sets reaches the typed config (recipe keys aside: a
    # recipe is applied after the group and may override it).
    recipe = _leaves(OmegaConf.load(REPO / "conf" / "recipe" / "qwen_4b.yaml")) if "+recipe=qwen_4b" in overrides else {}
    option_file = OmegaConf.load(REPO / "conf" / group / f"{option}.yaml")
    expected = _leaves(option_file, () if _is_global(group, option) else (group,))
    composed = _leaves(OmegaConf.structured(config))
    given = {o.split("=")[0] for o in overrides}
    checked = {k: v for k, v in expected.items()
               if v != "???" and k not in recipe and k not in given}
    assert checked, f"{group}={option} sets nothing checkable"
    assert {k: composed.get(k) for k in checked} == checked


def _is_global(group, option):
    return "@package _global_" in (REPO / "conf" / group / f"{option}.yaml").read_text()


def _leaves(node, prefix=()) -> dict:
    """Dotted key -> value for every leaf of a config (lists kept whole), without defaults."""
    container = node if isinstance(node, dict) else OmegaConf.to_container(node, resolve=False)
    out = {}
    for key, value in container.items():
        if key == "defaults" and not prefix:
            continue
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            out.update(_leaves(value, path))
        else:
            out[".".join(path)] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def test_qwen_4b_matches_the_seed_recipe():
    c = compose_config("+recipe=qwen_4b")
    assert (c.cluster.device, c.cluster.gpus_per_node, c.cluster.colocate) == ("cuda", 8, True)
    assert (c.rollout.engine, c.train.backend) == ("sglang", "megatron")
    assert c.train.tensor_model_parallel_size == 1 and c.train.world_size == 8
    assert c.derived.num_engines == 8
    assert (c.train.num_steps, c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt) == (20, 8, 4)
    assert (c.rollout.max_response_len, c.train.global_batch_size, c.train.save_interval) == (64, 8, 10)
    assert c.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert c.rollout.extra_config["max_turns"] == 6


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_recipes_correct_the_engines_bf16_gap(recipe):
    """SGLang's bf16 engines never compute the trainer's log-probs: every GPU recipe trains
    with the chosen correction (docs/algorithms.md), CPU recipes keep the default."""
    config = compose_config(f"+recipe={recipe}")
    gpu = config.cluster.device == "cuda"
    assert config.algo.rollout_correction == ("token_tis" if gpu else "none")
    assert config.algo.correction_bounds == ((None, 2.0) if gpu else (None, None))


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="bogus"):
        compose_config("rollout.bogus=1")


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="rollout.rollout_batch_size"):
        compose_config("rollout.rollout_batch_size=abc")


@pytest.mark.parametrize("overrides,key,rule", [
    (["rollout.rollout_batch_size=-1"], "rollout.rollout_batch_size", ">= 1"),
    (["rollout.temperature=-0.5"], "rollout.temperature", ">= 0"),
    (["model.dtype=float8"], "model.dtype", "one of"),
    (["train.backend=fsdp", "train.tensor_model_parallel_size=2"], "train.tensor_model_parallel_size", "megatron"),
    (["+recipe=qwen_4b", "train.tensor_model_parallel_size=3"], "train.tensor_model_parallel_size", "must divide"),
    (["+recipe=qwen_4b", "cluster.gpus_per_node=0"], "cluster.gpus_per_node", "no GPUs"),
    (["+recipe=qwen_4b", "rollout.num_gpus=4"], "rollout.num_gpus", "colocate"),
    (["+recipe=qwen_4b", "rollout.num_gpus_per_engine=3"], "rollout.num_gpus", "divisible"),
    (["rollout.engine=sglang"], "rollout.dtype", "bfloat16 only"),
    (["rollout.engine=sglang", "rollout.dtype=bfloat16", "rollout.num_gpus_per_engine=2"],
     "rollout.num_gpus_per_engine", "must be 1"),
    (["algo.max_staleness=1", "algo.rollout_correction=token_tis"], "algo.max_staleness", "colocate"),
    (["cluster.colocate=false", "algo.max_staleness=1"], "algo.max_staleness",
     "rollout_correction=none .* algo.allow_uncorrected_staleness=true"),
    (["train.global_batch_size=7"], "train.global_batch_size", "must divide"),
    (["warmup.splits=[train,test]"], "warmup.splits", "'train' / 'eval'"),
    (["train.share_prompts=true", "train.backend=megatron"], "train.share_prompts", "fsdp"),
    (["train.share_prompts=true", "train.gradient_checkpointing=true"], "train.share_prompts",
     "gradient_checkpointing"),
])
def test_rule_violations_name_key_and_rule(overrides, key, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        compose_config(*overrides)
    assert str(info.value).startswith(key)


@pytest.mark.parametrize("fix", ["algo.rollout_correction=icepop", "algo.tis_clip=2",
                                 "algo.allow_uncorrected_staleness=true"])
def test_staleness_with_a_correction_or_explicitly_allowed(fix):
    assert compose_config("cluster.colocate=false", "algo.max_staleness=2", fix).algo.max_staleness == 2


def test_share_prompts_defaults_to_where_it_applies():
    assert compose_config().derived.share_prompts
    assert not compose_config("train.gradient_checkpointing=true").derived.share_prompts
    assert not compose_config("+recipe=qwen_4b").derived.share_prompts  # megatron
    assert not compose_config("train.share_prompts=false").derived.share_prompts


@pytest.mark.subprocess
def test_cfg_job_prints_the_gpu_recipe_on_any_machine():
    out = subprocess.run([sys.executable, "-m", "trainer.main", "+recipe=qwen_4b", "--cfg", "job"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "recipe_name: qwen_4b" in out and "engine: sglang" in out and "backend: megatron" in out


@pytest.mark.subprocess
def test_cli_config_error_exits_cleanly():
    proc = subprocess.run([sys.executable, "-m", "trainer.main", "rollout.n_samples_per_prompt=0"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "rollout.n_samples_per_prompt: must be >= 1" in proc.stderr


def test_weight_sync_auto_is_resolved_once_and_the_key_kept():
    colocated, apart = compose_config(), compose_config("cluster.colocate=false")
    assert (colocated.derived.weight_sync, apart.derived.weight_sync) == ("tensor", "distributed")
    disk = compose_config("cluster.colocate=false", "train.weight_sync=disk")
    assert disk.derived.weight_sync == "disk"
    # The key keeps what the user wrote (the run directory's config.yaml shows it); a copy
    # with another layout gets its own derived values.
    assert to_dict(colocated)["train"]["weight_sync"] == "auto"
    moved = dataclasses.replace(colocated, cluster=apart.cluster)
    assert moved.derived.weight_sync == "distributed" and colocated.derived.weight_sync == "tensor"
    assert "derived" not in to_dict(colocated)


def test_deprecated_key_warns_once_naming_the_new_key(monkeypatch):
    import warnings

    from config import schema

    monkeypatch.setattr(schema, "_WARNED", set())
    with pytest.warns(FutureWarning, match=r"train.warmup_steps is deprecated: use "
                                           r"train.lr_warmup_steps"):
        old = compose_config("train.warmup_steps=3")
    assert (old.train.lr_warmup_steps, old.train.warmup_steps) == (3, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use is silent
        assert compose_config("train.warmup_steps=4").train.lr_warmup_steps == 4
    assert compose_config("train.lr_warmup_steps=3") == old
    with pytest.raises(ConfigError, match="train.warmup_steps: is the old name"):
        compose_config("train.warmup_steps=3", "train.lr_warmup_steps=5")
