"""Training a policy: `trainer.LLMTrainer` (micro-batches, data-parallel sums, one normalisation per step), its
checkpoint state (`state`), how a mini-batch is cut into micro-batches (`micro_batches`), the data-parallel
reduction it is given (`data_parallel`), and the warm start of a tiny model, plain next-token training on
demonstrations (`warm_start`)."""
