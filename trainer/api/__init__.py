"""The Python API: the seed notebook's objects, on your own Ray cluster.

    from trainer.api import (DatasetConfig, Endpoint, TinyQwen3, NumberGuessCPURecipe,
                             TrainJob)

    run = TrainJob(model=TinyQwen3(), dataset=MyDataset(),
                      recipe=NumberGuessCPURecipe(num_rollout=20)).launch()
    result = run.result()                      # blocks; a trainer.driver.loop.RunResult
    ckpt = result.checkpoints()[-1]            # checkpoints/step_NNNNNN (hf/ inside)
    with Endpoint.launch(TinyQwen3(), ckpt) as ep:
        ep.chat([{"role": "user", "content": "hi"}])

One code path with the CLI: ``TrainJob`` turns model + recipe + dataset into Hydra
overrides, composes ``conf/`` with ``hydra.compose`` exactly as ``python -m trainer.main``
does, builds the typed ``HomegymConfig`` with ``build_config`` and calls
``trainer.driver.loop.train``. ``launch()`` runs that in a background thread of this process on the
current Ray cluster (``cluster.address`` / ``RAY_ADDRESS`` / a local one) and returns a
``Run`` at once; ``Run.result()`` blocks until it finishes and re-raises its error.

The pieces live in modules of their own and are gathered here so a notebook imports
everything from one place: models (trainer.api.model_catalog), recipes (trainer.api.recipes),
datasets (trainer.api.dataset), custom functions (``custom_generate_function`` /
``custom_rm_function``: dotted paths or callables, trainer.api.shipping), the background run
(trainer.api.background) and the endpoint (trainer.serving.endpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from trainer.api.background import Run
from config import HomegymConfig, compose_config, deprecated, set_dotted
from trainer.api.dataset import DatasetConfig
from trainer.serving.endpoint import Endpoint
from trainer.api.model_catalog import (Model, Qwen3_0_6B, Qwen3_4B, Qwen3_5_4B, Qwen3_5_27B,
                                       Qwen3_8B, SmolLM2_135M, TinyQwen3, TinyQwen3_5)
from trainer.driver.preflight import preflight
from trainer.api.recipes import (NumberGuessCPURecipe, Qwen3_0_6B_Recipe, Qwen3_4B_Recipe,
                                 Qwen3_5_4B_Recipe, Qwen3_8B_Recipe, Recipe)
from trainer.api.shipping import ship_function, ship_locally, ship_or_describe

__all__ = [
    "DatasetConfig", "Model", "TinyQwen3", "TinyQwen3_5", "SmolLM2_135M", "Qwen3_0_6B", "Qwen3_4B",
    "Qwen3_8B", "Qwen3_5_4B", "Qwen3_5_27B", "Recipe", "NumberGuessCPURecipe", "Qwen3_0_6B_Recipe",
    "Qwen3_4B_Recipe", "Qwen3_8B_Recipe", "Qwen3_5_4B_Recipe",
    "TrainJob", "TrainConfig", "Run", "Endpoint", "compose_config", "ship_function",
]


@dataclass
class TrainJob:
    """``TrainJob(model, dataset, recipe).launch()``: the seed's entry point."""

    model: Optional[Model] = None
    dataset: Optional[DatasetConfig] = None  # None: rows from the environment
    recipe: Recipe = field(default_factory=NumberGuessCPURecipe)
    run_name: Optional[str] = None
    output_dir: Optional[str] = None

    def _base(self) -> tuple[list[str], dict]:
        model = self.model or self.recipe.default_model()
        overrides = self.recipe.hydra_overrides() + model.overrides()
        values = model.values()
        if self.output_dir:
            set_dotted(values, "logging.output_dir", str(self.output_dir))
        return overrides, values

    def build(self, *, ship: Optional[Callable[[Any, str], Any]] = None) -> HomegymConfig:
        """The validated HomegymConfig (no dataset files written, no Ray needed unless a
        function must be shipped by value)."""
        overrides, values = self._base()
        composed = compose_config(overrides, values)
        recipe_values = self.recipe.values(composed, ship=ship or ship_or_describe)
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(values),
                                                        OmegaConf.create(recipe_values)))
        if self.run_name:
            set_dotted(merged, "logging.run_name", self.run_name)
        return compose_config(overrides, merged)

    def launch(self) -> Run:
        from trainer.driver.runtime import connect_ray  # imports Ray: only when launching

        overrides, values = self._base()
        composed = compose_config(overrides, values)  # cheap validation before Ray starts
        run_name = self.run_name or f"{composed.derived.label}-{datetime.now():%Y%m%d-%H%M%S-%f}"
        data = None
        if self.dataset is not None:
            data_dir = Path(composed.logging.output_dir).resolve() / run_name / "data"
            data = self.dataset.materialize(data_dir)

        def final(ship: Callable[[Any, str], Any]) -> HomegymConfig:
            merged = OmegaConf.to_container(OmegaConf.merge(
                OmegaConf.create(values), OmegaConf.create(self.recipe.values(composed, ship=ship))))
            set_dotted(merged, "logging.run_name", run_name)
            if data is not None:
                set_dotted(merged, "data", {**merged.get("data", {}), **data})
            return compose_config(overrides, merged)

        preflight(final(ship_locally))  # the CLI's start-up checks, before Ray starts
        connect_ray(composed, pip=self.recipe.pip_packages())
        return Run(final(ship_function)).start()


@dataclass
class TrainConfig(TrainJob):
    """The seed notebook's name of ``TrainJob`` (deprecated: ``TrainConfig`` is also the
    ``train:`` config section's class, config.TrainConfig)."""

    def __post_init__(self) -> None:
        deprecated("trainer.api.TrainConfig", "trainer.api.TrainJob")
