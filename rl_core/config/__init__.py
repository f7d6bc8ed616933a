"""Typed configuration: schema, recipes + dotlist loading, preflight (docs/config.md)."""

from rl_core.config.loader import (
    ConfigError,
    config_from_dict,
    config_hash,
    flatten,
    load_config,
    to_yaml,
    write_resolved,
)
from rl_core.config.preflight import (
    PreflightReport,
    check,
    load_checked,
    num_mini_batches,
    per_replica_batch,
    preflight,
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
    TrackingConfig,
    ValidationConfig,
)

__all__ = [
    "ClusterConfig", "ConfigError", "DataConfig", "JobConfig", "LoRAConfig", "ModelConfig", "OptimizerConfig", "PosttrainConfig",
    "PreflightReport", "RLConfig", "RolloutConfig", "TrackingConfig", "ValidationConfig", "check", "config_from_dict",
    "config_hash", "flatten", "load_checked", "load_config", "num_mini_batches", "per_replica_batch", "preflight", "to_yaml",
    "write_resolved",
]
