"""Chaos soak: homegym runs under repeated real faults, and nothing is lost or trained twice.

    python scripts/chaos_soak.py                       # 30 steps, async and colocated
    python scripts/chaos_soak.py --steps 8 --modes async --engine-kills 2

Each mode runs `python -m trainer.main` once without faults (the reference wall time), then
once under chaos: engine servers SIGKILLed at random moments, a training rank SIGKILLed
(the run crashes and is resumed with train.resume=auto), and one SIGTERM (graceful stop,
then resumed). At the end the run's prompt ledger (ledger.json in the run directory) must
show every prompt group trained exactly once per epoch, and the figures are printed:
faults injected, engine restarts, requests retried, groups dropped and replaced, and the
wall-time overhead against the fault-free run.

tests/test_faults_chaos.py runs a short version of the same code in CI.
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


# ---------------------------------------------------------------------- the soak
MODES = {
    "async": ["cluster.colocate=false", "algo.max_staleness=1"],
    "colocated": ["cluster.colocate=true"],
}
BASE = ["rollout.num_engines=2", "train.ranks_per_node=1", "warmup.steps=0",
        "eval.before_and_after=false", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4", "train.save_interval=2", "train.resume=auto",
        "train.hang_timeout_s=300",
        # Long enough responses that a step lasts seconds: a fault lands inside a step.
        "rollout.max_response_len=32"]


@dataclass
class Figures:
    mode: str
    steps: int
    engine_kills: int = 0
    rank_kills: int = 0
    sigterms: int = 0
    launches: int = 0
    engine_restarts: float = 0.0
    request_retries: float = 0.0
    ledger: dict = field(default_factory=dict)
    wall_s: float = 0.0
    reference_wall_s: Optional[float] = None
    sigterm_outcome: str = ""
    events: list = field(default_factory=list)

    def report(self) -> str:
        requeued = {k.removeprefix("ledger/requeued_"): v for k, v in sorted(self.ledger.items())
                    if k.startswith("ledger/requeued_")}
        why = ", ".join(f"{k} {v:.0f}" for k, v in requeued.items()) or "none"
        outstanding = sum(self.ledger.get(f"ledger/{s}", 0.0)
                          for s in ("pending", "in_flight", "buffered", "generated"))
        overhead = (f"{self.wall_s - self.reference_wall_s:+.0f}s "
                    f"({self.wall_s / self.reference_wall_s - 1:+.0%})"
                    if self.reference_wall_s else "not measured")
        return "\n".join([
            f"chaos soak [{self.mode}], {self.steps} steps, {self.launches} launches",
            f"  faults injected: {self.engine_kills} engine kills, {self.rank_kills} training-rank "
            f"kills (crash, resumed), {self.sigterms} SIGTERM ({self.sigterm_outcome or '-'}; "
            f"resumed)",
            f"  when: {'; '.join(self.events) or '-'}",
            f"  engine restarts: {self.engine_restarts:.0f}; requests retried: "
            f"{self.request_retries:.0f}",
            f"  groups dropped and generated again: {sum(requeued.values()):.0f} ({why}); "
            f"replaced: {self.ledger.get('ledger/replaced', 0):.0f}",
            f"  ledger: {self.ledger.get('ledger/trained', 0):.0f} groups trained, "
            f"{self.ledger.get('ledger/trained_twice', 0):.0f} trained twice, "
            f"{outstanding:.0f} outstanding at the end",
            f"  wall time {self.wall_s:.0f}s; overhead against the fault-free run: {overhead}",
        ])


def _metric_sum(run_dir: Path, key: str) -> float:
    total = 0.0
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            total += float(json.loads(line).get(key, 0.0))
        except ValueError:
            pass
    return total


def _metric_max_per_launch(run_dir: Path, key: str) -> float:
    """``key`` is a run total that restarts at 0 with each launch: sum the launches' maxima
    (a launch shows as the step number falling back)."""
    total, best, last_step = 0.0, 0.0, 0
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = int(row.get("step", 0))
        if step < last_step:
            total, best = total + best, 0.0
        last_step = step
        best = max(best, float(row.get(key, 0.0)))
    return total + best


def soak(out_dir: Path, mode: str, *, steps: int, engine_kills: int, kill_rank_at: Optional[int],
         sigterm_at: Optional[int], reference: bool, seed: int = 0,
         timeout_s: float = 3600) -> Figures:
    """One chaos run of ``mode`` (see the module docstring); raises if it fails or if the
    ledger does not prove exactly-once."""
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
    # Engine kills at random steps (a random moment inside them: the kill waits a random
    # fraction of a step after the step is seen), away from the rank kill and the SIGTERM.
    # Not in the step of (or before) the rank kill or the SIGTERM, nor the last ones: the
    # run must live long enough after an engine kill to notice and restart it.
    busy = {s for at in (kill_rank_at, sigterm_at) if at is not None for s in (at - 1, at)}
    candidates = [s for s in range(1, steps - 1) if s not in busy]
    kill_steps = sorted(rng.sample(candidates, k=min(engine_kills, len(candidates))))
    t0 = time.monotonic()
    done = False
    while not done:
        run = launch(out_dir, name, overrides)
        figures.launches += 1
        stop = threading.Event()
        injected: list[str] = []
        last_engine_kill = [-10]

        def inject() -> None:
            pid = run.proc.pid
            while not stop.is_set() and run.proc.poll() is None:
                step = steps_logged(run_dir)
                if kill_steps and step >= kill_steps[0]:
                    kill_steps.pop(0)
                    time.sleep(rng.uniform(0.0, 0.5))
                    servers = engine_servers(pid, run_dir)
                    if servers:
                        rng.choice(servers).send_signal(signal.SIGKILL)
                        figures.engine_kills += 1
                        injected.append("engine")
                        figures.events.append(f"engine killed in step {step + 1}")
                        last_engine_kill[0] = step
                    continue
                # The run must get to restart a killed engine before it crashes or stops.
                if step < last_engine_kill[0] + 2:
                    time.sleep(0.2)
                    continue
                if kill_rank_at is not None and figures.rank_kills == 0 and step >= kill_rank_at:
                    time.sleep(rng.uniform(0.0, 1.0))
                    ranks = training_ranks(pid)
                    if ranks:
                        ranks[0].send_signal(signal.SIGKILL)
                        figures.rank_kills += 1
                        injected.append("rank")
                        figures.events.append(f"training rank killed in step {step + 1}")
                        return
                if sigterm_at is not None and figures.sigterms == 0 and step >= sigterm_at:
                    run.proc.send_signal(signal.SIGTERM)
                    figures.sigterms += 1
                    injected.append("sigterm")
                    figures.events.append(f"SIGTERM in step {step + 1}")
                    return
                time.sleep(0.2)

        injector = threading.Thread(target=inject, daemon=True)
        injector.start()
        code = run.wait(timeout_s)
        stop.set()
        injector.join(10)
        finished = "stopped after step" not in run.tail(3000) and code == 0
        if "sigterm" in injected:
            figures.sigterm_outcome = ("stopped after the step, saved" if code == 0
                                       else f"driver exited {code}")
        if code != 0 and not {"rank", "sigterm"} & set(injected):
            raise RuntimeError(f"{name}: trainer.main exited {code} without an injected "
                               f"crash:\n{run.tail()}")
        if code != 0:
            run.kill_tree()  # what a crash leaves behind goes with it
        done = finished
        if figures.launches > 6:
            raise RuntimeError(f"{name}: still not finished after {figures.launches} launches")
    figures.wall_s = time.monotonic() - t0
    figures.engine_restarts = _metric_max_per_launch(run_dir, "rollout/engine_restarts")
    figures.request_retries = _metric_sum(run_dir, "rollout/request_retries")
    figures.ledger = json.loads((run_dir / "ledger.json").read_text())
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
