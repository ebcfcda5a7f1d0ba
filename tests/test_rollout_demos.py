"""Scripted warm-up transcripts: same layout as RL rollouts; chat-template rendering."""

import asyncio

import pytest

from rollout.demos import make_demos
from rollout.chat import ChatRenderer
from rollout.generate import Episode, run_episode
from config import build_config
from trainer.driver import components


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_renderer_derives_chatml_observation_turn(tok):
    r = ChatRenderer(tok)
    assert r.close_text == "<|im_end|>"
    assert r.pre_text == "\n<|im_start|>user\n"
    assert r.post_text == "<|im_end|>\n<|im_start|>assistant\n"
    ids = r.observation_ids("<feedback>higher</feedback>", model_closed_turn=True)
    assert tok.decode(ids) == "\n<|im_start|>user\n<feedback>higher</feedback><|im_end|>\n<|im_start|>assistant\n"
    # a turn the model ended without eos (stop string) is closed by the renderer
    assert ids == r.observation_ids("<feedback>higher</feedback>", False)[len(r.close_ids):]


def test_renderer_follows_a_qwen3_style_template(tok):
    qwen3ish = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}")
    t = type(tok).from_pretrained(tok.name_or_path)
    t.chat_template = qwen3ish
    r = ChatRenderer(t, {"enable_thinking": False})
    assert r.post_text == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_demos_have_exact_rl_layout(tok):
    cfg = build_config({"rollout": {"num_engines": 1}})
    demos = make_demos(tok, 40, seed=3, **components.rollout_sections(cfg))
    r = ChatRenderer(tok)
    eos = tok.eos_token_id
    players_won = sum(s.metadata["success"] for s in demos)
    assert players_won >= 24  # binary search always wins; the careless player often
    for s in demos:
        s.check()
        resp, mask = s.response_tokens, s.loss_mask
        # rebuild the expected layout turn by turn from the env's own transcript
        pos, turns = 0, 0
        while pos < len(resp):
            end = resp.index(eos, pos) + 1
            assert all(m == 1 for m in mask[pos:end])
            text = tok.decode(resp[pos:end], skip_special_tokens=True)
            assert resp[pos:end] == tok(text, add_special_tokens=False)["input_ids"] + [eos]
            turns += 1
            pos = end
            if pos < len(resp):
                n = len(r.pre_ids)
                assert resp[pos:pos + n] == r.pre_ids
                obs_end = pos + _find(resp, r.post_ids, pos) + len(r.post_ids)
                assert all(m == 0 for m in mask[pos:obs_end])
                pos = obs_end
        assert turns == s.metadata["turns_taken"] == s.metadata["num_turns"]
        assert s.rollout_log_probs == [0.0] * s.response_length


def _find(seq, sub, start):
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i - start
    raise AssertionError("not found")


def test_demos_mix_players(tok):
    cfg = build_config({"rollout": {"num_engines": 1}})
    turns = [s.metadata["turns_taken"] for s in make_demos(tok, 60, seed=0,
                                                           **components.rollout_sections(cfg))]
    # binary search needs <= 5 turns; random play sometimes needs all 6 or fails
    assert max(turns) >= 5 and min(turns) <= 3


def test_warmup_plays_the_prompts_of_each_split(tok):
    cfg = build_config({"rollout": {"num_engines": 1}})
    targets = [s.metadata["target"] for s in make_demos(tok, 20, seed=0, splits=("train", "eval"),
                                                        **components.rollout_sections(cfg))]
    assert [t % 2 for t in targets] == [1, 0] * 10  # odd train, even eval, alternating
    odd = make_demos(tok, 10, **components.rollout_sections(cfg))
    assert all(t % 2 for t in (s.metadata["target"] for s in odd))


def test_context_budget_truncates(tok):
    from envs.number_guess import NumberGuessEnv
    from rollout.demos import ScriptedPolicy

    cfg = build_config({"rollout": {"num_engines": 1}})
    s = components.data_source(cfg, "train", tok).next_group()[0]
    env = NumberGuessEnv(players=["random"], seed=1)
    s.label = '{"answer": 20}'
    limit = len(s.tokens) + 12  # room for one turn, not for the feedback turn after it
    out = asyncio.run(run_episode(Episode(s, env), ScriptedPolicy(env, tok), ChatRenderer(tok),
                                  max_turns=6, max_context_len=limit, max_response_len=8))
    assert len(out.tokens) <= limit
    if not out.metadata.get("success"):
        assert out.status == out.Status.TRUNCATED
