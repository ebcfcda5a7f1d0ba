"""The SGLang engine's launch logic and placement rules (seeds, ranks, bind addresses),
plus the shared supervision/readiness/registration code exercised against the CPU engine."""

import pytest
import requests

from rollout.engines import EngineClient, EngineServer, HFLaunch, Router, SGLangLaunch
from rollout.engines.actor import bind_host
from rollout.engines.group import EngineView
from trainer.weight_sync.push import broadcast_group_ranks, source_rank
from config import ClusterConfig, HomegymConfig, RolloutConfig, TrainConfig
from trainer.driver import components


def gpu_config(colocate=True):
    # Colocated: 8 GPUs shared; disaggregated: 4 for rollout + 4 for training.
    return HomegymConfig(cluster=ClusterConfig(device="cuda", gpus_per_node=8, colocate=colocate),
                         rollout=RolloutConfig(engine="sglang", num_gpus=8 if colocate else 4,
                                               num_gpus_per_engine=2, mem_fraction_static=0.6),
                         train=TrainConfig(ranks_per_node=8 if colocate else 4))


def test_sglang_command_from_config():
    spec = components.engine_spec(gpu_config(), "/models/qwen", base_gpu_id=0)
    assert isinstance(spec, SGLangLaunch)
    cmd = spec.command(31000, None, "127.0.0.1")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = dict(zip(cmd, cmd[1:]))
    assert args["--model-path"] == "/models/qwen" and args["--port"] == "31000"
    assert args["--host"] == "127.0.0.1" and args["--tp-size"] == "2"
    assert args["--mem-fraction-static"] == "0.6" and args["--base-gpu-id"] == "0"
    assert args["--context-length"] == "1024" and args["--dtype"] == "float32"
    assert args["--device"] == "cuda"
    # Colocated: release/resume around training, and no prefill CUDA graph (its memory is
    # not released by the memory saver).
    assert "--enable-memory-saver" in cmd and "--disable-prefill-cuda-graph" in cmd
    disagg = components.engine_spec(gpu_config(False), "/m").command(1, None, "127.0.0.1")
    assert "--enable-memory-saver" not in disagg and "--disable-prefill-cuda-graph" not in disagg
    assert spec.extra_ready_check() == "/health_generate"
    assert not spec.uses_port_file
    # The router's 1 s health checks must not run generations on a released engine.
    assert spec.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"


def test_each_engine_gets_its_own_seed():
    seeds = [dict(zip(c, c[1:]))["--random-seed"] for c in
             (components.engine_spec(gpu_config(), "/m", index=i).command(1, None,
                                                                          "h") for i in range(4))]
    assert len(set(seeds)) == 4  # one seed for all would repeat a group's samples


def test_sglang_on_cpu_command():
    config = HomegymConfig(cluster=ClusterConfig(device="cpu"),
                           rollout=RolloutConfig(engine="sglang", num_engines=1, dtype="bfloat16",
                                                 sglang_python="/venv/bin/python"))
    spec = components.engine_spec(config, "/m")
    cmd = spec.command(5, None, "127.0.0.1")
    args = dict(zip(cmd, cmd[1:]))
    assert cmd[0] == "/venv/bin/python" and args["--device"] == "cpu"
    assert args["--dtype"] == "bfloat16" and args["--max-total-tokens"] == "65536"
    assert "--mem-fraction-static" not in cmd and "--enable-memory-saver" not in cmd
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_engines_bind_the_node_address_on_a_multi_node_cluster():
    assert bind_host("127.0.0.1", 1, "10.0.0.5") == "127.0.0.1"
    assert bind_host("127.0.0.1", 2, "10.0.0.5") == "10.0.0.5"
    assert bind_host("localhost", 2, "10.0.0.5") == "10.0.0.5"
    assert bind_host("10.0.0.9", 2, "10.0.0.5") == "10.0.0.9"  # an explicit address stays


def test_each_engine_broadcast_group_holds_rank_0_and_every_tp_rank_of_the_engine():
    assert broadcast_group_ranks(2) == (1, 3)  # the engine's TP ranks 1, 2 after the trainer
    assert broadcast_group_ranks(1) == (1, 2)
    view = EngineView([EngineClient(f"http://h:{i}", "k") for i in range(2)], [2, 1], [0, 1])
    assert [(t.url, t.api_key, t.tp_size) for t in view.targets()] == [
        ("http://h:0", "k", 2), ("http://h:1", "k", 1)]


def test_tensor_sources_put_each_engine_tp_rank_on_its_gpus_rank():
    # 2 engines x TP 2 on 4 colocated GPUs: engine e's TP rank k is training rank 2e + k.
    assert [[source_rank(e, k, 2, 4) for k in range(2)] for e in range(2)] == [[0, 1], [2, 3]]
    # CPU: more engines than ranks wrap around.
    assert [source_rank(e, 0, 1, 2) for e in range(3)] == [0, 1, 0]


def test_hf_command_and_bad_kind():
    config = HomegymConfig(rollout=RolloutConfig(num_engines=1))
    spec = components.engine_spec(config, "/m")
    assert isinstance(spec, HFLaunch)
    cmd = spec.command(0, "/tmp/p", "127.0.0.1")
    assert "--port-file" in cmd and cmd[cmd.index("--torch-threads") + 1] == "1"
    with pytest.raises(ValueError, match="hf or sglang"):
        components.engine_spec(config, "/m", engine_kind="vllm")


class HFWithGenerateCheck(HFLaunch):
    """The CPU engine started the way SGLang is: a picked port and /health_generate."""

    uses_port_file = False

    def extra_ready_check(self):
        return "/health_generate"


@pytest.mark.slow
def test_sglang_style_readiness_and_registration(tiny_model_path, tmp_path):
    eng = EngineServer(HFWithGenerateCheck(model_path=tiny_model_path, uses_port_file=False),
                       "sgl-style", str(tmp_path))
    router = Router(tokenizer_path=tiny_model_path, log_dir=str(tmp_path))
    try:
        url = eng.start()
        router.start([])
        eng.register(router.url)  # what the sglang actor does after readiness
        router.wait_healthy([url])
        # ignore_eos: the tiny model is random, and its sampled token is its eos ~0.3% of the time.
        sampling = {"max_new_tokens": 2, "ignore_eos": True}
        r = requests.post(router.url + "/generate",
                          json={"input_ids": [1, 2], "sampling_params": sampling}, timeout=30)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    finally:
        router.shutdown()
        eng.shutdown()


@pytest.mark.slow
def test_start_failure_reports_log(tmp_path):
    eng = EngineServer(HFLaunch(model_path=str(tmp_path / "missing"), ready_timeout_s=60),
                       "broken", str(tmp_path))
    with pytest.raises(RuntimeError, match="exited with code"):
        eng.start()
