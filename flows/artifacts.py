"""The Prefect artifacts of a training flow run: what its page in the Prefect UI shows besides logs and task runs.

- a link to the run's MLflow run (`<job>-mlflow`), when MLflow is a server (`http(s)://`; a local SQLite or
  file store has no page to link to: the summary names the store and the run id instead);
- a progress artifact (`<job>-progress`), set at the start (a resumed run starts at its checkpoint's step) and
  updated at every step;
- a markdown summary at the end (`<job>-summary`): steps, final reward, held-out accuracy and the reward that
  decides it (`data.success_reward`), the run directory, the newest checkpoint and the final model, the MLflow run;
- sample completions (`<job>-completions`), at the steps that log them to MLflow (`tracking.sample_completions_every`
  and the last): prompt, completion (an agent's whole conversation after its opening messages, tool calls and
  results included), reward, finish reason, the row's data columns and each reward function's value; the newest
  version is the latest step's.

The keys carry `job.name`, so the UI's Artifacts page keeps the newest of each per job. An artifact is for
people: when the API refuses or cannot be reached, a warning is logged, no further artifact is tried in this
run (each call would wait out the client's retries), and the run goes on.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_core.redact import redact_text
from rl_core.rewards import SUCCESS_VALUE

log = logging.getLogger("posttrain")

# (metrics key, label) of the summary's rows, the first present wins: on-policy objectives log a reward, DPO and a
# reward model their pairs' accuracy
REWARD_KEYS = (("rollout/reward_mean", "final reward (rollout/reward_mean)"),
               ("train/reward_accuracy", "final preference accuracy (train/reward_accuracy)"),
               ("train/accuracy", "final pair accuracy (train/accuracy)"))
ACCURACY_KEY = "val/accuracy"


def artifact_key(name: str) -> str:
    """An artifact key from `name`: lowercase letters, digits and dashes only (what the Prefect API accepts)."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", name.lower())).strip("-") or "run"


class RunArtifacts:
    """The artifacts of one training flow run (module notes). `start`, then `step` at each step, `summary` at the end."""

    def __init__(self, job_name: str, total_steps: int):
        self.job_name = job_name
        self.key = artifact_key(job_name)
        self.total = max(int(total_steps), 1)
        self.progress_id: Any = None
        self.off = False
        self.mlflow_url: str | None = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.off:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an artifact never fails the run
            self.off = True
            log.warning("Prefect artifacts: %s failed (%s: %s); no further artifacts for this run", what,
                        type(exc).__name__, redact_text(str(exc))[:300])
            return None

    def start(self, mlflow_url: str | None, mlflow_run_id: str, step: int = 0) -> None:
        """The link to the MLflow run (`mlflow_url`: its page on a server, None for a local store) and the progress
        artifact at `step`."""
        from prefect.artifacts import create_link_artifact, create_progress_artifact

        self.mlflow_url = mlflow_url
        if self.mlflow_url:
            self._call("create_link_artifact", create_link_artifact, self.mlflow_url,
                       link_text=f"MLflow run {mlflow_run_id}", key=f"{self.key}-mlflow",
                       description=f"The MLflow run of {self.job_name}: metrics, params, curve, model")
        self.progress_id = self._call("create_progress_artifact", create_progress_artifact, self._percent(step),
                                      key=f"{self.key}-progress", description=self._steps(step))

    def step(self, step: int) -> None:
        """The progress artifact at `step`."""
        from prefect.artifacts import update_progress_artifact

        if self.progress_id is not None:
            self._call("update_progress_artifact", update_progress_artifact, self.progress_id, self._percent(step),
                       description=self._steps(step))

    def summary(self, records: list[dict], *, step: int, run_dir: Path, checkpoint: Path | None, model_dir: str | None,
                mlflow_run_id: str | None, tracking_uri: str | None, success_reward: str | None = None) -> None:
        """The markdown summary of the finished run (`records`: its metrics.jsonl lines; `success_reward`: the reward
        whose full marks `val/accuracy` counts)."""
        from prefect.artifacts import create_markdown_artifact

        markdown = summary_markdown(self.job_name, records, step=step, total=self.total, run_dir=run_dir,
                                    checkpoint=checkpoint, model_dir=model_dir, mlflow_run_id=mlflow_run_id,
                                    mlflow_url=self.mlflow_url, tracking_uri=tracking_uri,
                                    success_reward=success_reward)
        self._call("create_markdown_artifact", create_markdown_artifact, markdown, key=f"{self.key}-summary",
                   description=f"{self.job_name}: the finished run")

    def completions(self, step: int, rows: list[dict]) -> None:
        """The sample completions of `step` (`rows`: the MLflow completions table's rows of that step)."""
        from prefect.artifacts import create_markdown_artifact

        self._call("create_markdown_artifact", create_markdown_artifact, completions_markdown(step, rows),
                   key=f"{self.key}-completions", description=f"{self.job_name}: sample completions of step {step}")

    def _percent(self, step: int) -> float:
        return min(100.0, 100.0 * step / self.total)

    def _steps(self, step: int) -> str:
        return f"{self.job_name}: step {step} of {self.total}"


def summary_markdown(job_name: str, records: list[dict], *, step: int, total: int, run_dir: Path,
                     checkpoint: Path | None, model_dir: str | None, mlflow_run_id: str | None,
                     mlflow_url: str | None, tracking_uri: str | None, success_reward: str | None = None) -> str:
    """The summary's text: a table of what a person looks for first; `success_reward` (the reward whose full marks
    `val/accuracy` counts, `rl_core.rewards.success_reward`) is named under the held-out accuracy."""
    rows = [("steps", f"{step} of {total}")]
    for key, label in REWARD_KEYS:
        last = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if last:
            rows.append((label, f"{last[-1][1]:.4f} (step {last[-1][0]})"))
            break
    accuracy = [(r["step"], r[ACCURACY_KEY]) for r in records if r.get(ACCURACY_KEY) is not None]
    if accuracy:
        (first_step, first), (last_step, last) = accuracy[0], accuracy[-1]
        rows.append(("held-out accuracy (val/accuracy)", f"{last:.4f} (step {last_step})" if first_step == last_step
                     else f"{first:.4f} (step {first_step}) → {last:.4f} (step {last_step})"))
        if success_reward:
            rows.append(("correct when", f"reward `{success_reward}` ≥ {SUCCESS_VALUE:g} (data.success_reward)"))
    rows.append(("run directory", f"`{Path(run_dir).resolve()}`"))
    rows.append(("newest checkpoint", f"`{Path(checkpoint).resolve()}`" if checkpoint else "none (rl.save_every=0)"))
    if model_dir:
        rows.append(("final model", f"`{model_dir}`"))
    if mlflow_run_id:
        where = f"[{mlflow_run_id}]({mlflow_url})" if mlflow_url else \
            f"`{mlflow_run_id}` in `{redact_text(str(tracking_uri))}`"
        rows.append(("MLflow run", where))
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"# {job_name}\n\n| | |\n| --- | --- |\n{table}\n"


COMPLETION_CHARS = 3000  # of one completion in the artifact; the MLflow table keeps it whole


def _fenced(text: str) -> str:
    """`text` as a markdown code block, fenced longer than any run of backticks in it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


SAMPLE_FIELDS = ("step", "attempt", "prompt", "completion", "reward", "finish_reason")  # shown in their own places


def completions_markdown(step: int, rows: list[dict]) -> str:
    """The sample completions of one step, one section each: reward, finish reason, prompt, the table's other
    columns (the row's data columns such as the reference answer, each reward function's value) and the
    completion (cut at `COMPLETION_CHARS`) as a code block. Secrets that look like credentials are redacted."""
    parts = [f"# Sample completions, step {step}"]
    for i, row in enumerate(rows, 1):
        text = str(row["completion"])
        if len(text) > COMPLETION_CHARS:
            text = text[:COMPLETION_CHARS] + f"\n... ({len(text) - COMPLETION_CHARS} more characters)"
        reward = "none" if row.get("reward") is None else f"{float(row['reward']):.4f}"
        fields = "".join(f"**{name}** {redact_text(str(value))[:200]}\n\n" for name, value in row.items()
                         if name not in SAMPLE_FIELDS)
        parts.append(f"## {i}. reward {reward}, finish reason {row.get('finish_reason') or 'n/a'}\n\n"
                     f"**prompt** {redact_text(str(row['prompt']))[:COMPLETION_CHARS]}\n\n"
                     f"{fields}{_fenced(redact_text(text))}")
    return "\n\n".join(parts) + "\n"
