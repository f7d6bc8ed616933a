"""User code by import path: `rl.objective.import_path`, `data.rewards[i].path` and `data.task` name a
function or task as `package.module:function`, imported and checked (`load_callable`) when the config is
checked, so a wrong path or signature fails before anything is placed, naming the key (docs/objectives.md,
docs/data.md).

What user code raises (a reward, a task's `load`, an environment or tool, a custom objective's builder or loss, a
module that fails at import) is described at one point, `user_error`: its type and its message made safe by
`rl_core.redact.redact_message`, so an API key or token in it reaches no log, error, Prefect state or artifact.
`call_user_code` raises that description as the caller's error, without the original exception (its message,
arguments and traceback are not passed on, not even as the new error's context).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rl_core.redact import redact_message

IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # 'package.module:name', as every import-path key is written

class ImportPathError(ValueError):
    """A `module:function` path that does not import, or a function with the wrong signature."""


class UserCodeError(ValueError):
    """User code (a task, an environment, a custom objective) raised; the message names it and says what it raised,
    scrubbed of credentials (`user_error`)."""


def user_error(exc: BaseException) -> str:
    """The one description of what user code raised: `Type: message`, the message made safe by `redact_message`
    (credentials in URIs, by their shape, in secret-named assignments, and the values of secret-named environment
    variables)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails: its type says enough
        message = "<message not readable>"
    return f"{type(exc).__name__}: {redact_message(message)}" if message else type(exc).__name__


# What a bug in user code raises: the same call on the same input raises it again, so retrying the step cannot help.
BUG_ERRORS = (TypeError, AttributeError, NameError, KeyError, IndexError, ZeroDivisionError, AssertionError,
              NotImplementedError, RecursionError)


def is_bug(exc: BaseException) -> bool:
    """Whether `exc` is a programming error (`BUG_ERRORS`) rather than one a retry may not meet again (a
    connection, a timeout, a resource)."""
    return isinstance(exc, BUG_ERRORS)


def raised_at(exc: BaseException) -> str:
    """` at <file>:<line>`: where in the user's own code `exc` was raised (the innermost frame of its traceback
    outside Python's library, the installed packages and posttrain's packages), else nothing."""
    import sysconfig
    import traceback
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    skip = tuple(f"{p}/" for p in {*(Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib",
                                                                                        "purelib", "platlib")),
                                  *(root / own for own in ("rl_core", "infra", "flows", "tasks", "cli"))})
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(skip)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def call_user_code(what: str, fn: Callable[..., Any], args: tuple = (), kwargs: Mapping[str, Any] | None = None, *,
                   error: Callable[[str], BaseException] = UserCodeError, hint: str = "") -> Any:
    """`fn(*args, **kwargs)`; an exception it raises becomes `error(f"{what} raised {user_error(exc)}{hint}")`,
    raised with neither cause nor context: nothing of the original (message, arguments, traceback, locals) goes on.
    The new error's `retryable` is False when the original was a programming error (`is_bug`): the phase's task
    is then not retried (`flows.restarts.worth_retrying`)."""
    try:
        return fn(*args, **(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the user's code: described, redacted, raised as the caller's error
        failure, bug = f"{what} raised {user_error(exc)}{hint}", is_bug(exc)
    raised = error(failure)
    raised.retryable = not bug
    raise raised  # outside the except block: the new error has no __context__


def load_object(path: str, key: str) -> Any:
    """Import `module:attr` for config key `key`; ImportPathError naming the key, the path and what to fix."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"{key}={path!r}: expected 'package.module:function'")
    module = call_user_code(f"{key}={path!r}: cannot import module {module_name!r} (importing it",
                            importlib.import_module, (module_name,), error=ImportPathError,
                            hint="); install it or put its directory on PYTHONPATH (Ray workers need it too)")
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ImportPathError(f"{key}={path!r}: module {module_name!r} has no {attr!r}")
    return obj


def load_callable(path: str, key: str, params: tuple[str, ...], *, by_keyword: bool = False,
                  kwargs: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Import `module:function` for config key `key` and check it can be called with `params` (positionally, or
    as keywords with `by_keyword`), plus `kwargs` by keyword.

    Raises ImportPathError naming the key, the path and what to fix.
    """
    attr = str(path).partition(":")[2]
    fn = load_object(path, key)
    if not callable(fn):
        raise ImportPathError(f"{key}={path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        if by_keyword:  # the other arguments (dataset columns) are known only when the data is loaded
            inspect.signature(fn).bind_partial(**dict.fromkeys(params))
        else:
            inspect.signature(fn).bind(*params, **(kwargs or {}))
    except TypeError as exc:
        call = ", ".join(f"{p}=..." for p in params) if by_keyword else ", ".join(params)
        call += "".join(f", {k}=..." for k in (kwargs or {}))
        raise ImportPathError(f"{key}={path!r}: {attr}{inspect.signature(fn)} cannot be called as "
                              f"{attr}({call}) ({exc})") from None
    except ValueError:  # a builtin without a signature: accept, it is checked when called
        pass
    return fn


REWARD_PARAMS = ("completions",)  # by keyword, as TRL calls reward_funcs; prompts and columns when it takes them
RECIPE_MODULE_PREFIX = "posttrain_recipe_"  # the module name a recipe file runs under: loaded by path, not importable
MAKE_IMPORTABLE = ("define it with def at the top level of a module that imports on the driver and on every Ray worker "
                   "(e.g. my_rewards.py in the directory you run posttrain from, or an installed package), import it "
                   "from there, or give its path: {'path': 'my_rewards:accuracy_reward'} (docs/data.md)")


def import_path_of(fn: Any) -> str:
    """The import path `package.module:qualname` of a module-level function (a reward given as a function object, as
    TRL takes `reward_funcs`): what the config records, so provenance names it and Ray workers import it. ValueError
    saying why and how to fix it for a function that has no such path: a lambda, one defined inside a function, in the
    script run as `__main__` or in the recipe file, or a callable that is not a function."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        why = f"a {type(fn).__name__} has no import path"
    elif "<lambda>" in qualname:
        why = "a lambda has no import path"
    elif "<locals>" in qualname:
        why = f"{qualname.replace('.<locals>', '')} is defined inside a function and has no import path"
    elif module == "__main__":
        why = f"{qualname} is defined in the script being run (__main__), which the Ray workers cannot import"
    elif module.startswith(RECIPE_MODULE_PREFIX):
        why = f"{qualname} is defined in the recipe file, which is run from its path and cannot be imported"
    else:
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is fn:
            return f"{module}:{qualname}"
        why = f"{module}:{qualname} does not import as this function"
    raise ImportPathError(f"{why}; {MAKE_IMPORTABLE}")


def user_code_problems(cfg: Any) -> list[str]:
    """Import and signature problems of the config's reward functions (the objective's own code is checked by its
    class, the task by preflight's data rules, a reward model's directory by `rl_core.rewards.model`)."""
    problems = []
    for i, entry in enumerate(cfg.data.rewards):
        if entry.path is None:  # a reward model: its path is checked with the machine (rl_core.preflight)
            continue
        try:
            load_callable(entry.path, f"data.rewards[{i}].path", REWARD_PARAMS, by_keyword=True)
        except ImportPathError as exc:
            problems.append(str(exc))
    return problems
