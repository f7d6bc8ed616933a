"""The checks of a loaded config before anything is placed or built (docs/config.md).

- `rules`: the config alone, its cross-field rules (`preflight`, `check`, `load_checked`).
- `machine`: this machine against the config (GPUs, memory, models and data reachable; `machine_problems`).
- `rows`: the rows of `data.train` and `data.val`, read as the run reads them (`check_data`)."""
