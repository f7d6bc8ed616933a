"""Prefect tasks: thin, one phase each; they call into rl_core and infra and keep no logic of their own.

A task of the step loop takes the step (`step=`, keyword only) for its run's name alone (`task_run_name`, e.g.
`rollout step 12`): the Prefect UI lists the runs of a step together.
"""
