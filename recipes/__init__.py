"""Recipes: one `build_config()` per named run. Load them with `rl_core.config.load_config(path, overrides)`."""
