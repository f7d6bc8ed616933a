"""Placement: the run's shape (ranks, engines, teacher replicas and their GPU shares, `run_shape`) and the memory
plan of every process on its GPU and host (`memory`, `host_memory`), from the config alone, before anything runs."""
