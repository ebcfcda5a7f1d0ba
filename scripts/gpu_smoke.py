#!/usr/bin/env python
"""GPU smoke test: what the GPU recipes run, on one GPU, in under 8 minutes, without Ray.

    python scripts/gpu_smoke.py                 # exit 0: all passed; 1: a check failed; 2: no CUDA
    python scripts/gpu_smoke.py --print-wheels  # the wheels a bare GPU box needs, how to get them

Needs torch and transformers (recent versions, not necessarily the pinned ones) and the
small wheels ``--print-wheels`` lists (megatron-core, hydra-core, omegaconf, antlr4,
torch_memory_saver); homegym's own server and cluster dependencies (Ray, aiohttp,
requests, SGLang) are not imported. Each group of checks runs in a process of its own,
so a crash does not hide the others and memory is measured without their allocations.
One line per check: ``PASS group/name: detail``, ``FAIL ...`` or ``SKIP ...: reason``.

fsdp/      the FSDP backend in fp32 on the built-in tiny Qwen3 (NCCL, world size 1).
megatron/  what the GPU recipes run: the Megatron backend in bf16 under megatron-core's
           mixed-precision wrapper (Float16Module) with the distributed optimizer.
           Both: dist, init (megatron: the wrapper, the dtypes, DistributedOptimizer
           with fp32 main parameters), log_probs_vs_hf (fp32: equal to transformers'
           fp32 forward; bf16: within 4x the bf16 noise of the same model measured in
           the parent), export_hf_names, train_step, offload_onload (judged by the
           device's free memory, torch.cuda.mem_get_info, not only by what the
           allocator counts), ipc_sglang_receiver, save_load; fsdp also flash_vs_sdpa.
           ipc_sglang_receiver: the exported weights, on the GPU, serialized for SGLang's
           /update_weights_from_tensor (the list and the flattened bucket), the sender's
           tensors freed and their memory refilled before a second process opens them
           with SGLang 0.5.18's own receiving code (the torch-reductions patch that
           rebuilds CUDA tensors by device UUID, MultiprocessingSerializer with its
           SafeUnpickler, FlattenedTensorBucket): from an installed sglang, else the
           copies in scripts/gpu_smoke_fixtures/sglang_0_5_18/; values must be equal.
memory_saver/  torch_memory_saver as SGLang's engines use it (preload hook, LD_PRELOAD):
           pausing the weights, KV-cache and CUDA-graph regions frees their memory on the
           device, resuming keeps every address, the captured graph replays after it, a
           CPU-backed region keeps its contents. SKIP when it is not installed.
startup/   a random bf16 Qwen3-4B-sized Megatron rank (TP 1, DP 1, distributed
           optimizer) built exactly as the backend builds one (checkpoint reading left
           out: random weights): its peak allocated memory against the memory plan's
           start-up peak (trainer/driver/memory_plan.py).

``--device cpu`` runs the same with gloo for debugging without a GPU: the CUDA-only checks
say SKIP and why.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # homegym need not be installed
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The rollout package's __init__ (and rollout.engines') import the HTTP stack (aiohttp,
# requests) that a bare GPU box lacks; the smoke uses only rollout.models,
# rollout.tiny_models and rollout.engines.weights_io, so the packages are set up without
# running their __init__.
for _pkg in ("rollout", "rollout.engines"):
    if _pkg not in sys.modules:
        _mod = types.ModuleType(_pkg)
        _mod.__path__ = [str(ROOT.joinpath(*_pkg.split(".")))]
        sys.modules[_pkg] = _mod

FIXTURES = Path(__file__).resolve().parent / "gpu_smoke_fixtures"
MIB = 1 << 20
GIB = 1 << 30
# Seconds per group of checks (shares of --time-limit); startup builds a 4B-parameter rank.
GROUPS = {"fsdp": 1.0, "megatron": 1.0, "memory_saver": 0.5, "startup": 1.5}

# The wheels a GPU box with torch and transformers needs (exact versions: the ones this
# project runs), for --print-wheels. antlr4-python3-runtime is an sdist on PyPI.
WHEELS = (("megatron-core", "0.16.1", "megatron_core-0.16.1-{cp}-{cp}-manylinux_2_24_x86_64"
           ".manylinux_2_28_x86_64.whl"),
          ("hydra-core", "1.3.8", "hydra_core-1.3.8-py3-none-any.whl"),
          ("omegaconf", "2.3.1", "omegaconf-2.3.1-py3-none-any.whl"),
          ("antlr4-python3-runtime", "4.9.3", "antlr4_python3_runtime-4.9.3-py3-none-any.whl"),
          ("torch_memory_saver", "0.0.10", "torch_memory_saver-0.0.10-cp39-abi3-"
           "manylinux2014_x86_64.whl"))
SDIST_ONLY = {"antlr4-python3-runtime"}


def print_wheels(python: str) -> None:
    cp = "cp" + python.replace(".", "")
    print(f"# wheels for scripts/gpu_smoke.py on a GPU machine with Python {python}, torch "
          "and transformers (x86_64):")
    for name, version, wheel in WHEELS:
        print(wheel.format(cp=cp) + ("   # built here: PyPI has only its sdist"
                                     if name in SDIST_ONLY else ""))
    binary = [f"{n}=={v}" for n, v, _ in WHEELS if n not in SDIST_ONLY]
    built = [f"{n}=={v}" for n, v, _ in WHEELS if n in SDIST_ONLY]
    print("# fetch them (any machine with the index), into wheels/:")
    print(f"pip download --no-deps --only-binary=:all: --python-version {python} "
          f"--implementation cp --abi {cp} --abi abi3 --abi none --platform "
          "manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d wheels "
          + " ".join(binary))
    print("pip wheel --no-deps -w wheels " + " ".join(built))
    print("# on the GPU machine:")
    print("pip install --no-index --no-deps wheels/*.whl && python scripts/gpu_smoke.py")


class Skip(Exception):
    pass


class Report:
    def __init__(self, prefix: str):
        self.prefix, self.failed, self.count = prefix, 0, 0

    def line(self, status: str, name: str, detail: str) -> None:
        detail = " ".join(str(detail).split())  # one line
        print(f"{status} {self.prefix}{name}: {detail}", flush=True)
        self.count += 1
        self.failed += status == "FAIL"

    def check(self, name: str, fn, *args, **kwargs):
        """Run ``fn`` -> detail string (or (detail, value)); a Skip is SKIP, any other
        exception FAIL. Returns the value (None when it did not pass)."""
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except Skip as e:
            self.line("SKIP", name, str(e))
            return None
        except Exception as e:  # noqa: BLE001  (a smoke test reports, never stops)
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb)
                          if str(ROOT) in f.filename), "")
            self.line("FAIL", name, f"{type(e).__name__}: {e} [{where}]")
            traceback.print_exc(file=sys.stderr)
            return None
        detail, value = out if isinstance(out, tuple) else (out, True)
        self.line("PASS", name, f"{detail} ({time.perf_counter() - start:.1f}s)")
        return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke_batch():
    from train_batches import make_batch

    # Two GRPO groups of 4 with a common first turn: shared prefixes longer than the prompt.
    return make_batch(num_groups=2, group_size=4, seed=3, common_start=4)


def smoke_config(backend: str, device: str, model_path: str, dtype: str = "float32",
                 engine: str = "sglang", **train):
    from config import build_config

    cluster = {"device": device, "torch_threads": 1 if device == "cpu" else 4}
    rollout = {"rollout_batch_size": 2, "n_samples_per_prompt": 4}
    if device == "cuda":
        cluster["gpus_per_node"] = 1
        rollout.update(engine=engine, num_gpus=1)
    else:
        rollout.update(engine="hf", num_engines=1)
    return build_config({
        "cluster": cluster, "rollout": rollout,
        "train": {"backend": backend, "lr": 1e-3, "ranks_per_node": 1,
                  "max_tokens_per_micro_batch": 256, **train},
        "model": {"path": model_path, "dtype": dtype}})


# The dtype each group trains in: FSDP as the CPU recipes; Megatron as the GPU recipes.
GROUP_DTYPE = {"fsdp": "float32", "megatron": "bfloat16"}


# ============================================================== parent: reference + children
def reference(model_path: str, out: Path) -> str:
    """transformers' forward on CPU, fp32 (the log-probs of each response token) and bf16
    (its largest difference from fp32: the bf16 noise of this model), and the HF
    checkpoint's tensor names and shapes."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    batch = smoke_batch()
    logps = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                     attn_implementation="eager").eval()
        got = []
        with torch.no_grad():
            for toks, r in zip(batch.tokens, batch.response_lengths):
                ids = torch.tensor([toks])
                logits = model(input_ids=ids).logits[0, -r - 1:-1].float()
                got.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -r:, None])[:, 0])
        logps[dtype] = got
    noise = max(float((a - b).abs().max()) for a, b in zip(logps[torch.bfloat16],
                                                          logps[torch.float32]))
    shapes = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    logps = logps[torch.float32]
    torch.save({"logps": logps, "shapes": shapes, "bf16_noise": noise}, out)
    return (f"{len(logps)} samples, {sum(len(x) for x in logps)} tokens, {len(shapes)} "
            f"tensors; bf16 vs fp32 max |logp diff| {noise:.3g}")


def child_plan(args) -> list[tuple[str, dict]]:
    """(group, extra environment) of each child process, or a SKIP line's reason."""
    plan = [("fsdp", {}), ("megatron", {})]
    if args.device != "cuda":
        plan += [("memory_saver", "needs CUDA"), ("startup", "needs CUDA")]
        return plan
    if importlib.util.find_spec("torch_memory_saver") is None:
        plan.append(("memory_saver", "torch_memory_saver is not installed (its wheel: "
                                     "scripts/gpu_smoke.py --print-wheels)"))
    else:
        # SGLang's engines run with the preload hook: its scheduler processes start with
        # LD_PRELOAD set by torch_memory_saver.configure_subprocess() (0.5.18
        # srt/entrypoints/engine.py:921).
        from torch_memory_saver import configure_subprocess

        with configure_subprocess():
            plan.append(("memory_saver", {"LD_PRELOAD": os.environ["LD_PRELOAD"]}))
    plan.append(("startup", {}))
    return plan


def run_children(args, report: Report, workdir: Path) -> None:
    deadline = time.monotonic() + args.time_limit
    plan = child_plan(args)
    for i, (name, env) in enumerate(plan):
        if isinstance(env, str):
            report.line("SKIP", f"{name}/all", env)
            continue
        left = deadline - time.monotonic()
        weights = [GROUPS[n] for n, e in plan[i:] if not isinstance(e, str)]
        budget = left * GROUPS[name] / sum(weights)  # its share of what is left
        if budget < 20:
            report.line("FAIL", f"{name}/child", f"no time left ({left:.0f}s)")
            continue
        log = workdir / f"{name}.log"
        cmd = [sys.executable, __file__, "--child", name, "--device", args.device,
               "--workdir", str(workdir)]
        lines = fails = 0
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            start = time.monotonic()
            try:
                for text in _lines(proc, start + budget):
                    if text.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP"):
                        print(text, flush=True)
                        lines += 1
                        fails += text.startswith("FAIL")
                        report.count += 1
                        report.failed += text.startswith("FAIL")
                    else:
                        err.write(text + "\n")
                rc = proc.wait(timeout=max(1.0, start + budget - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
        if rc != 0 and not (rc == 1 and fails):  # rc 1 with FAIL lines: already reported
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-6:])
            why = f"timed out after {budget:.0f}s" if rc is None else f"exited with rc={rc}"
            report.line("FAIL", f"{name}/child", f"{why} after {lines} checks; log {log}: "
                                                 f"{tail[-1500:]}")


def _lines(proc, deadline):
    """The child's stdout lines, until it ends or the deadline passes."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        if not sel.select(timeout=min(left, 5.0)):
            continue
        text = proc.stdout.readline()
        if not text:
            return
        yield text.rstrip("\n")


def parent(args) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: CUDA is not available (torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}); this smoke test needs "
              "one NVIDIA GPU. Nothing was run.", file=sys.stderr)
        return 2
    report = Report("")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="homegym-gpu-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    found = {m: "yes" if importlib.util.find_spec(m) else "no"
             for m in ("flash_attn", "megatron", "torch_memory_saver", "transformer_engine",
                       "sglang")}
    import transformers

    print(f"# gpu_smoke: device={args.device} python={sys.version.split()[0]} "
          f"torch={torch.__version__} cuda={torch.version.cuda} "
          f"transformers={transformers.__version__} "
          + (f"gpu={torch.cuda.get_device_name(0)} " if args.device == "cuda" else "")
          + " ".join(f"{m}={v}" for m, v in found.items()) + f" workdir={workdir}", flush=True)

    def model():
        from rollout.models import resolve_model_path

        cache = os.environ.get("HOMEGYM_CACHE")
        path = resolve_model_path("tiny-qwen3", os.path.join(cache, "models") if cache
                                  else str(workdir / "models"))
        (workdir / "model_path").write_text(path)
        return path, path

    path = report.check("model", model)
    if path is None:
        return 1
    if report.check("hf_reference", reference, path, workdir / "reference.pt") is None:
        return 1
    run_children(args, report, workdir)
    print(f"# gpu_smoke: {report.count} checks, {report.failed} failed", flush=True)
    return 1 if report.failed else 0


# ============================================================== child: one backend's checks
class BackendChecks:
    def __init__(self, name: str, device: str, workdir: Path, report: Report):
        import torch

        self.name, self.workdir, self.report = name, workdir, report
        self.cuda = device == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.dtype = GROUP_DTYPE[name]
        self.model_path = (workdir / "model_path").read_text()
        self.ref = torch.load(workdir / "reference.pt")
        self.batch = smoke_batch()
        self.backend = None

    # --------------------------------------------------------------- helpers
    def _sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def _allocated(self) -> int:
        import torch

        self._sync()
        return torch.cuda.memory_allocated() if self.cuda else 0

    def _free(self) -> int:
        """Free memory as the device reports it (what another process could allocate)."""
        import torch

        self._sync()
        return torch.cuda.mem_get_info()[0] if self.cuda else 0

    def _export(self, backend=None) -> dict:
        backend = backend or self.backend
        return {n: t for bucket in backend.named_weight_buckets(1 << 20) for n, t in bucket}

    def _logps(self, backend=None) -> list:
        return [x.detach().float().cpu() for x in (backend or self.backend).log_probs(self.batch)]

    @staticmethod
    def _max_diff(a: list, b: list) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    def _need_backend(self):
        if self.backend is None:
            raise Skip("backend did not initialise")

    def _finite(self, metrics: dict, what: str) -> None:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        if bad:
            raise AssertionError(f"{what}: non-finite metrics {bad}")

    # --------------------------------------------------------------- checks
    def dist(self):
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        kind = "nccl" if self.cuda else "gloo"
        if self.cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(kind, rank=0, world_size=1)
        x = torch.ones(4, device=self.device)
        dist.all_reduce(x)
        self._sync()
        assert float(x.sum()) == 4.0, x
        return f"{kind} world_size=1 all_reduce on {self.device}"

    def init(self):
        import torch

        from trainer.driver.components import backend_args
        from trainer.training.backends import make_backend

        backend = make_backend(self.name)
        backend.init(rank=0, world_size=1, **backend_args(
            smoke_config(self.name, "cuda" if self.cuda else "cpu", self.model_path,
                         dtype=self.dtype)))
        self.backend = backend
        params = list(self._parameters())
        extra = ""
        if self.name == "fsdp":
            extra = f", share_prompts={backend.share_prompts}"
        if self.name == "megatron":
            from megatron.core.transformer.module import Float16Module

            wrapped = backend.model.module
            assert isinstance(wrapped, Float16Module), f"DDP wraps {type(wrapped).__name__}"
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
            assert dtypes == ["bfloat16"], f"model parameters in {dtypes}"
            opts = backend._optimizers()  # a ChainedOptimizer's members, or the one
            kinds = sorted({type(o).__name__ for o in opts})
            assert kinds == ["DistributedOptimizer"], f"optimizers: {kinds}"
            assert backend.model.ddp_config.use_distributed_optimizer
            mains = [p for o in opts for g in o.optimizer.param_groups for p in g["params"]]
            assert mains and all(p.dtype == torch.float32 for p in mains), "main params not fp32"
            extra = (f", Float16Module bf16 parameters, {len(opts)} DistributedOptimizer with "
                     f"{sum(p.numel() for p in mains)} fp32 main parameters, "
                     f"transformer_engine={backend.use_te}, packed={backend.packed}")
        return (f"{type(backend).__name__} on {self.device}, {self.dtype}, "
                f"{sum(p.numel() for p in params)} parameters{extra}")

    def _parameters(self):
        b = self.backend
        return (b.gpt if self.name == "megatron" else b.model).parameters()

    def log_probs_vs_hf(self):
        self._need_backend()
        got = self._logps()
        if self.dtype == "float32":
            tol, what = (1e-3 if self.cuda else 1e-4), "fp32"
        else:  # bf16 rounds differently from one kernel to the next: headroom over its noise
            tol, what = 4 * self.ref["bf16_noise"], "4 x the bf16 noise of the HF model"
        diff = self._max_diff(got, self.ref["logps"])
        if not diff <= tol:
            raise AssertionError(f"max |logp - hf| = {diff:.3g} > {tol:.3g} ({what})")
        self.logps0 = got
        return f"{len(got)} samples, max |logp - hf fp32| = {diff:.2e} (tol {tol:.2e}: {what})"

    def export_hf_names(self):
        self._need_backend()
        import torch

        exported = self._export()
        want = self.ref["shapes"]
        missing, extra = sorted(set(want) - set(exported)), sorted(set(exported) - set(want))
        if missing or extra:
            raise AssertionError(f"missing {missing[:5]}, unexpected {extra[:5]}")
        wrong = [n for n, t in exported.items() if tuple(t.shape) != want[n]]
        if wrong:
            raise AssertionError("shapes differ: " + ", ".join(
                f"{n} {tuple(exported[n].shape)} vs {want[n]}" for n in wrong[:3]))
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in exported.values()})
        devices = sorted({str(t.device) for t in exported.values()})
        assert all(isinstance(t, torch.Tensor) for t in exported.values())
        return f"{len(exported)} tensors, names and shapes equal the HF checkpoint's, " \
               f"dtypes {dtypes}, on {devices}"

    def train_step(self):
        self._need_backend()
        import torch

        before = self._export()
        metrics = self.backend.train_step(self.batch)
        self._finite(metrics, "train step")
        after = self._export()
        changed = sum(not torch.equal(before[n], after[n]) for n in before)
        if not changed:
            raise AssertionError("no weight changed")
        keys = [k for k in ("train/loss", "train/pg_loss", "train/grad_norm") if k in metrics]
        shown = ", ".join(f"{k.split('/')[1]}={float(metrics[k]):.4g}" for k in keys)
        return f"{shown}, {changed}/{len(before)} tensors changed"

    def offload_onload(self):
        """Offload must hand the memory back to the device, where colocated engines can
        take it: judged by torch.cuda.mem_get_info's free memory, not only by what the
        allocator counts as allocated (cached blocks would still hold it)."""
        self._need_backend()
        import torch

        lp_before = self._logps()
        m0, f0 = self._allocated(), self._free()
        self.backend.offload()
        m1, f1 = self._allocated(), self._free()
        self.backend.onload()
        m2 = self._allocated()
        lp_after = self._logps()
        diff = self._max_diff(lp_before, lp_after)
        if diff > 1e-6:
            raise AssertionError(f"log-probs changed across offload/onload: {diff:.3g}")
        self._finite(self.backend.train_step(self.batch), "step after onload")
        if not self.cuda:
            raise Skip("CPU: offload/onload free no device memory (ran them: log-probs "
                       f"unchanged, max diff {diff:.1e}; next step finite)")
        freed, gained = m0 - m1, f1 - f0
        if freed <= 0:
            raise AssertionError(f"offload freed nothing: {m0 / MIB:.2f} MiB -> {m1 / MIB:.2f} MiB")
        if gained < 0.9 * freed:
            raise AssertionError(f"the allocator freed {freed / MIB:.1f} MiB but the device's "
                                 f"free memory grew by {gained / MIB:.1f} MiB only (cached "
                                 "blocks kept)")
        torch.cuda.empty_cache()
        return (f"allocated {m0 / MIB:.2f} -> {m1 / MIB:.2f} MiB after offload -> {m2 / MIB:.2f} "
                f"MiB after onload; device free memory +{gained / MIB:.2f} MiB (freed "
                f"{freed / MIB:.2f}); log-probs unchanged, next step finite")

    def ipc_sglang_receiver(self):
        self._need_backend()
        import torch

        from rollout.engines import weights_io

        exported = {n: t for b in self.backend.named_weight_buckets(
            1 << 20, device=str(self.device)) for n, t in b}
        named = [(n, t.to(self.device)) for n, t in exported.items()]
        nbytes, count = sum(t.numel() * t.element_size() for _, t in named), len(named)
        ref_file = self.workdir / f"{self.name}_ipc_ref.pt"
        torch.save({n: t.cpu() for n, t in named}, ref_file)
        payloads = {}
        for flattened in (True, False):
            (payload,), fmt = weights_io.serialize_for_sglang(named, tp_size=1,
                                                              flattened=flattened)
            payloads[fmt or "list"] = payload
            if self.cuda:
                uuid = str(torch.cuda.get_device_properties(0).uuid)
                assert uuid.encode() in base64.b64decode(payload), \
                    "the IPC handle does not name the device by UUID"
        if self.cuda:
            # The sender lets go of its tensors before the receiver opens them, and the
            # memory is asked for again: the handles must still give the pushed values.
            del exported, named
            self._sync()
            torch.cuda.empty_cache()
            filler = torch.full((2 * nbytes,), 0x5A, dtype=torch.uint8, device=self.device)
        # CPU tensors travel through /dev/shm files, which must outlive the receiver's open
        # (homegym's CPU push keeps its staging buffers): they stay referenced here.
        done = []
        for fmt, payload in payloads.items():
            proc = subprocess.run([sys.executable, "-c", _IPC_RECEIVER, str(FIXTURES),
                                   str(ref_file), fmt], input=payload, capture_output=True,
                                  text=True, timeout=180)
            if proc.returncode != 0:
                raise AssertionError(f"receiver ({fmt}) failed: {proc.stderr.strip()[-800:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if got["bad"] or got["count"] != count:
                raise AssertionError(f"receiver ({fmt}): {got}")
            done.append(f"{fmt}: {got['count']} tensors on {got['devices']}")
        if self.cuda:
            del filler
        how = ("CUDA IPC by device UUID, sender's tensors freed and memory refilled first"
               if self.cuda else "CPU tensors via /dev/shm")
        return (f"{nbytes / MIB:.1f} MiB, {how}; received by {got['receiver']}: "
                + "; ".join(done) + "; values equal")

    def save_load(self):
        self._need_backend()
        import torch

        path = self.workdir / f"ckpt_{self.name}"
        self.backend.train_step(self.batch)  # non-trivial optimizer state
        self.backend.save(str(path))
        saved = self._export()
        self.backend.train_step(self.batch)
        stepped = self._export()
        self.backend.load(str(path))
        restored = self._export()
        wrong = [n for n in saved if not torch.equal(saved[n], restored[n])]
        if wrong:
            raise AssertionError(f"{len(wrong)} tensors not restored exactly, e.g. {wrong[:3]}")
        self._finite(self.backend.train_step(self.batch), "step after load")
        replay = max(float((self._export()[n].float() - stepped[n].float()).abs().max())
                     for n in stepped) if stepped else 0.0
        files = sum(1 for p in path.rglob("*") if p.is_file())
        return (f"{files} files; weights restored exactly; the replayed step lands within "
                f"{replay:.1e} of the original")

    def flash_vs_sdpa(self):
        if self.name != "fsdp":
            raise Skip("flash-attn path is the FSDP backend's")
        if not self.cuda:
            raise Skip("needs CUDA")
        from trainer.training.backends import packed_attention as pa

        if not pa.flash_available():
            raise Skip(f"flash_attn is not importable ({pa.flash_import_error})")
        self._need_backend()
        from trainer.driver.components import backend_args
        from trainer.training.backends import make_backend

        bf16 = make_backend("fsdp")
        bf16.init(rank=0, world_size=1, **backend_args(
            smoke_config("fsdp", "cuda", self.model_path, dtype="bfloat16")))
        if not bf16.share_prompts:
            raise Skip("share_prompts is off: the packed attention is not used")
        calls = [0]
        kernel = pa._flash_varlen

        def counting(*args, **kwargs):
            calls[0] += 1
            return kernel(*args, **kwargs)

        pa._flash_varlen = counting
        try:
            pa.use_flash = False
            sdpa = self._logps(bf16)
            assert calls[0] == 0, "flash ran with use_flash=False"
            pa.use_flash = True
            flash = self._logps(bf16)
            forward_calls = calls[0]
            if not forward_calls:
                raise AssertionError("the flash path never ran (bf16 CUDA tensors expected)")
            metrics = bf16.train_step(self.batch)
        finally:
            pa._flash_varlen = kernel
            pa.use_flash = True
        self._finite(metrics, "bf16 train step on the flash path")
        diff = self._max_diff(flash, sdpa)
        vs_hf = (self._max_diff(flash, self.ref["logps"]), self._max_diff(sdpa, self.ref["logps"]))
        tol = 4 * self.ref["bf16_noise"]
        if not diff <= tol:
            raise AssertionError(f"max |flash - sdpa| = {diff:.3g} > {tol:.3g} (4 x bf16 noise)")
        return (f"bf16 log-probs max |flash - sdpa| = {diff:.2e} (tol {tol:.2e}); vs fp32 HF: "
                f"flash {vs_hf[0]:.2e}, sdpa {vs_hf[1]:.2e}; {forward_calls} flash calls; "
                f"bf16 train step on flash finite (loss={float(metrics.get('train/loss', 0)):.4g})")


# The receiver of ipc_sglang_receiver, as an SGLang TP rank receives a tensor update: its
# own payload only (0.5.18 managers/tp_worker.py:199-206: monkey_patch_torch_reductions,
# then MultiprocessingSerializer.deserialize), a flattened bucket rebuilt as in
# model_executor/model_runner_components/weight_updater.py:355-380. SGLang's code comes from
# an installed sglang when there is one, else from the vendored copies.
_IPC_RECEIVER = r"""
import json, sys, torch
fixtures, ref_file, fmt = sys.argv[1:4]
try:
    import sglang
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    receiver = f"installed sglang {sglang.__version__}"
except Exception:  # not installed (or not importable here): SGLang's own code, vendored
    sys.path.insert(0, fixtures)
    from sglang_0_5_18.serializer import MultiprocessingSerializer
    from sglang_0_5_18.patch_torch import monkey_patch_torch_reductions
    from sglang_0_5_18.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    receiver = "sglang 0.5.18's code (vendored)"
monkey_patch_torch_reductions()
obj = MultiprocessingSerializer.deserialize(sys.stdin.read())
if fmt == "flattened_bucket":
    metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                        start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                for m in obj["metadata"]]
    got = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                metadata=metadata).reconstruct_tensors()
else:
    got = obj
ref = torch.load(ref_file)
bad = [n for n, t in got if t.dtype != ref[n].dtype or t.shape != ref[n].shape
       or not torch.equal(t.cpu(), ref[n])]
if torch.cuda.is_available():
    torch.cuda.synchronize()
print(json.dumps({"count": len(got), "bad": bad[:5], "receiver": receiver,
                  "devices": sorted({str(t.device) for _, t in got})}))
"""


def backend_child(args, report: Report) -> None:
    import torch

    torch.set_num_threads(1 if args.device == "cpu" else 4)
    checks = BackendChecks(args.child, args.device, Path(args.workdir), report)
    if report.check("dist", checks.dist) is None:
        return
    if report.check("init", checks.init) is not None:
        for name in ("log_probs_vs_hf", "export_hf_names", "train_step", "offload_onload",
                     "ipc_sglang_receiver", "save_load", "flash_vs_sdpa"):
            report.check(name, getattr(checks, name))
    import torch.distributed as dist

    dist.destroy_process_group()


# ============================================================== child: the memory saver
def memory_saver_child(args, report: Report) -> None:
    """torch_memory_saver 0.0.10 as SGLang's engines run it: regions tagged weights,
    kv_cache and cuda_graph (srt/constants.py GPU_MEMORY_TYPE_*; the graph captured with
    torch_memory_saver.cuda_graph, as full_cuda_graph_backend.py does with
    SGLANG_MEMORY_SAVER_CUDA_GRAPH), paused and resumed as
    scheduler_components/weight_updater.py:202-287 does."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    torch.cuda.set_device(0)
    state: dict = {}

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def allocate():
        with tms.region(tag="weights"):
            state["w"] = torch.randn(8192, 8192, device="cuda")          # 256 MiB
        with tms.region(tag="kv_cache"):
            state["kv"] = torch.zeros(512 * MIB, dtype=torch.uint8, device="cuda")
        with tms.region(tag="backed", enable_cpu_backup=True):
            state["backed"] = torch.arange(16 * MIB, dtype=torch.int32, device="cuda")
        x = torch.randn(8192, 1024, device="cuda")
        state["x"] = x
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            (state["w"] @ x).relu_()  # warm-up outside the graph (cuBLAS workspace)
        torch.cuda.current_stream().wait_stream(stream)
        with tms.cuda_graph(graph, tag="cuda_graph"):
            state["y"] = (state["w"] @ x).relu_()
        state["graph"] = graph
        state["ptrs"] = {k: state[k].data_ptr() for k in ("w", "kv", "backed", "y")}
        return (f"weights 256 MiB, KV cache 512 MiB, a CPU-backed 64 MiB region, a CUDA "
                f"graph (output {state['y'].numel() * 4 / MIB:.0f} MiB) in its region")

    def pause():
        expected = {"kv_cache": 512 * MIB, "weights": 256 * MIB}
        out = []
        for tag, size in expected.items():
            before = free()
            tms.pause(tag)
            gained = free() - before
            if gained < 0.95 * size:
                raise AssertionError(f"pausing {tag} freed {gained / MIB:.1f} MiB of "
                                     f"{size / MIB:.0f}")
            out.append(f"{tag} +{gained / MIB:.0f} MiB")
        before = free()
        tms.pause("cuda_graph")
        graph = free() - before
        if graph < 0.9 * state["y"].numel() * 4:
            raise AssertionError(f"pausing the CUDA graph freed {graph / MIB:.1f} MiB")
        out.append(f"cuda_graph +{graph / MIB:.0f} MiB")
        tms.pause("backed")
        return "device free memory after each pause: " + ", ".join(out)

    def resume():
        before = free()
        tms.resume()
        taken = before - free()
        moved = [k for k, ptr in state["ptrs"].items() if state[k].data_ptr() != ptr]
        if moved:
            raise AssertionError(f"addresses changed across pause/resume: {sorted(moved)}")
        want = torch.arange(16 * MIB, dtype=torch.int32, device="cuda")
        if not torch.equal(state["backed"], want):
            raise AssertionError("the CPU-backed region lost its contents")
        # The weights came back without a backup (as SGLang's, before the trainer's push):
        # refill them, then the graph captured before the pause must compute with them.
        state["w"].copy_(torch.randn_like(state["w"]))
        state["graph"].replay()
        torch.cuda.synchronize()
        want = (state["w"] @ state["x"]).relu_()
        err = float((state["y"] - want).abs().max())
        if err > 1e-3 * float(want.abs().max()):
            raise AssertionError(f"graph replay after resume differs by {err:.3g}")
        return (f"{taken / MIB:.0f} MiB taken back; every address kept; CPU-backed contents "
                f"kept; the graph replays on the refilled weights (max err {err:.1e})")

    if report.check("allocate", allocate) is None:
        return
    if report.check("pause_frees_memory", pause) is not None:
        report.check("resume_keeps_addresses", resume)


# ============================================================== child: start-up peak
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "attention_bias": False, "hidden_act": "silu",
            "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}


def startup_child(args, report: Report) -> None:
    import torch

    state: dict = {}

    def plan():
        from trainer.training.backends.megatron.model import have_transformer_engine
        from trainer.driver.memory_plan import plan_memory

        model_dir = Path(args.workdir) / "qwen3-4b-random"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(QWEN3_4B))
        # The recipe's training settings on one rank (TP 1, DP 1).
        # (engine=hf: the plan's engine side is not measured here, and planning SGLang's
        # would import its launcher, whose HTTP client this machine may lack)
        config = smoke_config("megatron", "cuda", str(model_dir), dtype="bfloat16",
                              engine="hf", gradient_checkpointing=True)
        planned = plan_memory(config, transformer_engine=have_transformer_engine())
        item = [i for i in planned.phase("trainer start-up").items if i.name == "start-up peak"][0]
        state.update(config=config, planned=item.nbytes)
        return f"memory plan: start-up peak {item.nbytes / GIB:.2f} GiB ({item.note})"

    def measure():
        import torch.distributed as dist

        from trainer.training.backends import make_backend
        from trainer.training.backends.megatron import model as M

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        # Random weights: the checkpoint reader and loader are left out, the rest of
        # MegatronBackend.init runs as in a run.
        M.HFCheckpoint = lambda path: None
        M.load_hf_weights = lambda *a, **k: None
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        backend = make_backend("megatron")
        backend.init(state["config"], 0, 1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        ratio = peak / state["planned"]
        detail = (f"peak allocated {peak / GIB:.2f} GiB (reserved {reserved / GIB:.2f}) vs plan "
                  f"{state['planned'] / GIB:.2f} GiB: {ratio:.2f}x; built in "
                  f"{time.perf_counter() - start:.0f}s")
        del backend
        dist.destroy_process_group()
        if not 0.85 <= ratio <= 1.1:
            raise AssertionError(detail)
        return detail

    if report.check("plan", plan) is not None:
        report.check("megatron_rank_peak", measure)


CHILDREN = {"fsdp": backend_child, "megatron": backend_child,
            "memory_saver": memory_saver_child, "startup": startup_child}


def child(args) -> int:
    report = Report(f"{args.child}/")
    CHILDREN[args.child](args, report)
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same checks with gloo, for debugging without a GPU")
    parser.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None,
                        help="where the model, logs and checkpoints go (default: a new temp dir)")
    parser.add_argument("--time-limit", type=float, default=420.0,
                        help="seconds for all groups of checks together (default 420: with "
                             "the parent's own minute, under 8 minutes)")
    parser.add_argument("--print-wheels", action="store_true",
                        help="list the wheels a GPU box with torch and transformers needs, "
                             "and the commands to fetch them, then exit")
    parser.add_argument("--python", default="3.12",
                        help="the GPU box's Python for --print-wheels (default 3.12)")
    args = parser.parse_args(argv)
    if args.print_wheels:
        print_wheels(args.python)
        return 0
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
