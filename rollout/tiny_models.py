"""The built-in tiny models, made from code (no network): a ~1M-parameter Qwen3 architecture
with a small byte-level BPE trained on the task's own texts.

- ``tiny-qwen3``: the guessing game's tags as single tokens, a plain ChatML template;
- ``tiny-qwen3-tools``: one token per digit, the tool-call tags, and a chat template with
  Qwen3's tool-calling layout (tools in the system turn, ``<tool_call>`` JSON, results in
  ``<tool_response>``);
- ``tiny-qwen3_5``: Qwen3.5's hybrid architecture (Gated DeltaNet + gated attention) in its
  vision-language checkpoint layout, with tiny-qwen3's tokenizer.

``rollout.models.resolve_model_path`` builds them into the cache on first use.
"""

from __future__ import annotations

import json
from pathlib import Path

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
# Qwen3's tool-calling layout (without the thinking blocks): tools as JSON lines within
# <tools></tools> in the system turn, calls as <tool_call> JSON, results as <tool_response>
# in a user turn. An assistant message's ``arguments`` string is written verbatim, so the
# model's own call text renders back to the same tokens. Qwen3's prose instructions around
# <tools> are left out: a model trained from scratch cannot read them, and they were ~90 of
# a calculator prompt's ~175 tokens, paid in every warm-up, rollout and training forward.
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}"
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


# Qwen3.5's vision special tokens: the checkpoint's config names their ids (a VLM), so the
# tiny tokenizer has them too, though no tiny run feeds images.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen3_5_config(vocab_size: int, *, eos_token_id: int, pad_token_id: int,
                        vision_ids: dict[str, int]):
    """The real ``Qwen3_5Config`` (a vision-language checkpoint) at toy size: 4 text layers,
    3 Gated DeltaNet + 1 gated full attention (Qwen3.5's 1 in 4), head dims 64 everywhere
    (SGLang's CPU GDN kernels take 64 or 128 with equal key and value dims), partial rotary
    (a quarter of the head), a one-block vision tower, one MTP layer. Embeddings tied in the
    parent AND the text config: ``AutoModelForCausalLM`` reads only the text config, whose
    default is untied."""
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                         "mrope_interleaved": True},
        rms_norm_eps=1e-6, tie_word_embeddings=True, mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False, bos_token_id=None, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         **vision_ids)


def _mtp_tensors(config) -> dict:
    """Qwen3.5's multi-token-prediction head as its checkpoints store it (``mtp.*``, which
    SGLang's qwen3_5_mtp.py loads and transformers skips): one full-attention decoder layer,
    ``fc`` from [embedding; hidden] to hidden, and three (1 + w) RMSNorms."""
    import copy

    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    text = copy.deepcopy(config.text_config)
    text.num_hidden_layers, text.layer_types = 1, ["full_attention"]
    layer = Qwen3_5TextModel(text).layers[0]  # initialised by transformers' own post_init
    hidden = text.hidden_size
    fc = torch.empty(hidden, 2 * hidden).normal_(0.0, text.initializer_range)
    out = {f"mtp.layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()}
    out.update({"mtp.fc.weight": fc, "mtp.norm.weight": torch.zeros(hidden),
                "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
                "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden)})
    return out


def _build_tiny_qwen3_5(out: Path) -> None:
    """A ~1M-parameter Qwen3.5 (hybrid Gated DeltaNet + gated attention) saved in the layout
    of Qwen's own Qwen3.5 checkpoints: ``Qwen3_5ForConditionalGeneration`` with
    ``model.language_model.*``, ``model.visual.*`` and ``mtp.*``; tiny-qwen3's tokenizer
    and ChatML template."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForConditionalGeneration

    tokenizer = _build_tiny_tokenizer()
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"), tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    config = tiny_qwen3_5_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, vision_ids=ids)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    tensors.update(_mtp_tensors(config))
    save_file(tensors, weights, metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    (out / "homegym_model.json").write_text(json.dumps({"builtin": "tiny-qwen3_5"}))


# name -> (builder, version). Bump a version when its builder's output changes: caches
# built by an older version are rebuilt on next use.
TINY_BUILDERS = {"tiny-qwen3": (_build_tiny_qwen3, 1),
                 "tiny-qwen3-tools": (_build_tiny_qwen3_tools, 2),
                 "tiny-qwen3_5": (_build_tiny_qwen3_5, 1)}
