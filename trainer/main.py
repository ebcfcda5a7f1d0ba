"""Entry point: `python -m trainer.main [+recipe=NAME] [key=value ...]`.

Hydra composes conf/ over the typed schema; the result is turned into a validated
`HomegymConfig` once, here, and handed to the driver loop. With no recipe the embedded
CPU default (number_guess_cpu) runs.
"""

from __future__ import annotations

import sys
from typing import Optional

import hydra
from omegaconf import DictConfig

from config import CONF_DIR, ConfigError, HomegymConfig, build_config, register_schema

register_schema()


def run(config: HomegymConfig) -> dict:
    """The start-up checks, then the run. A bad dotted path, data file or model directory
    stops here within seconds, before Ray starts, instead of minutes later in an actor."""
    from trainer.driver.preflight import preflight

    preflight(config)
    # Imported here so that `--cfg job` and config errors stay fast and torch-free.
    from trainer.driver.loop import train

    return train(config)


def user_error(err: BaseException) -> Optional[Exception]:
    """The ConfigError or CheckpointError behind ``err``, else None.

    An exception raised inside a Ray task or actor method reaches the driver as a
    RayTaskError (nested once per task that passed it on) whose str() is the remote
    traceback; the user's exception is its ``cause``. One raised in an actor's constructor
    arrives, at the first call to the actor, as an ActorDiedError holding that
    RayTaskError as its argument."""
    # Modules looked up, not imported: an error of theirs cannot exist unless something
    # imported them, and a start-up check's error stays as fast as the check (no torch).
    ray_errors = sys.modules.get("ray.exceptions")
    checkpoint = sys.modules.get("trainer.driver.checkpoint")
    models = sys.modules.get("rollout.models")
    user_types = ((ConfigError,) + ((checkpoint.CheckpointError,) if checkpoint else ())
                  + ((models.ModelPathError,) if models else ()))
    for _ in range(16):  # bounded: a cause chain never needs more
        inner = [a for a in err.args if isinstance(a, BaseException)]
        if ray_errors and isinstance(err, ray_errors.RayTaskError) and \
                isinstance(err.cause, BaseException):
            err = err.cause
        elif ray_errors and isinstance(err, ray_errors.RayActorError) and inner:
            err = inner[0]
        elif isinstance(err, user_types):
            return err
        elif err.__cause__ is not None:
            err = err.__cause__
        else:
            return None
    return None


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        config = build_config(cfg)
    except ConfigError as err:
        print(f"homegym: invalid config: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except Exception as err:
        reported = user_error(err)
        if reported is None:
            raise
        print(f"homegym: {reported}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
