"""The training batch: `trajectory.Trajectory` (a dataclass of tensors, a row per completion) and `gate` (every
pandera schema a batch must satisfy before it reaches a trainer). The annotate phase that makes a batch from scored
completions is `rl_core.annotate`: it reads the config, which this room must not (the config's objective sections
reach the DPO pair reader, which builds batches)."""
