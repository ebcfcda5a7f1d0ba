"""EngineServer: one Ray actor that owns and supervises one inference server process.

The hf (homegym's CPU server) and sglang (the real SGLang server, on GPU or CPU) engines
differ only in the command that starts the server; supervision (start, readiness polling,
the SGLang version check, crash detection with the log tail, restart, shutdown) is shared.
Admin calls go through ``EngineClient`` (client.py), which any process can build from the
engine's URL. ``EngineServer`` is a plain class (usable without Ray, e.g. in tests and
scripts); ``remote_actor_class()`` is its Ray actor form.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import requests

from rollout.checkpoints import is_hybrid, read_config
from rollout.engines.client import EngineClient, EngineError
from rollout.engines.sglang_serving import cpu_state_slots, served_path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Callers that cannot bind port 0 themselves must
    retry on 'address in use' (see EngineServer.start), since another process may race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str, n: int) -> str:
    """The last ``n`` bytes of a process log, for error messages ("" if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM when the actor process dies (ray.kill, crash), so no
    # orphaned servers keep ports and memory.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()


def bind_host(configured: str, num_nodes: int, node_ip: Optional[str]) -> str:
    """The address a server binds: the configured one, except that a loopback address on
    a multi-node cluster becomes this node's IP (the router and the training ranks on
    other nodes could not reach it otherwise)."""
    loopback = configured in ("localhost", "::1") or configured.startswith("127.")
    if loopback and num_nodes > 1 and node_ip:
        return node_ip
    return configured


@dataclass
class LaunchSpec:
    """What differs between engine kinds: the command line and how the port is known."""

    model_path: str
    host: str = "127.0.0.1"
    num_nodes: int = 1  # of the cluster: a loopback host becomes the node's IP when > 1
    api_key: Optional[str] = None
    max_context_len: Optional[int] = None
    dtype: str = "float32"
    torch_threads: int = 1
    ready_timeout_s: float = 180.0
    env: dict = field(default_factory=dict)
    python: str = sys.executable  # the server's interpreter (SGLang may live in its own venv)
    # True: the server binds port 0 and writes the port to a file (no race at all).
    uses_port_file: bool = False

    def command(self, port: int, port_file: Optional[str], host: str) -> list[str]:
        raise NotImplementedError

    def extra_ready_check(self) -> Optional[str]:
        """Route that must also answer 200 before the engine counts as ready."""
        return None


@dataclass
class HFLaunch(LaunchSpec):
    attn_implementation: str = "eager"
    max_running_requests: int = 256
    weight_version: str = "default"
    uses_port_file: bool = True
    # The SGLang contract the server speaks (routes and rules of that version).
    contract_version: Optional[str] = None
    weight_noise: float = 0.0  # rollout.weight_noise

    def command(self, port: int, port_file: Optional[str], host: str) -> list[str]:
        cmd = [self.python, "-m", "rollout.engines.hf.server", "--model-path", self.model_path,
               "--host", host, "--port", str(port), "--dtype", self.dtype,
               "--torch-threads", str(self.torch_threads), "--attn-implementation",
               self.attn_implementation, "--max-running-requests", str(self.max_running_requests),
               "--weight-version", self.weight_version]
        if port_file:
            cmd += ["--port-file", port_file]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.max_context_len:
            cmd += ["--max-context-len", str(self.max_context_len)]
        if self.contract_version:
            cmd += ["--contract-version", self.contract_version]
        if self.weight_noise:
            cmd += ["--weight-noise", repr(self.weight_noise)]
        return cmd


@dataclass
class SGLangLaunch(LaunchSpec):
    """``python -m sglang.launch_server`` for one engine, with argument names from the
    pinned SGLang's ServerArgs (tests/test_sglang_contract.py checks every flag against the
    wheel). The Ray actor is given the engine's GPUs, so CUDA_VISIBLE_DEVICES already lists
    only them and base_gpu_id is 0 unless several engines share one actor's view."""

    device: str = "cuda"  # cuda | cpu (SGLang's CPU backend: AVX-512 + AMX, bfloat16 only)
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    base_gpu_id: int = 0
    enable_memory_saver: bool = False  # colocated: release/resume GPU memory around training
    random_seed: Optional[int] = None  # distinct per engine, or a group's samples repeat
    weight_version: str = "default"
    nccl_port: Optional[int] = None
    skip_warmup: bool = True
    log_level: str = "warning"
    # KV cache size in tokens. On CPU SGLang otherwise sizes it from free RAM (~13 GB on a
    # 24 GB box); null on GPU = from mem_fraction_static.
    max_total_tokens: Optional[int] = None
    extra_args: Sequence[str] = ()
    ready_timeout_s: float = 900.0
    # > 0: serve LoRA adapters of up to this rank on these modules (peft names), loaded
    # at run time with /load_lora_adapter (trainer/weight_sync/adapter.py).
    lora_rank: int = 0
    lora_target_modules: Sequence[str] = ()
    # Hybrid models (Qwen3.5's Gated DeltaNet layers): the pool of per-request recurrent
    # states. ratio = state memory / KV-cache memory (null: SGLang's 0.9); size = state
    # slots (a running request holds 3; null on GPU: SGLang sizes it from the ratio, on
    # CPU: ratio x the KV cache max_total_tokens sets, see sglang_serving.py).
    mamba_full_memory_ratio: Optional[float] = None
    max_mamba_cache_size: Optional[int] = None

    def __post_init__(self) -> None:
        # The router health-checks every engine each second through /health; by default
        # SGLang runs a real one-token generation for it, which fails while a colocated
        # engine has released its weights and KV cache. /health_generate still generates.
        self.env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
        # A shutdown signals the server's whole process group; its launcher sees the
        # scheduler exit, takes it for a crash and sleeps 5 s "to let GPU activity settle"
        # before a py-spy / CUDA core dump of schedulers already gone (0.5.18
        # tokenizer_manager.py, dump_requests_before_crash): 5 of the 6 s a stop took. A
        # hang's stacks come from homegym's own watchdog (trainer/driver/watchdog.py).
        self.env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "false")
        self.env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "false")
        if self.enable_memory_saver:
            # Decode CUDA graphs are captured into the memory saver's region, and so
            # released with the weights and KV cache, only with this set (0.5.18
            # srt/model_executor/runner_backend/full_cuda_graph_backend.py:65-68; slime and
            # miles set it for colocated engines too).
            self.env.setdefault("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "true")
        if self.device == "cuda":
            self.env.setdefault("NCCL_CUMEM_ENABLE", nccl_cumem_enable(self.extra_args))
        if self.device == "cpu":
            self.env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            if self.max_total_tokens is None:
                self.max_total_tokens = 65536
            # The weight loaders that re-pack AMX weights after an in-place update.
            path = [SGLANG_CPU_PLUGINS] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
            if self.lora_rank:
                # SGLang's LoRA layers pin host memory, which torch refuses without an
                # accelerator; the shim (its own directory, on PYTHONPATH only here) makes
                # pinning a no-op in the server (sglang_plugins/cpu_lora/sitecustomize.py).
                path.insert(0, SGLANG_CPU_LORA_SHIM)
            self.env.setdefault("PYTHONPATH", ":".join(path))
            # Intel's OpenMP (the intel-openmp wheel SGLang's CPU dependencies bring) runs
            # its CPU kernels ~25% faster than libgomp.
            iomp = os.path.join(os.path.dirname(os.path.dirname(self.python)), "lib", "libiomp5.so")
            if os.path.exists(iomp):
                self.env.setdefault("LD_PRELOAD", iomp)

    def command(self, port: int, port_file: Optional[str], host: str) -> list[str]:
        # Made on the engine's own node: a vision-language checkpoint as a text-only view.
        model_path = served_path(self.model_path)
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", host, "--port", str(port), "--device", self.device,
               "--tp-size", str(self.tp_size), "--dtype", _sglang_dtype(self.dtype),
               "--trust-remote-code", "--log-level", self.log_level,
               "--weight-version", self.weight_version]
        if self.device == "cuda":
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static),
                    "--base-gpu-id", str(self.base_gpu_id)]
        if self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.max_context_len:
            cmd += ["--context-length", str(self.max_context_len)]
        if self.enable_memory_saver:
            # The prefill CUDA graph's memory is not released by the memory saver (slime
            # turns it off for colocated training too); decode graphs are.
            cmd += ["--enable-memory-saver", "--disable-prefill-cuda-graph"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.random_seed is not None:
            cmd += ["--random-seed", str(self.random_seed)]
        if self.nccl_port is not None:
            cmd += ["--nccl-port", str(self.nccl_port)]
        if self.skip_warmup:
            cmd += ["--skip-server-warmup"]
        if self.device == "cpu":
            # Idle, the scheduler otherwise polls its sockets in a busy loop: a whole core
            # (10.0 CPU-s in 10 s idle, Intel Xeon), taken from colocated training ranks on a
            # small box. Asleep it waits on them and wakes when a request arrives.
            cmd += ["--custom-weight-loader", *SGLANG_CPU_LOADERS, "--sleep-on-idle"]
        cmd += self._state_args(read_config(self.model_path))
        if self.lora_rank:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.lora_rank),
                    "--lora-target-modules", *self.lora_target_modules]
            if self.device == "cpu":  # the default (csgmv) and triton kernels need Triton
                cmd += ["--lora-backend", "torch_native"]
        return cmd + list(self.extra_args)

    def extra_ready_check(self) -> Optional[str]:
        # SGLang's /health can answer before the scheduler serves; a 1-token generate can't.
        return "/health_generate"

    def _state_args(self, config: dict) -> list[str]:
        """The state pool's flags for a hybrid model (none for others)."""
        if not is_hybrid(config):
            return []
        size = self.max_mamba_cache_size
        if size is None and self.device == "cpu":
            size = cpu_state_slots(config, self.max_total_tokens, _sglang_dtype(self.dtype),
                                   self.mamba_full_memory_ratio)
        args = []
        if self.mamba_full_memory_ratio is not None:
            args += ["--mamba-full-memory-ratio", str(self.mamba_full_memory_ratio)]
        if size is not None:
            args += ["--max-mamba-cache-size", str(size)]
        if self.device == "cpu":
            # With the overlap scheduler on, SGLang's radix cache over the state pool picks
            # extra state buffers ("auto"), which only FLA's GPU kernels have: the CPU server
            # exits at start (0.5.18 server_args.py, _validate_mamba_extra_buffer). Without
            # it, "auto" resolves to no_buffer (arg_groups/overrides.py).
            args += ["--disable-overlap-schedule"]
        return args


def nccl_cumem_enable(sglang_args: Sequence[str] = ()) -> str:
    """NCCL_CUMEM_ENABLE as SGLang's processes have it: SGLang sets 0 unless the variable
    is set, and 1 with --enable-symm-mem (0.5.18 srt/entrypoints/engine.py:1659-1660).
    The ranks of one NCCL communicator must agree on it, and the weight-broadcast group
    spans training rank 0 and the engines: the training ranks get this value too
    (trainer.training.train_group), as slime does (ray/actor_group.py)."""
    if "--enable-symm-mem" in [str(a) for a in sglang_args]:
        return "1"
    return os.environ.get("NCCL_CUMEM_ENABLE", "0")


def releases_cuda_graphs(spec: "LaunchSpec") -> bool:
    """Whether releasing this engine's memory frees its decode CUDA graphs (the memory
    plan counts them as kept otherwise)."""
    return (isinstance(spec, SGLangLaunch) and spec.enable_memory_saver
            and spec.env.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "").lower() in ("1", "true"))


# SGLang's CPU backend needs its AMX weights re-packed after in-place updates: homegym's
# loaders for that (rollout/engines/sglang_plugins/homegym_sglang_cpu.py) run in the server.
SGLANG_CPU_PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_plugins")
SGLANG_CPU_LOADERS = ("homegym_sglang_cpu.load", "homegym_sglang_cpu.load_and_repack")
SGLANG_CPU_LORA_SHIM = os.path.join(SGLANG_CPU_PLUGINS, "cpu_lora")


def _sglang_dtype(dtype: str) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "auto")


class EngineServer:
    """Supervises one server process; ``client`` makes the admin calls."""

    def __init__(self, spec: LaunchSpec, name: str = "engine", log_dir: Optional[str] = None):
        self.spec = spec
        self.name = name
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="hg-engine-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.proc: Optional[subprocess.Popen] = None
        self._url: Optional[str] = None
        self.client: Optional[EngineClient] = None
        self.log_path = os.path.join(self.log_dir, f"{name}.log")
        self.session = requests.Session()
        self.headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}

    # ---- supervision ----
    def start(self, attempts: int = 3) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self._url
        last: Optional[Exception] = None
        for _ in range(attempts):
            try:
                return self._start_once()
            except _PortTaken as exc:  # someone took the port between pick and bind: retry
                last = exc
        raise RuntimeError(f"{self.name}: could not bind a port after {attempts} tries: {last}")

    def _bind_host(self) -> str:
        node_ip = None
        if self.spec.num_nodes > 1:
            import ray

            node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else None
        return bind_host(self.spec.host, self.spec.num_nodes, node_ip)

    def _start_once(self) -> str:
        spec = self.spec
        host = self._bind_host()
        port_file = None
        if spec.uses_port_file:
            port, port_file = 0, os.path.join(self.log_dir, f"{self.name}.port")
            if os.path.exists(port_file):
                os.remove(port_file)
        else:
            port = free_port(host)
        env = dict(os.environ, OMP_NUM_THREADS=str(spec.torch_threads),
                   TOKENIZERS_PARALLELISM="false", **{k: str(v) for k, v in spec.env.items()})
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(spec.command(port, port_file, host), stdout=log,
                                     stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + spec.ready_timeout_s
        # Readiness by polling: first the port (file), then /health, then the extra check.
        while spec.uses_port_file and not os.path.exists(port_file):
            self._check_alive()
            if time.monotonic() > deadline:
                self._timeout()
            time.sleep(0.05)
        if port_file:
            with open(port_file) as f:
                port = int(f.read())
        url_host = host if host not in ("0.0.0.0", "::") else "127.0.0.1"
        self._url = f"http://{url_host}:{port}"
        checks = ["/health"] + ([spec.extra_ready_check()] if spec.extra_ready_check() else [])
        for route in checks:
            while True:
                self._check_alive()
                try:
                    r = self.session.get(self._url + route, headers=self.headers, timeout=5)
                    if r.status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    self._timeout()
                time.sleep(0.1)
        self.client = EngineClient(self._url, spec.api_key, name=self.name)
        try:
            self.client.version()  # refuses a server of an unsupported SGLang version
            self.client.freeze_gc()  # what it loaded stays: collections skip it from now on
        except EngineError:
            self.shutdown()
            raise
        return self._url

    def _log_tail(self) -> str:
        return log_tail(self.log_path, 4000)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self._log_tail()
            code = self.proc.returncode
            self.proc = None
            if "address already in use" in tail.lower():
                raise _PortTaken(tail[-300:])
            raise RuntimeError(f"{self.name}: server exited with code {code} while starting; "
                               f"log {self.log_path}:\n{tail}")

    def _timeout(self) -> None:
        self.shutdown()
        raise TimeoutError(f"{self.name}: not ready after {self.spec.ready_timeout_s:.0f}s; "
                           f"log {self.log_path}:\n{self._log_tail()}")

    @property
    def url(self) -> Optional[str]:
        return self._url

    def get_url(self) -> Optional[str]:  # Ray actors cannot read properties remotely
        return self._url

    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> bool:
        if not self.alive():
            return False
        try:
            return self.session.get(self._url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and anything it spawned (TP ranks)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self) -> str:
        self.shutdown()
        return self.start()

    def register(self, router_url: str) -> None:
        """Add this engine to an sglang-router (POST /workers)."""
        r = self.session.post(f"{router_url}/workers", json={"url": self._url}, timeout=30)
        if r.status_code >= 300:
            raise EngineError(r.text, status=r.status_code, engine=self.name, route="/workers")

    def __del__(self):
        try:
            self.shutdown(timeout_s=2)
        except BaseException:  # Ray's SIGTERM handler raises SystemExit while the actor dies
            pass


class _PortTaken(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def remote_actor_class():
    """The Ray actor class (created lazily so importing this module needs no Ray)."""
    import ray

    return ray.remote(EngineServer)


def launch_spec(model, rollout, cluster, model_path: str, *, seed: int, lora=None,
                engine_kind: Optional[str] = None, base_gpu_id: int = 0,
                index: int = 0) -> LaunchSpec:
    """The launch spec of engine ``index`` of a run, from the model, rollout and cluster
    sections. ``seed`` + index seeds SGLang's sampling; ``lora`` (a ``train.lora``
    section) when the engines serve the adapters the trainer pushes."""
    kind = engine_kind or rollout.engine
    m, c, r = model, cluster, rollout
    common = dict(model_path=model_path, host=c.host, num_nodes=c.num_nodes,
                  max_context_len=m.max_context_len, dtype=r.dtype or m.dtype,
                  torch_threads=c.torch_threads)
    if kind == "hf":
        return HFLaunch(attn_implementation=m.attn_implementation, weight_noise=r.weight_noise,
                        **common)
    if kind == "sglang":
        return SGLangLaunch(device=c.device, tp_size=r.num_gpus_per_engine,
                            mem_fraction_static=r.mem_fraction_static, base_gpu_id=base_gpu_id,
                            enable_memory_saver=c.colocate and c.device == "cuda",
                            random_seed=seed + index,
                            python=r.sglang_python or sys.executable,
                            max_total_tokens=r.sglang_max_total_tokens,
                            mamba_full_memory_ratio=r.sglang_mamba_full_memory_ratio,
                            max_mamba_cache_size=r.sglang_max_mamba_cache_size,
                            extra_args=tuple(r.sglang_args), **_lora_args(lora), **common)
    raise ValueError(f"rollout.engine must be hf or sglang (got {kind!r})")


def _lora_args(lora) -> dict:
    """LoRA serving flags of an engine that receives adapters (train.lora.push)."""
    if lora is None:
        return {}
    return dict(lora_rank=lora.rank, lora_target_modules=tuple(lora.target_modules))
