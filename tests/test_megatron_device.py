"""The Megatron backend's GPU-facing decisions, checked on CPU.

- where collectives put their tensors (NCCL: the current CUDA device; gloo: CPU) and the
  metrics all-reduce built on it (two gloo ranks);
- the layer spec / fused-kernel plan for (device, Transformer Engine, apex, config);
- offload of everything a rank holds (params, DDP param/grad buffers, main params,
  optimizer state) and onload, on a real backend in a child process (the cpu_shim must
  not touch the pytest process);
- the exported weights' names, shapes and dtypes (the training dtype).
"""

import gc
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from trainer.training.backends.megatron import backend as B
from trainer.training.backends.megatron import model as M
from trainer.driver import components

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------ collective device
@pytest.mark.parametrize("backend,device", [
    ("nccl", "cuda"), ("NCCL", "cuda"), ("gloo", "cpu"), ("mpi", "cpu"),
    ("cpu:gloo,cuda:nccl", "cpu"), ("cuda:nccl", "cuda")])
def test_device_for_backend(backend, device):
    assert B.device_for_backend(backend) == device


def test_collective_device_follows_the_groups_backend(monkeypatch):
    group = object()
    seen = []

    def get_backend(g=None):
        seen.append(g)
        return "nccl"

    monkeypatch.setattr(B.dist, "get_backend", get_backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert B.collective_device(group) == torch.device("cuda", 3)
    assert seen == [group]
    monkeypatch.setattr(B.dist, "get_backend", lambda g=None: "gloo")
    assert B.collective_device(group) == torch.device("cpu")


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, timeout=timeout,
                          capture_output=True, text=True)


def _reduce_rank(rank: int, store: str, out: str) -> None:
    """Child: one of two gloo ranks reducing metric sums (rank 1 does not contribute)."""
    import torch.distributed as dist

    # Rendezvous through a file: no port to pick and lose to another process.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sums = {"a": torch.tensor(1.5 + rank), "b": 2.0}
    got = B.all_reduce_metric_sums(sums, {"a", "b", "c"}, contributes=True)
    only0 = B.all_reduce_metric_sums(sums, {"a", "b", "c"}, contributes=rank == 0)
    torch.save({"got": got, "only0": only0, "device": str(B.collective_device())},
               f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.subprocess
def test_metric_sums_all_reduce_over_gloo(tmp_path):
    store, out = str(tmp_path / "store"), str(tmp_path / "r")
    code = "import test_megatron_device as t; t._reduce_rank({}, %r, %r)" % (store, out)
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r)], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=f"{REPO}:{TESTS}"))
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for r in range(2):
        res = torch.load(f"{out}.{r}")
        assert res["device"] == "cpu"
        assert res["got"] == {"a": 1.5 + 2.5, "b": 4.0, "c": 0.0}
        assert res["only0"] == {"a": 1.5, "b": 2.0, "c": 0.0}


# ------------------------------------------------------------------ kernel plan
def _plan(device="cuda", te=False, apex=False, sp=False):
    return M.kernel_plan(device=device, te_available=te, fused_softmax_available=apex,
                         sequence_parallel=sp)


def test_kernel_plan_cuda_with_te():
    plan = _plan(te=True)
    assert plan.use_te and plan.packed and plan.note is None
    assert not any(plan.fusions.values())  # TE's attention ignores masked_softmax_fusion
    assert _plan(te=True, sp=True).use_te  # sequence parallel is fine with TE


@pytest.mark.parametrize("apex", [False, True])
def test_kernel_plan_cuda_without_te_uses_the_local_spec(apex):
    plan = _plan(te=False, apex=apex)
    assert not plan.use_te and not plan.packed
    # Apex's softmax kernels only when they are importable; every other fusion off.
    assert plan.fusions == dict(masked_softmax_fusion=apex, bias_dropout_fusion=False,
                                apply_rope_fusion=False, gradient_accumulation_fusion=False,
                                bias_activation_fusion=False, persist_layer_norm=False,
                                memory_efficient_layer_norm=False)
    assert "transformer_engine is not installed" in plan.note
    assert ("apex fused softmax" if apex else "unfused softmax") in plan.note


@pytest.mark.parametrize("te", [False, True])
def test_kernel_plan_cpu(te):
    plan = _plan(device="cpu", te=te, apex=True)
    assert not plan.use_te and plan.note is None and not any(plan.fusions.values())


@pytest.mark.parametrize("device,why", [("cuda", "transformer_engine is not installed"),
                                        ("cpu", "no CUDA device")])
def test_sequence_parallel_without_te_is_refused_naming_the_key(device, why):
    with pytest.raises(ValueError, match="train.sequence_parallel") as err:
        _plan(device=device, te=False, sp=True)
    assert why in str(err.value)


def _hf():
    return SimpleNamespace(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, hidden_size=16, intermediate_size=24,
                           num_hidden_layers=2, rms_norm_eps=1e-6, vocab_size=10,
                           max_position_embeddings=64, hidden_act="silu",
                           rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
                           tie_word_embeddings=True)


def test_local_spec_config_is_buildable_and_names_its_final_norm(monkeypatch):
    """The no-TE CUDA config passes TransformerConfig's checks, and the local block spec
    names torch RMSNorm as the final norm: a bare layer spec would get whatever
    transformer_block.LayerNormImpl is (apex's FusedLayerNorm when apex is installed,
    which rejects RMSNorm)."""
    pytest.importorskip("megatron.core")
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from config import TrainConfig

    plan = _plan(te=False, apex=False)
    config = M.transformer_config(_hf(), TrainConfig(), dtype="bfloat16", cpu=False,
                                  fusions=plan.fusions)
    assert config.bf16 and not config.masked_softmax_fusion and not config.sequence_parallel
    assert not config.persist_layer_norm and not config.gradient_accumulation_fusion
    monkeypatch.setattr(transformer_block, "LayerNormImpl", FusedLayerNorm)  # "apex installed"
    spec = M.layer_spec(config, use_te=False, num_layers=2)
    block = transformer_block._get_block_submodules(config, spec)
    assert block.layer_norm is WrappedTorchNorm
    assert len(block.layer_specs) == 2
    assert all(s.submodules.input_layernorm is WrappedTorchNorm for s in block.layer_specs)


# ------------------------------------------------------------------ offload (child process)
def _held(b) -> list[tuple[str, torch.Tensor]]:
    """Listed independently of the offloader's walk: every tensor category the backend
    holds on its device (on CUDA, torch's Adam keeps its step counts on the CPU)."""
    return [(label, t) for label, t in _held_any_device(b) if t.device.type == b.device.type]


def _held_any_device(b) -> list[tuple[str, torch.Tensor]]:
    out = []
    for label, module in (("policy", b.model), ("ref", b.ref)):
        if module is None:
            continue
        for name, p in module.named_parameters():
            out.append((f"{label} param {name}", p))
            if getattr(p, "main_grad", None) is not None:
                out.append((f"{label} main_grad {name}", p.main_grad))
    for i, buf in enumerate(b.model.buffers + b.model.expert_parallel_buffers):
        if buf.param_data is not None:
            out.append((f"DDP buffer {i} param_data", buf.param_data))
        out.append((f"DDP buffer {i} grad_data", buf.grad_data))
    for j, opt in enumerate(b._optimizers()):
        for g in opt.optimizer.param_groups:
            for k, p in enumerate(g["params"]):
                out.append((f"optimizer {j} main param {k}", p))
        for k, st in enumerate(opt.optimizer.state.values()):
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    out.append((f"optimizer {j} state {k} {key}", v))
    return out


def _export(b) -> dict:
    return {n: t for bucket in b.named_weight_buckets(1 << 20) for n, t in bucket}


def _offload_child(dtype: str, kl: float, out: str, device: str = "cpu") -> None:
    """Child: one rank (world 1: gloo on CPU, NCCL on CUDA) trains a step and saves it;
    trains a second step as the reference (nothing offloaded yet) and loads the first step's
    checkpoint back; offloads, checks, onloads, and trains the second step again. Saves both
    second steps' metrics and exported weights to ``out``."""
    import torch.distributed as dist

    from train_batches import make_batch, make_config
    from trainer.training.backends.megatron.backend import MegatronBackend

    cuda = device == "cuda"
    # One rank: an in-memory store, no port.
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    extra = {"cluster": {"device": "cuda", "gpus_per_node": 1},
             "rollout": {"num_gpus": 1}} if cuda else {}
    config = make_config(train={"backend": "megatron", "lr": 1e-3,
                                "max_tokens_per_micro_batch": 128},
                         model={"dtype": dtype}, algo={"kl_coef": kl}, **extra)
    b = MegatronBackend()
    b.init(rank=0, world_size=1, **components.backend_args(config))
    batch = make_batch(num_groups=2, group_size=4, seed=3)
    result = {"m1": b.train_step(batch), "param_dtype": str(next(b.gpt.parameters()).dtype)}
    b.save(out + ".ckpt_on")
    result["ref_m2"] = b.train_step(batch)
    result["ref_export"] = _export(b)
    b.load(out + ".ckpt_on")
    before = _export(b)
    held = _held(b)
    keys = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for _, t in held}
    allocated = torch.cuda.memory_allocated() if cuda else 0
    b.offload()
    assert b.offloader.offloaded
    not_freed = [label for label, t in held if t.untyped_storage().nbytes()]
    assert not not_freed, f"still holding device memory: {not_freed[:10]}"
    assert b.last_offload["offloaded_bytes"] >= sum(keys.values())
    if cuda:  # measured by the allocator (device memory actually given back)
        freed = allocated - torch.cuda.memory_allocated()
        assert freed >= 0.95 * sum(keys.values()), (freed, sum(keys.values()))
        result["cuda_freed"] = freed
    # Nothing else in the process holds memory besides the host copies (a few RNG
    # states and class-level scalars of megatron-core aside).
    host = {e[2].untyped_storage()._cdata for e in b.offloader._entries.values()
            if e[2] is not None}
    host |= {t.untyped_storage()._cdata  # this test's copies
             for t in (*before.values(), *result["ref_export"].values())}
    left = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == device:
            st = o.untyped_storage()
            if st.nbytes() and st._cdata not in host:
                left[st._cdata] = (tuple(o.shape), str(o.dtype), st.nbytes())
    assert sum(n for *_, n in left.values()) < 64 << 10, sorted(left.values())[-10:]
    # Export and save read the host copies while offloaded; load keeps it offloaded.
    assert all(torch.equal(t, before[n]) for n, t in _export(b).items())
    b.save(out + ".ckpt_off")
    b.load(out + ".ckpt_on")  # onloads, loads, offloads again
    assert b.offloader.offloaded
    not_freed = [label for label, t in _held(b) if t.untyped_storage().nbytes()]
    assert not not_freed, f"still holding device memory after load: {not_freed[:10]}"
    b.onload()
    assert not b.offloader.offloaded
    assert all(t.untyped_storage().nbytes() == keys[t.untyped_storage()._cdata]
               for _, t in held)
    assert all(torch.equal(t, before[n]) for n, t in _export(b).items())
    result["offloaded_bytes"] = b.last_offload["offloaded_bytes"]
    result["held_bytes"] = sum(keys.values())
    result["m2"] = b.train_step(batch)
    result["export"] = _export(b)
    torch.save(result, out)
    dist.destroy_process_group()


_KL = {"float32": 0.0, "bfloat16": 0.01}  # bf16 runs also hold a frozen reference model


@pytest.fixture(scope="module")
def child_result(tmp_path_factory):
    """(dtype, device) -> the result of one ``_offload_child`` run (each run once)."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("megatron-offload")
    cache: dict = {}

    def get(dtype: str, device: str = "cpu") -> dict:
        if (dtype, device) not in cache:
            out = str(tmp / f"{device}-{dtype}.pt")
            code = ("import test_megatron_device as t; t._offload_child("
                    f"{dtype!r}, {_KL[dtype]!r}, {out!r}, {device!r})")
            proc = _run(["-c", code])
            assert proc.returncode == 0, proc.stderr[-6000:]
            cache[dtype, device] = dict(torch.load(out, weights_only=False), path=out)
        return cache[dtype, device]
    return get


def _assert_same_checkpoint(a: str, b: str) -> None:
    sa, sb = (torch.load(f"{p}/megatron_rank0.pt", weights_only=False) for p in (a, b))
    assert sa["model"].keys() == sb["model"].keys()
    for k, v in sa["model"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, sb["model"][k]), k
    for oa, ob in zip(sa["optimizers"], sb["optimizers"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(oa["main_params"], ob["main_params"],
                                                      strict=True))
        for (ka, va), (kb, vb) in zip(oa["inner"]["state"].items(), ob["inner"]["state"].items()):
            assert ka == kb and all(torch.equal(va[k], vb[k]) for k in va)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32-views", "bf16-ref"])
def test_offload_frees_everything_and_onload_restores_it(child_result, dtype):
    """fp32: the distributed optimizer's main params are views into DDP's param buffer;
    bf16: separate fp32 main params, plus a frozen reference model (kl_coef > 0). The
    child asserts that every held tensor's storage is freed and comes back; here: the
    step after onload equals the same step taken before anything was offloaded, and a
    checkpoint saved while offloaded equals the one saved before."""
    result = child_result(dtype)
    assert result["offloaded_bytes"] >= result["held_bytes"] > 0
    _assert_same_checkpoint(result["path"] + ".ckpt_on", result["path"] + ".ckpt_off")
    a, b = result["m2"], result["ref_m2"]
    assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
        {k: v for k, v in b.items() if not k.startswith("perf/")}
    assert result["export"].keys() == result["ref_export"].keys()
    for name, t in result["export"].items():
        assert torch.equal(t, result["ref_export"][name]), name


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_on_cuda_gives_the_memory_back(child_result, dtype):
    """The same checks on a GPU (NCCL, pinned host copies): torch.cuda.memory_allocated
    drops by at least the bytes of everything held, and the step after onload equals the
    one taken before offloading (up to the GPU kernels' run-to-run differences)."""
    result = child_result(dtype, "cuda")
    assert result["cuda_freed"] >= 0.95 * result["held_bytes"] > 0
    assert result["export"].keys() == result["ref_export"].keys()
    tol = dict(atol=1e-5, rtol=0) if dtype == "float32" else dict(atol=2e-2, rtol=0)
    for name, t in result["export"].items():
        assert t.dtype == getattr(torch, dtype), name
        torch.testing.assert_close(t.float(), result["ref_export"][name].float(), **tol, msg=name)
    assert result["m2"]["train/pg_loss"] == pytest.approx(
        result["ref_m2"]["train/pg_loss"], rel=1e-3, abs=1e-5)


# ------------------------------------------------------------------ export dtype
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_names_shapes_and_training_dtype(child_result, tiny_model_path, dtype):
    from safetensors.torch import load_file

    res = child_result(dtype)
    assert res["param_dtype"] == f"torch.{dtype}"
    reference = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    exported = res["export"]
    assert sorted(exported) == sorted(reference)
    for name, t in exported.items():
        assert t.shape == reference[name].shape, name
        assert t.dtype == getattr(torch, dtype), name
        assert t.device.type == "cpu" and t.is_contiguous(), name
