"""Checkpoints: atomic, complete or absent.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding
    train/            the backend's model + optimizer + RNG state (every rank writes its part)
    hf/               the policy exported as a Hugging Face checkpoint (serve/eval it directly;
                      a LoRA policy's merged weights)
    adapter/          LoRA runs only: the adapter in peft format (PeftModel.from_pretrained
                      on the base model, or an engine's LoRA route); train/ holds only the
                      adapters and their optimizer state, the base is model.path
    rollout.pt        the rollout manager's state: data position, epoch, partial-rollout buffer
    meta.json         step, policy version, wandb run id, driver RNG
    COMPLETE          written last
It is assembled under a temporary name and renamed into place, so an interrupted save never
looks like a checkpoint; `latest()` only ever returns directories with the marker.
`checkpoints/latest` is a symlink to the newest one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.driver.metrics import write_json

_NAME = re.compile(r"^step_(\d{6,})$")
MARKER = "COMPLETE"
ADAPTER_DIR = "adapter"


class CheckpointError(RuntimeError):
    pass


@dataclass
class Resumed:
    path: Path
    step: int
    meta: dict[str, Any]
    rollout_state: Any


def preflight_output_dir(run_dir: Path, *, min_free_bytes: int) -> None:
    """Fail before any work starts if the run directory cannot hold checkpoints."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_probe"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"logging.output_dir: cannot write to {run_dir}: {err.strerror or err}. "
                              "Choose a writable directory (logging.output_dir=...).") from err
    free = shutil.disk_usage(run_dir).free
    if free < min_free_bytes:
        raise CheckpointError(
            f"logging.output_dir: only {free / 2**20:.0f} MiB free at {run_dir}, but a checkpoint "
            f"needs about {min_free_bytes / 2**20:.0f} MiB. Free space or point logging.output_dir "
            "elsewhere.")


class CheckpointManager:
    def __init__(self, run_dir: Path) -> None:
        self.root = Path(run_dir) / "checkpoints"

    def all_complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir()
                 if _NAME.match(p.name) and (p / MARKER).exists() and not p.is_symlink()]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        complete = self.all_complete()
        return complete[-1] if complete else None

    def save(self, step: int, *, save_train: Callable[[Path], None],
             export_hf: Callable[[Path], None] | None, rollout_state: Any,
             meta: dict[str, Any]) -> Path:
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".step_{step:06d}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            save_train(tmp / "train")
            if export_hf is not None:
                export_hf(tmp / "hf")
            torch.save(rollout_state, tmp / "rollout.pt")
            write_json(tmp / "meta.json", {**meta, "step": step})
            torch.save({"python": random.getstate(), "torch": torch.get_rng_state()},
                       tmp / "driver_rng.pt")
            (tmp / MARKER).write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except KeyboardInterrupt:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as err:  # a full disk surfaces as RuntimeError from torch.save too
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint step {step} to {final} failed: {err}. "
                                  "The previous checkpoint is intact.") from err
        self._point_latest(final)
        return final

    def _point_latest(self, target: Path) -> None:
        link = self.root / "latest"
        tmp_link = self.root / ".latest.tmp"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        tmp_link.symlink_to(target.name)
        os.replace(tmp_link, link)

    def load(self, path: Path, *, load_train: Callable[[Path], None]) -> Resumed:
        path = Path(path).resolve()
        if not (path / MARKER).exists():
            raise CheckpointError(f"train.resume: {path} is not a complete checkpoint "
                                  f"(no {MARKER} marker)")
        meta = json.loads((path / "meta.json").read_text())
        load_train(path / "train")
        rng = torch.load(path / "driver_rng.pt", weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        rollout_state = torch.load(path / "rollout.pt", weights_only=False)
        return Resumed(path=path, step=int(meta["step"]), meta=meta, rollout_state=rollout_state)

    def resolve_resume(self, resume: str) -> Path | None:
        """`auto`: the latest complete checkpoint of this run, if any; `never`; or a path."""
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / MARKER).exists():
            raise CheckpointError(f"train.resume: {resume} is not a complete checkpoint directory")
        return path


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A servable HF directory for a checkpoint dir (``<ckpt>/hf``), an HF dir, a run dir
    (its latest checkpoint) or ``checkpoints/`` dir."""
    p = Path(path).expanduser()
    candidates = [p / "hf", p, p / "latest" / "hf", p / "checkpoints" / "latest" / "hf"]
    for c in candidates:
        if (c / "config.json").exists():
            return str(c.resolve())
    raise FileNotFoundError(
        f"checkpoint={path}: no Hugging Face checkpoint there (looked for config.json in "
        f"{', '.join(str(c) for c in candidates)}). Give a checkpoint directory "
        "(outputs/<run>/checkpoints/step_NNNNNN or .../latest), its hf/ subdirectory, or a run "
        "directory.")


# Files of the source checkpoint that describe it (not weights): copied next to an export.
_HF_META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                  "tokenizer.model", "added_tokens.json", "preprocessor_config.json",
                  "video_preprocessor_config.json", "processor_config.json")


def export_hf(buckets: list[list[tuple[str, torch.Tensor]]], source_dir: str, out_dir: Path) -> None:
    """Write the policy as a Hugging Face checkpoint: the trained tensors under their HF
    names in the source checkpoint's layout (a vision-language source keeps its vision tower
    and MTP layer, ``trainer.hf_export``) plus the source model's config and tokenizer files."""
    from safetensors.torch import save_file

    from trainer.driver.hf_export import in_base_layout

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = in_base_layout(
        {name: t.detach().to("cpu").contiguous() for bucket in buckets for name, t in bucket},
        source_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in _HF_META_FILES:
        src = Path(source_dir) / name
        if src.exists():
            shutil.copy2(src, out_dir / name)
