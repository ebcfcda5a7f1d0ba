"""verifiers environments (0.4: a ``Taskset`` and the ``Harness`` that plays it) as homegym
agents: each episode is the environment's own ``run_episode``, its model calls served by
the episode's session, its reward the taskset's.

    python -m rollout.agent.verifiers_env my_taskset tasks.jsonl       # a row per task
    python -m trainer.main model.path=... data.path=tasks.jsonl \\
        rollout.agent.function=rollout.agent.verifiers_env:agent \\
        +rollout.extra_config.verifiers.taskset=my_taskset

``rollout.extra_config.verifiers`` (``args.verifiers``) names the environment:

- ``taskset``: the taskset id (an importable module exporting a ``Taskset``, and its
  default ``Harness`` if it ships one), ``taskset_config``: its config fields;
- ``harness``: a harness to pin, its id or ``{id: ..., <its config>}`` (null: the
  taskset's own, else verifiers' ``bash``);
- ``runtime``: where the harness program runs, default ``subprocess`` (this machine;
  verifiers' own default is a remote sandbox);
- ``client``: ``eval`` (default: the harness's requests -- chat completions, streamed or
  not, Responses, Anthropic Messages -- are relayed to the session in their own dialect)
  or ``train`` (verifiers renders the prompt itself and posts token ids to the session's
  ``/inference/v1/generate``; ``renderer`` is its ``renderers`` config, e.g.
  ``{name: default, tool_parser: qwen3}``).

A row's label is ``{"idx": i}``: the taskset's i-th task. An episode that verifiers
reports failed (a harness that cannot start, a reward that raises) fails its sample with
verifiers' own error message. verifiers' built-in harnesses (``bash``, ``null``, ...)
install ``uv`` and their script's packages when they first start, so they need a package
index; a harness whose loop runs in-process (``launch`` making its model calls itself)
needs nothing.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterator, Optional

MODEL = "policy"
_TASKS: dict[str, list] = {}  # the tasks of each taskset config, loaded once per process


def _options(args: Any) -> dict:
    options = getattr(args, "verifiers", None)
    if not isinstance(options, dict) or not options.get("taskset"):
        raise ValueError("rollout.extra_config.verifiers.taskset: name the verifiers taskset "
                         "(e.g. +rollout.extra_config.verifiers.taskset=my_taskset)")
    return dict(options)


def _env_config(options: dict) -> Any:
    import verifiers.v1 as vf

    agent: dict[str, Any] = {"runtime": {"type": options.get("runtime") or "subprocess"}}
    harness = options.get("harness")
    if harness:  # an id, or {id: ..., <its config fields>}
        agent["harness"] = dict(harness) if isinstance(harness, dict) else {"id": harness}
    taskset = {**(options.get("taskset_config") or {}), "id": options["taskset"]}
    return vf.SingleAgentEnvConfig(taskset=taskset, agent=agent)


def tasks(options: dict) -> list:
    """The taskset's tasks in ``load()`` order (the index a row's label names)."""
    import verifiers.v1 as vf

    key = json.dumps([options["taskset"], options.get("taskset_config")], sort_keys=True)
    if key not in _TASKS:
        _TASKS[key] = list(vf.load_taskset(_env_config(options).taskset))
    return _TASKS[key]


def _client(options: dict, base_url: str, args: Any) -> Any:
    import verifiers.v1 as vf

    kind = options.get("client") or "eval"
    # No key is read from the environment: the session needs none.
    common = {"base_url": base_url, "api_key_var": "HOMEGYM_SESSION_KEY"}
    if kind == "eval":
        return vf.EvalClientConfig(**common)
    if kind == "train":
        from rollout.models import resolve_model_path

        return vf.TrainClientConfig(**common, renderer=options.get("renderer"),
                                    renderer_model_name=resolve_model_path(
                                        args.model.path))
    raise ValueError(f"rollout.extra_config.verifiers.client: {kind!r}; expected eval or train")


def _task_index(sample: Any) -> int:
    label = json.loads(sample.label) if isinstance(sample.label, str) else sample.label
    if not isinstance(label, dict) or not isinstance(label.get("idx"), int):
        raise ValueError(f"a verifiers row's label is {{\"idx\": <task index>}}, got "
                         f"{sample.label!r}")
    return label["idx"]


async def agent(client: Any, sample: Any, args: Any) -> float:
    """One episode of the taskset's task ``sample.label["idx"]``; its reward."""
    import verifiers.v1 as vf

    options = _options(args)
    all_tasks = tasks(options)
    idx = _task_index(sample)
    if not 0 <= idx < len(all_tasks):
        raise ValueError(f"task {idx}: taskset {options['taskset']!r} has {len(all_tasks)} tasks")
    task = all_tasks[idx]
    sampling = {}
    if options.get("client") == "train" and args.data.apply_chat_template_kwargs:
        sampling["chat_template_kwargs"] = dict(args.data.apply_chat_template_kwargs)
    ctx = vf.ModelContext(model=MODEL, client=_client(options, str(client.base_url), args),
                          sampling=vf.Sampling(**sampling))
    # An Env is cheap (about a millisecond) and holds its serving state: one per episode.
    env = vf.load_environment(_env_config(options))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    if not episode.ok:
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "not ok"
        raise RuntimeError(f"verifiers episode failed: {detail}")
    metrics = {k: v for t in episode.traces for k, v in (t.metrics or {}).items()
               if isinstance(v, (int, float))}
    if metrics:
        sample.metadata["verifiers"] = metrics
    return sum(t.reward for t in episode.traces) / len(episode.traces)


def rows(taskset: str, taskset_config: Optional[dict] = None) -> Iterator[dict]:
    """A data row per task: its prompt (for the record: the harness renders its own) and
    the label naming it."""
    options = {"taskset": taskset, "taskset_config": taskset_config}
    for i, task in enumerate(tasks(options)):
        prompt = task.data.prompt
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                    [m.model_dump(exclude_none=True) for m in prompt or []])
        yield {"messages": messages or [{"role": "user", "content": ""}],
               "label": json.dumps({"idx": i})}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m rollout.agent.verifiers_env TASKSET_ID OUT.jsonl",
              file=sys.stderr)
        return 2
    with open(argv[1], "w") as f:
        n = sum(f.write(json.dumps(row) + "\n") > 0 for row in rows(argv[0]))
    print(f"wrote {n} rows to {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
