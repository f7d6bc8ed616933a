"""Typed configuration: the schema and loading recipes + dotlists (docs/config.md). The checks of a loaded config
are `rl_core.preflight.rules` (the config alone: `preflight`, `check`, `load_checked`),
`rl_core.preflight.machine` (this machine) and `rl_core.preflight.rows` (the rows of the data splits).
`rl_core.config.explain` turns every problem into a line naming its dotted key."""

from rl_core.config.explain import ConfigError
from rl_core.config.loader import (
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
