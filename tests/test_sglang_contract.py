"""homegym against SGLang's own source: every route homegym calls exists with that method
in each supported SGLang version, every key it sends is a field of the route's request
struct, every sampling parameter is one SGLang accepts, every launch flag is a ServerArgs
field of the pinned version and every SGLANG_ variable the launch sets is one it reads,
and homegym's CPU engine serves only that version's routes.

SGLang's routes and structs are read from the PyPI wheels on each run (tests/
sglang_source.py parses them with ast); nothing of them is copied here. What homegym sends
is recorded, not listed: a recording proxy sits in front of a real CPU engine serving the
version's contract, and homegym's own code (EngineClient, the training ranks' weight
senders, the rollout's episode policy) talks through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import torch

from rollout.engines import SUPPORTED_SGLANG_VERSIONS, PINNED_SGLANG_VERSION, EngineServer, HFLaunch
from rollout.engines.hf.server import routes as hf_routes
from trainer.driver import components

sglang_source = pytest.importorskip("sglang_source")


@pytest.fixture(scope="module", params=SUPPORTED_SGLANG_VERSIONS)
def contract(request, sglang_wheels):
    return sglang_wheels.contract(request.param)  # downloads the wheel once into the cache


class _Recorder(BaseHTTPRequestHandler):
    """Forwards every request to the engine and records (method, path, JSON body)."""

    upstream = ""
    log: list = []

    def _forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        path = self.path.split("?")[0]
        self.log.append((self.command, path, body))
        r = requests.request(self.command, self.upstream + self.path, data=raw or None,
                             headers={"Content-Type": "application/json"}, timeout=120)
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    do_GET = do_POST = do_PUT = _forward

    def log_message(self, *args):
        pass


def _record_homegym_traffic(version: str, model_path: str, tmp_path) -> list:
    """Drive homegym's engine-facing code against a CPU engine serving ``version``."""
    from rollout.args import RolloutArgs
    from rollout.engines import EngineClient, free_port
    from rollout.engines.group import EngineTarget
    from rollout.generate import EnginePolicy, GenerateState, sampling_params_from
    from rollout.http import close_session
    from safetensors.torch import load_file
    from config import HomegymConfig, RolloutConfig
    from trainer.weight_sync.push import GROUP_NAME, PushPlan, join_broadcast_group, send_weights

    engine = EngineServer(HFLaunch(model_path=model_path, contract_version=version),
                          f"contract-{version}", str(tmp_path))
    handler = type("Rec", (_Recorder,), {"log": []})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        handler.upstream = engine.start()
        client = EngineClient(url, name="proxied")
        assert client.version() == version
        client.weight_version()
        weights = sorted(load_file(f"{model_path}/model.safetensors").items())
        target = (EngineTarget("proxied", url, None, 1),)
        plan = PushPlan(mode="tensor", version=1, targets=target, bucket_bytes=1 << 20,
                        dtype="float32", device="cpu", flush_cache=True)
        metrics, _ = send_weights([weights[:3], weights[3:]], plan, rank=0, world_size=1)
        assert metrics["perf/weight_sync_checked_tensors"] > 0
        port = free_port()
        name = f"{GROUP_NAME}_contract_{version}"  # one group name per process and group
        group = join_broadcast_group(target[0], "127.0.0.1", port, name, "gloo")
        send_weights([weights], dataclasses.replace(plan, mode="distributed", version=2,
                                                    group_names=(name,)),
                     rank=0, world_size=1, weight_groups=[group])
        client.destroy_weights_update_group(name)
        torch.distributed.destroy_process_group(group)  # leave this process as it was
        send_weights([weights], dataclasses.replace(plan, mode="disk", version=3,
                                                    disk_dir=str(tmp_path / "push")),
                     rank=0, world_size=1)
        client.pause_generation("in_place")
        client.continue_generation()
        client.abort_all()
        client.flush_cache()
        client.freeze_gc()
        client.release_memory()
        client.resume_memory(["weights"])
        send_weights([weights], dataclasses.replace(plan, version=4), rank=0, world_size=1)
        client.resume_memory(["kv_cache", "cuda_graph"])
        # The rollout's own requests, with every sampling option homegym sets.
        cfg = HomegymConfig(rollout=RolloutConfig(num_engines=1, stop=["</guess>"]))
        state = GenerateState(RolloutArgs(url, **components.rollout_sections(cfg)))
        params = sampling_params_from(1.0, 0.9, 5, 4, ["</guess>"])
        params["sampling_seed"] = 3

        async def episode():
            try:
                return await EnginePolicy(state, params).act([1, 2, 3], 4)
            finally:
                await close_session()
        asyncio.run(episode())
    finally:
        proxy.shutdown()
        engine.shutdown()
    return handler.log


@pytest.fixture(scope="module")
def traffic(contract, tiny_model_path, tmp_path_factory):
    return _record_homegym_traffic(contract.version, tiny_model_path,
                                   tmp_path_factory.mktemp(f"contract-{contract.version}"))


@pytest.mark.slow
def test_every_route_and_key_homegym_sends_exists_in_sglang(contract, traffic):
    seen = {(m, p) for m, p, _ in traffic}
    # The scenario reached the routes that matter (a silent short-cut would hide them).
    for must in ("/update_weights_from_tensor", "/update_weights_from_distributed",
                 "/update_weights_from_disk", "/init_weights_update_group", "/model_info",
                 "/generate", "/freeze_gc"):
        assert any(p == must for _, p in seen), must
    problems = []
    for method, path, body in traffic:
        route = contract.route(path, method)
        if route is None:
            problems.append(f"{method} {path}: no such route in SGLang {contract.version}")
            continue
        fields = contract.request_fields(path, method)
        if fields is not None and isinstance(body, dict):
            unknown = set(body) - fields
            if unknown:
                problems.append(f"{method} {path}: {sorted(unknown)} are not fields of "
                                f"{route.request_struct} in SGLang {contract.version}")
        if path == "/generate" and isinstance(body, dict):
            names = contract.sampling_param_api_names
            schema = contract.schema_sampling_param_names
            sent = set(body.get("sampling_params") or {})
            unknown = sent - names if schema is None else sent - (names & schema)
            if unknown:
                problems.append(f"/generate sampling_params {sorted(unknown)} are not "
                                f"SamplingParams of SGLang {contract.version}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_weight_updates_use_the_session_where_the_version_has_one(contract, traffic):
    paths = [p for _, p, _ in traffic]
    has_sessions = contract.route("/begin_weight_update", "POST") is not None
    assert ("/begin_weight_update" in paths) == has_sessions
    if has_sessions:  # every tensor/distributed update sits between begin and end
        open_ = False
        for p in paths:
            if p == "/begin_weight_update":
                assert not open_
                open_ = True
            elif p == "/end_weight_update":
                open_ = False
            elif p in ("/update_weights_from_tensor", "/update_weights_from_distributed"):
                assert open_, f"{p} outside a weight-update session"
            elif p == "/update_weights_from_disk":  # re-processes its weights itself
                assert not open_, f"{p} inside a weight-update session"
    # No update asks the server to flush (fatal with a request queued); flushes are separate.
    for _, p, body in traffic:
        if p.startswith("/update_weights_from"):
            assert body.get("flush_cache") is False, p


@pytest.mark.slow
def test_a_distributed_push_sends_its_small_tensors_as_one_broadcast(traffic):
    """The recorded distributed push (the whole tiny model, one bucket): every tensor under
    FLATTEN_BELOW_BYTES goes in one flattened_bucket update, each larger one on its own,
    and each tensor exactly once."""
    import math

    from trainer.weight_sync.push import FLATTEN_BELOW_BYTES

    bodies = [b for _, p, b in traffic if p == "/update_weights_from_distributed"]
    flat = [b for b in bodies if b.get("load_format") == "flattened_bucket"]
    assert len(flat) == 1 and len(flat[0]["names"]) > 1
    sizes = {n: math.prod(s) * getattr(torch, d).itemsize
             for b in bodies for n, d, s in zip(b["names"], b["dtypes"], b["shapes"])}
    assert all(sizes[n] < FLATTEN_BELOW_BYTES for n in flat[0]["names"])
    singles = [n for b in bodies if b not in flat for n in b["names"]]
    assert all(sizes[n] >= FLATTEN_BELOW_BYTES for n in singles)
    assert sorted(flat[0]["names"] + singles) == sorted(sizes)


def _sglang_distributed_receiver(version: str, sglang_wheels):
    """SGLang's own receiving side of a ``flattened_bucket`` distributed update
    (model_runner_components/weight_updater.py), run from the wheel's
    weight_sync/tensor_bucket.py (it imports only torch): ``(names, dtypes, shapes) ->
    (buffer the broadcast fills, reconstruct)``."""
    import sys
    import types

    module = types.ModuleType(f"sglang_{version.replace('.', '_')}_tensor_bucket")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(sglang_wheels.source_text(version, "sglang/srt/weight_sync/tensor_bucket.py"),
                 "tensor_bucket.py", "exec"), module.__dict__)
    bucket_cls = module.FlattenedTensorBucket

    def receive(names, dtypes, shapes):
        if hasattr(bucket_cls, "empty"):  # 0.5.23: _receive_bucketed_weights_from_distributed
            bucket = bucket_cls.empty(names, dtypes, shapes, "cpu")
        else:  # 0.5.18: _update_bucketed_weights_from_distributed
            bucket = bucket_cls(named_tensors=[
                (n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)])
        return bucket.get_flattened_tensor(), bucket.reconstruct_tensors
    return receive


def test_a_broadcast_bucket_is_what_sglangs_receiver_reads(contract, sglang_wheels):
    """homegym's one-broadcast bucket (weights_io.broadcast_bucket) fills SGLang's receive
    buffer byte for byte, and SGLang's reconstruction gives back every tensor: mixed
    dtypes, an odd-length bf16 and a bool tensor among float32 ones (in the order given,
    a float32 tensor would start off its alignment; the sender orders them)."""
    from rollout.engines.weights_io import broadcast_bucket, broadcast_bucket_views

    gen = torch.Generator().manual_seed(0)
    named = [("a.bool", torch.rand(3, generator=gen) > 0.5),
             ("b.bf16", torch.randn(5, 3, generator=gen).bfloat16()),
             ("c.f32", torch.randn(7, 4, generator=gen)),
             ("d.scalar", torch.tensor(2.5)),
             ("e.f16", torch.randn(2, 2, generator=gen).half())]
    receive = _sglang_distributed_receiver(contract.version, sglang_wheels)
    sent, flat = broadcast_bucket(named)
    names = [n for n, _ in sent]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in sent]
    shapes = [list(t.shape) for _, t in sent]
    buffer, reconstruct = receive(names, dtypes, shapes)
    assert buffer.dtype == flat.dtype == torch.uint8 and buffer.shape == flat.shape
    buffer.copy_(flat)  # what the broadcast does
    got = dict(reconstruct())
    assert sorted(got) == sorted(n for n, _ in named)
    for name, tensor in named:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # homegym's engine lays the buffer out the same way.
    ours, views = broadcast_bucket_views(names, [getattr(torch, d) for d in dtypes], shapes)
    assert ours.shape == flat.shape
    ours.copy_(flat)
    assert all(torch.equal(v, got[n]) for n, v in views)


def test_cpu_engine_serves_only_routes_of_its_contract(contract):
    served = hf_routes(contract.version)
    missing = [f"{m} {p}" for m, p, _ in served if contract.route(p, m) is None]
    assert not missing, f"the CPU engine serves routes SGLang {contract.version} lacks: {missing}"


def test_pinned_version_launch_flags_are_server_args(contract, tiny_qwen3_5_path):
    """Every flag SGLangLaunch can emit is a CLI field of the pinned ServerArgs."""
    import ast

    from rollout.engines import SGLangLaunch

    if contract.version != PINNED_SGLANG_VERSION:
        pytest.skip("the launch command is built for the pinned version")
    src = sglang_source.wheel_dir(contract.version) / "src" / "sglang/srt/server_args.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    flags = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "no_cli=True" in ast.unparse(node.annotation):
                continue
            flags.add("--" + node.target.id.replace("_", "-"))
    for device in ("cuda", "cpu"):
        spec = SGLangLaunch(model_path="/m", device=device, tp_size=2, enable_memory_saver=True,
                            random_seed=1, nccl_port=5, api_key="k", max_context_len=64,
                            max_total_tokens=1024, lora_rank=8, lora_target_modules=("q_proj",))
        used = {a for a in spec.command(1, None, "127.0.0.1") if a.startswith("--")}
        assert used - flags == set(), f"not ServerArgs of SGLang {contract.version}"
        assert len(used) >= 15
        # A hybrid model (Qwen3.5) adds its state pool's flags; on CPU, without the overlap
        # scheduler, whose state-cache buffers need GPU kernels.
        hybrid = dataclasses.replace(spec, model_path=tiny_qwen3_5_path,
                                     mamba_full_memory_ratio=0.5, max_mamba_cache_size=30)
        extra = {a for a in hybrid.command(1, None, "127.0.0.1") if a.startswith("--")} - used
        want = {"--mamba-full-memory-ratio", "--max-mamba-cache-size"}
        assert extra == want | ({"--disable-overlap-schedule"} if device == "cpu" else set())
        assert extra <= flags


# Read straight from os.environ, not declared in srt/environ.py: where the pinned version does.
READ_DIRECTLY = {"SGLANG_USE_CPU_ENGINE": "sglang/srt/utils/common.py"}


@pytest.mark.slow
def test_pinned_version_reads_every_variable_the_launch_sets(contract):
    """A variable SGLang does not read is a silent no-op (a health check that generates, a
    5-s sleep at every shutdown): each SGLANG_ one the launch sets is declared in the
    pinned version's srt/environ.py, or read where READ_DIRECTLY says."""
    import re

    from rollout.engines import SGLangLaunch

    if contract.version != PINNED_SGLANG_VERSION:
        pytest.skip("the launch environment is built for the pinned version")
    environ = sglang_source.source_text(contract.version, "sglang/srt/environ.py")
    declared = set(re.findall(r"^\s+(SGLANG_\w+)\s*=\s*Env\w+\(", environ, re.M))
    assert len(declared) > 100
    names = set()
    for device in ("cuda", "cpu"):
        spec = SGLangLaunch(model_path="/m", device=device, enable_memory_saver=True)
        names |= {n for n in spec.env if n.startswith("SGLANG_")}
    assert len(names) >= 5
    for name in sorted(names - declared):
        assert name in READ_DIRECTLY, f"SGLang {contract.version} does not declare {name}"
        assert name in sglang_source.source_text(contract.version, READ_DIRECTLY[name])


def test_client_refuses_an_unsupported_version():
    from rollout.engines.client import UnsupportedEngineVersion, check_version

    assert check_version(PINNED_SGLANG_VERSION) == PINNED_SGLANG_VERSION
    with pytest.raises(UnsupportedEngineVersion, match=r"'0\.4\.9'.*0\.5\.18"):
        check_version("0.4.9")


def test_pinned_version_is_the_gpu_extra_pin():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = [d for d in meta["project"]["optional-dependencies"]["gpu"] if d.startswith("sglang")]
    assert pins == [f"sglang=={PINNED_SGLANG_VERSION}"]
    assert torch.__version__.startswith("2.13")  # the torch that SGLang 0.5.18 pins
