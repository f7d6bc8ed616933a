"""The data check: the rows of `data.train` and `data.val`, read as the run reads them, every bad one reported at once.

`posttrain validate` prints it after the preflight report; `posttrain run` makes it before anything starts
(`rl_core.preflight.rules.check`), so a bad row stops a run in seconds, in one short block, not inside a flow.

`check_data(cfg, read_hub=...)` loads each split through its task (`rl_core.tasks`: the prompts task's row checks,
the arithmetic and GSM8K tasks' fields, JSONL's value rules, `rl_core.data.jsonl.value_problem`) or, for an offline
objective (DPO), as preference pairs through the pair gate (`rl_core.data.preferences`, without the tokenizer);
then, under `data.prompt_template=auto`, that both splits render one way (`rl_core.tasks.row_templates`). Every
problem names the key, the file and the row. A split it does not read is reported with why ("not checked"): a
local split that is not there (the quickstart's, which the run builds first with `posttrain make-data`, or one that
the machine check names as missing), a hub dataset id without `read_hub` (`validate --no-env` never needs the
network), a task that does not load (preflight names it).

What needs the tokenizer is checked by the run as it loads the data, before anything is placed: a prompt that with
`rollout.max_tokens` exceeds the model's context, a chat template the messages do not fit, DPO's token limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_core.config.explain import ConfigError
from rl_core.config.schema import PosttrainConfig

MAX_LISTED = 20  # problems listed in full; the rest are counted
# what a loader raises on bad data or on a source it cannot read
LOAD_ERRORS = (ValueError, OSError, RuntimeError, ImportError)


@dataclass
class SplitReport:
    key: str  # data.train | data.val
    source: str
    rows: int = 0  # good rows read
    problems: list[str] = field(default_factory=list)  # each `<key>=<source>: <file:row>: <what, what to do>`
    not_checked: str | None = None  # why the split was not read


@dataclass
class DataReport:
    splits: list[SplitReport]
    problems: list[str] = field(default_factory=list)  # across both splits (templates)

    @property
    def errors(self) -> list[str]:
        return [p for s in self.splits for p in s.problems] + self.problems

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        """The report as `posttrain validate` prints it: a line per split, then the problems (at most `MAX_LISTED`)."""
        errors = self.errors
        read = any(s.not_checked is None for s in self.splits)
        lines = [f"data: {f'FAILED ({len(errors)} problem(s))' if errors else 'ok' if read else 'not checked'}"]
        for s in self.splits:
            state = (f"not checked: {s.not_checked}" if s.not_checked is not None
                     else f"{len(s.problems)} bad row(s)" if s.problems else f"{s.rows} rows ok")
            lines.append(f"  {s.key}={s.source!r}: {state}")
        lines += [f"  error: {p}" for p in listed(errors)]
        return "\n".join(lines)

    def raise_errors(self) -> None:
        if not self.ok:
            raise DataError(self.errors)


def listed(problems: list[str]) -> list[str]:
    """The first `MAX_LISTED` problems, and how many more there are."""
    more = len(problems) - MAX_LISTED
    return problems[:MAX_LISTED] + ([f"... and {more} more"] if more > 0 else [])


class DataError(ConfigError):
    """Bad rows of the data splits: `.problems` holds every one; the message lists the first `MAX_LISTED`, one a line,
    under a one-line head (what `posttrain run` prints, once)."""

    def __init__(self, problems: list[str]):
        super().__init__(problems, "data")
        shown = listed(self.problems)
        head = f"bad data: {len(self.problems)} problem(s) in the data splits; fix them (`posttrain validate` lists them)"
        self.args = (head + "\n" + "\n".join(f"  - {p}" for p in shown),)

    @classmethod
    def of_split(cls, key: str, source: str, exc: Exception) -> DataError:
        return cls(split_problems(key, source, exc))


def split_problems(key: str, source: str, exc: Exception) -> list[str]:
    """What loading split `key` raised, one message per bad row (`RowErrors`), each naming the key."""
    return [f"{key}={source!r}: {p}" for p in getattr(exc, "problems", None) or [str(exc)]]


def not_checked_why(source: str, read_hub: bool, build_hint: str | None) -> str | None:
    """Why split `source` is not read here, or None."""
    from rl_core.preflight.sources import is_quickstart_data, local_split

    path = local_split(source)
    if path is not None and path.exists():
        return None
    if path is not None:
        if is_quickstart_data(source):
            return "not built yet: the run builds it first (`posttrain make-data`)"
        return "no such file" + (f"; build it with {build_hint}" if build_hint else "")
    if not read_hub:
        return ("not a local file (a hub dataset id): validate --no-env does not fetch it; the run reads it, and so "
                "does validate without --no-env")
    return None


def check_data(cfg: PosttrainConfig, *, read_hub: bool = True, open_episode: bool = False) -> DataReport:
    """Read both splits as the run does and collect every bad row (see the module's docstring). With
    `open_episode` (`posttrain validate`), an environment task also opens one episode on data.train's first row,
    in this process (`first_episode_problem`)."""
    from rl_core.tasks import get_task, load_split, row_templates

    d = cfg.data
    report = DataReport([SplitReport("data.train", d.train), SplitReport("data.val", d.val)])
    try:
        task = get_task(d.task)
    except ValueError:
        for s in report.splits:
            s.not_checked = f"data.task={d.task!r} does not load (preflight says why)"
        return report
    offline = cfg.rl.objective.topology == "offline"
    loaded = {}
    for s in report.splits:
        s.not_checked = not_checked_why(s.source, read_hub, task.build_hint)
        if s.not_checked is not None:
            continue
        try:
            rows = _pair_rows(s.source) if offline else load_split(task, s.source, d)
        except LOAD_ERRORS as exc:
            s.problems = split_problems(s.key, s.source, exc)
            continue
        s.rows = rows if offline else len(rows)
        if not s.rows:
            s.problems = [f"{s.key}={s.source!r}: no examples (the split is empty); point {s.key} at a split with data"]
        elif not offline:
            loaded[s.key] = rows
    if (open_episode and loaded.get("data.train") and task.environment is not None
            and (problem := first_episode_problem(task.environment, loaded["data.train"][0]))):
        report.problems.append(f"data.task={d.task}: {problem}")
    if len(loaded) == 2 and d.prompt_template == "auto":
        try:
            row_templates(loaded["data.train"] + loaded["data.val"], task, d.prompt_template)
        except ValueError as exc:
            report.problems.append(f"data.train, data.val: {exc}")
    return report


def first_episode_problem(environment: type, example) -> str | None:
    """What stops an episode of `environment` from opening on `example`, as the rollout opens one (the class built
    on the row, `reset`, its tools' schemas), else None; the episode is closed after. An agent function's episode is
    not opened: its tools come with its requests, which need a model to answer; a function that carries a `check()`
    (a verifiers environment's: the environment loads in verifiers' Python) is asked for its problem instead."""
    from rl_core.agents.gateway.agent import AgentEnvironment
    from rl_core.agents.host import LocalEnvironments

    if issubclass(environment, AgentEnvironment):
        check = getattr(environment.agent, "check", None)
        return None if check is None else check()
    host = LocalEnvironments()
    (opening,) = host.open(environment, [("validate", example)])
    host.discard(["validate"])
    if opening.error is None:
        return None
    return (f"an episode on data.train's first row ({example.row or 'row 1'}) cannot start: {opening.error}; the run "
            "would leave out every row it fails on")


def _pair_rows(source: str) -> int:
    """Preference pairs read and gated as the DPO flow does, without the tokenizer: the number of pairs."""
    from rl_core.data.preferences import load_preference_pairs, validate_preference_pairs

    return len(validate_preference_pairs(load_preference_pairs(source)))
