"""Start-up checks: the config against the code and files it names, before Ray starts.

``build_config`` checks values against each other; ``preflight`` checks them against the
world, so that a mistake costs seconds instead of surfacing minutes later inside a Ray
actor as a remote traceback:

- every dotted path (rollout.custom_generate_function, rollout.custom_rm_function,
  rollout.dynamic_sampling_filter, env.name) imports and has the shape homegym calls it
  with (async or not, the positional parameters it is given);
- the environment's own start-up check passes (``Environment.check_setup``: an adapter's
  package is installed, its task or game exists, its server answers), and env.kwargs are
  accepted by the environment's constructor (one throwaway instance);
- a warm-up (warmup.steps > 0) has a scripted player (``Environment.demo_action``);
- every split the run reads has rows: data files exist and hold data.input_key and
  data.label_key, or the environment generates the split;
- model.path is a directory with a config and a tokenizer (or a built-in model that can
  be made here);
- the engine can serve the model here: SGLang on CPU needs AVX-512 and AMX (and, for
  Qwen3.5, Gated DeltaNet head dims its kernels take), homegym's CPU engine keeps
  recurrent state for Qwen3.5 only, and a hybrid model's cached states can be flushed
  after every weight update (not while requests wait in place);
- what the training backend needs is installed here (Megatron's sequence parallelism:
  Transformer Engine), before any engine or rank starts;
- the training backend runs the model's layers exactly: a hybrid model's Gated DeltaNet
  layers are homegym's (packed sequences and shared prefixes with per-sequence state) for
  Qwen3.5 only, any other would run transformers' kernels, which take neither; on Megatron
  they are built on the local layer spec, which has no sequence parallelism.

Each problem is a ``ConfigError`` whose one-line message starts with the key. Nothing here
loads a torch model, a tokenizer or a whole data file.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from envs.base import Environment, EnvSetupError
from rollout.filters import FILTERS
from rollout.plugins import get_env_class, load_object, registered_or_dotted
from config import ConfigError, HomegymConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def preflight(config: HomegymConfig) -> None:
    """Raise ConfigError for the first thing in ``config`` that cannot work."""
    check_backend(config)
    env_cls = check_env(config)
    check_plugins(config, env_cls)
    check_warmup(config, env_cls)
    check_data(config, env_cls)
    check_model(config)
    check_engine(config)
    check_training(config)


def _fail(key: str, message: str) -> ConfigError:
    return ConfigError(f"{key}: " + " ".join(message.split()))


def _keyed(err: Exception) -> ConfigError:
    """An error whose message already starts with the key (load_object's, EnvSetupError)."""
    return ConfigError(" ".join(str(err).split()))


def _load(path: str, key: str, registry: Optional[Mapping[str, Any]] = None,
          what: str = "") -> Any:
    """The object at dotted ``path`` (or ``registry[path]``: rollout.plugins.
    registered_or_dotted), a user mistake as a ConfigError."""
    try:
        if registry is not None:
            return registered_or_dotted(path, registry, key, what)
        return load_object(path, key)
    except ValueError as err:  # load_object's own message already names key and path
        raise _keyed(err) from err
    except Exception as err:  # the module itself failed on import (SyntaxError, ...)
        raise _fail(key, f"{path!r}: importing it raised {type(err).__name__}: {err}") from err


def _takes(fn: Callable, *args: Any) -> bool:
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): cannot tell, let the call decide
        return True
    return True


def _signature(fn: Callable) -> str:
    try:
        return f"{getattr(fn, '__name__', 'it')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


# ----------------------------------------------------------------------- backend
def check_backend(config: HomegymConfig) -> None:
    """Megatron's sequence parallelism needs Transformer Engine's layer spec: the local
    spec normalises with torch RMSNorm, which refuses it (megatron-core 0.16.1
    transformer/torch_norm.py). The ranks would find out in their actors, after every
    engine started (trainer/backends/megatron/model.py kernel_plan)."""
    train = config.train
    if train.backend != "megatron" or not train.sequence_parallel:
        return
    if config.cluster.device != "cuda":
        raise _fail("train.sequence_parallel", "true needs Transformer Engine on CUDA; "
                    "cluster.device=cpu runs Megatron's local layer spec: set "
                    "train.sequence_parallel=false")
    from trainer.training.backends.megatron.model import have_transformer_engine

    if not have_transformer_engine():
        raise _fail("train.sequence_parallel", "true needs Transformer Engine, which does "
                    "not import here: install it (pip install --no-build-isolation -c "
                    "constraints.txt -e '.[te]') or set train.sequence_parallel=false")


# ----------------------------------------------------------------------- environment
def check_env(config: HomegymConfig) -> Optional[type[Environment]]:
    """The environment class (None for env.name=none), built once with env.kwargs."""
    env = config.env
    if not env.enabled:
        return None
    try:
        cls = get_env_class(env.name)
    except ValueError as err:
        raise _keyed(err) from err
    except Exception as err:  # the env's module failed on import
        raise _fail("env.name", f"{env.name!r}: importing it raised {type(err).__name__}: "
                    f"{err}") from err
    if inspect.isabstract(cls):
        raise _fail("env.name", f"{env.name!r}: {cls.__name__} leaves abstract methods "
                    f"unimplemented ({', '.join(sorted(cls.__abstractmethods__))})")
    kwargs = env.init_kwargs
    try:
        cls.check_setup(**kwargs)  # e.g. an adapter's package, task name or server
    except EnvSetupError as err:
        raise _keyed(err) from err
    try:
        inspect.signature(cls).bind(max_turns=env.max_turns, seed=0, **kwargs)
    except TypeError as err:
        params = ", ".join(inspect.signature(cls).parameters)
        raise _fail("env.kwargs", f"{cls.__name__} rejects them: {err} (it takes {params})"
                    ) from err
    try:
        cls(max_turns=env.max_turns, seed=0, **kwargs)
    except EnvSetupError as err:
        raise _keyed(err) from err
    except Exception as err:
        raise _fail("env.kwargs", f"{cls.__name__}(max_turns={env.max_turns}, **{kwargs}) "
                    f"raised {type(err).__name__}: {err}") from err
    return cls


# ----------------------------------------------------------------------- plug-ins
def check_plugins(config: HomegymConfig, env_cls: Optional[type[Environment]]) -> None:
    """User functions by dotted path, with the shape rollout.manager calls them with."""
    r = config.rollout
    if r.custom_generate_function:
        check_async_function(_load(r.custom_generate_function, "rollout.custom_generate_function"),
                             "rollout.custom_generate_function", r.custom_generate_function,
                             ("args", "sample", "sampling_params"))
    if r.agent.function:  # an OpenAI-API agent (rollout/agent)
        check_async_function(_load(r.agent.function, "rollout.agent.function"),
                             "rollout.agent.function", r.agent.function,
                             ("client", "sample", "args"))
    if r.agent.demo_function and not callable(_load(r.agent.demo_function,
                                                    "rollout.agent.demo_function")):
        raise _fail("rollout.agent.demo_function", f"{r.agent.demo_function!r} is not callable")
    if r.custom_rm_function:
        check_async_function(_load(r.custom_rm_function, "rollout.custom_rm_function"),
                             "rollout.custom_rm_function", r.custom_rm_function,
                             ("args", "samples") if r.group_rm else ("args", "sample"))
    elif r.group_rm:
        raise _fail("rollout.group_rm", "true needs rollout.custom_rm_function (the function "
                    "that scores a whole group)")
    if (env_cls is None and not r.custom_rm_function and not r.custom_generate_function
            and not r.agent.function):
        raise _fail("env.name", f"{config.env.name!r} means no environment, so no reward: set "
                    "env.name or rollout.custom_rm_function")
    name = r.dynamic_sampling_filter
    if name is not None:
        key = "rollout.dynamic_sampling_filter"
        fn = _load(name, key, FILTERS, "filter")
        if name in FILTERS:
            return
        if not callable(fn):
            raise _fail(key, f"{name!r} is not callable")
        if inspect.iscoroutinefunction(fn):
            raise _fail(key, f"{name!r} must be a plain function (def, not async def): the "
                        "manager calls it synchronously and uses its truth value")
        if not _takes(fn, None, []):
            raise _fail(key, f"{name!r} must take (args, samples); it is {_signature(fn)}")


def check_async_function(fn: Any, key: str, path: str, params: tuple[str, ...]) -> None:
    """``fn`` is ``async def`` and takes ``params`` positionally."""
    if "shipped__" in path:  # the Python API's by-value function: name it, not its key
        path = getattr(fn, "__qualname__", path)
    if not callable(fn):
        raise _fail(key, f"{path!r} is not callable")
    if not inspect.iscoroutinefunction(fn):
        raise _fail(key, f"{path!r} must be an async function (async def): it runs on the "
                    "rollout manager's event loop")
    if not _takes(fn, *([None] * len(params))):
        raise _fail(key, f"{path!r} must take ({', '.join(params)}); it is {_signature(fn)}")


# ----------------------------------------------------------------------- warm-up
def check_warmup(config: HomegymConfig, env_cls: Optional[type[Environment]]) -> None:
    steps = config.warmup.steps
    if steps <= 0:
        return
    if config.rollout.agent.function:  # the agent plays against its scripted player
        if not config.rollout.agent.demo_function:
            raise _fail("warmup.steps", f"{steps} with an agent (rollout.agent.function) "
                        "needs its scripted player, rollout.agent.demo_function; or set "
                        "warmup.steps=0")
        return
    if env_cls is None:
        raise _fail("warmup.steps", f"{steps} needs an environment whose scripted player "
                    f"plays the warm-up transcripts; env.name is {config.env.name!r}")
    if getattr(env_cls, "demo_action", None) is Environment.demo_action:
        raise _fail("warmup.steps", f"{steps}, but environment {config.env.name!r} "
                    f"({env_cls.__name__}) has no scripted player (demo_action) to make the "
                    "warm-up transcripts; set warmup.steps=0 or give it a demo_action")


# ----------------------------------------------------------------------- data
def _splits(config: HomegymConfig) -> list[str]:
    """The splits this run reads."""
    splits = ["train"]
    evaluates = config.derived.eval_before_and_after or bool(config.eval.interval)
    if evaluates or (config.warmup.steps > 0 and "eval" in config.warmup.splits):
        splits.append("eval")
    return splits


def check_data(config: HomegymConfig, env_cls: Optional[type[Environment]]) -> None:
    data = config.data
    for split in _splits(config):
        key = "data.path" if split == "train" else "data.eval_path"
        path = data.path if split == "train" else data.eval_path
        if path is not None:
            columns, origin = _file_columns(path, key), path
        else:
            columns = _env_columns(config, env_cls, split, key)
            origin = f"the {split} rows of environment {config.env.name!r}"
        if columns is None:  # a format whose columns are only known once loaded
            continue
        if data.input_key not in columns:
            raise _fail("data.input_key", f"{data.input_key!r} is not a column of {origin} "
                        f"(columns: {', '.join(sorted(columns))})")
        if data.label_key is not None and data.label_key not in columns:
            raise _fail("data.label_key", f"{data.label_key!r} is not a column of {origin} "
                        f"(columns: {', '.join(sorted(columns))}); data.label_key=null if the "
                        "rows have no label")


def _file_columns(path: str, key: str) -> Optional[set[str]]:
    """Column names of a data file from its schema or first row (the file is not loaded)."""
    p = Path(path)
    if not p.exists():
        raise _fail(key, f"{path!r} does not exist")
    if p.is_dir():  # written by datasets' save_to_disk
        if (p / "dataset_dict.json").exists():
            raise _fail(key, f"{path!r} holds a DatasetDict (several splits); point {key} at "
                        "one split's directory")
        info = p / "dataset_info.json"
        if not info.exists():
            raise _fail(key, f"{path!r} is a directory but not a saved `datasets` dataset "
                        "(no dataset_info.json)")
        features = json.loads(info.read_text()).get("features")
        return set(features) if isinstance(features, dict) else None
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return set(pq.read_schema(path).names)
        except Exception as err:
            raise _fail(key, f"{path!r} is not a readable parquet file: {err}") from err
    if path.endswith((".jsonl", ".json")):
        from rollout.data import jsonl_rows

        try:
            for row in jsonl_rows(path):  # the first row is enough
                return set(row)
        except ValueError as err:
            raise _fail(key, str(err)) from err
        raise _fail(key, f"{path!r} has no rows")
    raise _fail(key, f"{path!r}: unsupported data format (use .parquet, .jsonl or a "
                "`datasets` directory)")


def _env_columns(config: HomegymConfig, env_cls: Optional[type[Environment]], split: str,
                 key: str) -> set[str]:
    if env_cls is None:
        raise _fail(key, f"null, and env.name={config.env.name!r} generates no {split} rows; "
                    f"set {key}")
    try:
        rows = env_cls.dataset(split, **config.env.init_kwargs)
    except NotImplementedError as err:
        raise _fail(key, f"null, and {err}") from err
    except EnvSetupError as err:
        raise _keyed(err) from err
    except Exception as err:
        raise _fail("env.kwargs", f"{env_cls.__name__}.dataset({split!r}) raised "
                    f"{type(err).__name__}: {err}") from err
    if not rows:
        raise _fail(key, f"null, and environment {config.env.name!r} generates no {split} rows")
    if not isinstance(rows[0], dict):
        raise _fail("env.name", f"{env_cls.__name__}.dataset({split!r}) must return dicts, "
                    f"got {type(rows[0]).__name__}")
    return set(rows[0])


# ----------------------------------------------------------------------- model
def check_model(config: HomegymConfig) -> None:
    """model.path holds a config and a tokenizer, or is a built-in model buildable here."""
    from rollout.models import ModelPathError

    try:
        _check_model_files(config)
    except ModelPathError as err:
        raise ConfigError(str(err)) from err


def _check_model_files(config: HomegymConfig) -> None:
    from rollout.models import (BUILTIN_MODELS, default_cache_dir, resolve_model_path,
                                smollm2_gguf_file)

    path = config.model.path
    if path in BUILTIN_MODELS and not os.path.isdir(path):
        cache = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
        if not (cache / path / "config.json").exists():
            if path == "smollm2-135m":
                smollm2_gguf_file()  # the package that ships its GGUF file is installed
            return  # tiny-qwen3 is made from code on first use
        directory = cache / path
    else:
        directory = Path(resolve_model_path(path))  # a directory with config.json, or why not
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise _fail("model.path", f"{str(directory)!r} has no tokenizer (none of "
                    f"{', '.join(TOKENIZER_FILES)}); save the tokenizer into the checkpoint "
                    "directory (tokenizer.save_pretrained)")


# ----------------------------------------------------------------------- engine
def _model_config(config: HomegymConfig) -> dict:
    """model.path's config.json ({} for a built-in model not made yet)."""
    from rollout.checkpoints import read_config
    from rollout.models import BUILTIN_MODELS, default_cache_dir

    path = config.model.path
    if path in BUILTIN_MODELS and not os.path.isdir(path):
        cache = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
        path = str(cache / path)
    return read_config(path)


def check_engine(config: HomegymConfig) -> None:
    """What the configured engine cannot serve here, or cannot keep right for this model."""
    from rollout.checkpoints import cpu_engine_refusal, is_hybrid
    from rollout.engines.sglang_serving import cpu_model_problem, missing_cpu_flags
    from rollout.models import HYBRID_BUILTINS

    r, cluster = config.rollout, config.cluster
    model = _model_config(config)
    if r.engine == "sglang" and cluster.device == "cpu":
        missing = missing_cpu_flags()
        if missing:
            raise _fail("rollout.engine", f"sglang on cluster.device=cpu needs a CPU with "
                        f"AVX-512 and AMX (SGLang's CPU kernels are built for them); this one "
                        f"lacks {', '.join(missing)}: use rollout.engine=hf")
        problem = cpu_model_problem(model)
        if problem:
            raise _fail("model.path", f"{config.model.path!r}: SGLang on CPU cannot serve it: "
                        f"{problem}; use rollout.engine=hf or cluster.device=cuda")
    if r.engine == "hf":
        refusal = cpu_engine_refusal(model)
        if refusal:
            raise ConfigError(refusal)
    hybrid = is_hybrid(model) or (not model and config.model.path in HYBRID_BUILTINS)
    if hybrid and not cluster.colocate and r.update_in_flight == "pause":
        raise _fail("rollout.update_in_flight", "pause with a hybrid model (Qwen3.5): the "
                    "engines' cached recurrent states were computed with the old weights and "
                    "must be flushed after every update, and an engine flushes only when no "
                    "request waits in place; set rollout.update_in_flight=abort (or "
                    "cluster.colocate=true)")


# ----------------------------------------------------------------------- training
# Hybrid text models whose linear-attention layers homegym's trainer runs itself
# (rollout/modeling/hybrid.py: the Qwen3.5 Gated DeltaNet layout).
TRAINER_HYBRID_TYPES = ("qwen3_5_text",)


def check_training(config: HomegymConfig) -> None:
    """What the training backend would run differently from the model (never silently)."""
    from rollout.checkpoints import is_hybrid, text_config
    from rollout.models import HYBRID_BUILTINS

    model = _model_config(config)
    if not (is_hybrid(model) or (not model and config.model.path in HYBRID_BUILTINS)):
        return
    kind = text_config(model).get("model_type", "qwen3_5_text") if model else "qwen3_5_text"
    if kind not in TRAINER_HYBRID_TYPES:
        raise _fail("model.path", f"{config.model.path!r} is a hybrid {kind} model: homegym's "
                    f"trainer runs the linear-attention layers of {', '.join(TRAINER_HYBRID_TYPES)} "
                    "only, and transformers' own kernels for them take no packed sequences "
                    "(cu_seqlens) or per-sequence states, so packed or shared-prefix batches "
                    "would change the numbers")
    if config.train.backend == "megatron" and config.train.sequence_parallel:
        raise _fail("train.sequence_parallel", f"true with a hybrid model ({kind}) on "
                    "train.backend=megatron: its layers are built on megatron-core's local "
                    "layer spec (trainer/training/backends/megatron/hybrid.py), whose torch "
                    "norms have no sequence parallelism; set train.sequence_parallel=false")
