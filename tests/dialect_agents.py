"""The calculator agent's loop (envs/calculator.py) written against each API dialect's own
client, for the tests: streamed chat completions (usage asked for and checked), the
Responses API and Anthropic's Messages API (every other call streamed). Each runs the
calculator tool on the model's calls, answers a call whose arguments do not parse with the
tool's error, and returns the model's final text."""

from __future__ import annotations

import json

from envs import calculator

_FN = calculator.CALCULATOR_TOOL["function"]


async def chat_stream(base_url: str, api_key: str, model: str, question: str,
                      max_turns: int = 4, require_usage: bool = True) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": question}]
    try:
        for _ in range(max_turns):
            stream = await client.chat.completions.create(
                model=model, messages=messages, tools=[calculator.CALCULATOR_TOOL],
                stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            if require_usage:  # as asked: on the last chunk, which has no choices, only there
                assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
                assert all(c.usage is None for c in chunks[:-1])
            content, calls = "", {}
            for choice in (c for chunk in chunks for c in chunk.choices):
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
            if not calls:
                return content
            messages.append({"role": "assistant", "content": content or None,
                             "tool_calls": list(calls.values())})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": calculator.run_tool(
                c["function"]["name"], c["function"]["arguments"])} for c in calls.values()]
    finally:
        await client.close()
    return ""


async def responses(base_url: str, api_key: str, model: str, question: str,
                    max_turns: int = 4) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", "name": _FN["name"], "description": _FN["description"],
              "parameters": _FN["parameters"]}]
    items = [{"role": "user", "content": question}]
    try:
        for turn in range(max_turns):
            if turn % 2:
                response = await client.responses.create(model=model, input=items, tools=tools)
            else:
                stream = await client.responses.create(model=model, input=items, tools=tools,
                                                       stream=True)
                events = [event async for event in stream]
                assert events[0].type == "response.created"
                assert events[-1].type == "response.completed"
                response = events[-1].response
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                return response.output_text
            items += [o.model_dump(exclude_none=True) for o in response.output]
            items += [{"type": "function_call_output", "call_id": c.call_id,
                       "output": calculator.run_tool(c.name, c.arguments)} for c in calls]
    finally:
        await client.close()
    return ""


async def messages(base_url: str, api_key: str, model: str, question: str,
                   max_turns: int = 4) -> str:
    """A tool input that is not JSON comes wrapped as {"INVALID_JSON": text}, as Anthropic
    wraps it."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"name": _FN["name"], "description": _FN["description"],
              "input_schema": _FN["parameters"]}]
    messages = [{"role": "user", "content": question}]
    try:
        for turn in range(max_turns):
            request = dict(model=model, max_tokens=64, messages=messages, tools=tools)
            if turn % 2:
                async with client.messages.stream(**request) as stream:
                    message = await stream.get_final_message()
            else:
                message = await client.messages.create(**request)
            uses = [b for b in message.content if b.type == "tool_use"]
            if not uses:
                return "".join(b.text for b in message.content)
            assert message.stop_reason == "tool_use"
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in message.content]})
            messages.append({"role": "user", "content": [{
                "type": "tool_result", "tool_use_id": b.id, "content": calculator.run_tool(
                    b.name, b.input.get("INVALID_JSON") or json.dumps(b.input))} for b in uses]})
    finally:
        await client.close()
    return ""


LOOPS = {"chat_stream": chat_stream, "responses": responses, "messages": messages}
