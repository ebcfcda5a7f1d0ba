"""homegym's configuration: the typed schema (``schema``), its composition from ``conf/``
(``compose``) and the values derived from it (``derived``).

The bottom of the import graph: it imports no torch, Ray or transformers and nothing else
of homegym (tests/test_layering.py checks both), so every process and every tool can read
a config cheaply.
"""

from config.compose import CONF_DIR, compose_config, set_dotted, split_args
from config.schema import (
    AdvantageEstimator, AgentConfig, AlgoConfig, Backend, ClusterConfig, ConfigError,
    DataConfig, EnvConfig, EvalConfig, HomegymConfig, KLType, LoggingConfig, LoraConfig,
    LossAgg, ModelConfig, PolicyLoss, RolloutConfig, RolloutCorrection, TrainConfig,
    WarmupConfig, build_config, choices, deprecated, register_schema, to_dict)

__all__ = [
    "AdvantageEstimator", "AgentConfig", "AlgoConfig", "Backend", "CONF_DIR", "ClusterConfig",
    "ConfigError", "DataConfig", "EnvConfig", "EvalConfig", "HomegymConfig", "KLType",
    "LoggingConfig", "LoraConfig", "LossAgg", "ModelConfig", "PolicyLoss", "RolloutConfig",
    "RolloutCorrection", "TrainConfig", "WarmupConfig", "build_config", "choices",
    "compose_config", "deprecated",
    "register_schema", "set_dotted", "split_args", "to_dict",
]
