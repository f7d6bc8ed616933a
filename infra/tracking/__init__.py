"""What a run records and shows.

- `tracker`: `RunTracker`, the MLflow mirror of a run; `items`: datasets, completions and the final model as
  MLflow objects; `experiments`: where an experiment may keep artifacts; `provenance`: DVC hashes, code revision,
  versions.
- `metrics_log`: `runs/<job.name>/metrics.jsonl`, the one record of a run's numbers; `plots`: its curves.
- `regression_report`: the nightly regression's report and its MLflow side."""
