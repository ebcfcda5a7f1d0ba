"""The Megatron backend on Qwen3.5 (tiny-qwen3_5: Gated DeltaNet layers as HF-layout modules
replicated over TP, gated attention, partial rotary, (1 + w) norms), on CPU at TP 1 and
TP 2: log-probs equal transformers' per-sample forward, and the exported weights are the
checkpoint's.

Each rank runs in its own child process (megatron's cpu_shim must not touch the pytest
process; no Ray needed: a gloo group over a file store). Tolerance: fp32, 1e-5; measured
here 9.5e-7 at TP 1 and TP 2 (summation order), while a wrongly fused gate or a conv
leak moves log-probs by 1e-2 .. 1.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent


def _batch():
    from train_batches import make_batch

    return make_batch(num_groups=2, group_size=3, prompt_len=(10, 20), response_len=(5, 80),
                      vocab=450, seed=3, common_start=4)


def _rank_child(rank: int, world: int, out: str) -> None:
    """Child: one Megatron rank (TP = world) saves log-probs and the exported weights."""
    import torch.distributed as dist

    from train_batches import make_config
    from trainer.driver import components
    from trainer.training.backends.megatron.backend import MegatronBackend

    store = dist.FileStore(out + ".store", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    b = MegatronBackend()
    b.init(rank=rank, world_size=world, **components.backend_args(make_config(
        model={"path": "tiny-qwen3_5"},
        train={"backend": "megatron", "ranks_per_node": world,
               "tensor_model_parallel_size": world, "max_tokens_per_micro_batch": 300})))
    res = {"log_probs": b.log_probs(_batch()),
           "export": {n: t for bucket in b.named_weight_buckets(1 << 16) for n, t in bucket}}
    if rank == 0:
        torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> Path:
    """Where the ranks' torch.compile would put what it compiles (test_nothing_is_compiled)."""
    return tmp_path_factory.mktemp("inductor") / "cache"


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory, tiny_qwen3_5_path, inductor_cache):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]),
               OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(inductor_cache))
    results = {}
    for tp in (1, 2):
        out = str(tmp_path_factory.mktemp(f"tp{tp}") / "res.pt")
        procs = [subprocess.Popen(
            [sys.executable, "-c", f"import test_megatron_qwen3_5 as t; "
                                   f"t._rank_child({r}, {tp}, {out!r})"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(tp)]
        for p in procs:
            output, _ = p.communicate(timeout=600)
            assert p.returncode == 0, output[-6000:]
        results[tp] = torch.load(out, weights_only=False)
    return results


def test_qwen3_5_log_probs_and_export_equal_transformers_at_tp_1_and_2(megatron_results,
                                                                        tiny_qwen3_5_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32).eval()
    batch = _batch()
    with torch.no_grad():
        ref = []
        for toks, r in zip(batch.tokens, batch.response_lengths):
            ids = torch.tensor([toks])
            logits = model(input_ids=ids).logits[0, -r - 1:-1]
            ref.append(torch.log_softmax(logits, -1).gather(1, ids[0, -r:, None])[:, 0])
    state = {n: p for n, p in model.named_parameters()}  # the tied head listed once
    for tp, res in megatron_results.items():
        for got, want in zip(res["log_probs"], ref):
            assert (got - want).abs().max() <= 1e-5, tp
        assert set(res["export"]) == set(state), tp
        for name, tensor in res["export"].items():
            assert torch.equal(tensor, state[name].detach()), (tp, name)


def test_nothing_is_compiled_on_cpu(megatron_results, inductor_cache):
    """megatron-core's jit_fuser is torch.compile (the output gate above): on CPU the
    backend runs it eagerly, so no rank spends seconds in inductor and the C++ compiler."""
    compiled = [p.name for p in inductor_cache.rglob("*") if p.is_file()]
    assert compiled == [], compiled[:10]
