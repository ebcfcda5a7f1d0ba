"""Shared fixtures: one torch thread per process, a model cache, a real local Ray."""

import collections
import contextlib
import os
import sys
import tempfile
from pathlib import Path

# Before torch is imported anywhere: on a 2-core box one thread per process is fastest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HOMEGYM_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "homegym"))

import pytest  # noqa: E402
import torch  # noqa: E402
from trainer.driver import components  # noqa: E402

torch.set_num_threads(1)


# -------------------------------------------------------------------- tiers
# fast (`make test-fast`): no Ray, no subprocess. A test that uses ray_local is marked `ray`
# here; one that starts any other process (a server, trainer.main, a script) carries
# @pytest.mark.subprocess; end-to-end ones carry @pytest.mark.slow. A test with none of
# them that starts a process anyway fails (the audit hook below sees every spawn).
TIER_MARKERS = ("slow", "ray", "subprocess")
# Quick system tools libraries run on their own (platform.processor() runs uname;
# matplotlib's first import on a machine runs fc-list to build its font cache): not what
# the tier is about. A fork without exec (a privilege drop) is not either.
_QUICK_TOOLS = frozenset({"uname", "ldconfig", "git", "nproc", "lscpu", "id", "df", "which",
                          "fc-list"})
# The engine's C kernels compile on first use, once per cache and CPU (about a second:
# rollout/engines/hf/native.py); on a fresh cache a fast test that runs the engine's
# forward in process is the first to ask for them.
_NATIVE_SOURCE = os.path.join("rollout", "engines", "hf", "csrc", "kernels.c")
_fast_guard: dict = {"armed": False, "spawned": []}


def _audit_spawns(event: str, args) -> None:
    if not _fast_guard["armed"]:
        return
    if event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1] or args[0]]
        native_build = any(str(a).endswith(_NATIVE_SOURCE) for a in argv)
        if os.path.basename(str(argv[0])) not in _QUICK_TOOLS and not native_build:
            _fast_guard["spawned"].append(" ".join(map(str, argv))[:160])
    elif event in ("os.posix_spawn", "os.spawn", "os.system", "os.exec"):
        _fast_guard["spawned"].append(f"{event} {str(args)[:140]}")
    elif event == "homegym.sglang_wheel":  # sglang_source.wheel_dir: pip download when uncached
        _fast_guard["spawned"].append(f"pip download sglang=={args[0]} (on a fresh cache)")


sys.addaudithook(_audit_spawns)


def starts_processes(fixture_function):
    """For a fixture that starts a process (put it under @pytest.fixture): every test that
    uses the fixture, directly or through another, is marked ``subprocess``."""
    fixture_function.starts_processes = True
    return fixture_function


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(getattr(d.func, "starts_processes", False)
                                    for defs in info.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.subprocess)
    # Files with the most end-to-end tests first, each file's own order kept. `make test`
    # hands whole files to its workers in this order (--no-loadscope-reorder; xdist's own
    # order is by test count, which put the one-test end-to-end files, 45-75 s each, last),
    # so the long runs start early and small files fill in at the end instead of one
    # worker idling while the other finishes a long run.
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


def _is_fast(item) -> bool:
    return not any(item.get_closest_marker(m) for m in TIER_MARKERS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # Armed before the item's fixtures (module- and session-scoped ones included) start.
    _fast_guard["armed"], _fast_guard["spawned"] = _is_fast(item), []
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    _fast_guard["armed"] = False


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process(request):
    """A test in the fast tier (no tier marker) starts no process."""
    yield
    spawned = list(_fast_guard["spawned"])
    if _fast_guard["armed"] and spawned:
        pytest.fail(f"{request.node.nodeid} started a process but is in the fast tier: mark it "
                    f"@pytest.mark.subprocess (or use ray_local for Ray): {spawned[:3]}",
                    pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from rollout.models import resolve_model_path

    return resolve_model_path("tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_5_path() -> str:
    """The built-in hybrid model (Gated DeltaNet + gated attention, Qwen3.5's VLM layout)."""
    from rollout.models import resolve_model_path

    return resolve_model_path("tiny-qwen3_5")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance for the whole session (started and stopped here)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="hg-ray-")
    # Logical CPUs above the 2 physical cores: actors here mostly wait on I/O, and a test
    # file's module-scoped groups hold theirs until the file ends (test_fsdp_train_group
    # holds 7 training ranks while its zero-advantage test starts 2 more). An actor asking
    # for more than is free waits, without an error, for good.
    # address="local": always a fresh instance, never one already running on the machine.
    # Its workers inherit this process's environment (one thread, HOMEGYM_CACHE: set at the
    # top of this file); a runtime_env would start each of them through Ray's setup shim.
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=True,
             _temp_dir=tmp)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_local) -> str:
    """The session's Ray instance, for a ``trainer.main`` subprocess to join (run_main)."""
    return ray_local.get_runtime_context().gcs_address


@pytest.fixture()
def engine_group(ray_local, tiny_model_path, tmp_path):
    """``engine_group(config, **kwargs)`` starts an EngineGroup (tiny model by default)
    that is shut down after the test, whether or not an assert failed."""
    groups = []

    def start(config, **kwargs):
        kwargs.setdefault("model_path", tiny_model_path)
        kwargs.setdefault("log_dir", str(tmp_path / f"engines{len(groups)}"))
        groups.append(components.engine_group(config, **kwargs))
        return groups[-1]

    yield start
    for group in reversed(groups):
        group.shutdown()


def fresh_logprobs(model, prompt, output, temperature):
    """Log-probs of ``output`` tokens from one plain forward pass over prompt + output,
    temperature-scaled as the engines report them."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


# What session-scoped fixtures started (actor ids, server (pid, start time)): owned by the
# session, not leaked by the test or module that happened to start them.
_SESSION_ACTORS: set = set()
_SESSION_SERVERS: set = set()

# A fixed greedy request whose answer (tokens and log-probs, from an empty prefix cache)
# fingerprints an engine's weights.
_FINGERPRINT = {"input_ids": [5, 17, 42, 99, 7], "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}


def _engine_state(group, *, idle_timeout_s: float = 60) -> dict:
    """What a test must leave as it found it: every engine alive and behind the router,
    its weights (version and a greedy fingerprint), not paused, memory not released,
    nothing running (aborted requests get ``idle_timeout_s`` to wind down)."""
    import time

    import requests

    deadline = time.monotonic() + idle_timeout_s
    while any(i.get("num_running_reqs") for i in group.server_infos()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    infos = group.server_infos()
    workers = requests.get(f"{group.router_url}/workers", timeout=30).json()
    workers = workers.get("workers", workers) if isinstance(workers, dict) else workers
    group.flush_cache()
    prints = []
    for url in group.urls:
        out = requests.post(f"{url}/generate", json=_FINGERPRINT, timeout=60).json()
        prints.append((out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]))
    return {"urls": list(group.urls), "health": group.health(),
            "router": sorted((w["url"], w.get("is_healthy")) for w in workers),
            "versions": group.weight_versions(), "weights": prints,
            "running": [i.get("num_running_reqs") for i in infos],
            "paused": [i.get("paused") for i in infos], "released": [i.get("released") for i in infos]}


@pytest.fixture(scope="session")
def shared_engines(ray_local, tiny_model_path, tmp_path_factory):
    """Two hf engines (tiny model) behind the router for the whole session, with their state
    as started (``_engine_state``). Use it through ``shared_router``."""
    from rollout_engines import config
    from trainer.driver import components

    actors, servers = _alive_actors(), _servers()
    group = components.engine_group(config(num_engines=2), model_path=tiny_model_path,
                        log_dir=str(tmp_path_factory.mktemp("shared-engines")))
    try:
        _SESSION_ACTORS.update(set(_alive_actors()) - set(actors))
        _SESSION_SERVERS.update(set(_servers()) - set(servers))
        yield group, _engine_state(group)
    finally:
        group.shutdown()


@pytest.fixture()
def shared_router(shared_engines) -> str:
    """The router URL of the session's two engines (tiny model, ``rollout_engines.config``'s
    settings), for a test that generates, aborts or times out requests but changes nothing
    else: after the test the engines must be as it found them (weights, count, not paused,
    memory held, idle), or it fails. A test that pushes weights, pauses, releases memory or
    kills an engine starts its own group (``engine_group``)."""
    group, found = shared_engines
    yield group.router_url
    left = _engine_state(group)
    changed = {k: (found[k], left[k]) for k in found if found[k] != left[k]}
    assert not changed, f"the test left the shared engines changed (found, left): {changed}"


def push_tensors(client, named_tensors, version=None) -> dict:
    """Load (name, tensor) pairs into one engine through SGLang's own tensor route, in
    SGLang's payload format (what the training ranks send)."""
    from rollout.engines.weights_io import serialize_for_sglang

    payloads, load_format = serialize_for_sglang(list(named_tensors))
    return client.update_weights_from_tensor(payloads, load_format=load_format, version=version)


REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port free a moment ago (the one helper: rollout.engines.free_port). Only
    for what must be told a port; anything that can bind port 0 itself should."""
    from rollout.engines.actor import free_port as _free_port

    return _free_port("127.0.0.1")


def fake_run_dir(tmp_path, model_dir, *, step: int = 3, name: str = "run") -> Path:
    """A run directory as trainer.main leaves it, for what reads one (serve, eval): one
    complete checkpoint ``step_<step>`` holding ``model_dir`` as its hf/ export, and
    ``latest`` pointing at it."""
    import shutil

    from trainer.driver.checkpoint import MARKER

    run = Path(tmp_path) / name
    step_dir = run / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(model_dir, step_dir / "hf")
    (step_dir / MARKER).write_text("ok\n")
    (run / "checkpoints" / "latest").symlink_to(step_dir.name)
    return run


def chaos_module():
    """scripts/chaos_soak.py as a module (its fault injection serves tests too), loaded once."""
    import importlib.util
    import sys

    if "chaos_soak" not in sys.modules:
        spec = importlib.util.spec_from_file_location("chaos_soak",
                                                      REPO / "scripts" / "chaos_soak.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["chaos_soak"] = module
        spec.loader.exec_module(module)
    return sys.modules["chaos_soak"]


@contextlib.contextmanager
def running_engine(launch, name: str, log_dir):
    """A homegym engine server (``rollout.engines.EngineServer``) started for the block and
    shut down after it; the fixture or test using it must be in the subprocess tier."""
    from rollout.engines import EngineServer

    eng = EngineServer(launch, name, str(log_dir))
    eng.start()
    try:
        yield eng
    finally:
        eng.shutdown()


def wait_for(predicate, *, timeout_s: float, what: str, interval_s: float = 0.01):
    """Poll ``predicate`` until it returns something truthy (returned); fail naming
    ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


# -------------------------------------------------------------------- leak checks
# Servers a test may start (directly or inside Ray actors): engine servers and the router.
_SERVER_MARKERS = ("rollout.engines.hf.server", "sglang_router", "sglang::router",
                   "sglang.launch_server")


def _alive_actors() -> dict:
    import ray

    if not ray.is_initialized():
        return {}
    from ray._private.state import actors

    return {aid: info.get("ActorClassName", "?")
            for aid, info in actors(actor_state_name="ALIVE").items()}


def started(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (/proc/<pid>/stat, field
    22): with the pid, what tells a process from a later one that reuses the pid. Not
    psutil's ``create_time``: that adds the boot time in wall-clock seconds, read again on
    every call, so an adjustment of the clock moves it for every process at once (and a
    process seen before would pass for a new one)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _servers() -> dict:
    import psutil

    found = {}
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for p in children:
        try:
            cmd = " ".join(p.cmdline())
            if any(m in cmd for m in _SERVER_MARKERS) and p.status() != psutil.STATUS_ZOMBIE:
                found[(p.pid, started(p.pid))] = cmd[:160]
        except (psutil.Error, OSError):
            pass
    return found


def _supervised_by(pid: int, supervisors: set) -> bool:
    """Whether one of ``pid``'s ancestors is one of ``supervisors`` (and still alive): a
    restarted engine's server and the HTTP front it forks belong to the engine's actor."""
    import psutil

    try:
        return any(p.pid in supervisors for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _check_no_leaks(before_actors: dict, before_servers: dict, where: str,
                    before_pids: frozenset = frozenset()) -> None:
    """Actors and server processes started since the snapshot must be gone (shutdown is
    asynchronous: allow them a deadline); leftover servers are killed, then reported. A
    server started by a process that predates the snapshot (an engine actor of a
    module-scoped group restarting its server) belongs to that owner, not to the test."""
    import time

    import psutil

    deadline = time.monotonic() + 30
    while True:
        actors = {a: c for a, c in _alive_actors().items()
                  if a not in before_actors and a not in _SESSION_ACTORS}
        servers = {k: c for k, c in _servers().items() if k not in before_servers
                   and k not in _SESSION_SERVERS and not _supervised_by(k[0], before_pids)}
        if not actors and not servers:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid, _ in servers:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    pytest.fail(f"{where} left running: actors {sorted(actors.values())}, "
                f"servers {sorted(servers.values())}")


@pytest.fixture(autouse=True)
def no_leaked_actors_or_servers(request):
    """No Ray actor or server process a test started outlives it."""
    import psutil

    # This process's descendants (an orphaned server's parent, init, is never one of them).
    pids = frozenset(p.pid for p in psutil.Process().children(recursive=True))
    actors, servers = _alive_actors(), _servers()
    yield
    _check_no_leaks(actors, servers, request.node.nodeid, pids)


@pytest.fixture(scope="module", autouse=True)
def no_leaked_actors_or_servers_per_module(request):
    """The same for module-scoped fixtures (an engine group shared by a module's tests),
    and no torch process group left in this process: a pytest worker runs many modules, and
    the next one's counts of groups would be off."""
    actors, servers, groups = _alive_actors(), _servers(), process_groups()
    yield
    _check_no_leaks(actors, servers, request.module.__name__)
    left = sorted(process_groups() - groups)
    if left:
        pytest.fail(f"{request.module.__name__} left torch process groups behind: {left}",
                    pytrace=False)


def process_groups() -> set[str]:
    """The names of this process's torch process groups (none when torch.distributed was
    never imported: a fast test's check imports nothing)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return set(c10d._world.pg_names.values()) if c10d is not None else set()


def compose_config(*overrides):
    """The run config as `python -m trainer.main OVERRIDES` composes it (homegym's one
    composition, config.compose)."""
    from config import compose_config

    return compose_config(overrides)


def read_jsonl(path):
    import json

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def clean_env() -> dict:
    """This process's environment without anything that would make a child join another
    Ray cluster or log online."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "WANDB_API_KEY", "WANDB_MODE"):
        env.pop(key, None)
    return env


def run_group(cmd, *, timeout_s: float, merge_output: bool = False, **kwargs):
    """``subprocess.run`` with text output captured, in its own process group, which is
    killed whole once the command returns or times out (what it started cannot outlive
    the test). Output goes through files, not pipes, so a leftover grandchild holding
    them open cannot stall the wait. ``timeout_s`` stays under pytest's own timeout, so
    the test fails with the output rather than being killed without it."""
    import signal
    import subprocess
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out if merge_output else err,
                                text=True, start_new_session=True, **kwargs)
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        pytest.fail(f"{' '.join(map(str, cmd))[:200]} timed out after {timeout_s:.0f}s:\n"
                    f"{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


class MainRun:
    def __init__(self, run_dir: Path, output: str):
        self.run_dir, self.output = run_dir, output

    @property
    def metrics(self) -> list:
        return read_jsonl(self.run_dir / "metrics.jsonl")


def run_main(tmp_path, *overrides, timeout_s: float = 600, run_name: str = "run",
             ray_address: str | None = None, wandb_mode: str = "disabled") -> MainRun:
    """``python -m trainer.main`` in its own process group (killed whole when it ends or
    times out), with a clean environment and the run under ``tmp_path``; fails with the
    output's tail. ``ray_address`` (the ``ray_address`` fixture): the run joins the
    session's Ray instance (RAY_ADDRESS, as on a cluster) instead of starting its own,
    which saves a Ray start and stop; not for a run whose test kills its process group or
    checks what it leaves behind (its actors then live in the session's Ray, not under the
    driver), nor for one that needs an environment the session's Ray workers lack.
    ``wandb_mode``: ``offline`` for a test that checks what wandb keeps (~1 CPU-s more)."""
    import sys

    out_dir = Path(tmp_path) / "out"
    cmd = [sys.executable, "-m", "trainer.main", f"logging.output_dir={out_dir}",
           f"logging.run_name={run_name}", f"logging.wandb_mode={wandb_mode}", *overrides]
    env = clean_env()
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    proc = run_group(cmd, cwd=REPO, env=env, timeout_s=timeout_s, merge_output=True)
    if proc.returncode != 0:
        pytest.fail(f"trainer.main exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return MainRun(out_dir / run_name, proc.stdout)


class MainExit:
    def __init__(self, returncode: int, stdout: str, stderr: str, seconds: float, run_dir: Path):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.seconds, self.run_dir = seconds, run_dir


def main_exit(tmp_path, *overrides, env: dict | None = None, timeout_s: float = 120,
              run_name: str = "run") -> MainExit:
    """``python -m trainer.main`` expected to stop (a config error, a start-up check): its
    exit code, stdout and stderr apart, and how long it took. ``env``: extra variables."""
    import subprocess
    import sys
    import time

    out_dir = Path(tmp_path) / "out"
    cmd = [sys.executable, "-m", "trainer.main", f"logging.output_dir={out_dir}",
           f"logging.run_name={run_name}", "logging.wandb_mode=disabled", *overrides]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env={**clean_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)
    return MainExit(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start,
                    out_dir / run_name)


# -------------------------------------------------------------------- the suite's time
_durations: dict = {}
_session_start: list = []


def pytest_sessionstart(session):
    import time

    _session_start.append(time.monotonic())


_worker_done: dict = {}  # pytest-xdist worker -> seconds into the session of its last report


def pytest_runtest_logreport(report):
    import time

    # A test's time is its setup + call + teardown (a module fixture's start-up counts
    # for the test that set it up).
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    node = getattr(report, "node", None)  # set in the controller of a -n run
    if node is not None and _session_start:
        _worker_done[node.gateway.id] = time.monotonic() - _session_start[0]


@pytest.hookimpl(trylast=True)  # after --durations' list: the log's last lines
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's wall time and its ten slowest tests, last (CI's log ends with them)."""
    import time

    if not _session_start or not _durations:
        return
    wall = time.monotonic() - _session_start[0]
    load = os.getloadavg()
    tr = terminalreporter
    tr.write_sep("=", "the suite's time")
    tr.write_line(f"wall time {wall:.0f} s ({wall / 60:.1f} min) for {len(_durations)} tests; "
                  f"load average now {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
                  f"on {os.cpu_count()} CPUs")
    if len(_worker_done) > 1:  # the gap is time a worker had no file left to take
        tr.write_line("each worker's last test ended at " + ", ".join(
            f"{w} {t:.0f} s" for w, t in sorted(_worker_done.items())))
    tr.write_line("ten slowest tests (setup + call + teardown):")
    for nodeid, seconds in sorted(_durations.items(), key=lambda kv: -kv[1])[:10]:
        tr.write_line(f"  {seconds:7.1f} s  {nodeid}")


@pytest.fixture(scope="session")
@starts_processes  # the first use on a machine runs `pip download` for the wheel
def sglang_wheels():
    """tests/sglang_source.py (SGLang's own source, read from its PyPI wheels in the cache).
    Tests take it through this fixture, which puts them in the subprocess tier."""
    import sglang_source

    return sglang_source


@pytest.fixture(scope="session")
@starts_processes
def openenv_echo_server(tmp_path_factory):
    """The URL of tests/openenv_echo_server.py (an openenv-core environment served with
    uvicorn) in a process of its own, killed at the end of the session."""
    import signal
    import subprocess
    import sys

    import requests

    port = free_port()
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "openenv_echo_server.py"),
                                 str(port)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            pytest.fail(f"the OpenEnv server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return requests.get(f"{url}/health", timeout=2).ok
        except requests.ConnectionError:
            return False

    try:
        # Importing openenv-core's server imports gradio: slow on a loaded box.
        wait_for(healthy, timeout_s=300, what="the OpenEnv server's /health", interval_s=0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
