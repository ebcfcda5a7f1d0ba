"""Chaos soak: homegym runs under repeated real faults, and nothing is lost or trained twice.

    python scripts/chaos_soak.py                       # 30 steps, async and colocated
    python scripts/chaos_soak.py --steps 8 --modes async --engine-kills 2

Each mode runs `python -m trainer.main` once without faults (the reference wall time), then
once under chaos, with a fault schedule every run meets (a fault waits for its moment,
however many steps that takes, and the soak fails if one never lands):
- engine servers SIGKILLed, alternately while generating (an engine seen decoding
  requests) and in the layout's weight phase (async: an engine seen paused for a weight
  push; colocated: an engine seen with its memory released for training, before the
  resume and push), each once the previous kill's restart shows in the metrics;
- a training rank SIGKILLed (the run crashes and is resumed with train.resume=auto);
- one SIGTERM (graceful stop after the step, then resumed).
At the end the run's prompt ledger (ledger.json in the run directory) must show every
prompt group trained exactly once per epoch, and the figures are printed: faults injected
(engine kills by phase), engine restarts, requests retried, groups dropped and replaced,
and the wall-time overhead against the fault-free run.

The engines are homegym's CPU engine (its /get_server_info reports running requests,
paused and released). tests/test_faults_chaos.py runs a short version of the same code in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

REPO = Path(__file__).resolve().parents[1]
ENGINE_MARKER = "rollout.engines.hf.server"
RANK_MARKER = "ray::TrainActor"


# ---------------------------------------------------------------------- processes
def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def find(pid: int, marker: str, also: Optional[str] = None) -> list[psutil.Process]:
    """Live descendants of ``pid`` whose command line holds ``marker`` (and ``also``)."""
    found = []
    for p in descendants(pid):
        try:
            cmd = " ".join(p.cmdline())
            if marker in cmd and (also is None or also in cmd) and \
                    p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def engine_servers(driver_pid: int, run_dir: Path) -> list[psutil.Process]:
    return find(driver_pid, ENGINE_MARKER, str(run_dir))


def training_ranks(driver_pid: int) -> list[psutil.Process]:
    return find(driver_pid, RANK_MARKER)


def steps_logged(run_dir: Path) -> int:
    """The highest training step in metrics.jsonl (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "train/pg_loss" in row or "perf/train_time" in row:
            step = max(step, int(row.get("step", 0)))
    return step


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


# ---------------------------------------------------------------------- a driver run
@dataclass
class Launch:
    """One `python -m trainer.main` process of a run (a run may take several: resumes)."""

    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise TimeoutError(f"trainer.main timed out after {timeout_s:.0f}s:\n"
                               f"{self.tail()}")
        self._reader.join(10)
        return code

    def tail(self, n: int = 4000) -> str:
        return "".join(self.output)[-n:]

    def kill_tree(self) -> None:
        """What a crash leaves: the driver's process group SIGKILLed (a local Ray dies with
        it, as a node losing power would)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def clean_env() -> dict:
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "WANDB_API_KEY", "WANDB_MODE"):
        env.pop(key, None)
    return env


def launch(out_dir: Path, run_name: str, overrides: list[str], *,
           pythonpath: Optional[str] = None) -> Launch:
    """Start ``python -m trainer.main`` in its own process group; ``pythonpath`` is put in
    front of the import path (where user plug-ins live), for the driver and its actors."""
    cmd = [sys.executable, "-m", "trainer.main", f"logging.output_dir={out_dir}",
           f"logging.run_name={run_name}", "logging.wandb_mode=disabled", *overrides]
    env = clean_env()
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Launch(proc)


# ---------------------------------------------------------------------- engine phases
def server_url(proc: psutil.Process) -> Optional[str]:
    """The URL of an hf engine server, from the port file its command line names."""
    try:
        args = proc.cmdline()
        host = args[args.index("--host") + 1]
        port_file = args[args.index("--port-file") + 1] if "--port-file" in args else None
        port = (Path(port_file).read_text().strip() if port_file
                else args[args.index("--port") + 1])
    except (psutil.Error, ValueError, IndexError, OSError):
        return None
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{port}" if port and port != "0" else None


def server_info(url: str) -> Optional[dict]:
    try:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


# What an engine reports (/get_server_info of homegym's CPU engine) while it is in a phase:
# decoding requests of a rollout; paused for a weight update (async: pause, push,
# continue); its memory released (colocated: release, train, resume and push).
PHASES = {
    "generation": lambda i: i.get("num_running_reqs", 0) > 0 and not i.get("paused")
    and not i.get("released"),
    "push": lambda i: bool(i.get("paused")),
    "release": lambda i: bool(i.get("released")),
}
# The phase in which each layout changes an engine's weights.
WEIGHT_PHASE = {"async": "push", "colocated": "release"}


# ---------------------------------------------------------------------- the soak
MODES = {
    "async": ["cluster.colocate=false", "algo.max_staleness=1", "algo.rollout_correction=token_tis"],
    "colocated": ["cluster.colocate=true"],
}
BASE = ["rollout.num_engines=2", "train.ranks_per_node=1", "warmup.steps=0",
        "eval.before_and_after=false", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4", "train.save_interval=2", "train.resume=auto",
        "train.hang_timeout_s=300",
        # Long enough responses that a step lasts seconds: a fault lands inside a step.
        "rollout.max_response_len=32"]


@dataclass
class Fault:
    """One fault of the schedule: armed once the run has logged step ``after``, and
    injected at the first moment its condition holds (an engine fault: an engine is seen
    in ``phase``), however many steps that takes."""

    kind: str  # engine | rank | sigterm
    after: int
    phase: str = ""  # engine faults: generation | push | release
    armed: int = 0  # the last step logged when its wait for the moment began
    landed_in: int = 0  # the step it landed in
    landed: str = ""  # where it landed, once injected


def schedule(mode: str, *, steps: int, engine_kills: int, kill_rank_at: Optional[int],
             sigterm_at: Optional[int], rng: random.Random) -> list[Fault]:
    """Faults in the order they are injected. Engine kills alternate between generation
    and the layout's weight phase (so any two include one of each), at random steps away
    from the rank kill and the SIGTERM, and early enough that the run outlives their
    recovery."""
    busy = {s for at in (kill_rank_at, sigterm_at) if at is not None for s in (at - 1, at)}
    candidates = [s for s in range(1, max(2, steps - 2)) if s not in busy]
    at = sorted(rng.sample(candidates, k=min(engine_kills, len(candidates))))
    phases = ["generation", WEIGHT_PHASE[mode]]
    faults = [Fault("engine", s, phases[i % 2]) for i, s in enumerate(at)]
    if kill_rank_at is not None:
        faults.append(Fault("rank", kill_rank_at))
    if sigterm_at is not None:
        faults.append(Fault("sigterm", sigterm_at))
    return sorted(faults, key=lambda f: f.after)  # stable: engine faults first on a tie


@dataclass
class Figures:
    mode: str
    steps: int
    engine_kills: dict = field(default_factory=dict)  # phase -> engines killed in it
    rank_kills: int = 0
    sigterms: int = 0
    launches: int = 0
    engine_restarts: float = 0.0
    request_retries: float = 0.0
    failed_samples: float = 0.0
    ledger: dict = field(default_factory=dict)
    wall_s: float = 0.0
    reference_wall_s: Optional[float] = None
    sigterm_outcome: str = ""
    landed: list = field(default_factory=list)  # the faults injected, in order

    @property
    def num_engine_kills(self) -> int:
        return sum(self.engine_kills.values())

    @property
    def faults(self) -> int:
        return self.num_engine_kills + self.rank_kills + self.sigterms

    def report(self) -> str:
        requeued = {k.removeprefix("ledger/requeued_"): v for k, v in sorted(self.ledger.items())
                    if k.startswith("ledger/requeued_")}
        why = ", ".join(f"{k} {v:.0f}" for k, v in requeued.items()) or "none"
        outstanding = sum(self.ledger.get(f"ledger/{s}", 0.0)
                          for s in ("pending", "in_flight", "buffered", "generated"))
        overhead = (f"{self.wall_s - self.reference_wall_s:+.0f}s "
                    f"({self.wall_s / self.reference_wall_s - 1:+.0%}; fault-free "
                    f"{self.reference_wall_s:.0f}s)"
                    if self.reference_wall_s else "not measured")
        kills = ", ".join(f"{n} mid-{phase}" for phase, n in sorted(self.engine_kills.items()))
        return "\n".join([
            f"chaos soak [{self.mode}], {self.steps} steps, {self.launches} launches",
            f"  faults injected: {self.faults}: {self.num_engine_kills} engine kills "
            f"({kills or '-'}), {self.rank_kills} training-rank kills (crash, resumed), "
            f"{self.sigterms} SIGTERM ({self.sigterm_outcome or '-'}; resumed)",
            f"  when: {'; '.join(f.landed for f in self.landed) or '-'}",
            f"  engine restarts: {self.engine_restarts:.0f}; requests retried by post(): "
            f"{self.request_retries:.0f} (the router re-sends a dead engine's requests "
            f"itself, uncounted); samples failed: {self.failed_samples:.0f}",
            f"  groups dropped and generated again: {sum(requeued.values()):.0f} ({why}); "
            f"replaced: {self.ledger.get('ledger/replaced', 0):.0f}",
            f"  ledger: {self.ledger.get('ledger/trained', 0):.0f} groups trained, "
            f"{self.ledger.get('ledger/trained_twice', 0):.0f} trained twice, "
            f"{outstanding:.0f} outstanding at the end",
            f"  wall time {self.wall_s:.0f}s; overhead against the fault-free run: {overhead}",
        ])


def _metric_rows(run_dir: Path, skip: int = 0) -> list[dict]:
    """metrics.jsonl's rows after the first ``skip`` lines."""
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines()[skip:] if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return rows


def _metric_sum(run_dir: Path, key: str) -> float:
    return sum(float(r.get(key, 0.0)) for r in _metric_rows(run_dir))


class Injector:
    """Injects ``faults`` into one launch, in order, each at the first moment its condition
    holds; returns after a fault that ends the launch (rank kill, SIGTERM), when the
    launch exits, or when the schedule is done. The schedule carries over to the next
    launch."""

    def __init__(self, run: Launch, run_dir: Path, faults: list[Fault], figures: Figures,
                 rng: random.Random) -> None:
        self.run, self.run_dir, self.faults = run, run_dir, faults
        self.figures, self.rng = figures, rng
        path = run_dir / "metrics.jsonl"
        self.skip = len(path.read_text().splitlines()) if path.exists() else 0
        self.killed_here = 0  # engines killed in this launch
        self.ended_by: Optional[str] = None  # the fault that ended the launch
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)

    def _alive(self) -> bool:
        return not self.stop.is_set() and self.run.proc.poll() is None

    def _recovered(self) -> bool:
        """This launch has logged a step, and one that counts every engine killed in it
        as restarted: nothing else is injected before that."""
        rows = _metric_rows(self.run_dir, self.skip)
        restarts = max((r.get("rollout/engine_restarts", 0.0) for r in rows), default=0.0)
        return any("perf/step_time" in r for r in rows) and restarts >= self.killed_here

    def _shortest_step_time(self) -> float:
        """The shortest perf/step_time this launch has logged: a step that follows an
        engine's restart takes seconds, the ones after it a tenth of that."""
        rows = _metric_rows(self.run_dir, self.skip)
        return min((float(r["perf/step_time"]) for r in rows if "perf/step_time" in r),
                   default=1.0)

    def _loop(self) -> None:
        while self.faults and self._alive():
            fault = self.faults[0]
            step = steps_logged(self.run_dir)
            if step < fault.after or not self._recovered():
                # Often enough to land in the step after the one awaited: the short soak's
                # async steps after a resume take ~0.2 s, and a SIGTERM that arrives only
                # once the last step is done finds nothing left to stop.
                time.sleep(0.05)
                continue
            fault.armed = fault.armed or step
            if fault.kind == "engine":
                self._kill_engine(fault)
            elif fault.kind == "rank":
                # A random moment of the step under way or the next: within the shortest
                # step's length from now. A fixed second would span several of the short
                # soak's ~0.1 s async steps, and a crash after the last checkpoint but one
                # leaves the resumed launch no step for the stop.
                time.sleep(self.rng.uniform(0.0, self._shortest_step_time()))
                ranks = training_ranks(self.run.proc.pid)
                if ranks and self._alive():
                    ranks[0].send_signal(signal.SIGKILL)
                    self._landed(fault, "training rank killed")
                    self.figures.rank_kills += 1
                    self.ended_by = "rank"
                    return
            elif fault.kind == "sigterm":
                self.run.proc.send_signal(signal.SIGTERM)
                self._landed(fault, "SIGTERM")
                self.figures.sigterms += 1
                self.ended_by = "sigterm"
                return

    def _kill_engine(self, fault: Fault) -> None:
        """Poll the engines until one is seen in the fault's phase, then SIGKILL its server."""
        in_phase = PHASES[fault.phase]
        urls: dict[int, str] = {}
        while self._alive():
            for proc in engine_servers(self.run.proc.pid, self.run_dir):
                # A server seen before it wrote its port file is looked up again next round.
                url = urls.get(proc.pid) or server_url(proc)
                if url is not None:
                    urls[proc.pid] = url
                info = server_info(url) if url else None
                if info is not None and in_phase(info):
                    proc.send_signal(signal.SIGKILL)
                    self.killed_here += 1
                    self.figures.engine_kills[fault.phase] = \
                        self.figures.engine_kills.get(fault.phase, 0) + 1
                    running = info.get("num_running_reqs", 0)
                    self._landed(fault, f"engine killed mid-{fault.phase}",
                                 f" ({running} requests running)")
                    return
            time.sleep(0.02)

    def _landed(self, fault: Fault, what: str, detail: str = "") -> None:
        fault.landed_in = steps_logged(self.run_dir) + 1
        fault.landed = f"{what} in step {fault.landed_in}{detail}"
        self.figures.landed.append(fault)
        self.faults.pop(0)


def soak(out_dir: Path, mode: str, *, steps: int, engine_kills: int, kill_rank_at: Optional[int],
         sigterm_at: Optional[int], reference: bool, seed: int = 0,
         timeout_s: float = 3600) -> Figures:
    """One chaos run of ``mode`` (see the module docstring); raises if it fails, if a
    scheduled fault never landed, or if the ledger does not prove exactly-once."""
    rng = random.Random(seed)
    overrides = BASE + MODES[mode] + [f"train.num_steps={steps}"]
    figures = Figures(mode=mode, steps=steps)
    if reference:
        t0 = time.monotonic()
        ref = launch(out_dir, f"{mode}-reference", overrides)
        if ref.wait(timeout_s) != 0:
            raise RuntimeError(f"the fault-free {mode} run failed:\n{ref.tail()}")
        figures.reference_wall_s = time.monotonic() - t0
    name = f"{mode}-chaos"
    run_dir = out_dir / name
    faults = schedule(mode, steps=steps, engine_kills=engine_kills, kill_rank_at=kill_rank_at,
                      sigterm_at=sigterm_at, rng=rng)
    planned = [f"{f.kind}{'/' + f.phase if f.phase else ''} after step {f.after}" for f in faults]
    t0 = time.monotonic()
    done = False
    while not done:
        run = launch(out_dir, name, overrides)
        figures.launches += 1
        injector = Injector(run, run_dir, faults, figures, rng)
        code = run.wait(timeout_s)
        injector.close()
        # rollout/engine_restarts is a total per launch: this launch's own rows give its share.
        figures.engine_restarts += max((float(r.get("rollout/engine_restarts", 0.0))
                                        for r in _metric_rows(run_dir, injector.skip)), default=0.0)
        stopped = "stopped after step" in run.tail(3000)
        if injector.ended_by == "sigterm":
            figures.sigterm_outcome = ("stopped after the step, saved" if code == 0 and stopped
                                       else f"driver exited {code}")
        if code != 0 and injector.ended_by is None:
            raise RuntimeError(f"{name}: trainer.main exited {code} without an injected "
                               f"crash:\n{run.tail()}")
        if code != 0:
            run.kill_tree()  # what a crash leaves behind goes with it
        done = code == 0 and not stopped
        if figures.launches > 6:
            raise RuntimeError(f"{name}: still not finished after {figures.launches} launches")
    figures.wall_s = time.monotonic() - t0
    figures.request_retries = _metric_sum(run_dir, "rollout/request_retries")
    figures.failed_samples = _metric_sum(run_dir, "rollout/failed_samples")
    figures.ledger = json.loads((run_dir / "ledger.json").read_text())
    if faults:
        raise RuntimeError(f"{name}: faults that never landed: {faults} (planned: {planned})\n"
                           f"{figures.report()}")
    if figures.ledger.get("ledger/trained_twice", 0) != 0:
        raise RuntimeError(f"{name}: groups trained twice: {figures.ledger}")
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--modes", nargs="+", default=["async", "colocated"], choices=list(MODES))
    p.add_argument("--engine-kills", type=int, default=4)
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "chaos")
    args = p.parse_args(argv)
    reports = []
    for mode in args.modes:
        figures = soak(args.out / time.strftime("%Y%m%d-%H%M%S"), mode, steps=args.steps,
                       engine_kills=args.engine_kills, kill_rank_at=args.steps // 3,
                       sigterm_at=(2 * args.steps) // 3, reference=not args.no_reference,
                       seed=args.seed)
        reports.append(figures.report())
        print(reports[-1], flush=True)
    print("\n" + "\n\n".join(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
