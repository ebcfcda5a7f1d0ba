"""Offline models: built from a config with no network, loaded as ordinary HF checkpoints."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.models import ModelPathError, resolve_model_path


def test_tiny_model_is_a_normal_hf_checkpoint(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.model_type == "qwen3"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    # The game's tags are single tokens; the chat template renders ChatML.
    for tag in ("<answer>", "</answer>", "<feedback>", "</feedback>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    ids = tok("<answer>17</answer>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "<answer>17</answer>"
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_tiny_model_is_built_once_and_deterministic(tmp_path):
    a = resolve_model_path("tiny-qwen3", str(tmp_path / "a"))
    b = resolve_model_path("tiny-qwen3", str(tmp_path / "b"))
    assert resolve_model_path("tiny-qwen3", str(tmp_path / "a")) == a
    sa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not [p for p in os.listdir(tmp_path / "a") if ".tiny-qwen3." in p]


def test_a_cache_built_by_an_older_builder_is_rebuilt(tmp_path):
    import json

    from rollout.tiny_models import TINY_BUILDERS

    path = resolve_model_path("tiny-qwen3-tools", str(tmp_path))
    stamp = os.path.join(path, "homegym_model.json")
    current = json.load(open(stamp))["version"]
    assert current == TINY_BUILDERS["tiny-qwen3-tools"][1]
    # What an older builder left: no version stamp, and files the new one does not write.
    with open(stamp, "w") as f:
        json.dump({"builtin": "tiny-qwen3-tools"}, f)
    open(os.path.join(path, "old-file"), "w").close()
    assert resolve_model_path("tiny-qwen3-tools", str(tmp_path)) == path
    assert json.load(open(stamp))["version"] == current
    assert not os.path.exists(os.path.join(path, "old-file"))
    assert sorted(os.listdir(tmp_path)) == ["tiny-qwen3-tools", "tiny-qwen3-tools.lock"]
    mtime = os.path.getmtime(stamp)
    assert resolve_model_path("tiny-qwen3-tools", str(tmp_path)) == path  # current: kept
    assert os.path.getmtime(stamp) == mtime


def test_local_directory_is_used_as_is(tiny_model_path):
    assert resolve_model_path(tiny_model_path) == tiny_model_path


def test_hub_name_needs_a_local_path():
    with pytest.raises(ModelPathError, match="never downloads from a model hub"):
        resolve_model_path("Qwen/Qwen3-4B")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelPathError, match="config.json"):
        resolve_model_path(str(tmp_path))


@pytest.mark.slow
def test_smollm2_from_the_packaged_gguf():
    """rollout.models converts the GGUF file itself (dequantized weights under transformers'
    names, q/k rows back in transformers' rotary order, transformers' tokenizer converter):
    the model answers a question right greedily (with q/k left in llama.cpp's order it
    answers nothing)."""
    path = resolve_model_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "paris" in reply.lower(), reply


def test_tiny_qwen3_5_has_the_real_checkpoint_layout(tiny_qwen3_5_path):
    """tiny-qwen3_5 is saved as Qwen's Qwen3.5 checkpoints are (the vision-language class,
    text under model.language_model, a vision tower, an MTP layer), with head dims SGLang's
    CPU GDN kernels take, and AutoModelForCausalLM loads its text model with the embedding
    still tied to the LM head."""
    import json

    from safetensors import safe_open
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config.from_pretrained(tiny_qwen3_5_path)
    text = config.text_config
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert text.linear_key_head_dim == text.linear_value_head_dim in (64, 128)
    assert text.head_dim in (64, 128)
    raw = json.load(open(os.path.join(tiny_qwen3_5_path, "config.json")))
    assert raw["text_config"]["full_attention_interval"] == 4  # what SGLang reads
    with safe_open(os.path.join(tiny_qwen3_5_path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {k.split(".layers.")[0].split(".")[0] + "." + k.split(".")[1] for k in keys} >= {
        "model.language_model", "model.visual", "mtp.layers", "mtp.fc"}
    assert "lm_head.weight" not in keys  # tied

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_5_path)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id < len(tok)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    full = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_qwen3_5_path)
    ids = torch.tensor([tok("<answer>7</answer> lower", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(input_ids=ids).logits)
