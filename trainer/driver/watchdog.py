"""Hang diagnosis: a step that makes no progress for ``train.hang_timeout_s`` fails the run,
with the stacks of every process of it on disk.

The driver calls ``kick(what)`` whenever it moves on (each step, checkpoint, evaluation).
If no kick comes in time, the watchdog thread
- dumps the Python stacks (``py-spy dump``) of the driver, every Ray actor process of the
  run and every engine server into ``<run dir>/hang/``;
- names the stuck call: Ray titles an actor's process ``ray::Class.method`` while a task
  runs in it, so the busy actors say which call is stuck, and the driver's own stack says
  where it waits;
- ends the stuck calls so the driver stops waiting: the busy actor processes are
  SIGKILLed (the driver's ``ray.get`` then raises, and ``Driver.run`` turns that into a
  ``HangError`` carrying the message); where no actor is busy (the driver waits on
  something else), SIGUSR1 raises the ``HangError`` in the driver's main thread. Either
  way the run unwinds through the runtime's teardown like any other error.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

log = logging.getLogger("homegym")

# SGLang's server is its launcher (the HTTP front) and the processes it spawns, titled
# sglang::scheduler, sglang::detokenizer: a stuck generation waits in the scheduler.
ENGINE_MARKERS = ("rollout.engines.hf.server", "sglang.launch_server", "sglang::")


class HangError(RuntimeError):
    """A step made no progress for train.hang_timeout_s."""


def _py_spy() -> Optional[str]:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def run_processes(root_pid: int) -> list[tuple[int, str]]:
    """(pid, title) of the run's processes worth a stack dump: Ray actors and engine
    servers among ``root_pid``'s descendants, or, on a cluster, the actors the Ray state
    API lists on this node."""
    import psutil

    found: dict[int, str] = {}
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        children = []
    for p in children:
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if (title.startswith("ray::") and not title.startswith("ray::IDLE")) or any(
                m in title for m in ENGINE_MARKERS):
            found[p.pid] = title[:200]
    if not found:
        try:
            from ray.util.state import list_actors

            for a in list_actors(filters=[("state", "=", "ALIVE")]):
                if a.pid:
                    found[a.pid] = f"ray::{a.class_name}"
        except Exception as err:  # no state API (no dashboard): the driver alone
            log.warning("watchdog: cannot list the run's actors: %s", err)
    return sorted(found.items())


def busy_calls(processes: list[tuple[int, str]]) -> list[str]:
    """``Class.method (pid N)`` of each actor process running a task."""
    busy = []
    for pid, title in processes:
        name = title.split()[0]
        if name.startswith("ray::") and "." in name:
            busy.append(f"{name.removeprefix('ray::')} (pid {pid})")
    return busy


def dump_stacks(out_dir: Path, processes: list[tuple[int, str]], *,
                driver_pid: int, timeout_s: float = 30.0) -> list[Path]:
    """``py-spy dump`` of the driver and of ``processes`` into ``out_dir``; the driver's
    own threads also through ``traceback`` (no py-spy needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    frames = sys._current_frames()
    text = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is not None:
            text.append(f"Thread {thread.name} ({thread.ident}):\n"
                        + "".join(traceback.format_stack(frame)))
    path = out_dir / f"driver_{driver_pid}.traceback.txt"
    path.write_text("\n".join(text))
    written.append(path)
    spy = _py_spy()
    if spy is None:
        log.warning("watchdog: py-spy not found; only the driver's stacks are dumped")
        return written
    targets = [(driver_pid, "driver")] + [(pid, title) for pid, title in processes]
    for pid, title in targets:
        name = title.split()[0].removeprefix("ray::").replace("/", "_") or "process"
        if "engines" in title:
            name = "engine_server"
        path = out_dir / f"{name}_{pid}.txt"
        try:
            r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                               text=True, timeout=timeout_s)
            path.write_text(f"# {title}\n{r.stdout}{r.stderr}")
        except (subprocess.TimeoutExpired, OSError) as err:
            path.write_text(f"# {title}\npy-spy dump failed: {err}\n")
        written.append(path)
    return written


def _driver_waits_at(thread_id: int) -> str:
    """The driver's innermost homegym frame: where its main thread waits."""
    frame = sys._current_frames().get(thread_id)
    where = ""
    root = str(Path(__file__).resolve().parents[2])
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(root) and "site-packages" not in code.co_filename:
            where = f"{Path(code.co_filename).name}:{frame.f_lineno} in {code.co_name}"
            break
        frame = frame.f_back
    return where


class Watchdog:
    """Call ``kick`` on progress; ``close`` when done. ``timeout_s`` None: does nothing."""

    def __init__(self, timeout_s: Optional[float], run_dir: Path) -> None:
        self.timeout_s = timeout_s
        self.run_dir = Path(run_dir)
        self.what = "start"
        self.message: Optional[str] = None
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread: Optional[threading.Thread] = None
        self._old_handler = None
        if timeout_s is None:
            return
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGUSR1, self._raise)
        self._thread = threading.Thread(target=self._watch, name="homegym-watchdog",
                                        daemon=True)
        self._thread.start()

    def kick(self, what: str) -> None:
        self.what = what
        self._last = time.monotonic()

    def _raise(self, signum, frame) -> None:
        raise HangError(self.message or "hang")

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            self._fire(idle)
            return

    def _fire(self, idle: float) -> None:
        where = _driver_waits_at(self._main)
        processes = run_processes(os.getpid())
        busy = busy_calls(processes)
        out_dir = self.run_dir / "hang"
        dump_stacks(out_dir, processes, driver_pid=os.getpid())
        stuck = ", ".join(busy) if busy else "no actor is running a task"
        self.message = (f"no progress for {idle:.0f}s after {self.what} "
                        f"(train.hang_timeout_s={self.timeout_s:g}): stuck in {stuck}; the "
                        f"driver waits at {where or '?'}. Stacks of every process: {out_dir}")
        (out_dir / "report.txt").write_text(self.message + "\n")
        print(f"homegym: hang: {self.message}", flush=True)
        stuck_pids = [pid for pid, title in processes
                      if title.startswith("ray::") and "." in title.split()[0]]
        for pid in stuck_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not stuck_pids and self._old_handler is not None:
            os.kill(os.getpid(), signal.SIGUSR1)

    def close(self) -> None:
        self._stop.set()
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR1, self._old_handler)
            self._old_handler = None

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
