"""Tokenizers and chat rendering: one tokenizer per model path per process, and the token
ids of environment observations rendered as chat turns."""

from __future__ import annotations

from typing import Any, Optional

_TOKENIZERS: dict[str, Any] = {}


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer, loaded once per process (slime-style user code builds its
    ``GenerateState`` on every turn)."""
    tokenizer = _TOKENIZERS.get(model_path)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = _TOKENIZERS[model_path] = AutoTokenizer.from_pretrained(model_path)
    return tokenizer


class ChatRenderer:
    """Token ids of "a user turn holding an observation, then the assistant's header".

    Derived once from the tokenizer's own chat template (so Qwen3's template, with e.g.
    ``enable_thinking=False`` adding an empty think block, works as well as ChatML):
    a conversation with sentinel texts is rendered and split around the sentinels.
    Per observation only the observation text itself is tokenized.
    """

    _U, _A, _O = "\u2063HGUSER\u2063", "\u2063HGASSISTANT\u2063", "\u2063HGOBS\u2063"

    def __init__(self, tokenizer: Any, chat_template_kwargs: Optional[dict] = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        eos = tokenizer.eos_token
        if eos is None:
            raise ValueError("the tokenizer has no eos_token; multi-turn rendering needs one")
        msgs = [{"role": "user", "content": self._U}, {"role": "assistant", "content": self._A},
                {"role": "user", "content": self._O}]
        full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **self.kwargs)
        after = full[full.index(self._A) + len(self._A):]
        end = after.find(eos)
        if end < 0:
            raise ValueError(f"the chat template does not end assistant turns with the eos "
                             f"token {eos!r}; cannot render observations token-in/token-out")
        # What closes an assistant turn (normally just eos): used when the model stopped
        # without emitting eos (a stop string).
        self.close_text = after[:end + len(eos)]
        pre, _, post = after[end + len(eos):].partition(self._O)
        self.pre_text, self.post_text = pre, post
        enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        self._enc = enc
        self.close_ids: list[int] = enc(self.close_text)
        self.pre_ids: list[int] = enc(pre)
        self.post_ids: list[int] = enc(post)
        self.eos_token_id: int = tokenizer.eos_token_id
        self._obs_cache: dict[str, list[int]] = {}

    def observation_ids(self, observation: str, model_closed_turn: bool) -> list[int]:
        head = self.pre_ids if model_closed_turn else self.close_ids + self.pre_ids
        # Game observations repeat ("<feedback>higher</feedback>"): encode each text once.
        ids = self._obs_cache.get(observation)
        if ids is None:
            ids = self._enc(observation)
            if len(self._obs_cache) < 4096:
                self._obs_cache[observation] = ids
        return head + ids + self.post_ids

    def prompt_ids(self, messages: list[dict]) -> tuple[str, list[int]]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **self.kwargs)
        return text, self._enc(text)

