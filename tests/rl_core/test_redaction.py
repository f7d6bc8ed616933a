"""Credentials inside URIs: one redactor (`rl_core.redact`), refused in config URI fields, never in output.

Covers the rule on the tricky cases, the config refusal (its message names the key and where credentials
go, without echoing them), and storage messages built by the real code paths with a credentialed URI or
endpoint.
"""

from __future__ import annotations

import logging
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch
import yaml

from infra.checkpoints.store import CheckpointStore, CheckpointUploadError
from rl_core.config import ConfigError, S3Config, load_config
from rl_core.config.loader import config_from_dict
from rl_core.redact import has_userinfo, redact, redact_environment_values, redact_message, redact_uri

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "recipes" / "arithmetic.py"
SECRET = "se/cr#et?x"  # "/", "#", "?": each broke one of the two redactors this module replaced


# -------------------------------------------------------------------------------------- redact_uri

@pytest.mark.parametrize("text, expected", [
    ("s3://AK:se/cr#et?x@bucket/p", "s3://***@bucket/p"),  # "/", "#", "?" in the password
    ("https://TOKEN@host/x", "https://***@host/x"),  # a bare token is userinfo too
    ("https://u:p@h:5000", "https://***@h:5000"),
    ("s3://AK:p@ss:w/d@bucket/p", "s3://***@bucket/p"),  # "@" and ":" in the password
    ("http://u:pw@127.0.0.1:5000/api/2.0", "http://***@127.0.0.1:5000/api/2.0"),
    ("upload to s3://AK:a/b@bkt/run failed; tracking at https://tok@mlflow.example/x (retrying)",
     "upload to s3://***@bkt/run failed; tracking at https://***@mlflow.example/x (retrying)"),  # two URIs
    ("s3://a:b/c@x/p,https://t@y/q", "s3://***@x/p,https://***@y/q"),  # two URIs, no space between
    ('Could not connect to the endpoint URL: "http://u:s3cr/t@127.0.0.1:9/b/k"',
     'Could not connect to the endpoint URL: "http://***@127.0.0.1:9/b/k"'),
    ("remote_uri='s3://AK:x/y@b/p': bad", "remote_uri='s3://***@b/p': bad"),
    ("https://TOKEN@host/path@ref", "https://***@host/path@ref"),
])
def test_redact_uri_removes_userinfo(text, expected):
    assert redact_uri(text) == expected
    assert has_userinfo(text)


@pytest.mark.parametrize("text", [
    "s3://bucket/prefix",
    "https://host:8080/path s3://bucket/prefix",
    "http://127.0.0.1:5000",
    "sqlite:////tmp/runs@2/mlflow.db",
    "hf://datasets/org/name@main",  # an "@" in the path is a revision, not userinfo
    "git+https://github.com/org/repo@v1.2",
    "https://host/x?email=a@b.com",
    "no uri here: user:pass@host",
    "",
])
def test_redact_uri_leaves_uris_without_credentials_unchanged(text):
    assert redact_uri(text) == text
    assert not has_userinfo(text)


def test_key_names_and_environment_values_are_redacted_too():
    assert redact({"hf_token": "x", "rollout.max_tokens": 4, "uri": "s3://AK:s/k@b/p"}) == \
        {"hf_token": "***", "rollout.max_tokens": 4, "uri": "s3://***@b/p"}
    env = {"AWS_SECRET_ACCESS_KEY": "abc/DEF+ghi123", "HOME": "/home/someone-long", "HF_TOKEN": "short"}
    assert redact_environment_values("key abc/DEF+ghi123 in /home/someone-long", env) == \
        "key *** in /home/someone-long"


# ------------------------------------------------------------------------- refused in the config

@pytest.mark.parametrize("key, uri, where", [
    ("tracking.checkpoint_uri", f"s3://AKIAEXAMPLE:{SECRET}@bucket/run", "AWS_SECRET_ACCESS_KEY"),
    ("tracking.checkpoint_uri", "s3://TOKEN0123456789@bucket/run", "AWS_PROFILE"),
    ("tracking.mlflow_uri", f"https://user:{SECRET}@mlflow.example:5000", "MLFLOW_TRACKING_PASSWORD"),
    ("tracking.mlflow_uri", "https://TOKEN0123456789@mlflow.example", "MLFLOW_TRACKING_USERNAME"),
])
def test_credentials_in_uri_fields_are_refused_without_echoing_them(key, uri, where, tmp_path):
    secret = SECRET if SECRET in uri else "TOKEN0123456789"
    with pytest.raises(ConfigError) as info:  # a dotlist override
        load_config(ARITH, [f"{key}={uri}"])
    (problem,) = info.value.problems
    assert problem.startswith(f"{key}=") and "credentials in the URI are refused" in problem
    assert where in problem
    assert secret not in str(info.value)

    section, field = key.split(".")
    with pytest.raises(ConfigError) as info:  # a resolved YAML file (e.g. an old run's config_resolved.yaml)
        path = tmp_path / "config_resolved.yaml"
        path.write_text(yaml.safe_dump({section: {field: uri}}))
        load_config(path)
    assert secret not in str(info.value) and key in str(info.value)

    with pytest.raises(ConfigError) as info:  # a config handed over as data (Ray workers)
        config_from_dict({section: {field: uri}})
    assert secret not in str(info.value)

    cfg = load_config(ARITH)
    with pytest.raises(ValueError) as info:  # a recipe assigning it: pydantic's own message
        setattr(cfg.tracking, field, uri)
    assert secret not in str(info.value) and "credentials in the URI are refused" in str(info.value)


def test_uris_without_credentials_still_load():
    cfg = load_config(ARITH, ["tracking.checkpoint_uri=s3://bucket/run", "tracking.mlflow_uri=http://127.0.0.1:5000"])
    assert cfg.tracking.checkpoint_uri == "s3://bucket/run"


@pytest.mark.e2e
def test_cli_validate_refuses_a_credentialed_uri_without_printing_it():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "cli.main", "validate", "recipes/arithmetic.py", "--",
                          f"tracking.checkpoint_uri=s3://AKIAEXAMPLE:{SECRET}@bucket/run"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 1
    assert "tracking.checkpoint_uri='s3://***@bucket/run'" in out.stderr
    assert SECRET not in out.stdout + out.stderr and "AKIAEXAMPLE" not in out.stdout + out.stderr


# ---------------------------------------------------------------------------------------- storage

def test_checkpoint_store_refuses_a_credentialed_remote_uri(tmp_path):
    with pytest.raises(ValueError) as info:
        CheckpointStore(tmp_path, remote_uri=f"s3://AKIAEXAMPLE:{SECRET}@bucket/run")
    assert "s3://***@bucket/run" in str(info.value) and "AWS_ACCESS_KEY_ID" in str(info.value)
    assert SECRET not in str(info.value)


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """Dummy credentials only, no profile or config file."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-access-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-key-0123")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.mark.parametrize("endpoint_secret", ["pa55w0rd-0123", "TOKEN-4567-abcd"])
def test_storage_error_with_a_credentialed_endpoint_hides_the_secret(no_aws, tmp_path, caplog, endpoint_secret):
    """botocore quotes the endpoint URL, userinfo included, in its connection error: through the real
    upload path (CheckpointStore against a closed loopback port) neither the error nor a log line holds it."""
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    userinfo = f"user:{endpoint_secret}" if endpoint_secret.startswith("pa") else endpoint_secret
    store = CheckpointStore(tmp_path / "ckpt", remote_uri="s3://bucket/run",
                            endpoint_url=f"http://{userinfo}@127.0.0.1:{port}", s3_config=S3Config(max_attempts=2))
    with caplog.at_level(logging.DEBUG, logger="posttrain.storage"), pytest.raises(CheckpointUploadError) as info:
        store.save(1, {"s": {"w": torch.zeros(2)}}, {})
    err = info.value
    assert f"http://***@127.0.0.1:{port}" in str(err)  # still says where it failed
    assert "no answer from the endpoint within tracking.s3.max_attempts=2 tries" in str(err)
    text = str(err) + "".join(traceback.format_exception(err)) + caplog.text
    assert endpoint_secret not in text
    tries = [r.getMessage() for r in caplog.records if " of 2 failed (" in r.getMessage()]  # botocore's tries, logged
    assert len(tries) == 2 and all("127.0.0.1" in m for m in tries)


def test_redact_message_scrubs_uris_and_secret_environment_values(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    text = 'SignatureDoesNotMatch for key wJalrXUtnFEMI/K7MDENG at "https://t0ken@s3.example/b"'
    assert redact_message(text) == 'SignatureDoesNotMatch for key *** at "https://***@s3.example/b"'


# ------------------------------------------------------------------------------ $MLFLOW_TRACKING_URI

class PrintingClient:
    """Prints what MlflowClient.set_terminated prints for a server run (its tracking URI, credentials and all)."""

    def __init__(self, uri: str):
        self.uri = uri

    def set_terminated(self, run_id, status):
        print(f"🏃 View run nightly at: {self.uri}/#/experiments/1/runs/{run_id}")


def test_terminating_a_run_prints_the_tracking_uri_scrubbed(capsys):
    """What MLflow prints on set_terminated (RunTracker.finish and the regression flow, whose prints are logged)
    names the server without the token of a credentialed $MLFLOW_TRACKING_URI."""
    from infra.tracking.tracker import set_terminated

    set_terminated(PrintingClient("https://TOKEN0123456789@mlflow.example"), "abc", "FINISHED")
    out = capsys.readouterr().out
    assert "View run nightly at: https://***@mlflow.example/#/experiments/1/runs/abc" in out
    assert "TOKEN0123456789" not in out


URI_KEYS = ("data.train", "data.val", "model.name_or_path", "model.teacher", "rl.reference", "cluster.address")


@pytest.mark.e2e
def test_cli_validate_and_run_params_print_no_credential_of_any_uri_like_key(tmp_path):
    """`posttrain validate` printed `data.train=https://user:pass@...` and `model.name_or_path=https://user:token@...`
    as given; `posttrain run-params` printed a credentialed URI before refusing it."""
    import subprocess

    overrides = [f"{key}=https://user{i}:{SECRET}{i}@host{i}.example/x" for i, key in enumerate(URI_KEYS)]
    out = subprocess.run([sys.executable, "-m", "cli.main", "validate", "recipes/arithmetic.py", "--", *overrides],
                         capture_output=True, text=True, cwd=ROOT, check=False, env={**__import__("os").environ,
                                                                                      "HF_HUB_OFFLINE": "1"})
    text = out.stdout + out.stderr
    assert "https://***@host0.example/x" in text, text[-2000:]
    assert SECRET not in text and not any(f"user{i}" in text for i in range(len(URI_KEYS))), text[-3000:]
    params = tmp_path / "params.yaml"
    train: dict = {"tracking": {"checkpoint_uri": f"s3://AKIAEXAMPLE:{SECRET}@bucket/run"}}
    for item in overrides:  # params.yaml's train: section holds the same values, nested
        key, value = item.split("=", 1)
        section, leaf = key.rsplit(".", 1)
        node = train
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[leaf] = value
    params.write_text(yaml.safe_dump({"train": train}))
    out = subprocess.run([sys.executable, "-m", "cli.main", "run-params", "recipes/arithmetic.py", "--params",
                          str(params)], capture_output=True, text=True, cwd=ROOT, check=False, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "s3://***@bucket/run" in text, text[-2000:]
    assert SECRET not in text and "AKIAEXAMPLE" not in text and "user0" not in text, text[-3000:]


def test_every_config_error_is_redacted_whoever_builds_it():
    """Preflight and environment problems quote values back (a model or data URI): a ConfigError scrubs them all,
    so the CLI, the flow's logs and the Prefect API's state message never carry the credential."""
    error = ConfigError([f"model.name_or_path='https://user:{SECRET}@hub.example/m': not found",
                         "data.train='s3://AKIAEXAMPLE:x/y@bucket/train.jsonl?X-Amz-Signature=abcdef0123': no such file"])
    assert SECRET not in str(error) and "AKIAEXAMPLE" not in str(error) and "abcdef0123" not in str(error)
    assert "https://***@hub.example/m" in error.problems[0] and "s3://***@bucket/train.jsonl" in error.problems[1]


# ------------------------------------------------------------------- what user code raises, and the run's logs

# what a user's reward, task, environment, tool or objective might quote back from an API it calls
LEAKED = {"openai": "sk-proj-" + "Zq8vW2mN4xR7tY1uI3oP5aS9", "aws": "AKIA" + "Q3EXAMPLEW7KZ2VB", "bearer": "eyJhbGci" + ".leak3d-t0ken",
          "assignment": "hunter" + "2-the-password"}
LEAKY = (f"upstream refused {LEAKED['openai']} (access key {LEAKED['aws']}); request headers "
         f"{{'Authorization': 'Bearer {LEAKED['bearer']}', 'api_password': '{LEAKED['assignment']}'}}")


def everything_said(exc: BaseException) -> str:
    """The message, the printed traceback and every chained cause or context of `exc`: all a log, a Prefect state
    message or an artifact could quote."""
    out, seen = [], 0
    while exc is not None and seen < 20:
        out += [str(exc), repr(exc.args), "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return "\n".join(out)


def assert_no_leak(text: str) -> None:
    for name, secret in LEAKED.items():
        assert secret not in text, (name, text)


def leaky(*_, **__):
    raise ValueError(LEAKY)


class LeakyEnvironment:
    def __init__(self, example):
        raise ConnectionError(LEAKY)


def test_redact_message_removes_keys_by_their_shape_and_secret_named_assignments():
    assert redact_message(LEAKY) == ("upstream refused *** (access key ***); request headers "
                                     "{'Authorization': 'Bearer ***', 'api_password': '***'}")
    kept = "KeyError: 'answer' at max_tokens=5, token_id=3 (sk-short)"  # not credentials: kept as they are
    assert redact_message(kept) == kept


def test_what_user_code_raises_is_redacted_at_one_point_and_chains_nothing(tmp_path, monkeypatch):
    """A reward, a task's load, an environment, a tool, a custom objective's builder and loss, and a module that
    fails at import, each raising with an API key, an AWS key id, a bearer token and a password in its message: the
    error each raises names the user code and what it raised, and neither it, its traceback nor any chained
    exception holds a credential."""
    from rl_core.agents.host import LocalEnvironments
    from rl_core.agents.tools import ToolCall, run_tool_call
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.registry import build_objective
    from rl_core.rewards import RewardError, RewardFunction, RewardInputs, call_reward, score
    from rl_core.tasks import Example, Task, load_examples
    from rl_core.user_code import ImportPathError, UserCodeError, load_object

    inputs = RewardInputs(["1+1="], ["2"], {"answer": ["2"]}, ["train.jsonl:1"])
    for call in (lambda: call_reward(RewardFunction("leaky", leaky, 1.0, "data.rewards[0]"), inputs),
                 lambda: score([RewardFunction("leaky", leaky, 1.0, "data.rewards[0]")], inputs)):
        with pytest.raises(RewardError) as raised:
            call()
        assert str(raised.value).startswith("reward 'leaky' (data.rewards[0]) raised ValueError: upstream refused ***")
        assert raised.value.__cause__ is None and raised.value.__context__ is None
        assert_no_leak(everything_said(raised.value))

    class LeakyTask(Task):
        name = "leaky-task"

        def load(self, source, data):
            leaky()

    with pytest.raises(UserCodeError, match=r"data.task 'leaky-task': load raised ValueError: upstream") as raised:
        load_examples(tmp_path / "x.jsonl", LeakyTask())
    assert_no_leak(everything_said(raised.value))

    opening = LocalEnvironments().open(LeakyEnvironment, [("k", Example("1+1=", "2"))])[0]
    assert opening.error.startswith("LeakyEnvironment raised ConnectionError: upstream refused ***")
    assert_no_leak(opening.error)
    result = run_tool_call({"lookup": leaky}, ToolCall("lookup", {}))  # the model reads it; so may a completions table
    assert result.error and "lookup raised ValueError" in result.content
    assert_no_leak(result.content)

    monkeypatch.setattr(sys.modules[__name__], "leaky_builder", lambda rl, context: leaky(), raising=False)
    cfg = load_config(ARITH, ["rl.objective={type: custom, import_path: 'tests.rl_core.test_redaction:leaky_builder'}"])
    with pytest.raises(UserCodeError, match=r"rl.objective.import_path=.*: the builder raised ValueError") as raised:
        build_objective(cfg, ObjectiveContext.from_config(cfg))
    assert_no_leak(everything_said(raised.value))
    from rl_core.algorithms.custom import UserFunction

    with pytest.raises(UserCodeError, match="the objective's fn raised ValueError") as raised:
        UserFunction(leaky, "rl.objective.import_path='m:b': the objective's fn")(torch.nn.Linear(1, 1), None)
    assert_no_leak(everything_said(raised.value))

    (tmp_path / "leaky_module.py").write_text(f"raise RuntimeError({LEAKY!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportPathError, match="cannot import module 'leaky_module'") as raised:
        load_object("leaky_module:fn", "data.rewards[0].path")
    assert_no_leak(everything_said(raised.value))


def test_the_run_log_handlers_scrub_every_record_they_write():
    """Prefect's API handler (the run's log rows in its database) and the console handler (stderr) carry the
    redacting filter once a flow has called `redact_run_logs`: a record whose arguments and traceback quote a key
    is written without it."""
    import prefect.logging.handlers as prefect_handlers

    from flows.logs import redact_run_logs
    from rl_core.redact import RedactingFilter

    handlers = redact_run_logs()
    assert redact_run_logs() == handlers  # once each
    api = [h for h in handlers if isinstance(h, prefect_handlers.APILogHandler)]
    console = [h for h in handlers if h in logging.getLogger().handlers]
    assert api and console
    assert all(sum(isinstance(f, RedactingFilter) for f in h.filters) == 1 for h in handlers)
    try:
        leaky()
    except ValueError:
        exc_info = sys.exc_info()
    for handler in api + console:
        record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "reward phase failed: %s",
                                   (LEAKY,), exc_info)
        record.task_run_name, record.flow_run_name = "reward step 1", "leaky-run"  # what a run logger adds
        assert handler.filter(record)
        written = handler.format(record)
        assert "reward phase failed: upstream refused ***" in written and "Traceback" in written
        assert_no_leak(written)
