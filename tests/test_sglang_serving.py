"""What homegym's SGLang launch sets for Qwen3.5 (rollout/engines/sglang_serving.py): the
text-only view of the vision-language checkpoint and the recurrent-state pool; no server
is started (tests/test_sglang_cpu.py runs the real one where the CPU allows)."""

import os
from pathlib import Path

from rollout.checkpoints import kv_bytes_per_token, read_config, state_bytes_per_sequence
from rollout.engines import SGLangLaunch


def flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_vlm_checkpoint_is_served_as_a_text_only_view(tiny_qwen3_5_path, tmp_path,
                                                        monkeypatch):
    """SGLang gets a view of the checkpoint whose config.json adds
    ``language_model_only: true`` (the CLI flag is refused for Qwen3.5): every other file
    is the checkpoint's own, the checkpoint is left untouched, and the view loads in
    transformers as the same Qwen3.5 config. Made once, reused by every launch."""
    from transformers import AutoConfig

    monkeypatch.setenv("HOMEGYM_CACHE", str(tmp_path))
    spec = SGLangLaunch(model_path=tiny_qwen3_5_path, device="cpu", dtype="bfloat16")
    cmd = spec.command(1, None, "127.0.0.1")
    served = flag(cmd, "--model-path")
    assert served.startswith(str(tmp_path)) and "--language-model-only" not in cmd
    original = read_config(tiny_qwen3_5_path)
    assert "language_model_only" not in original
    assert read_config(served) == {**original, "language_model_only": True}
    files = sorted(os.listdir(tiny_qwen3_5_path))
    assert sorted(os.listdir(served)) == files
    for name in files:
        if name != "config.json":
            assert Path(served, name).resolve() == Path(tiny_qwen3_5_path, name).resolve()
    loaded = AutoConfig.from_pretrained(served)
    assert loaded.language_model_only and loaded.text_config.layer_types == \
        original["text_config"]["layer_types"]
    assert flag(spec.command(2, None, "127.0.0.1"), "--model-path") == served
    # A text-only checkpoint (Qwen3) is served from its own directory.
    from rollout.models import resolve_model_path

    qwen3 = resolve_model_path("tiny-qwen3")
    assert flag(SGLangLaunch(model_path=qwen3).command(1, None, "h"), "--model-path") == qwen3


def test_hybrid_models_get_a_state_pool(tiny_qwen3_5_path, tiny_model_path):
    """On CPU, where homegym fixes the KV cache, the state pool is SGLang's share of it
    (0.9, or rollout.sglang_mamba_full_memory_ratio, times the KV bytes) in whole
    per-sequence states; on GPU the ratio and size pass through and SGLang sizes the rest.
    Dense models get no state flags."""
    cfg = read_config(tiny_qwen3_5_path)
    per_state = state_bytes_per_sequence(cfg, "bfloat16")
    kv_bytes = 65536 * kv_bytes_per_token(cfg, "bfloat16")
    cpu = SGLangLaunch(model_path=tiny_qwen3_5_path, device="cpu", dtype="bfloat16")
    assert int(flag(cpu.command(1, None, "h"), "--max-mamba-cache-size")) == \
        int(0.9 * kv_bytes // per_state)
    half = SGLangLaunch(model_path=tiny_qwen3_5_path, device="cpu", dtype="bfloat16",
                        mamba_full_memory_ratio=0.45)
    cmd = half.command(1, None, "h")
    assert int(flag(cmd, "--max-mamba-cache-size")) == int(0.45 * kv_bytes // per_state)
    assert flag(cmd, "--mamba-full-memory-ratio") == "0.45"
    gpu = SGLangLaunch(model_path=tiny_qwen3_5_path, device="cuda", dtype="bfloat16")
    assert "--max-mamba-cache-size" not in gpu.command(1, None, "h")
    sized = SGLangLaunch(model_path=tiny_qwen3_5_path, device="cuda", max_mamba_cache_size=96)
    assert flag(sized.command(1, None, "h"), "--max-mamba-cache-size") == "96"
    dense = SGLangLaunch(model_path=tiny_model_path, device="cpu", dtype="bfloat16",
                         mamba_full_memory_ratio=0.5)
    assert not [a for a in dense.command(1, None, "h") if "mamba" in a]


def test_state_bytes_of_qwen3_5_4b():
    """The per-sequence state of Qwen3.5-4B's shape (slime's script: 24 GDN layers of 32
    value heads x 128 x 128 fp32, conv over 2 x 16 x 128 + 32 x 128 channels): ~49 MiB."""
    text = {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_conv_kernel_dim": 4, "num_hidden_layers": 32, "hidden_size": 2560,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256}
    cfg = {"text_config": text, "vision_config": {}}
    assert state_bytes_per_sequence(cfg, "bfloat16") == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert round(state_bytes_per_sequence(cfg, "bfloat16") / 2**20, 1) == 49.1
    assert kv_bytes_per_token(cfg, "bfloat16") == 8 * 2 * 4 * 256 * 2


class NoEngines:
    """An engine view with nothing to push to (the plan is all this test reads)."""

    @staticmethod
    def targets():
        return []


def test_every_weight_push_to_a_hybrid_model_flushes_the_engines_caches():
    """Cached prefixes of a hybrid model carry recurrent states computed with the weights
    of the moment: every push ends with a flush, in every layout preflight lets through;
    a dense model keeps the rule it had (flush after aborting in-flight requests)."""
    from conftest import compose_config
    from trainer.driver import components

    def flushes(*overrides):
        sync = components.weight_sync(compose_config(*overrides), None, NoEngines())
        return sync.plan(1).flush_cache

    assert flushes("model.path=tiny-qwen3_5")
    assert not flushes()
    assert flushes("cluster.colocate=false", "rollout.update_in_flight=abort")
