"""The real sglang-router (Rust) in front of the engines.

Launched as ``python -m sglang_router.launch_router``; engines are added and removed at
runtime through its ``/workers`` API. Registration is asynchronous (the router answers
/health before its workers are checked), so readiness means: every expected worker shows
``is_healthy: true`` in ``GET /workers``. A dead engine is found by the router's own
health checks (interval and threshold set low here) and traffic moves to the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import requests

from rollout.engines.actor import _die_with_parent, free_port, log_tail


class Router:
    def __init__(self, host: str = "127.0.0.1", port: Optional[int] = None,
                 tokenizer_path: Optional[str] = None, policy: str = "round_robin",
                 health_check_interval_s: int = 1, health_failure_threshold: int = 2,
                 request_timeout_s: int = 1800, circuit_open_s: int = 2,
                 api_key: Optional[str] = None,
                 log_dir: Optional[str] = None, ready_timeout_s: float = 60.0,
                 extra_args: Sequence[str] = ()):
        if policy not in ("random", "round_robin", "cache_aware", "power_of_two"):
            raise ValueError(f"router policy must be random, round_robin, cache_aware or "
                             f"power_of_two (got {policy!r})")
        self.host, self.fixed_port = host, port
        self.tokenizer_path, self.policy, self.api_key = tokenizer_path, policy, api_key
        self.health_check_interval_s = health_check_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.request_timeout_s = request_timeout_s
        self.circuit_open_s = circuit_open_s
        self.ready_timeout_s = ready_timeout_s
        self.extra_args = list(extra_args)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="hg-router-")
        self.log_path = os.path.join(self.log_dir, "router.log")
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.session = requests.Session()

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def command(self, port: int, worker_urls: Sequence[str]) -> list[str]:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host,
               "--port", str(port), "--policy", self.policy,
               "--health-check-interval-secs", str(self.health_check_interval_s),
               "--health-failure-threshold", str(self.health_failure_threshold),
               "--request-timeout-secs", str(self.request_timeout_s),
               # After a run of failures (an engine answering 503 while it restarts or its
               # weights are released) the router stops sending to it for this long; its
               # default, 60 s, would leave a recovered engine -- or the only one -- idle
               # for a minute. Dead engines are taken out by the health checks anyway.
               "--cb-timeout-duration-secs", str(self.circuit_open_s),
               "--log-level", "warn",
               # Its metrics exporter otherwise binds a fixed port (29000 on all
               # interfaces), so two routers on one machine would collide.
               "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host))]
        if worker_urls:
            cmd += ["--worker-urls", *worker_urls]
        # A local tokenizer keeps the router from looking one up on the hub.
        if self.tokenizer_path:
            cmd += ["--tokenizer-path", self.tokenizer_path]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.extra_args

    def start(self, worker_urls: Sequence[str] = ()) -> str:
        for attempt in range(3):
            port = self.fixed_port or free_port(self.host)
            log = open(self.log_path, "ab")
            env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
            self.proc = subprocess.Popen(self.command(port, worker_urls), stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_die_with_parent)
            log.close()
            self.port = port
            try:
                self._wait(lambda: self._get("/health") is not None, "router /health")
                break
            except RuntimeError as exc:
                if "address" in str(exc).lower() and "in use" in str(exc).lower() and \
                        self.fixed_port is None and attempt < 2:
                    continue  # lost a race for the port: pick another
                raise
        self.wait_healthy(worker_urls)
        return self.url

    def _get(self, route: str):
        try:
            r = self.session.get(self.url + route, timeout=5)
            return r if r.status_code == 200 else None
        except requests.RequestException:
            return None

    def _wait(self, cond, what: str, timeout_s: Optional[float] = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        while not cond():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited ({self.proc.returncode}) waiting for "
                                   f"{what}; log {self.log_path}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; log {self.log_path}:\n"
                                   f"{self._log_tail()}")
            time.sleep(0.1)

    def _log_tail(self) -> str:
        return log_tail(self.log_path, 3000)

    def workers(self) -> list[dict]:
        r = self.session.get(self.url + "/workers", timeout=10)
        r.raise_for_status()
        data = r.json()
        return data.get("workers", data) if isinstance(data, dict) else data

    def healthy_urls(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}

    def wait_healthy(self, urls: Sequence[str], timeout_s: Optional[float] = None) -> None:
        want = {u.rstrip("/") for u in urls}
        self._wait(lambda: want <= {u.rstrip("/") for u in self._safe_healthy()},
                   f"workers {sorted(want)} healthy in the router", timeout_s)

    def _safe_healthy(self) -> set[str]:
        try:
            return self.healthy_urls()
        except (requests.RequestException, ValueError):
            return set()

    def add_worker(self, url: str, wait: bool = True) -> None:
        r = self.session.post(self.url + "/workers", json={"url": url}, timeout=30)
        if r.status_code >= 300:
            raise RuntimeError(f"router refused worker {url}: HTTP {r.status_code} {r.text}")
        if wait:
            self.wait_healthy([url])

    def remove_worker(self, url: str) -> None:
        url = url.rstrip("/")
        for w in self.workers():
            if w["url"].rstrip("/") == url:
                r = self.session.delete(f"{self.url}/workers/{w['id']}", timeout=30)
                if r.status_code >= 300:
                    raise RuntimeError(f"router refused to remove {url}: HTTP {r.status_code} {r.text}")
                self._wait(lambda: url not in {x["url"].rstrip("/") for x in self.workers()},
                           f"worker {url} removed")
                return
        raise ValueError(f"{url} is not a worker of the router at {self.url}")

    def shutdown(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
