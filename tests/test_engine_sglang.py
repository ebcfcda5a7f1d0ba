"""The SGLang engine's launch logic (SGLang itself needs a GPU), plus the shared
supervision/readiness/registration code exercised against the CPU engine."""

import pytest
import requests

from rollout.engines import EngineServer, HFLaunch, Router, SGLangLaunch, spec_from_config
from trainer.config import ClusterConfig, HomegymConfig, RolloutConfig, TrainConfig


def gpu_config(colocate=True):
    # Colocated: 8 GPUs shared; disaggregated: 4 for rollout + 4 for training.
    return HomegymConfig(cluster=ClusterConfig(device="cuda", gpus_per_node=8, colocate=colocate),
                         rollout=RolloutConfig(engine="sglang", num_gpus=8 if colocate else 4,
                                               num_gpus_per_engine=2, mem_fraction_static=0.6),
                         train=TrainConfig(ranks_per_node=8 if colocate else 4))


def test_sglang_command_from_config():
    spec = spec_from_config(gpu_config(), "/models/qwen", base_gpu_id=0)
    assert isinstance(spec, SGLangLaunch)
    cmd = spec.command(31000, None)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    args = dict(zip(cmd, cmd[1:]))
    assert args["--model-path"] == "/models/qwen" and args["--port"] == "31000"
    assert args["--host"] == "127.0.0.1" and args["--tp-size"] == "2"
    assert args["--mem-fraction-static"] == "0.6" and args["--base-gpu-id"] == "0"
    assert args["--context-length"] == "1024" and args["--dtype"] == "float32"
    assert "--enable-memory-saver" in cmd  # colocated: release/resume around training
    assert "--enable-memory-saver" not in spec_from_config(gpu_config(False), "/m").command(1, None)
    assert spec.extra_ready_check() == "/health_generate"
    assert not spec.uses_port_file


def test_hf_command_and_bad_kind():
    config = HomegymConfig(rollout=RolloutConfig(num_engines=1))
    spec = spec_from_config(config, "/m")
    assert isinstance(spec, HFLaunch)
    cmd = spec.command(0, "/tmp/p")
    assert "--port-file" in cmd and cmd[cmd.index("--torch-threads") + 1] == "1"
    with pytest.raises(ValueError, match="hf or sglang"):
        spec_from_config(config, "/m", engine_kind="vllm")


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
        r = requests.post(router.url + "/generate", json={"input_ids": [1, 2], "sampling_params":
                                                          {"max_new_tokens": 2}}, timeout=30)
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
