"""The seed's dataset object: user rows written as the run's data files (``data.*``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from config import ConfigError


class DatasetConfig:
    """The seed's dataset object. Subclass it and override ``load(split)`` (rows for the
    split: "train", "eval" or "all") and/or ``prepare(path, eval_paths)`` (write the train
    file to ``path`` and each eval file to ``eval_paths[name]``; parquet or JSONL).

    Class attributes map onto ``data.*``: ``input_key`` (column with the chat messages or
    prompt text), ``label_key``, ``metadata_key``, ``apply_chat_template``. ``always_prepare``
    re-writes the files on every launch (else an existing file is reused)."""

    input_key: str = "messages"
    label_key: Optional[str] = "label"
    metadata_key: Optional[str] = None
    apply_chat_template: bool = True
    input_column: str = "prompt"  # accepted for seed compatibility (only load() uses it)
    always_prepare: bool = False

    def load(self, split: str = "all") -> list[dict]:
        raise NotImplementedError(f"{type(self).__name__}.load(split) is not implemented")

    def prepare(self, path: str, eval_paths: Optional[dict[str, str]] = None) -> None:
        """Default: write ``load("train")`` / ``load("eval")`` rows as parquet."""
        from datasets import Dataset

        os.makedirs(os.path.dirname(path), exist_ok=True)
        Dataset.from_list(self.load("train")).to_parquet(path)
        for eval_path in (eval_paths or {}).values():
            os.makedirs(os.path.dirname(eval_path), exist_ok=True)
            Dataset.from_list(self.load("eval")).to_parquet(eval_path)

    def materialize(self, data_dir: Path) -> dict[str, Any]:
        """Prepare the files under ``data_dir``; returns the ``data.*`` values."""
        path, eval_path = data_dir / "train.parquet", data_dir / "eval.parquet"
        if self.always_prepare or not path.exists():
            self.prepare(str(path), {"eval": str(eval_path)})
        if not path.exists():
            raise ConfigError(f"{type(self).__name__}.prepare did not write {path}")
        return {"path": str(path), "eval_path": str(eval_path) if eval_path.exists() else None,
                "input_key": self.input_key, "label_key": self.label_key,
                "metadata_key": self.metadata_key,
                "apply_chat_template": bool(self.apply_chat_template)}
