"""scripts/gpu_smoke.py where it runs without a GPU: its arguments, the wheels it asks for,
the SGLang code it vendors, and its CPU path (the CUDA-only checks there say SKIP)."""

import ast
import importlib.metadata
import re
import sys

import pytest

from conftest import REPO, clean_env, run_group

SMOKE = REPO / "scripts" / "gpu_smoke.py"
VENDORED = REPO / "scripts" / "gpu_smoke_fixtures" / "sglang_0_5_18"
# What a bare GPU box lacks and the smoke must not import: homegym's server and cluster
# stack (the box has torch, transformers and the carried wheels only).
ABSENT_ON_THE_GPU_BOX = ("aiohttp", "ray", "requests", "sglang", "sglang_router", "wandb",
                         "orjson", "psutil", "datasets", "openai", "anthropic")


def smoke(*args, timeout_s=120, env=None):
    return run_group([sys.executable, str(SMOKE), *args], timeout_s=timeout_s, cwd=REPO,
                     env={**clean_env(), **(env or {})})


@pytest.mark.subprocess
def test_print_wheels_names_the_project_versions_and_how_to_fetch_them():
    out = smoke("--print-wheels").stdout
    lines = out.splitlines()
    for dist in ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime"):
        version = importlib.metadata.version(dist)  # what this project runs
        wheel = dist.replace("-", "_") + f"-{version}-"
        assert any(line.startswith(wheel) for line in lines), (dist, version, out)
    assert any(line.startswith("megatron_core-0.16.1-cp312-cp312-manylinux") for line in lines)
    assert any(line.startswith("torch_memory_saver-0.0.10-cp39-abi3-") for line in lines)
    # torch_memory_saver is not installed here: its pin must satisfy the gpu extra.
    from packaging.requirements import Requirement
    pyproject = (REPO / "pyproject.toml").read_text()
    spec = Requirement(re.search(r'"(torch_memory_saver[^"]*)"', pyproject).group(1)).specifier
    assert "0.0.10" in spec
    download = next(line for line in lines if line.startswith("pip download"))
    assert "--python-version 3.12" in download and "--abi cp312" in download
    assert "megatron-core==0.16.1" in download and "torch_memory_saver==0.0.10" in download
    assert "pip wheel --no-deps -w wheels antlr4-python3-runtime==4.9.3" in out
    assert "cp311-cp311" in smoke("--print-wheels", "--python", "3.11").stdout


@pytest.mark.subprocess
def test_without_cuda_it_runs_nothing_and_exits_2():
    run = smoke()
    assert run.returncode == 2 and "CUDA is not available" in run.stderr
    assert "PASS" not in run.stdout


def _definitions(source: str) -> dict:
    return {node.name: ast.dump(node) for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_vendored_receiver_is_sglangs_own_code(sglang_wheels):
    """Every function and class in the vendored files is, statement for statement, the one
    in the sglang 0.5.18 wheel (read from the wheel itself)."""
    try:
        theirs = {rel: sglang_wheels.source_text("0.5.18", f"sglang/srt/{rel}") for rel in (
            "utils/patch_torch.py", "utils/common.py", "weight_sync/tensor_bucket.py")}
    except sglang_wheels.SglangSourceUnavailable as err:
        pytest.skip(f"the sglang 0.5.18 wheel is not available: {err}")
    pairs = {"patch_torch.py": "utils/patch_torch.py", "serializer.py": "utils/common.py",
             "tensor_bucket.py": "weight_sync/tensor_bucket.py"}
    for ours, rel in pairs.items():
        mine = _definitions((VENDORED / ours).read_text())
        original = _definitions(theirs[rel])
        assert mine, ours
        for name, dump in mine.items():
            assert dump == original.get(name), f"{ours}: {name} differs from sglang/srt/{rel}"
        header = (VENDORED / ours).read_text().splitlines()[:3]
        assert header[0] == "# Copyright 2023-2024 SGLang Team", ours
        assert "Apache License, Version 2.0" in header[1], ours
    assert set(_definitions((VENDORED / "serializer.py").read_text())) == {
        "MultiprocessingSerializer", "SafeUnpickler", "safe_pickle_load"}
    assert set(_definitions(theirs["weight_sync/tensor_bucket.py"])) == set(
        _definitions((VENDORED / "tensor_bucket.py").read_text()))


@pytest.mark.slow
def test_the_cpu_path_runs_both_backends_without_the_server_stack(tmp_path):
    """--device cpu: both backends' checks pass with gloo (Megatron in bf16 with its
    Float16Module and the distributed optimizer), the tensor handoff is received by
    SGLang's vendored code, the CUDA-only checks say SKIP and why; and nothing of the
    server stack is imported, in any of its processes."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    # None in sys.modules: an import fails as for a missing package, find_spec says None.
    (blocker / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({ABSENT_ON_THE_GPU_BOX!r}))\n")
    import os

    path = os.pathsep.join([str(blocker), str(REPO), os.environ.get("PYTHONPATH", "")])
    run = smoke("--device", "cpu", "--workdir", str(tmp_path / "work"), "--time-limit", "900",
                timeout_s=1200, env={"PYTHONPATH": path})
    lines = run.stdout.splitlines()
    status = {line.split(":")[0].split(" ", 1)[1]: line.split(" ")[0] for line in lines
              if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")}
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for group in ("fsdp", "megatron"):
        for check in ("dist", "init", "log_probs_vs_hf", "export_hf_names", "train_step",
                      "ipc_sglang_receiver", "save_load"):
            assert status.get(f"{group}/{check}") == "PASS", (group, check, run.stdout[-3000:])
        assert status[f"{group}/offload_onload"] == "SKIP"
    megatron_init = next(line for line in lines if line.startswith("PASS megatron/init"))
    assert "bfloat16" in megatron_init and "DistributedOptimizer" in megatron_init
    receiver = next(line for line in lines if line.startswith("PASS megatron/ipc_sglang_receiver"))
    assert "sglang 0.5.18's code (vendored)" in receiver
    for group in ("memory_saver", "startup"):
        assert status[f"{group}/all"] == "SKIP"
        assert f"SKIP {group}/all: needs CUDA" in run.stdout
