"""The import graph: layers config < envs < rollout < trainer < scripts/examples, no cycle.

Every import statement of every module (function-level ones included) is read with ast;
a module may import its own layer or a lower one, never a higher one, and no module
reaches itself again through imports. The config package is the bottom: it must also stay
free of torch, Ray and transformers, checked by really importing it (and composing the
default config) in a fresh interpreter."""

import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

LAYERS = {"config": 0, "envs": 1, "rollout": 2, "trainer": 3, "scripts": 4, "examples": 4}
HEAVY = ("torch", "ray", "transformers")


def _imports(path):
    """(line, top-level package) of each absolute or relative import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(REPO).parts[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, package if node.level else (node.module or "").split(".")[0]


def test_no_upward_import():
    upward = []
    for package, layer in LAYERS.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for line, target in _imports(path):
                if LAYERS.get(target, -1) > layer:
                    upward.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports. ``from pkg import name`` depends on the
    package itself (its __init__ runs and is read) and on ``pkg.name`` when that is a
    module."""
    modules = {}
    for package in LAYERS:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0]
                                                  if node.level > 1 else package, base]))
                deps.add(known(base))
                deps.update(f"{base}.{a.name}" for a in node.names
                            if f"{base}.{a.name}" in modules)
        graph[name] = deps - {name, ""}
    return graph


def test_import_graph_has_no_cycle():
    graph = _module_graph()
    assert "trainer.training.backends.megatron.backend" in graph  # the walk saw the tree
    cycles, done = [], set()

    def visit(node, path):
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _loaded_after(statement: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after running ``statement``."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return set(json.loads(out))


@pytest.mark.subprocess
def test_config_imports_nothing_heavy_and_nothing_of_the_project():
    loaded = _loaded_after("import config; config.compose_config()")
    assert "config" in loaded and "hydra" in loaded  # the check saw the real import
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
    assert not loaded & (set(LAYERS) - {"config"}), loaded & set(LAYERS)


@pytest.mark.subprocess
def test_an_engine_actor_process_does_not_import_torch():
    """Each engine's Ray actor only supervises its server process and speaks HTTP to it;
    torch costs every such process seconds of CPU at start-up (two per run, more on
    restarts), so the actor's module and the rollout package's top level stay without it."""
    loaded = _loaded_after("import rollout.engines.actor, rollout.engines")
    assert "rollout" in loaded and "requests" in loaded  # the check saw the real import
    assert "torch" not in loaded


@pytest.mark.subprocess
def test_a_rank_or_engine_actor_loads_no_generate_machinery_and_no_hydra():
    """Ranks and engine actors import submodules of rollout and config. The package names
    (``from rollout import Sample``) load their modules on first use, and the schema imports
    Hydra only to register itself for composing, so neither the generate machinery
    (aiohttp) nor Hydra costs those processes anything at start."""
    loaded = _loaded_after("import rollout.engines.actor, trainer.training.train_group, "
                           "trainer.training.backends.fsdp")
    assert {"rollout", "trainer", "config", "omegaconf"} <= loaded  # the real imports ran
    assert not loaded & {"aiohttp", "hydra"}, loaded & {"aiohttp", "hydra"}
    assert "aiohttp" in _loaded_after("from rollout import GenerateState")  # names still load


# Below the driver: what runs in Ray actors or is built per component.
BELOW_DRIVER = ("envs", "rollout", "trainer/training", "trainer/weight_sync")


def test_no_component_below_the_driver_takes_the_root_config():
    """A component gets the sections it uses: none below the driver names the root config
    type or reads its derived values (those reach it as named arguments)."""
    found = []
    for folder in BELOW_DRIVER:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Name) and node.id == "HomegymConfig") or (
                        isinstance(node, ast.Attribute) and node.attr == "derived"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, "the root config below the driver:\n" + "\n".join(found)


def test_the_root_config_cannot_reach_an_actor_but_its_sections_can():
    import copy
    import pickle

    import pytest
    import ray

    from config import compose_config

    config = compose_config()
    with pytest.raises(TypeError, match="stays in the driver"):
        pickle.dumps(config)
    with pytest.raises(TypeError, match="stays in the driver"):
        ray.cloudpickle.dumps(config)  # what Ray uses for an actor's arguments
    sections = pickle.loads(pickle.dumps((config.rollout, config.train, config.derived)))
    assert sections == (config.rollout, config.train, config.derived)
    clone = copy.deepcopy(config)  # copies still work in the driver
    assert clone == config and clone.derived == config.derived and clone.train is not config.train
