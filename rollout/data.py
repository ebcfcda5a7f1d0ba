"""Prompt data: rows from parquet / JSONL / a saved ``datasets`` dataset, or from the env.

A ``DataSource`` turns rows into groups of ``Sample``s (``n_samples_per_prompt`` copies of
one prompt share a ``group_index``), applying the chat template once per row (prompt ids are
cached: a step must not re-tokenize). Train data is reshuffled each epoch from
``seed + epoch``, so the order is reproducible and the position (epoch, offset, counters) is
all a checkpoint needs to resume exactly.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Iterator, Optional

import numpy as np

from rollout.sample import Sample


def jsonl_rows(path: str) -> Iterator[dict]:
    """The JSON objects of a JSONL file, one per non-blank line, read lazily; a bad line is
    a ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: invalid JSON: {e.msg}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object")
            yield row


def _load_rows(path: str) -> list[dict]:
    """Rows of a parquet file, a JSONL file, or a directory written by ``save_to_disk``."""
    if not os.path.exists(path):
        raise ValueError(f"data file {path!r} does not exist")
    if os.path.isdir(path):
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            raise ValueError(f"{path}: holds a DatasetDict with splits {list(ds)}; point "
                             "data.path / data.eval_path at one split's directory")
        return ds.to_list()
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
        rows = list(jsonl_rows(path))
        return rows
    raise ValueError(f"{path}: unsupported data format (use .parquet, .jsonl or a "
                     "`datasets` directory)")


class DataSource:
    """Groups of samples for one split, with a resumable position.

    ``rows`` are dicts; ``origin`` names where they came from (for error messages).
    """

    def __init__(self, rows: list[dict], origin: str, tokenizer: Any, *, input_key: str,
                 label_key: Optional[str], metadata_key: Optional[str],
                 apply_chat_template: bool, chat_template_kwargs: dict,
                 n_samples_per_prompt: int, shuffle: bool, seed: int) -> None:
        if not rows:
            raise ValueError(f"{origin}: no rows")
        if n_samples_per_prompt < 1:
            raise ValueError("n_samples_per_prompt must be >= 1")
        self.rows, self.origin, self.tokenizer = rows, origin, tokenizer
        self.input_key, self.label_key, self.metadata_key = input_key, label_key, metadata_key
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs)
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle, self.seed = shuffle, seed
        self._prompts: dict[int, tuple[str, list[int], Any, dict]] = {}
        self.epoch = 0
        self.offset = 0
        self.last_row = -1
        self.next_group_index = 0
        self.next_sample_index = 0
        self._order = self._permutation(0)

    # ---- construction from config ---------------------------------------------------
    @classmethod
    def for_split(cls, split: str, tokenizer: Any, *, data: Any, env: Any,
                  n_samples_per_prompt: int) -> "DataSource":
        """``split`` "train" reads data.path, "eval" data.eval_path; null means the rows
        come from the environment's ``dataset(split)``."""
        path = data.path if split == "train" else data.eval_path
        if path is not None:
            rows, origin = _load_rows(path), path
        else:
            from rollout.plugins import get_env_class

            env_cls = get_env_class(env.name)
            try:
                rows = env_cls.dataset(split, **env.init_kwargs)
            except NotImplementedError as e:
                key = "data.path" if split == "train" else "data.eval_path"
                raise ValueError(f"{key} is null and {e}") from e
            origin = f"env {env.name!r} {split} split"
        return cls(rows, origin, tokenizer, input_key=data.input_key, label_key=data.label_key,
                   metadata_key=data.metadata_key, apply_chat_template=data.apply_chat_template,
                   chat_template_kwargs=data.apply_chat_template_kwargs,
                   n_samples_per_prompt=n_samples_per_prompt, shuffle=data.shuffle and split == "train",
                   seed=data.seed)

    def __len__(self) -> int:
        return len(self.rows)

    # ---- rows -> prompts ------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng(self.seed + epoch).permutation(len(self.rows))

    def _bad(self, i: int, column: str, problem: str) -> ValueError:
        return ValueError(f"{self.origin}: row {i}: column {column!r}: {problem}")

    def _prompt_ids(self, i: int, value: Any) -> tuple[str, list[int]]:
        """Row ``i``'s prompt text and ids; none for a null prompt, which leaves the prompt
        to the environment's first observation (the episode driver renders it), e.g. a
        game whose row is its seed."""
        if value is None:
            return "", []
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, (list, tuple)) and value and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in value):
            messages = [dict(m) for m in value]
        else:
            raise self._bad(i, self.input_key, "expected a string, a non-empty list of "
                            "{role, content} messages or null (the environment's first "
                            f"observation), got {type(value).__name__}")
        if self.apply_chat_template:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True,
                    **self.chat_template_kwargs)
            except Exception as e:  # a template error on user data: say which row
                raise self._bad(i, self.input_key, f"chat template failed: {e}") from e
        else:
            if not isinstance(value, str):
                raise self._bad(i, self.input_key,
                                "a message list needs data.apply_chat_template=true")
            text = value
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, i: int) -> tuple[str, list[int], Any, dict]:
        """(prompt text, prompt ids, label, metadata) of row ``i``, built once."""
        cached = self._prompts.get(i)
        if cached is not None:
            return cached
        row = self.rows[i]
        if self.input_key not in row:
            raise self._bad(i, self.input_key, f"missing (row has {sorted(row)})")
        text, ids = self._prompt_ids(i, row[self.input_key])
        label = None
        if self.label_key is not None:
            if self.label_key not in row:
                raise self._bad(i, self.label_key, "missing")
            label = row[self.label_key]
        metadata: dict = {}
        if self.metadata_key is not None:
            raw = row.get(self.metadata_key)
            if isinstance(raw, str):
                try:
                    raw = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise self._bad(i, self.metadata_key, f"invalid JSON: {e.msg}") from e
            if raw is not None and not isinstance(raw, dict):
                raise self._bad(i, self.metadata_key, f"expected a dict, got {type(raw).__name__}")
            metadata = dict(raw or {})
        cached = (text, ids, label, metadata)
        self._prompts[i] = cached
        return cached

    def make_group(self, i: int, n: Optional[int] = None) -> list[Sample]:
        text, ids, label, metadata = self.prompt(i)
        group = []
        for _ in range(n or self.n_samples_per_prompt):
            group.append(Sample(prompt=text, tokens=list(ids), label=copy.deepcopy(label),
                                metadata=copy.deepcopy(metadata), index=self.next_sample_index,
                                group_index=self.next_group_index))
            self.next_sample_index += 1
        self.next_group_index += 1
        return group

    # ---- iteration --------------------------------------------------------------------
    def next_group(self) -> list[Sample]:
        """The next prompt's group; wraps into a new (reshuffled) epoch at the end."""
        if self.offset >= len(self.rows):
            self.epoch += 1
            self.offset = 0
            self._order = self._permutation(self.epoch)
        i = int(self._order[self.offset])
        self.offset += 1
        self.last_row = i  # with ``epoch``, the group's key in the prompt ledger
        return self.make_group(i)

    def all_groups(self, n: Optional[int] = None) -> list[list[Sample]]:
        """Every row once, in order (evaluation); does not move the position."""
        return [self.make_group(i, n) for i in range(len(self.rows))]

    def reseed(self, seed: int) -> None:
        """Restart from epoch 0 with a shuffled order drawn from ``seed``."""
        self.shuffle, self.seed = True, seed
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_rows": len(self.rows), "next_group_index": self.next_group_index,
                "next_sample_index": self.next_sample_index}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_rows") != len(self.rows):
            raise ValueError(f"{self.origin}: the checkpoint's data position is for "
                             f"{state.get('num_rows')} rows, the data has {len(self.rows)}")
        self.seed = state["seed"]
        self.epoch, self.offset = state["epoch"], state["offset"]
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self._order = self._permutation(self.epoch)
