"""The Python API (trainer/api/): recipe -> Hydra config mapping, shipping user functions
to Ray workers, datasets, and (slow tier) the seed tutorial example end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, clean_env, read_jsonl, run_group
from trainer import api
from trainer.api import (DatasetConfig, NumberGuessCPURecipe, Qwen3_4B, Qwen3_4B_Recipe,
                         TinyQwen3, TrainJob)
from config import ConfigError



def test_cpu_recipe_fields_map_onto_the_hydra_config():
    cfg = TrainJob(model=TinyQwen3(), recipe=NumberGuessCPURecipe(
        num_rollout=3, rollout_batch_size=2, n_samples_per_prompt=4, rollout_max_response_len=16,
        rollout_temperature=0.7, global_batch_size=4, save_interval=3, eval_interval=None,
        extra_config={"max_turns": 5, "log_multi_turn": True},
        apply_chat_template_kwargs='{"enable_thinking": false}',
        custom_rm_function="examples.number_guess_seed.number_guess_rm",
        overrides=["warmup.steps=5"])).build()
    assert cfg.recipe_name == "number_guess_cpu" and cfg.model.path == "tiny-qwen3"
    assert (cfg.train.num_steps, cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt,
            cfg.rollout.max_response_len, cfg.rollout.temperature, cfg.train.global_batch_size,
            cfg.train.save_interval, cfg.eval.interval) == (3, 2, 4, 16, 0.7, 4, 3, None)
    assert cfg.rollout.extra_config == {"max_turns": 5, "log_multi_turn": True}
    assert cfg.env.max_turns == 5  # the built-in driver's budget follows max_turns
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert cfg.rollout.custom_rm_function == "examples.number_guess_seed.number_guess_rm"
    assert cfg.warmup.steps == 5


def cli_config(monkeypatch, *overrides):
    """The config `python -m trainer.main OVERRIDES` hands to its run: the real
    @hydra.main entry point, stopped before anything starts."""
    import trainer.main as entry

    seen = []
    monkeypatch.setattr(entry, "run", seen.append)
    monkeypatch.setattr(sys, "argv", ["trainer.main", *overrides])
    entry.main()
    assert len(seen) == 1
    return seen[0]


def test_gpu_recipe_matches_the_cli_composition(monkeypatch):
    via_api = TrainJob(model=Qwen3_4B("/models/q4b"), recipe=Qwen3_4B_Recipe()).build()
    via_cli = cli_config(monkeypatch, "+recipe=qwen_4b", "model.path=/models/q4b")
    assert via_api == via_cli  # one code path: same Hydra composition, same object

    cfg = TrainJob(model=Qwen3_4B("/models/q4b"), recipe=Qwen3_4B_Recipe(
        gpu_type="H100", colocate=False, actor_num_gpus_per_node=4, rollout_num_gpus=4,
        rollout_num_gpus_per_engine=1, tensor_model_parallel_size=2, sequence_parallel=True,
        custom_generate_function="examples.number_guess_seed.number_guess_generate")).build()
    assert cfg.cluster.colocate is False and cfg.train.ranks_per_node == 4
    assert cfg.rollout.num_gpus == 4 and cfg.cluster.gpus_per_node == 8
    assert cfg.train.tensor_model_parallel_size == 2 and cfg.train.sequence_parallel
    assert "gpu:H100" in cfg.logging.wandb_tags
    assert cfg.model.dtype == "bfloat16"  # the family's settings come with the path


def test_seed_qwen3_5_recipe_call_ports_with_only_its_imports_changed(monkeypatch):
    """The seed's Qwen3_5_4B_Recipe(...) call, verbatim: the same config as the CLI's
    +recipe=qwen3_5_4b with those values (1 x 8 H100, colocated, TP 1)."""
    from trainer.api import Qwen3_5_4B, Qwen3_5_4B_Recipe

    assert TrainJob(model=Qwen3_5_4B(), recipe=Qwen3_5_4B_Recipe()).build() == cli_config(
        monkeypatch, "+recipe=qwen3_5_4b")
    cfg = TrainJob(model=Qwen3_5_4B(), recipe=Qwen3_5_4B_Recipe(
        gpu_type="H100", actor_num_nodes=1, actor_num_gpus_per_node=8,
        tensor_model_parallel_size=1, sequence_parallel=False, rollout_num_gpus=8,
        rollout_num_gpus_per_engine=1, colocate=True, num_rollout=1, n_samples_per_prompt=4,
        rollout_batch_size=8, rollout_max_response_len=2048, save_interval=5,
        custom_rm_function="examples.number_guess_seed.number_guess_rm")).build()
    assert cfg.model.path == "/models/Qwen3.5-4B" and cfg.model.dtype == "bfloat16"
    assert (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node, cfg.cluster.colocate) == (1, 8, True)
    assert (cfg.train.world_size, cfg.train.tensor_model_parallel_size) == (8, 1)
    assert (cfg.rollout.num_gpus, cfg.rollout.num_gpus_per_engine, cfg.derived.num_engines) == (8, 1, 8)
    assert (cfg.train.num_steps, cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size,
            cfg.rollout.max_response_len, cfg.train.save_interval) == (1, 4, 8, 2048, 5)


def test_config_mistakes_name_the_key():
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        TrainJob(recipe=NumberGuessCPURecipe(n_samples_per_prompt=0)).build()
    with pytest.raises(ConfigError, match="bogus"):
        TrainJob(recipe=NumberGuessCPURecipe(overrides=["rollout.bogus=1"])).build()
    with pytest.raises(ConfigError, match="apply_chat_template_kwargs"):
        TrainJob(recipe=NumberGuessCPURecipe(apply_chat_template_kwargs="{not json")).build()
    with pytest.raises(ConfigError, match="gpu_type"):
        TrainJob(recipe=NumberGuessCPURecipe(gpu_type="H100")).build()


def test_image_overlay_maps_to_runtime_env_pip_or_is_rejected():
    recipe = NumberGuessCPURecipe(image_overlay=lambda image: image.pip_install("syllables"),
                                  pip=["regex"])
    assert recipe.pip_packages() == ["regex", "syllables"]
    bad = NumberGuessCPURecipe(image_overlay=lambda image: image.apt_install("ffmpeg"))
    with pytest.raises(ConfigError, match=r"Recipe\(pip=\[\.\.\.\]\)"):
        bad.pip_packages()


def test_recipe_pip_is_refused_once_ray_runs(ray_local, tmp_path):
    """Ray's runtime_env is fixed at ray.init: launch() with Recipe(pip=...) in a process
    whose Ray is already up says so instead of training without the packages."""
    run = TrainJob(recipe=NumberGuessCPURecipe(pip=["regex"]), output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"recipe.pip=\['regex'\]: Ray is already initialized"):
        run.launch()


def test_importable_function_is_passed_by_dotted_path():
    from examples.number_guess_seed import number_guess_rm

    assert api.ship_function(number_guess_rm, "k") == "examples.number_guess_seed:number_guess_rm"
    assert api.ship_function("pkg.mod.fn", "k") == "pkg.mod.fn"
    with pytest.raises(ConfigError):
        api.ship_function(42, "k")


def test_notebook_function_is_shipped_by_value_to_ray_workers(ray_local):
    """A function Ray workers cannot import (defined in a function, like one in __main__)
    is cloudpickled into the cluster's KV store and loads through the dotted path in any
    worker, as rollout.args.load_plugin does."""
    bonus = 0.25

    async def my_rm(args, sample, **kwargs) -> float:
        return float(len(sample)) + bonus

    path = api.ship_function(my_rm, "recipe.custom_rm_function")
    assert path.startswith("trainer.api.shipping:shipped__my_rm__")

    @ray_local.remote
    def load_and_call(p):
        import asyncio

        import trainer.api.shipping as shipping
        shipping._SHIPPED.clear()  # a fresh worker would not have it: force the KV path
        from rollout.args import load_plugin

        fn = load_plugin(p, "rollout.custom_rm_function")
        return asyncio.run(fn(None, "abc"))

    assert ray_local.get(load_and_call.remote(path)) == 3.25


def test_dataset_config_prepares_files(tmp_path):
    class Rows(DatasetConfig):
        def load(self, split="all"):
            t = [1, 3] if split == "train" else [2]
            return [{"messages": [{"role": "user", "content": "go"}],
                     "label": json.dumps({"answer": x})} for x in t]

    values = Rows().materialize(tmp_path / "data")
    assert Path(values["path"]).exists() and Path(values["eval_path"]).exists()
    from rollout.data import _load_rows

    assert len(_load_rows(values["path"])) == 2 and len(_load_rows(values["eval_path"])) == 1
    assert values["input_key"] == "messages" and values["label_key"] == "label"


@pytest.mark.slow
def test_seed_example_runs_end_to_end(tmp_path):
    """examples/number_guess.py --quick: base eval through an endpoint, TrainJob.launch()
    (warm-up + 2 RL steps, the script's own reward function shipped from __main__), trained
    eval through an endpoint, table."""
    proc = run_group(
        [sys.executable, str(REPO / "examples" / "number_guess.py"), "--quick",
         f"logging.output_dir={tmp_path}", "logging.wandb_mode=disabled"],
        cwd=tmp_path, env=clean_env(), timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    summary = json.loads(line[len("RESULT "):])
    run_dir = Path(summary["run_dir"])
    cfg = (run_dir / "config.yaml").read_text()
    # shipped by value from __main__
    assert "trainer.api.shipping:shipped__number_guess_rm__" in cfg
    assert (run_dir / "data" / "train.parquet").exists()
    # The two RL steps ran.
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "rollout/raw_reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # The trained endpoint served a different model from the base one: the checkpoint
    # the second evaluation loaded is not the base's weights.
    from safetensors.torch import load_file

    from rollout.models import resolve_model_path

    trained = load_file(str(Path(summary["checkpoint"]) / "hf" / "model.safetensors"))
    base = load_file(str(Path(resolve_model_path("tiny-qwen3")) / "model.safetensors"))
    assert any(not torch.equal(trained[k], base[k]) for k in trained)
    # Each evaluation played all 10 even targets, scored by the example's own shaping:
    # success 2.0 - 0.1 * (turns - 1) with turns <= 6, format error -2, otherwise -1.
    for name in ("base", "trained"):
        s = summary[name]
        n_success, n_format = round(10 * s["success_rate"]), round(10 * s["format_error_rate"])
        assert abs(10 * s["success_rate"] - n_success) < 1e-9
        n_other = 10 - n_success - n_format
        low = (1.5 * n_success - n_other - 2 * n_format) / 10
        high = (2.0 * n_success - n_other - 2 * n_format) / 10
        assert low - 1e-9 <= s["mean_reward"] <= high + 1e-9, (name, s)
    table = (run_dir / "example_eval_table.md").read_text()
    for name in ("base", "trained"):
        assert f"| {name} | {summary[name]['success_rate']:.1%} | {summary[name]['mean_reward']:+.3f} |" in table


def test_the_seed_name_train_config_still_builds_and_warns_once(monkeypatch):
    import warnings

    from config import schema

    monkeypatch.setattr(schema, "_WARNED", set())
    with pytest.warns(FutureWarning, match="trainer.api.TrainConfig is deprecated: use "
                                           "trainer.api.TrainJob"):
        seed = api.TrainConfig(recipe=NumberGuessCPURecipe(num_rollout=2)).build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.TrainConfig(recipe=NumberGuessCPURecipe(num_rollout=2))
    assert seed == TrainJob(recipe=NumberGuessCPURecipe(num_rollout=2)).build()
