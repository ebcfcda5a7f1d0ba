"""Scripted players for the environment adapters' tests, and the token-layout check: what
homegym's episode driver must make of any environment's text."""

from rollout.data import DataSource


def source(rows, tok, name):
    """The rows as the manager reads them: one sample per group, in row order."""
    return DataSource(rows, name, tok, input_key="messages", label_key="label",
                      metadata_key=None, apply_chat_template=True, chat_template_kwargs={},
                      n_samples_per_prompt=1, shuffle=False, seed=0)


class Player:
    """A scripted policy: ``reply(observations) -> text`` is tokenized and closed with eos
    where the engine's output ids would go; remembers what it emitted."""

    def __init__(self, tok, env, reply):
        self.tok, self.env, self.reply = tok, env, reply
        self.turns: list[list[int]] = []
        self.weight_version = None

    async def act(self, token_ids, max_new_tokens):
        ids = self.tok(self.reply(self.env.said), add_special_tokens=False)["input_ids"]
        ids = ids + [self.tok.eos_token_id]
        self.turns.append(ids)
        return ids, [-0.5] * len(ids), "stop"


def recording(env):
    """``env`` remembering every observation it gave (``env.said``)."""
    env.said = []
    reset, step = env.reset, env.step

    async def recorded_reset(sample):
        env.said.append(await reset(sample))
        return env.said[-1]

    async def recorded_step(text):
        out = await step(text)
        env.said.append(out[0])
        return out

    env.reset, env.step = recorded_reset, recorded_step
    return env


def assert_token_layout(sample, prompt_ids, player, observations, renderer):
    """Model turns verbatim with loss mask 1 and their log-probs; every observation
    between them rendered as a user turn, mask 0; nothing else."""
    tokens, mask = list(prompt_ids), []
    for i, ids in enumerate(player.turns):
        tokens += ids
        mask += [1] * len(ids)
        if i < len(player.turns) - 1:
            obs = renderer.observation_ids(observations[i + 1], model_closed_turn=True)
            tokens += obs
            mask += [0] * len(obs)
    assert sample.tokens == tokens
    assert sample.loss_mask == mask
    assert sample.rollout_log_probs == [-0.5 if m else 0.0 for m in mask]
