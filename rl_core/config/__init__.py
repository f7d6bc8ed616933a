"""Typed configuration: the schema and loading recipes + dotlists (docs/config.md). The checks of a loaded config
are `rl_core.config.preflight` (the config alone: `preflight`, `check`, `load_checked`),
`rl_core.config.environment` (this machine) and `rl_core.config.data_check` (the rows of the data splits)."""

from rl_core.config.loader import (
    ConfigError,
    config_from_dict,
    config_hash,
    flatten,
    load_config,
    to_yaml,
    write_resolved,
)
from rl_core.config.schema import (
    ClusterConfig,
    DataConfig,
    JobConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    PosttrainConfig,
    RLConfig,
    RolloutConfig,
    S3Config,
    TrackingConfig,
    ValidationConfig,
)

__all__ = [
    "ClusterConfig", "ConfigError", "DataConfig", "JobConfig", "LoRAConfig", "ModelConfig", "OptimizerConfig", "PosttrainConfig",
    "RLConfig", "RolloutConfig", "S3Config", "TrackingConfig", "ValidationConfig", "config_from_dict", "config_hash", "flatten",
    "load_config", "to_yaml", "write_resolved",
]
