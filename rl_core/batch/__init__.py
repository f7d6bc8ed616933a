"""The training batch: `trajectory.Trajectory` (a dataclass of tensors, a row per completion), `gate` (every
pandera schema a batch must satisfy before it reaches a trainer) and `dynamic_sampling` (which scored groups a step
trains on, over generation rounds: `rollout.filter_groups`). The annotate phase that makes a batch from scored
completions is `rl_core.annotate`: it reads the config, which this room must not (the config's objective sections
reach the DPO pair reader, which builds batches)."""
