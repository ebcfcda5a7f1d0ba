"""The args object user plug-ins see, plug-in loading, and manager config errors."""

import pytest

from rollout.args import RolloutArgs, load_plugin
from config import build_config
from trainer.driver import components


def cfg(**rollout):
    return build_config({"rollout": {"num_engines": 1, **rollout}})


def test_args_expose_router_config_and_extra_keys():
    a = RolloutArgs("http://127.0.0.1:30000",
                    **components.rollout_sections(cfg(extra_config={"max_turns": 3,
                                                                    "log_multi_turn": True})))
    assert (a.sglang_router_ip, a.sglang_router_port) == ("127.0.0.1", 30000)
    assert a.router_url == "http://127.0.0.1:30000"
    assert a.max_turns == 3 and a.log_multi_turn is True
    assert a.rollout.n_samples_per_prompt == a.n_samples_per_prompt == 4
    assert a.model.path == a.hf_checkpoint == "tiny-qwen3" and a.env.max_turns == 6
    assert not hasattr(a, "config") and not hasattr(a, "train")  # the rollout side's sections
    # env.max_turns by default
    assert RolloutArgs("127.0.0.1:1", **components.rollout_sections(cfg())).max_turns == 6


def test_args_reject_bad_keys_and_urls():
    with pytest.raises(ValueError, match="not a Python identifier"):
        RolloutArgs("http://h:1", **components.rollout_sections(cfg(extra_config={"max-turns": 3})))
    with pytest.raises(ValueError, match="host and a port"):
        RolloutArgs("http://h", **components.rollout_sections(cfg()))


def test_load_plugin_messages():
    assert load_plugin("examples.number_guess_seed.number_guess_rm", "k").__name__ == "number_guess_rm"
    assert load_plugin("examples.number_guess_seed:number_guess_generate", "k")
    with pytest.raises(ValueError, match="cannot import module"):
        load_plugin("nope_pkg.fn", "rollout.custom_rm_function")
    with pytest.raises(ValueError, match="has no 'missing'"):
        load_plugin("examples.number_guess_seed.missing", "rollout.custom_rm_function")
    with pytest.raises(ValueError, match="must be an async function"):
        load_plugin("envs.number_guess.extract_answer", "rollout.custom_rm_function")


def test_manager_config_errors(tiny_model_path):
    from rollout.manager import RolloutManagerCore

    with pytest.raises(ValueError, match="group_rm=true needs"):
        RolloutManagerCore(router_url="http://127.0.0.1:1",
                           **components.manager_args(cfg(group_rm=True)))
    with pytest.raises(ValueError, match="unknown filter 'nonzero'"):
        RolloutManagerCore(router_url="http://127.0.0.1:1",
                           **components.manager_args(cfg(dynamic_sampling_filter="nonzero")))
    c = cfg()
    c.env.name = "none"
    with pytest.raises(ValueError, match="no reward source"):
        RolloutManagerCore(router_url="http://127.0.0.1:1", **components.manager_args(c))
    c = cfg()
    c.env.kwargs = {"colour": "red"}
    with pytest.raises(ValueError, match="env.kwargs: NumberGuessEnv rejects"):
        RolloutManagerCore(router_url="http://127.0.0.1:1", **components.manager_args(c))


def test_generate_state_cached_per_config(tiny_model_path):
    from rollout.generate import GenerateState

    a, b = cfg(temperature=0.5), cfg(temperature=0.9)
    sa = GenerateState(RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(a)))
    assert GenerateState(RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(a))) is sa
    sb = GenerateState(RolloutArgs("http://127.0.0.1:1", **components.rollout_sections(b)))
    assert sb is not sa and sb.tokenizer is sa.tokenizer
    assert (sa.sampling_params["temperature"], sb.sampling_params["temperature"]) == (0.5, 0.9)
