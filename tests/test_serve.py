"""The endpoint (trainer/serving/endpoint.py, trainer/serving/auth_proxy.py, the
trainer/serve.py CLI), for real: hf engine + sglang-router + the authenticating proxy on
loopback."""

import subprocess
import sys
import time

import pytest
import requests

from conftest import REPO, clean_env, fake_run_dir
from trainer.api import Endpoint, TinyQwen3
from trainer.serving.auth_proxy import choose_api_key
from trainer.driver.checkpoint import resolve_checkpoint
from config import split_args
from trainer.serving.endpoint import EndpointError

KEY = "test-key-0123456789"
CHAT = {"messages": [{"role": "user", "content": "You are playing a number guessing game."}],
        "max_tokens": 4}


@pytest.fixture(scope="module")
def endpoint(ray_local):
    ep = Endpoint.launch(TinyQwen3(), api_key=KEY, num_engines=1, quiet=True)
    yield ep
    ep.shutdown()


def test_chat_returns_the_message_dict(endpoint):
    endpoint.wait_until_ready(timeout=60)
    msg = endpoint.chat([{"role": "user", "content": "hi"}],
                        chat_template_kwargs={"enable_thinking": False}, temperature=0)
    assert msg["role"] == "assistant" and isinstance(msg.get("content"), str)
    full = endpoint.chat_completion([{"role": "user", "content": "hi"}], max_tokens=3)
    assert full["object"] == "chat.completion" and full["usage"]["completion_tokens"] <= 3


def test_api_key_is_required_and_enforced(endpoint):
    url = endpoint.url + "/v1/chat/completions"
    assert requests.post(url, json=CHAT, timeout=30).status_code == 401
    r = requests.post(url, json=CHAT, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert KEY not in r.text
    r = requests.post(url, json=CHAT, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert requests.get(endpoint.url + "/v1/models", timeout=10).status_code == 401
    assert requests.get(endpoint.url + "/health", timeout=10).status_code == 200  # open


@pytest.mark.parametrize("method,route,body", [
    ("get", "/v1/models", None),
    ("post", "/v1/completions", {"prompt": "You are playing", "max_tokens": 3, "temperature": 0}),
    # ignore_eos: the tiny model is random, and samples its eos within 3 tokens ~0.5% of the time.
    ("post", "/generate", {"text": "You are playing",
                           "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}),
])
def test_every_public_route_serves_with_the_key_only(endpoint, method, route, body):
    """README: /v1/chat/completions, /v1/models, /v1/completions and SGLang's /generate."""
    call = getattr(requests, method)
    if route == "/v1/completions":  # OpenAI's completions name the model (from /v1/models)
        models = requests.get(endpoint.url + "/v1/models", timeout=10,
                              headers={"Authorization": f"Bearer {KEY}"}).json()
        body = {**body, "model": models["data"][0]["id"]}
    kwargs = {"json": body} if body is not None else {}
    assert call(endpoint.url + route, timeout=30, **kwargs).status_code == 401
    r = call(endpoint.url + route, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kwargs)
    assert r.status_code == 200, r.text
    out = r.json()
    if route == "/v1/models":
        assert out["object"] == "list" and out["data"] and out["data"][0]["id"]
    elif route == "/v1/completions":
        assert out["object"] == "text_completion" and isinstance(out["choices"][0]["text"], str)
        assert out["usage"]["completion_tokens"] <= 3
    else:
        assert len(out["output_ids"]) == 3 and out["meta_info"]["completion_tokens"] == 3


def test_bad_requests_are_4xx(endpoint):
    h = {"Authorization": f"Bearer {KEY}"}
    url = endpoint.url + "/v1/chat/completions"
    assert requests.post(url, data=b"{not json", headers=h, timeout=10).status_code == 400
    assert requests.post(url, json={"messages": "hi"}, headers=h, timeout=10).status_code == 400
    assert requests.post(url, json=[1, 2], headers=h, timeout=10).status_code == 400
    r = requests.post(url, json={**CHAT, "temperature": -1}, headers=h, timeout=10)
    assert 400 <= r.status_code < 500, r.text
    # Admin routes of the engines are not reachable through the public entry.
    r = requests.post(endpoint.url + "/update_weights_from_disk", json={"model_path": "/x"},
                      headers=h, timeout=10)
    assert r.status_code == 404
    with pytest.raises(EndpointError) as err:
        endpoint.chat("not a list")
    assert err.value.status == 400


def test_chat_streams_and_speaks_responses_and_anthropic_messages(endpoint):
    """The real openai and anthropic clients against the endpoint: streamed chat with the
    usage in the last chunk, the Responses API (streamed and not) and Anthropic's Messages
    (its x-api-key), greedy: every dialect answers the same text for the same turn (tool
    calls go through the session's code, tested in test_rollout_agent)."""
    import anthropic
    import openai

    endpoint.wait_until_ready(timeout=60)
    client = openai.OpenAI(base_url=endpoint.url + "/v1", api_key=KEY, max_retries=0)
    hi = [{"role": "user", "content": "You are playing a number guessing game."}]
    greedy = {"temperature": 0, "model": "m"}
    plain = client.chat.completions.create(messages=hi, max_tokens=5, **greedy)
    chunks = list(client.chat.completions.create(
        messages=hi, max_tokens=5, stream=True, stream_options={"include_usage": True},
        **greedy))
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == \
        plain.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    response = client.responses.create(input=hi[0]["content"], max_output_tokens=5, **greedy)
    assert response.output_text == plain.choices[0].message.content
    events = list(client.responses.create(input=hi[0]["content"], max_output_tokens=5,
                                          stream=True, **greedy))
    assert events[-1].response.output_text == response.output_text
    claude = anthropic.Anthropic(base_url=endpoint.url, api_key=KEY, max_retries=0)
    greedy = {"extra_body": {"temperature": 0}, "model": "m"}  # anthropic 2: no temperature=
    message = claude.messages.create(messages=hi, max_tokens=5, **greedy)
    assert message.content[0].text == plain.choices[0].message.content
    with claude.messages.stream(messages=hi, max_tokens=5, **greedy) as stream:
        assert stream.get_final_message().content[0].text == message.content[0].text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=endpoint.url, api_key="wrong", max_retries=0) \
            .messages.create(messages=hi, max_tokens=5, **greedy)


def test_key_never_in_repr_and_generated_key_printed_once(endpoint, capsys, monkeypatch):
    assert KEY not in repr(endpoint) and "auth=on" in repr(endpoint)
    monkeypatch.delenv("HOMEGYM_API_KEY", raising=False)
    assert choose_api_key(True) is None
    assert choose_api_key(False, "given") == "given"
    monkeypatch.setenv("HOMEGYM_API_KEY", "from-env")
    assert choose_api_key(False) == "from-env"
    assert capsys.readouterr().out == ""  # given keys are never printed
    monkeypatch.delenv("HOMEGYM_API_KEY")
    key = choose_api_key(False)
    out = capsys.readouterr().out
    assert len(key) > 30 and out.count(key) == 1


def test_checkpoint_resolution(tmp_path, tiny_model_path):
    run = fake_run_dir(tmp_path, tiny_model_path, step=2)
    step = run / "checkpoints" / "step_000002"
    want = str((step / "hf").resolve())
    for p in (step, step / "hf", run, run / "checkpoints", run / "checkpoints" / "latest"):
        assert resolve_checkpoint(p) == want
    with pytest.raises(FileNotFoundError, match="checkpoint="):
        resolve_checkpoint(tmp_path / "nothing")
    assert split_args(["checkpoint=a", "rollout.num_engines=1", "+recipe=x"], ("checkpoint",)) == \
        ({"checkpoint": "a"}, ["rollout.num_engines=1", "+recipe=x"])


@pytest.mark.slow
def test_serve_cli_serves_a_checkpoint(tmp_path, tiny_model_path):
    """`python -m trainer.serve checkpoint=<run dir>`: the key comes from HOMEGYM_API_KEY
    and is never printed; Ctrl-C (SIGINT) shuts everything down."""
    run = fake_run_dir(tmp_path, tiny_model_path, step=1)
    env = dict(clean_env(), HOMEGYM_API_KEY="cli-secret-key")
    proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", f"checkpoint={run}", "port=0",
                             "rollout.num_engines=1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        url = None
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("homegym: serving "):
                url = line.split(" at ")[1].split("/v1/")[0]
        assert url, "".join(lines)
        r = requests.post(url + "/v1/chat/completions", json=CHAT,
                          headers={"Authorization": "Bearer cli-secret-key"}, timeout=60)
        assert r.status_code == 200, r.text
        assert requests.post(url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 401
    finally:
        proc.send_signal(2)
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    assert "cli-secret-key" not in text
