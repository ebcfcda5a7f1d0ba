"""Entry point: `python -m trainer.main [+recipe=NAME] [key=value ...]`.

Hydra composes conf/ over the typed schema; the result is turned into a validated
`HomegymConfig` once, here, and handed to the driver loop. With no recipe the embedded
CPU default (number_guess_cpu) runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trainer.config import ConfigError, HomegymConfig, build_config, register_schema

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

register_schema()


def run(config: HomegymConfig) -> dict:
    # Imported here so that `--cfg job` and config errors stay fast and torch-free.
    from trainer.loop import train

    return train(config)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from trainer.checkpoint import CheckpointError

    try:
        config = build_config(cfg)
    except ConfigError as err:
        print(f"homegym: invalid config: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except (CheckpointError, ConfigError) as err:
        print(f"homegym: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
