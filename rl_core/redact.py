"""The one redactor: keeps credentials out of everything posttrain prints, logs, raises or uploads.

Pure text and dict handling (no Prefect, Ray, MLflow or boto3 imports), used by the config loader,
checkpoint storage (`infra.checkpoints.store`), MLflow tracking (`infra.tracking.tracker`) and the flows.

  * `redact_uri(text)`: the userinfo of every `scheme://user[:password]@host` in free text becomes
    `***` (`s3://***@bucket/p`, `https://***@host`). A password may hold unencoded `/`, `#`, `?`, `@`
    and `:` (AWS secret keys hold `/`); a bare token (`https://TOKEN@host`) counts as userinfo too.
  * `is_secret_name(name)`: whether a key / env-var / query-parameter name looks like it holds a
    credential (rule below).
  * `redact_text(text)`: `redact_uri`, plus the values of secret-named URI query parameters
    (`?token=...`, `X-Amz-Signature=...`).
  * `redact_environment_values(text)`: the values (8+ characters) of secret-named environment
    variables, wherever they appear (an AWS secret quoted back in a botocore error).
  * `redact_tokens(text)`: credentials recognised by their shape wherever they stand (`sk-...` API keys, AWS
    access key ids, GitHub / Hugging Face / Slack / GitLab / Google tokens, `Bearer ...` and `Basic ...`
    authorization values) and the values of secret-named assignments (`api_key=...`, `"token": "..."`).
  * `redact_message(text)`: all three, for error messages and log lines (what user code raised included:
    `rl_core.user_code.user_error`).
  * `RedactingFilter`: a `logging.Filter` that passes every record through `redact_message` (message,
    arguments, traceback), for the handlers whose output leaves the process (flows/logs.py).
  * `redact(mapping)`: a copy of a (nested) dict safe to log: values of secret-named keys become
    `***`, every other string is scrubbed by `redact_text`.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

REDACTED = "***"

# ------------------------------------------------------------------------------------ URI userinfo
#
# A URI starts at `scheme://` (RFC 3986 scheme, not glued to a preceding scheme character) and runs
# to the first whitespace, quote, `<`, `>` or backquote, or to the next `scheme://`. Within it:
#   * the text up to its LAST "@" is userinfo when it holds no "/" at all, or when the part before
#     its first "/", "?" or "#" holds a ":" (user:password, the password possibly holding "/", "#",
#     "?", "@", ":");
#   * otherwise an "@" inside the authority proper (before the first "/", "?", "#") ends the
#     userinfo (RFC 3986: `https://TOKEN@host/path@ref`).
# So `hf://datasets/org/name@main` and `git+https://github.com/o/r@v1` (an "@" in the path) are kept.
# Over-redacting is the safe direction: `https://host:8080/a@b` becomes `https://***@b`.

_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
_URI_END = re.compile(r"[\s'\"<>`]")
_AUTHORITY_END = re.compile(r"[/?#]")


def _userinfo_end(rest: str) -> int:
    """Length of the userinfo at the start of `rest` (the text after `scheme://`); 0 when there is none."""
    last_at = rest.rfind("@")
    if last_at <= 0:
        return 0
    candidate = rest[:last_at]
    head = _AUTHORITY_END.split(candidate, 1)[0]
    if "/" not in candidate or ":" in head:
        return last_at
    authority = _AUTHORITY_END.split(rest, 1)[0]
    return max(authority.rfind("@"), 0)


def redact_uri(text: str) -> str:
    """`text` with the userinfo of every URI in it replaced by `***` (rule above); the rest unchanged."""
    text = str(text)
    if "://" not in text:
        return text
    schemes = list(_SCHEME.finditer(text))
    out: list[str] = []
    pos = 0
    for i, match in enumerate(schemes):
        start = match.end()
        if start <= pos:  # inside userinfo already redacted
            continue
        limit = schemes[i + 1].start() if i + 1 < len(schemes) else len(text)
        end = _URI_END.search(text, start, limit)
        rest = text[start:end.start() if end else limit]
        n = _userinfo_end(rest)
        if n:
            out.append(text[pos:start])
            out.append(REDACTED)
            pos = start + n
    out.append(text[pos:])
    return "".join(out)


def has_userinfo(uri: str) -> bool:
    """True when `uri` carries `user[:password]@`: what `redact_uri` removes, or an "@" in the authority
    as `urllib.parse` reads it (e.g. a password with an unencoded space)."""
    uri = str(uri)
    if redact_uri(uri) != uri:
        return True
    try:
        return "@" in urlsplit(uri).netloc
    except ValueError:
        return False


# ------------------------------------------------------------------------------------ secret names
#
# The rule (applied to config keys, metric/record keys, env-style names and URI query parameters):
# a name is split into components on "." and "/", each component into lower-case words on "_", "-",
# spaces and camelCase boundaries. The name is secret when any component
#   * contains, with separators removed, one of SECRET_SUBSTRINGS (secret, password, passwd,
#     passphrase, credential, apikey, accesskey, privatekey, authtoken, ...); or
#   * has a word in SECRET_WORDS (key, keys, auth, private, pwd, creds, signature, sig, bearer, ...);
#   * or has the word "token" (singular) and no COUNTING_WORDS word (max, min, num, per, count, id,
#     eos, pad, ...) in the same component.
# Plural "tokens" names a count (max_tokens, shared_prefix_min_tokens, tokens_per_s) and is kept;
# `api_token`, `hf_token`, `auth_token`, `HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`, `password` are secret.

SECRET_SUBSTRINGS = ("secret", "password", "passwd", "passphrase", "credential", "apikey", "accesskey",
                     "privatekey", "authtoken", "accesstoken", "sessiontoken", "securitytoken")
SECRET_WORDS = frozenset({"key", "keys", "auth", "private", "pwd", "creds", "signature", "sig", "bearer",
                          "cookie", "authorization", "authentication"})
COUNTING_WORDS = frozenset({"max", "min", "num", "n", "per", "count", "counts", "id", "ids", "len", "length",
                            "limit", "budget", "level", "type", "eos", "bos", "pad", "unk", "sep", "cls",
                            "mask", "special"})
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
_QUERY_PARAM = re.compile(r"(?P<head>[?&;](?P<name>[^=&#;\s]+)=)(?P<value>[^&#;\s]*)")
# environment values shorter than this are not scrubbed from text (too likely to occur by chance)
MIN_ENV_SECRET_CHARS = 8


def _component_is_secret(component: str) -> bool:
    squashed = re.sub(r"[^a-z0-9]", "", component.lower())
    if any(s in squashed for s in SECRET_SUBSTRINGS):
        return True
    words = {w.lower() for w in _WORD.findall(component)}
    if words & SECRET_WORDS:
        return True
    return "token" in words and not (words & COUNTING_WORDS)


def is_secret_name(name: str) -> bool:
    """True when a key/env-var/parameter name looks like it holds a credential (rule above)."""
    return any(_component_is_secret(part) for part in re.split(r"[./]", str(name)) if part)


# ------------------------------------------------------------------------------------- free text

def redact_text(text: str) -> str:
    """Scrub credentials embedded in URIs from free text (config values, error messages): the userinfo
    and the values of secret-named query parameters."""
    text = redact_uri(text)
    return _QUERY_PARAM.sub(
        lambda m: m.group("head") + (REDACTED if is_secret_name(m.group("name")) else m.group("value")), text)


def redact_environment_values(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with the value of every secret-named environment variable (`AWS_SECRET_ACCESS_KEY`,
    `HF_TOKEN`, ...) of at least MIN_ENV_SECRET_CHARS characters replaced by `***`."""
    text = str(text)
    env = os.environ if environ is None else environ
    values = sorted({v for k, v in env.items() if v and len(v) >= MIN_ENV_SECRET_CHARS and is_secret_name(k)},
                    key=len, reverse=True)  # longest first: a value that contains another is removed whole
    for value in values:
        text = text.replace(value, REDACTED)
    return text


# Credentials by their shape: long enough that ordinary text does not match by chance.
_TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"sk-[A-Za-z0-9_\-]{16,}"  # OpenAI / Anthropic-style API keys (sk-..., sk-proj-..., sk-ant-...)
    r"|(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}"  # AWS access key ids
    r"|(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"  # Slack
    r"|glpat-[A-Za-z0-9_\-]{20,}"  # GitLab
    r"|AIza[A-Za-z0-9_\-]{35}"  # Google API keys
    r")")
_AUTH_SCHEME = re.compile(r"(?i)\b(?P<scheme>bearer|basic)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/=\-]{8,})")
# `name=value`, `name: value` after a quoted name (`{'api_key': 'x'}`, JSON) — when `name` is secret-named
_ASSIGNMENT = re.compile(
    r"""(?P<head>(?P<q>['"]?)(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P=q)"""
    r"""(?:\s*=\s*|(?<=['"])\s*:\s*)(?P<open>['"]?))(?P<value>[^\s'",;&)}\]]+)""")


def redact_tokens(text: str) -> str:
    """`text` with credentials recognised by their shape replaced by `***` (API keys, access key ids, tokens,
    `Bearer`/`Basic` authorization values) and the value of every secret-named assignment (`api_key=...`,
    `'token': '...'`)."""
    def assignment(m: re.Match) -> str:
        value = m.group("value")
        keep = not is_secret_name(m.group("name")) or value.lower() in ("bearer", "basic")  # its token: below
        return m.group("head") + (value if keep else REDACTED)

    text = _ASSIGNMENT.sub(assignment, _TOKEN_SHAPES.sub(REDACTED, str(text)))
    return _AUTH_SCHEME.sub(lambda m: m.group("scheme") + m.group("sep") + REDACTED, text)


def redact_message(text: str) -> str:
    """An error message or log line made safe: `redact_text`, `redact_tokens` and `redact_environment_values`."""
    return redact_environment_values(redact_tokens(redact_text(text)))


class RedactingFilter(logging.Filter):
    """Passes every record, its message (arguments merged), traceback and stack made safe by `redact_message`.
    Installed on a handler it scrubs what that handler writes or sends, whichever logger the record came from."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format: keep its parts
            message = f"{record.msg} {record.args}"
        record.msg, record.args = redact_message(message), ()
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = redact_message("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
            record.exc_info = None  # formatters then write exc_text, the redacted traceback
        elif record.exc_text:
            record.exc_text = redact_message(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_message(record.stack_info)
        return True


# ----------------------------------------------------------------------------------------- dicts

def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return redact(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(v) for v in value)
    return value


def redact(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `mapping` (same key order) safe to log: values of secret-looking keys become "***"
    (whole sub-trees for a secret section name), every other string value is scrubbed of URI
    credentials; nested mappings and lists are handled recursively."""
    return {k: (REDACTED if is_secret_name(str(k)) else _redact_value(v)) for k, v in mapping.items()}


def redact_override(item: str) -> str:
    """A `key=value` dotlist override safe to log: the value hidden when the key is secret, else scrubbed."""
    key, sep, value = str(item).partition("=")
    if not sep:
        return redact_text(key)
    return f"{key}={REDACTED if is_secret_name(key) else redact_text(value)}"
