"""The README's first way to bring an environment (homegym's own ``Environment``), exactly
as printed: its code block saved as mypkg/envs.py and its command run (with small-run
overrides appended), so the README and the program cannot drift apart."""

import os
import re
import shlex

import pytest

from conftest import REPO, compose_config, run_main


def _readme_example() -> tuple[str, list[str]]:
    section = REPO.joinpath("README.md").read_text().split("## Bringing an environment", 1)[1]
    section = section.split("**1. ", 1)[1].split("**2. ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = next(line.strip() for line in section.splitlines()
                   if line.strip().startswith("python -m trainer.main"))
    return code, shlex.split(command)[3:]


def test_readme_example_composes_without_the_games_settings():
    _, overrides = _readme_example()
    config = compose_config(*overrides)
    assert config.env.name == "mypkg.envs:Countdown"
    assert config.env.kwargs == {} and config.warmup.steps == 0 and not config.eval.train_split
    assert config.derived.label == "countdown-tiny-qwen3"
    # The default run keeps the game's own settings.
    default = compose_config()
    assert default.env.kwargs["players"] and default.warmup.steps > 0 and default.eval.train_split


@pytest.mark.slow
def test_readme_environment_example_trains_as_printed(tmp_path, monkeypatch):
    code, overrides = _readme_example()
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(code)
    # The user's package is importable where they run the command (here: on PYTHONPATH,
    # which Ray's workers inherit).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run = run_main(tmp_path, *overrides, "train.num_steps=2", "rollout.rollout_batch_size=2",
                   "rollout.n_samples_per_prompt=2", "train.ranks_per_node=1",
                   "rollout.num_engines=1", "eval.n_samples_per_prompt=1", "train.save_interval=null",
                   timeout_s=400)
    steps = [m for m in run.metrics if "rollout/raw_reward" in m]
    assert [m["step"] for m in steps] == [1, 2], run.output[-2000:]
    # Episodes ran through the user's environment: its info keys became metrics.
    assert all("rollout/success_rate" in m for m in steps)
