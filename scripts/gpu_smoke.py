#!/usr/bin/env python
"""GPU smoke test of the training backends: one GPU, a few minutes, no Ray.

    python scripts/gpu_smoke.py            # exit 0: all passed; 1: a check failed; 2: no CUDA

Needs only torch and transformers, plus (carried) megatron-core, hydra-core and omegaconf;
flash-attn is used when it imports. For each backend (FSDP, Megatron) a child process
initialises torch.distributed itself (NCCL, world size 1, MASTER_ADDR/PORT) and builds the
real backend from a HomegymConfig with the built-in tiny Qwen3 (made offline), then checks,
one line each (``PASS name: detail`` / ``FAIL name: detail`` / ``SKIP name: reason``):

- dist: the process group (an all-reduce on the device);
- init: the backend builds;
- log_probs_vs_hf: log-probs equal transformers' own forward (fp32, computed once by the
  parent on CPU);
- export_hf_names: the HF-named export has the HF checkpoint's names and shapes;
- train_step: a finite RL step that changes the weights;
- offload_onload: the memory offload frees (torch.cuda.memory_allocated), and onload brings
  back the same log-probs and a finite next step;
- ipc_sglang_format: the exported weights, on the GPU, handed to a second process in
  SGLang's /update_weights_from_tensor format (rollout/engines/weights_io.py, both the
  list and the flattened bucket; CUDA IPC naming the device by UUID); the child
  deserializes and compares values;
- save_load: save, step, load restores the weights exactly;
- flash_vs_sdpa (FSDP): with flash-attn, the shared-prefix attention's flash-attn varlen
  path against SDPA in bf16 (log-probs, and a finite bf16 train step on the flash path).

Each backend runs in its own process so that one crashing does not hide the other, and
memory is measured without the other's allocations. ``--device cpu`` (for debugging
without a GPU) runs the same checks with gloo and skips the CUDA-only ones.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # homegym need not be installed
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BACKENDS = ("fsdp", "megatron")
WEIGHTS_IO = ROOT / "rollout" / "engines" / "weights_io.py"
MIB = 1 << 20


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


def load_weights_io():
    """rollout/engines/weights_io.py by path: the rollout package's __init__ imports the
    engine servers' dependencies (aiohttp, requests), which this machine may not have."""
    spec = importlib.util.spec_from_file_location("homegym_weights_io", WEIGHTS_IO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke_batch():
    from train_batches import make_batch

    # Two GRPO groups of 4 with a common first turn: shared prefixes longer than the prompt.
    return make_batch(num_groups=2, group_size=4, seed=3, common_start=4)


def smoke_config(backend: str, device: str, model_path: str, dtype: str = "float32"):
    from config import build_config

    cluster = {"device": device, "torch_threads": 1 if device == "cpu" else 4}
    rollout = {"rollout_batch_size": 2, "n_samples_per_prompt": 4}
    if device == "cuda":
        cluster["gpus_per_node"] = 1
        rollout.update(engine="sglang", num_gpus=1)
    else:
        rollout.update(engine="hf", num_engines=1)
    return build_config({
        "cluster": cluster, "rollout": rollout,
        "train": {"backend": backend, "lr": 1e-3, "ranks_per_node": 1,
                  "max_tokens_per_micro_batch": 256},
        "model": {"path": model_path, "dtype": dtype}})


# ============================================================== parent: reference + children
def reference(model_path: str, out: Path) -> str:
    """transformers' fp32 forward on CPU (log-probs of each response token) and the HF
    checkpoint's tensor names and shapes."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    batch = smoke_batch()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    logps = []
    with torch.no_grad():
        for toks, r in zip(batch.tokens, batch.response_lengths):
            ids = torch.tensor([toks])
            logits = model(input_ids=ids).logits[0, -r - 1:-1].float()
            logps.append(torch.log_softmax(logits, -1).gather(-1, ids[0, -r:, None])[:, 0])
    shapes = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    torch.save({"logps": logps, "shapes": shapes}, out)
    return f"{len(logps)} samples, {sum(len(x) for x in logps)} tokens, {len(shapes)} tensors"


def run_children(args, report: Report, workdir: Path) -> None:
    deadline = time.monotonic() + args.time_limit
    for i, name in enumerate(BACKENDS):
        left = deadline - time.monotonic()
        budget = left / (len(BACKENDS) - i)  # an even share of what is left
        if budget < 20:
            report.line("FAIL", f"{name}/child", f"no time left ({left:.0f}s)")
            continue
        log = workdir / f"{name}.log"
        cmd = [sys.executable, __file__, "--child", name, "--device", args.device,
               "--workdir", str(workdir)]
        lines = fails = 0
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
    print(f"# gpu_smoke: device={args.device} torch={torch.__version__} "
          f"cuda={torch.version.cuda} "
          + (f"gpu={torch.cuda.get_device_name(0)} " if args.device == "cuda" else "")
          + f"flash_attn={'yes' if importlib.util.find_spec('flash_attn') else 'no'} "
          f"megatron_core={'yes' if importlib.util.find_spec('megatron') else 'no'} "
          f"workdir={workdir}", flush=True)

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
        self.model_path = (workdir / "model_path").read_text()
        self.ref = torch.load(workdir / "reference.pt")
        self.batch = smoke_batch()
        self.backend = None
        self.wio = load_weights_io()

    # --------------------------------------------------------------- helpers
    def _sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def _allocated(self) -> int:
        import torch

        self._sync()
        return torch.cuda.memory_allocated() if self.cuda else 0

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
        from trainer.driver.components import backend_args
        from trainer.training.backends import make_backend

        backend = make_backend(self.name)
        backend.init(rank=0, world_size=1, **backend_args(
            smoke_config(self.name, "cuda" if self.cuda else "cpu", self.model_path)))
        self.backend = backend
        params = sum(p.numel() for p in self._parameters())
        extra = ""
        if self.name == "fsdp":
            extra = f", share_prompts={backend.share_prompts}"
        if self.name == "megatron":
            extra = f", transformer_engine={backend.use_te}, packed={backend.packed}"
        return f"{type(backend).__name__} on {self.device}, {params} parameters{extra}"

    def _parameters(self):
        b = self.backend
        return list((b.gpt if self.name == "megatron" else b.model).parameters())

    def log_probs_vs_hf(self):
        self._need_backend()
        got = self._logps()
        tol = 1e-3 if self.cuda else 1e-4
        diff = self._max_diff(got, self.ref["logps"])
        if not diff <= tol:
            raise AssertionError(f"max |logp - hf| = {diff:.3g} > {tol}")
        self.logps0 = got
        return f"{len(got)} samples, max |logp - hf| = {diff:.2e} (tol {tol})"

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
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        if bad:
            raise AssertionError(f"non-finite metrics {bad}")
        after = self._export()
        changed = sum(not torch.equal(before[n], after[n]) for n in before)
        if not changed:
            raise AssertionError("no weight changed")
        keys = [k for k in ("train/loss", "train/pg_loss", "train/grad_norm") if k in metrics]
        shown = ", ".join(f"{k.split('/')[1]}={float(metrics[k]):.4g}" for k in keys)
        return f"{shown}, {changed}/{len(before)} tensors changed"

    def offload_onload(self):
        self._need_backend()
        import torch

        lp_before = self._logps()
        m0 = self._allocated()
        self.backend.offload()
        m1 = self._allocated()
        self.backend.onload()
        m2 = self._allocated()
        lp_after = self._logps()
        diff = self._max_diff(lp_before, lp_after)
        if diff > 1e-6:
            raise AssertionError(f"log-probs changed across offload/onload: {diff:.3g}")
        metrics = self.backend.train_step(self.batch)
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        if bad:
            raise AssertionError(f"step after onload: non-finite {bad}")
        if not self.cuda:
            raise Skip("CPU: offload/onload are no-ops by design (ran them: log-probs "
                       f"unchanged, max diff {diff:.1e}; next step finite)")
        freed = m0 - m1
        if freed <= 0:
            raise AssertionError(f"offload freed nothing: {m0 / MIB:.2f} MiB -> {m1 / MIB:.2f} MiB")
        detail = (f"allocated {m0 / MIB:.2f} MiB -> {m1 / MIB:.2f} MiB after offload "
                  f"(freed {freed / MIB:.2f} MiB, {100 * freed / max(m0, 1):.0f}%) -> "
                  f"{m2 / MIB:.2f} MiB after onload; log-probs unchanged, next step finite")
        torch.cuda.empty_cache()
        return detail

    def ipc_sglang_format(self):
        self._need_backend()
        import torch

        import inspect

        buckets = self.backend.named_weight_buckets
        if "device" in inspect.signature(buckets).parameters:  # exported straight to the GPU
            exported = {n: t for b in buckets(1 << 20, device=str(self.device)) for n, t in b}
        else:
            exported = self._export()
        named = [(n, t.to(self.device)) for n, t in exported.items()]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        ref_file = self.workdir / f"{self.name}_ipc_ref.pt"
        torch.save({n: t.cpu() for n, t in named}, ref_file)
        done = []
        for flattened in (True, False):
            payloads, fmt = self.wio.serialize_for_sglang(named, tp_size=1, flattened=flattened)
            if self.cuda:
                uuid = str(torch.cuda.get_device_properties(0).uuid)
                raw = base64.b64decode(payloads[0])
                assert uuid.encode() in raw, "the IPC handle does not name the device by UUID"
            self._sync()
            proc = subprocess.run([sys.executable, "-c", _IPC_CHILD, str(WEIGHTS_IO),
                                   str(ref_file), fmt or "none"],
                                  input=payloads[0], capture_output=True, text=True,
                                  timeout=180)
            if proc.returncode != 0:
                raise AssertionError(f"receiver ({fmt}) failed: {proc.stderr.strip()[-800:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if got["bad"] or got["count"] != len(named):
                raise AssertionError(f"receiver ({fmt}): {got}")
            done.append(f"{fmt or 'list'} ({len(payloads[0]) // 1024} KiB payload, "
                        f"received on {got['devices']})")
        how = "CUDA IPC, device by UUID" if self.cuda else "CPU tensors via /dev/shm"
        return f"{len(named)} tensors, {nbytes / MIB:.1f} MiB, {how}: " + "; ".join(done) + \
               "; second process equal values"

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
        metrics = self.backend.train_step(self.batch)
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        if bad:
            raise AssertionError(f"step after load: non-finite {bad}")
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
        bad = {k: v for k, v in metrics.items() if not math.isfinite(float(v))}
        if bad:
            raise AssertionError(f"bf16 train step on the flash path: non-finite {bad}")
        diff = self._max_diff(flash, sdpa)
        vs_hf = (self._max_diff(flash, self.ref["logps"]), self._max_diff(sdpa, self.ref["logps"]))
        tol = 5e-2
        if not diff <= tol:
            raise AssertionError(f"max |flash - sdpa| = {diff:.3g} > {tol} (bf16)")
        return (f"bf16 log-probs max |flash - sdpa| = {diff:.2e} (tol {tol}); vs fp32 HF: "
                f"flash {vs_hf[0]:.2e}, sdpa {vs_hf[1]:.2e}; {forward_calls} flash calls; "
                f"bf16 train step on flash finite (loss={float(metrics.get('train/loss', 0)):.4g})")


# The receiver of the IPC check: loads weights_io by path, reads the payload from stdin as
# an SGLang TP rank would (own payload; CUDA handles by UUID), compares with the reference.
_IPC_CHILD = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("homegym_weights_io", sys.argv[1])
wio = importlib.util.module_from_spec(spec); spec.loader.exec_module(wio)
fmt = None if sys.argv[3] == "none" else sys.argv[3]
got = wio.deserialize_named_tensors(sys.stdin.read(), fmt)
ref = torch.load(sys.argv[2])
bad = [n for n, t in got if t.dtype != ref[n].dtype or t.shape != ref[n].shape
       or not torch.equal(t.cpu(), ref[n])]
if torch.cuda.is_available():
    torch.cuda.synchronize()
devices = sorted({str(t.device) for _, t in got})
print(json.dumps({"count": len(got), "bad": bad, "devices": devices}))
"""


def child(args) -> int:
    import torch

    torch.set_num_threads(1 if args.device == "cpu" else 4)
    report = Report(f"{args.child}/")
    checks = BackendChecks(args.child, args.device, Path(args.workdir), report)
    if report.check("dist", checks.dist) is None:
        return 1
    if report.check("init", checks.init) is not None:
        for name in ("log_probs_vs_hf", "export_hf_names", "train_step", "offload_onload",
                     "ipc_sglang_format", "save_load", "flash_vs_sdpa"):
            report.check(name, getattr(checks, name))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 1 if report.failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help=argparse.SUPPRESS)  # cpu: debugging without a GPU
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None,
                        help="where the model, logs and checkpoints go (default: a new temp dir)")
    parser.add_argument("--time-limit", type=float, default=540.0,
                        help="seconds for both backends together (default 540)")
    args = parser.parse_args()
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
