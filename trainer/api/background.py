"""A training run in a background thread of this process: the Python API's ``Run``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from config import HomegymConfig


class Run:
    """A training run in a background thread. ``result()`` blocks and returns the
    ``RunResult`` (``.run_dir``, ``.evals``, ``.checkpoints()``), re-raising its error."""

    def __init__(self, config: HomegymConfig) -> None:
        self.config = config
        self.training_run_id: str = config.logging.run_name or ""
        self.run_dir = Path(config.logging.output_dir).resolve() / self.training_run_id
        self._result = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._main, name=f"homegym-{self.training_run_id}")

    def start(self) -> "Run":
        self._thread.start()
        return self

    def _main(self) -> None:
        from trainer.driver.loop import train

        try:
            self._result = train(self.config)
        except BaseException as err:  # handed to result()
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: Optional[float] = None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"run {self.training_run_id} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def checkpoints(self) -> list[Path]:
        return self.result().checkpoints()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"Run({self.training_run_id!r}, {state}, run_dir={str(self.run_dir)!r})"
