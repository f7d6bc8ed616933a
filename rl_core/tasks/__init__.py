"""Tasks: a task bundles how a dataset is loaded, how a prompt is formatted and which rewards score it.

`data.task` names a task: a built-in one (`arithmetic`, `gsm8k`, `prompts`, see `TASKS`) or yours by import
path, `package.module:MY_TASK` (a `Task` instance or a subclass of it). Everything task-specific reaches the
rest of posttrain through this interface; nothing else branches on the task's name.

A task's `load(source, data)` returns `Example`s; `plain_text` / `messages` give the prompt the model sees
under `data.prompt_template=plain` / `chat`; `default_rewards(data)` the rewards used when `data.rewards` is
unset. See docs/data.md for writing one.

`load_examples` loads a split through its task; `encode_prompts` turns examples into the token ids the
rollout engine takes, with the configured template (`auto`, the default, is chat for a row whose prompt is chat
messages and for an environment's episodes, plain for a text prompt: `row_template`):

- plain: the task's plain text (arithmetic prompts as they are; GSM8K as `Question: ...\\nAnswer:`),
  tokenised with the tokenizer's own special tokens (e.g. the tiny model's `<bos>`).
- chat: the task's messages (GSM8K adds an instruction to end with `#### <number>`) rendered with the
  tokenizer's chat template and a generation prompt; the template supplies its own special tokens.
"""

from __future__ import annotations

from pathlib import Path

from rl_core.tasks.base import Example, Task, is_import_path


def get_task(name: str) -> Task:
    """The task `data.task` names: a built-in name or `package.module:attr` (a Task instance or subclass, or an
    `rl_core.agents.Environment` subclass, a class in TRL's `environment_factory` convention or an agent function
    (`rl_core.agents.gateway.agent`): its episodes on the rows of the `prompts` task)."""
    from rl_core.tasks.builtin import TASKS

    if not is_import_path(name):
        if name not in TASKS:
            raise ValueError(f"data.task={name!r} is not a built-in task ({', '.join(sorted(TASKS))}) nor an "
                             "import path 'package.module:TASK' of your own")
        return TASKS[name]
    from rl_core.user_code import load_object

    obj = load_object(name, "data.task")
    from rl_core.agents.environment import Environment
    from rl_core.agents.gateway.agent import is_agent_function
    from rl_core.agents.trl_style import is_trl_style, trl_environment

    if isinstance(obj, type) and issubclass(obj, Environment):
        from rl_core.tasks.environment import EnvironmentTask

        return EnvironmentTask(obj, name)
    if isinstance(obj, type) and issubclass(obj, Task):
        obj = obj()
    elif is_agent_function(obj):  # an agent behind the OpenAI-compatible gateway
        from rl_core.agents.gateway.agent import agent_environment
        from rl_core.tasks.environment import EnvironmentTask

        return EnvironmentTask(agent_environment(obj), name)
    elif is_trl_style(obj):  # a class written for TRL's GRPOTrainer(environment_factory=...)
        from rl_core.tasks.environment import EnvironmentTask

        return EnvironmentTask(trl_environment(obj), name)
    if not isinstance(obj, Task):  # a config error, reported with the other ValueErrors of the config
        raise ValueError(  # noqa: TRY004
            f"data.task={name!r}: {type(obj).__name__} is not a rl_core.tasks.Task (an instance or a subclass), an "
            "rl_core.agents.Environment subclass, a class with a reset method (TRL's environment_factory "
            "convention) nor an agent function; see docs/data.md and docs/agents.md")
    return obj



def _task(task: str | Task) -> Task:
    return task if isinstance(task, Task) else get_task(task)


def load_examples(source: str | Path, task: str | Task, data=None) -> list[Example]:
    """The examples of one split, loaded by the task (`data` is the `data` config section, or None for the
    task's defaults). Bad rows raise ValueError naming the file and row."""
    return load_split(_task(task), str(source), data)


def load_split(task: Task, source: str, data=None) -> list[Example]:
    """`task.load(source, data)`; a task of your own (its class outside rl_core) is called through
    `rl_core.user_code.call_user_code`: what it raises is a UserCodeError (a ValueError) naming the task, its message
    scrubbed of credentials (a data source's API key, say); but `RowErrors` (every bad row) comes through as it is,
    each row's message scrubbed."""
    if type(task).__module__.startswith("rl_core."):
        return task.load(source, data)
    from rl_core.data.jsonl import RowErrors
    from rl_core.redact import redact_text
    from rl_core.user_code import call_user_code

    def load() -> tuple[list[Example] | None, RowErrors | None]:
        try:
            return task.load(source, data), None
        except RowErrors as exc:
            return None, RowErrors([redact_text(str(p)) for p in exc.problems])

    examples, rows = call_user_code(f"data.task {task.name!r}: load", load, ())
    if rows is not None:
        raise rows
    return examples


TEMPLATES = ("auto", "plain", "chat")  # data.prompt_template


def row_template(example: Example, task: Task, template: str) -> str:
    """How `example` is rendered, `plain` or `chat`: `template` when it is one of them; under `auto`, chat for a
    chat-format row (its prompt is messages: TRL's conversational format) or an environment's episode, plain for a
    text prompt."""
    if template == "auto":
        return "chat" if example.messages is not None or task.environment is not None else "plain"
    if template in TEMPLATES:
        return template
    raise ValueError(f"data.prompt_template={template!r} is not one of {', '.join(map(repr, TEMPLATES))}")


def row_templates(examples: list[Example], task: str | Task, template: str) -> list[str]:
    """`row_template` of each example. Under `auto` the rows must agree (one run renders its prompts one way): a
    mix of text prompts and chat messages is refused, naming a row of each."""
    task = _task(task)
    kinds = [row_template(ex, task, template) for ex in examples]
    if template == "auto" and len(set(kinds)) > 1:
        chat = examples[kinds.index("chat")]
        text = examples[kinds.index("plain")]
        raise ValueError(f"{chat.row or 'a row'} has a chat-format prompt (messages) and {text.row or 'another'} a "
                         "text prompt: data.prompt_template=auto renders a run's prompts one way; set "
                         "data.prompt_template=chat (a text prompt becomes the user's turn), or write every row alike")
    return kinds


def format_prompt(example: Example, tokenizer, task: str | Task, template: str = "plain", data=None) -> str:
    """The prompt text the model sees (before tokenisation)."""
    task = _task(task)
    kind = row_template(example, task, template)
    if kind == "plain":
        return task.plain_text(example, data)
    if not getattr(tokenizer, "chat_template", None):
        why = ("data.prompt_template=chat" if template == "chat" else
               f"{example.row or 'a row'} is a chat-format prompt (messages), which data.prompt_template=auto renders "
               "with the chat template,")
        raise ValueError(f"{why} but the tokenizer has no chat_template; use a model with one, or text prompts with "
                         "data.prompt_template=plain")
    return tokenizer.apply_chat_template(task.messages(example, data), tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer, examples: list[Example], task: str | Task, template: str = "plain",
                   data=None) -> list[list[int]]:
    """Unpadded prompt token ids for the rollout engine. Plain text gets the tokenizer's own special tokens; a chat
    template brings its own."""
    task = _task(task)
    kinds = row_templates(examples, task, template)
    texts = [format_prompt(ex, tokenizer, task, kind, data) for ex, kind in zip(examples, kinds)]
    enc = tokenizer(texts, add_special_tokens=(kinds[0] == "plain" if kinds else True))
    return [list(ids) for ids in enc["input_ids"]]


def encode_for(data, tokenizer, examples: list[Example]) -> list[list[int]]:
    """`encode_prompts` with the task, template, system prompt and instruction of the `data` config section."""
    return encode_prompts(tokenizer, examples, data.task, data.prompt_template, data)


__all__ = ["TEMPLATES", "Example", "Task", "encode_for", "encode_prompts", "format_prompt", "get_task",
           "is_import_path", "load_examples", "load_split", "row_template", "row_templates"]
