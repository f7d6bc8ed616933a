"""The run's Ray actors, one module per role, and what they share (`actor`: the `Actor` protocol, `ActorGroup`,
the device and node helpers and `worker_config`, the resolved config an actor receives as data).

- `policy`: a data-parallel trainer rank (`PolicyWorker`, `build_trainer`); `sharded_load` fills its FSDP shards
  at start-up (`checkpoint_index`: which files of the checkpoint it may read); `distributed`: its rendezvous,
  process groups and the weight-sync stream.
- `engines`: a separate rollout engine (`RolloutWorker`) and the driver's `EnginePool`; `tp_weights`: a
  tensor-parallel vLLM engine's workers as ranks of the weight-sync group.
- `teacher`: OPD teacher replicas; `rewards`: the reward pool; `environments`: the agent environments' pool.

Modules load on use: importing this package imports none of them (each actor process pays only for its own)."""
