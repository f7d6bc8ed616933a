"""Prefect tasks: thin, one phase each; they call into rl_core and infra and keep no logic of their own."""
