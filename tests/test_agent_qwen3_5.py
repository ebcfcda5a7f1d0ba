"""Qwen3.5's tool-call format (Qwen3-Coder's XML) in the agent session: parsing typed by
the tool schema, the text a scripted player writes, the session choosing the format from
the chat template, and episodes recorded token-exactly in every API dialect, a malformed
call included (the Qwen3 JSON path: tests/test_rollout_agent.py)."""

import json

import pytest

from envs import calculator
from qwen3_5_template import QWEN3_5_LAYOUT
from rollout.agent import ToolCall
from rollout.agent.tool_formats import HERMES, QWEN3_CODER, tool_format
from rollout.agent.xml_toolcalls import (arguments_as_objects, format_tool_calls,
                                         parse_tool_calls)
from test_rollout_agent import QUESTION, same_episode_in_every_dialect

TOOL = {"type": "function", "function": {"name": "probe", "parameters": {
    "type": "object", "properties": {
        "text": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
        "flag": {"type": "boolean"}, "opts": {"type": "object"},
        "items": {"type": ["array", "null"]}}}}}


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    """A tokenizer with Qwen3.5's chat layout (tests/qwen3_5_template.py) whose tool-call
    and think tags are single tokens, as in Qwen3.5's own tokenizer."""
    from transformers import AutoTokenizer

    from rollout.models import resolve_model_path

    t = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen3-tools"))
    t.add_tokens(["<think>", "</think>"])
    t.chat_template = QWEN3_5_LAYOUT
    return t


def render(tok, messages, tools, generation_prompt=True, **kwargs):
    return tok.apply_chat_template(arguments_as_objects(messages), tools=tools, tokenize=False,
                                   add_generation_prompt=generation_prompt, **kwargs)


def test_calls_parse_typed_by_the_schema_and_render_back_to_the_models_text(tok):
    """Values are text in this format: the tool's schema types them (SGLang's qwen3_coder
    rules); the template renders the parsed message back to exactly what the model wrote."""
    text = ("Checking.\n\n<tool_call>\n<function=probe>\n<parameter=text>\n 2 + 2\nlines\n"
            "</parameter>\n<parameter=n>\n7\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
            "<parameter=flag>\ntrue\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n"
            "</parameter>\n<parameter=items>\nnull\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=probe>\n<parameter=n>\nseven\n</parameter>\n"
            "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>")
    p = parse_tool_calls(text, [TOOL])
    assert p.content == "Checking." and p.malformed == 0
    assert [json.loads(c.arguments) for c in p.tool_calls] == [
        {"text": " 2 + 2\nlines", "n": 7, "x": 2.5, "flag": True, "opts": {"a": [1, 2]},
         "items": None},
        {"n": "seven", "extra": "42"}]  # not an integer: kept as text; unknown: text
    message = {"role": "assistant", "content": p.content,
               "tool_calls": [c.to_openai() for c in p.tool_calls]}
    rendered = render(tok, [{"role": "user", "content": "q"}, message], [TOOL], False)
    # Jinja's `string` of Python's None and True, as Qwen3.5's template writes them; the
    # rest verbatim. (An answer sent back unchanged is rendered as the model's text.)
    written = text.replace("\nnull\n", "\nNone\n").replace("\ntrue\n", "\nTrue\n")
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + written
                             + "<|im_end|>\n")
    assert format_tool_calls(p.tool_calls, p.content) == written
    # Without the schema every value stays the model's text.
    assert json.loads(parse_tool_calls(text).tool_calls[0].arguments)["n"] == "7"
    assert parse_tool_calls("no call here").tool_calls == []


@pytest.mark.parametrize("text,error", [
    ("<tool_call>\n<function=probe>\n<parameter=n>\n7\n</parameter>\n</tool_call>",
     "not one <function=...> block"),
    ("<tool_call>\n<function=probe>\n<parameter=n>\n7\n</parameter>\nstray\n</function>\n"
     "</tool_call>", "sequence of <parameter=...> blocks"),
    ("<tool_call>\n<function=probe>\n<parameter=n>\n7\n</parameter>\n<parameter=n>\n8\n"
     "</parameter>\n</function>\n</tool_call>", "distinct names"),
    ("<tool_call>\n<function=probe>\n<parameter=n>\n7", "not closed"),
    ('<tool_call>\n{"name": "probe", "arguments": {}}\n</tool_call>', "<function=...>"),
])
def test_a_malformed_call_is_a_call_with_its_error_and_raw_text(text, error):
    p = parse_tool_calls(text, [TOOL])
    (call,) = p.tool_calls
    assert call.error is not None and error in call.error and p.malformed == 1
    assert call.arguments in text
    assert call.name in ("probe", "invalid_tool_call")
    after = parse_tool_calls(format_tool_calls([ToolCall("probe", '{"n": 1}')]) + " and more")
    assert after.stray_text and after.malformed == 1 and after.tool_calls[0].error is None


def test_the_session_picks_the_format_its_chat_template_writes(tok, tiny_model_path):
    from transformers import AutoTokenizer

    from rollout.models import resolve_model_path

    assert tool_format(tok) is QWEN3_CODER
    assert tool_format(AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen3-tools"))) \
        is HERMES
    assert tool_format(AutoTokenizer.from_pretrained(tiny_model_path)) is HERMES


def xml_fumbling_reply(sample, messages, tools, rng):
    """The scripted model in Qwen3.5's format: a call without its </function> first, then,
    answered with the tool's error, a well-formed call, then the result as the answer."""
    question = next(m["content"] for m in messages if m["role"] == "user")
    expression = QUESTION.search(question).group(1)
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if results and not results[-1].startswith("error"):
        return f"<answer>{results[-1]}</answer>"
    call = format_tool_calls([ToolCall("calculator", json.dumps({"expression": expression}))])
    return call if results else call.replace("</function>\n", "")


@pytest.mark.parametrize("thinking", [False, True])
def test_every_dialect_records_a_qwen3_5_episode_token_exactly(tok, thinking):
    """The real openai (chat, streamed chat, Responses) and anthropic clients drive the same
    episode in Qwen3.5's format, with thinking off (the generation prompt closes an empty
    <think> block) and on (the model writes its reasoning and closes it): a malformed call
    answered with the tool's error, a corrected call, the answer. Each is one token-exact
    sample, the malformed call counted, and the four are the same tokens."""
    def reply(sample, messages, tools, rng):
        text = xml_fumbling_reply(sample, messages, tools, rng)
        return f"Let me see.\n</think>\n\n{text}" if thinking else text

    first = same_episode_in_every_dialect(tok, reply, max_new_tokens=96, max_context_len=1024,
                                          chat_template_kwargs={"enable_thinking": thinking})
    text = tok.decode(first.tokens)
    expression = calculator.task_of(first)["expression"]
    assert f"<parameter=expression>\n{expression}\n</parameter>\n</function>\n</tool_call>" \
        in text
    assert "<tool_response>\nerror: " in text
    # The first prompt is the template's own render (generation prompt with or without
    # the closed think block).
    question = [{"role": "user", "content": calculator.task_of(first)["question"]}]
    prompt = render(tok, question, [calculator.CALCULATOR_TOOL], enable_thinking=thinking)
    assert tok(prompt, add_special_tokens=False)["input_ids"] == \
        first.tokens[:first.prompt_length]
