"""Deployments (prefect.yaml) on a real Prefect server and worker, and an MLflow server, on loopback.

The services are started and stopped by `infra.services.supervisor` with a temporary state directory; the
deployments are created by `posttrain deploy` (`prefect deploy --all`) and run with
`prefect deployment run ... --param overrides=...`. The worker runs flows in the project directory
(the deployments' pull step), so the quickstart run points model, data and outputs at absolute paths
of the test's work directory. Also here: the machine preflight (rl_core/preflight/machine.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from infra.services.prefect_api import http_ok
from infra.services.supervisor import WORK_POOL, Services, venv_bin
from rl_core.config import ConfigError, load_config
from rl_core.preflight.machine import machine_problems, visible_gpus
from rl_core.preflight.rules import check
from tests.conftest import FAST, LEAN, REPO, recipe
from tests.servers import UNUSED_PREFECT_SERVICES

DEPLOYMENTS = {"grpo/gspo-gsm8k", "grpo/grpo-gsm8k", "grpo/dr-grpo-gsm8k", "grpo/arithmetic",
               "grpo/tool-arithmetic", "grpo/tool-arithmetic-agent", "grpo/tool-arithmetic-sdk-agent", "grpo/guess-number", "grpo/code-arithmetic", "grpo/ppo-arithmetic", "grpo/rlhf-arithmetic", "grpo/judge-arithmetic", "dpo/rm-arithmetic", "opd/opd-arithmetic", "opd/opd-gsm8k", "dpo/dpo-arithmetic", "dpo/dpo-gsm8k",
               "regression/nightly-regression"}
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
OPTED_IN = ("grpo/arithmetic", "dpo/dpo-arithmetic", "opd/opd-arithmetic")  # see `deployed`


# ------------------------------------------------------------------------------ prefect.yaml


def test_prefect_yaml_declares_the_deployments():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert not spec.get("build") and not spec.get("push")
    assert spec["pull"] == [{"infra.services.deploy_steps.enter_project": {"directory": "{{ $POSTTRAIN_PROJECT_DIR }}"}}]
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert set(by_name) == {d.split("/")[1] for d in DEPLOYMENTS}
    for name, file in (("gspo-gsm8k", "gspo_gsm8k"), ("grpo-gsm8k", "grpo_gsm8k"), ("dr-grpo-gsm8k", "dr_grpo_gsm8k"),
                       ("arithmetic", "arithmetic"), ("tool-arithmetic", "tool_arithmetic"),
                       ("tool-arithmetic-agent", "tool_arithmetic_agent"),
                       ("tool-arithmetic-sdk-agent", "tool_arithmetic_sdk_agent"), ("guess-number", "guess_number"),
                       ("code-arithmetic", "code_arithmetic")):
        d = by_name[name]
        assert d["entrypoint"] == "flows/grpo.py:grpo"
        assert d["parameters"] == {"recipe": f"recipes/{file}.py", "overrides": []}
        assert (REPO / d["parameters"]["recipe"]).is_file()
    for algo in ("opd", "dpo"):
        for task in ("arithmetic", "gsm8k"):
            d = by_name[f"{algo}-{task}"]
            assert d["entrypoint"] == f"flows/{algo}.py:{algo}"
            assert d["parameters"] == {"recipe": f"recipes/{algo}_{task}.py", "overrides": []}
            assert (REPO / d["parameters"]["recipe"]).is_file()
    nightly = by_name["nightly-regression"]
    assert nightly["entrypoint"] == "flows/regression.py:regression"
    assert nightly["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}]
    for d in spec["deployments"]:
        assert d["work_pool"]["name"] == WORK_POOL
        assert not d["work_pool"].get("job_variables")  # the pool's template refuses them (infra.services.supervisor)


def test_deployments_run_one_at_a_time_and_the_gpu_pool_example_deploys():
    """prefect.yaml as `prefect deploy` reads it (its own model of the file): one run of a training deployment at a
    time, the next one queued (the run directory's lock would fail it: both have the recipe's job.name); the
    nightly run skipped while the last one still runs. The GPU pool's example deployment, uncommented, is valid
    too, and its job variable is accepted by the GPU pool's template and refused by the process pool's."""
    import jsonschema
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy
    from prefect.utilities.templating import apply_values

    from infra.services.prefect_api import process_pool_template
    from infra.services.work_pools import GPU_POOL, gpu_pool_template

    def read(text: str):
        spec = yaml.safe_load(text)  # the schedule is checked above (reading one imports croniter, which runs `file`)
        spec["deployments"] = [{k: v for k, v in d.items() if k != "schedules"} for d in spec["deployments"]]
        return PrefectYamlModel.model_validate(spec)

    text = (REPO / "prefect.yaml").read_text()
    model = read(text)
    for d in model.deployments:
        strategy = "CANCEL_NEW" if d.name == "nightly-regression" else "ENQUEUE"
        assert (d.concurrency_limit.limit, d.concurrency_limit.collision_strategy) == (1, strategy), d.name
        ConcurrencyLimitStrategy(d.concurrency_limit.collision_strategy)  # a strategy the API knows
    example = text.split("# - name: grpo-gsm8k-gpu", 1)[1]
    uncommented = text.split("  # - name: grpo-gsm8k-gpu", 1)[0] + "  - name: grpo-gsm8k-gpu" + "\n".join(
        line.replace("  # ", "  ", 1) for line in example.splitlines())
    gpu = read(uncommented).deployments[-1]
    assert gpu.name == "grpo-gsm8k-gpu" and gpu.work_pool.name == GPU_POOL
    assert gpu.entrypoint == "flows/grpo.py:grpo" and (REPO / gpu.parameters["recipe"]).is_file()
    assert gpu.concurrency_limit.limit == 1
    variables = gpu.work_pool.job_variables
    assert variables == {"cuda_visible_devices": "0,1,2,3"}
    template = gpu_pool_template()
    jsonschema.validate(variables, template["variables"])
    job = apply_values(template["job_configuration"], variables)
    assert job["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"} and "command" not in job
    assert apply_values(template["job_configuration"], {})["env"] == {}  # unset: the machine's GPUs
    for refused in ({"cuda_visible_devices": "0; touch /tmp/x"}, {"env": {"LD_PRELOAD": "/tmp/x.so"}},
                    {"command": "touch /tmp/x"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(refused, template["variables"])
    with pytest.raises(jsonschema.ValidationError):  # the process pool has no such variable: a pool of its own
        jsonschema.validate(variables, process_pool_template()["variables"])


# ------------------------------------------------------------------------- machine preflight


@pytest.mark.skipif(visible_gpus() > 0, reason="this machine has a GPU")
def test_gpu_recipe_without_gpu_fails_preflight_naming_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(recipe("gspo_gsm8k"), [])
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert time.monotonic() - started < 30
    problems = info.value.problems
    from rl_core.preflight.machine import vllm_build

    gpu = [p for p in problems if "no GPU on this machine" in p]
    assert gpu and "cluster.gpus_per_worker=1" in gpu[0]
    # vLLM's CPU build (installed by `make test`) runs without a GPU; the GPU build does not
    assert ("rollout.backend=vllm" in gpu[0]) == (vllm_build() != "cpu")
    assert "cluster.gpus_per_worker=0 rollout.backend=hf model.name_or_path=artifacts/tiny-model/warm" in gpu[0]
    assert "recipes/gspo_gsm8k_cpu.py" in gpu[0]
    if not any("model.name_or_path" in p for p in problems):
        pytest.skip("Qwen/Qwen2.5-3B-Instruct is in this machine's Hugging Face cache")
    model = [p for p in problems if p.startswith("model.name_or_path=")]
    assert model and "Qwen/Qwen2.5-3B-Instruct" in model[0] and "offline" in model[0]


def test_environment_is_probed_only_after_the_config_is_clean():
    cfg = load_config(recipe("gspo_gsm8k"), ["model.teacher=artifacts/teacher", "cluster.teacher_replicas=2"])
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert len(info.value.problems) == 2 and not any("GPU" in p for p in info.value.problems)


def test_quickstart_and_local_models_pass_and_a_missing_directory_is_named(in_workdir):
    assert machine_problems(load_config(recipe("arithmetic"), [])) == []  # warm model: built on demand
    assert machine_problems(load_config(recipe("arithmetic"), FAST)) == []
    cfg = load_config(recipe("arithmetic"), ["model.name_or_path=./no/such/model"])
    (problem,) = machine_problems(cfg)
    assert problem.startswith("model.name_or_path='./no/such/model': no such local directory")


def test_an_existing_ray_cluster_is_not_judged_by_this_machine(monkeypatch, in_workdir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(recipe("arithmetic"), [*FAST, "cluster.gpus_per_worker=1", "cluster.address=ray://head:10001"])
    assert machine_problems(cfg) == []


def test_too_few_gpus_and_a_missing_vllm_are_named(monkeypatch, in_workdir):
    import importlib.util

    from rl_core.preflight import machine

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(machine, "visible_gpus", lambda: 1)  # what torch.cuda.device_count() would say
    cfg = load_config(recipe("arithmetic"), [*FAST, "cluster.num_workers=4", "cluster.gpus_per_worker=1",
                                             "rollout.prompts_per_step=4", "rollout.backend=vllm"])
    problems = machine_problems(cfg)
    assert any("need 4 GPUs; this machine has 1; set cluster.num_workers=1" in p for p in problems), problems
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert any(p.startswith("rollout.backend=vllm: the vllm package is not installed") for p in problems) != has_vllm


@pytest.mark.e2e
def test_deploy_without_services_fails_clearly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cli.main", "deploy", "--state-dir", str(tmp_path / "none")],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 1
    assert "not up" in out.stderr and "posttrain services up" in out.stderr


# --------------------------------------------------------------------- server, worker, runs


def prefect(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([venv_bin("prefect"), "--no-prompt", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


_AUTH: dict[str, str] = {}  # API URL -> its `user:password`, filled by the services fixture


def api(url: str, coro_fn):
    from prefect.client.orchestration import PrefectClient

    async def go():
        async with PrefectClient(api=url, auth_string=_AUTH.get(url)) as client:
            return await coro_fn(client)

    return asyncio.run(go())


def wait_for_flow_run(url: str, flow_run_id: str, timeout: float = 420):
    deadline = time.monotonic() + timeout
    while True:
        run = api(url, lambda c: c.read_flow_run(flow_run_id))
        if run.state and run.state.type.value in TERMINAL:
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"flow run {flow_run_id} still {run.state.type.value if run.state else None} "
                                 f"after {timeout:.0f} s")
        time.sleep(2)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    svc = Services.at(tmp_path_factory.mktemp("services"))
    # no opt-in in the worker's environment: the run tests' deployments are opted in as stored (`deployed`); every
    # server loop runs, as `posttrain services` runs them (the tests' own APIs leave some off, tests/servers.py)
    with pytest.MonkeyPatch.context() as patch:
        for name in UNUSED_PREFECT_SERVICES:
            patch.delenv(name, raising=False)
        env = svc.up(prefect_port=0, mlflow_port=0, announce=lambda _: None,
                     worker_env={"PREFECT_WORKER_QUERY_SECONDS": "2", "HF_HUB_OFFLINE": "1"})
    _AUTH[env["PREFECT_API_URL"]] = env["PREFECT_API_AUTH_STRING"]
    try:
        yield svc, env
    finally:
        svc.down(announce=lambda _: None)


@pytest.fixture(scope="module")
def client_env(services) -> dict:
    svc, env = services
    out = {**os.environ, "PREFECT_API_URL": env["PREFECT_API_URL"], "PREFECT_API_AUTH_STRING": env["PREFECT_API_AUTH_STRING"],
           "PREFECT_HOME": str(svc.prefect_home)}
    out.pop("PREFECT_PROFILE", None)
    return out


@pytest.fixture(scope="module")
def deployed(services, client_env):
    svc, _ = services
    out = subprocess.run([sys.executable, "-m", "cli.main", "deploy", "--state-dir", str(svc.root)],
                         capture_output=True, text=True, cwd=REPO, env=client_env, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # The run tests point model, data and outputs at the test's directories: the operator opts these deployments
    # in on the API (the stored deployment's tags; the worker's environment has no opt-in).
    from prefect.client.schemas.actions import DeploymentUpdate

    from flows.guard import OPT_IN_TAG

    url = services[1]["PREFECT_API_URL"]
    for name in OPTED_IN:
        d = api(url, lambda c, n=name: c.read_deployment_by_name(n))
        api(url, lambda c, d=d: c.update_deployment(d.id, DeploymentUpdate(tags=[*d.tags, OPT_IN_TAG])))
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_services_are_up_with_state_files(services, client_env):
    svc, env = services
    assert all(svc.running().values())
    for name in ("prefect-server", "prefect-worker", "mlflow"):
        assert svc.pid_file(name).is_file() and svc.log_file(name).is_file()
    assert http_ok(env["PREFECT_API_URL"] + "/health") and http_ok(env["MLFLOW_TRACKING_URI"] + "/health")
    assert (svc.prefect_home / "prefect.db").is_file()  # the server's own home, not ~/.prefect
    # nothing in the state directory is readable by other users (MLflow has no authentication)
    import stat

    assert stat.S_IMODE(svc.root.stat().st_mode) == 0o700
    files = [svc.root / "mlflow.db", svc.root / "ports.json", svc.prefect_home / "prefect.db",
             *(f(n) for n in ("prefect-server", "prefect-worker", "mlflow") for f in (svc.pid_file, svc.log_file))]
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {str(p): "0o600" for p in files}
    text = svc.env_file.read_text()
    assert f"export PREFECT_API_URL={env['PREFECT_API_URL']}" in text
    assert f"export MLFLOW_TRACKING_URI={env['MLFLOW_TRACKING_URI']}" in text
    status = subprocess.run([sys.executable, "-m", "cli.main", "services", "status", "--state-dir", str(svc.root)],
                            capture_output=True, text=True, cwd=REPO, check=False)
    assert status.returncode == 0 and status.stdout.count(" running ") == 3, status.stdout
    pools = prefect(client_env, "work-pool", "inspect", WORK_POOL)
    assert pools.returncode == 0 and "type='process'" in pools.stdout, pools.stdout


@pytest.mark.e2e
@pytest.mark.slow
def test_the_api_wants_its_password_and_csrf_tokens_and_the_secret_files_are_private(services):
    """`services up` protects the Prefect API: basic auth with a generated password (0600 files only),
    CSRF tokens on writes, browser requests from the UI's own origin only."""
    import base64
    import stat
    import urllib.error
    import urllib.request

    svc, env = services
    api, auth = env["PREFECT_API_URL"], env["PREFECT_API_AUTH_STRING"]
    user, _, password = auth.partition(":")
    assert user == "posttrain" and len(password) >= 32
    for path in (svc.env_file, svc.auth_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert password in svc.env_file.read_text()

    def call(path: str, *, method: str = "GET", headers: dict | None = None) -> int:
        request = urllib.request.Request(api + path, method=method, headers=headers or {},
                                         data=b"{}" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    basic = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode(), "Content-Type": "application/json"}
    wrong = {**basic, "Authorization": "Basic " + base64.b64encode(b"posttrain:guess").decode()}
    pool = "/work_pools/posttrain-process"
    assert call(pool) == 401 and call(pool, headers=wrong) == 401
    assert call(pool, headers=basic) == 200
    # an anonymous write (what an attacker's `create flow run` is) is refused before it reaches a route
    assert call("/deployments/filter", method="POST") in (401, 403)
    # authenticated, but without the CSRF token the Prefect client fetches first: refused too; with both, served
    assert call("/flow_runs/filter", method="POST", headers=basic) == 403
    from infra.services.prefect_api import csrf_headers

    assert call("/flow_runs/filter", method="POST", headers={**basic, **csrf_headers(api, auth)}) == 200
    # a browser on another origin gets no CORS permission
    request = urllib.request.Request(api + "/health", method="OPTIONS", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            allowed = resp.headers.get("access-control-allow-origin")
    except urllib.error.HTTPError as exc:
        allowed = exc.headers.get("access-control-allow-origin")
    assert allowed not in ("*", "http://evil.example")


@pytest.mark.e2e
@pytest.mark.slow
def test_deploy_creates_every_deployment_in_the_process_pool(services, deployed):
    _, env = services

    async def read(client):
        return await client.read_deployments()

    deployments = api(env["PREFECT_API_URL"], read)
    names = set()
    for d in deployments:
        flow = api(env["PREFECT_API_URL"], lambda c, fid=d.flow_id: c.read_flow(fid))
        names.add(f"{flow.name}/{d.name}")
        assert d.work_pool_name == WORK_POOL
        assert d.pull_steps == [{"infra.services.deploy_steps.enter_project": {"directory": str(REPO)}}]
        # one run at a time (prefect.yaml's concurrency_limit, as the server keeps it)
        assert d.global_concurrency_limit.limit == 1
        assert d.concurrency_options.collision_strategy.value == (
            "CANCEL_NEW" if d.name == "nightly-regression" else "ENQUEUE")
        if d.name != "nightly-regression":  # the typed knobs reach the run form
            assert d.parameter_openapi_schema["definitions"]["RunKnobs"]["properties"]["max_steps"]["description"]
    assert names == DEPLOYMENTS


@pytest.mark.e2e
@pytest.mark.slow
def test_a_pool_with_prefects_default_template_is_named_by_deploy(services, deployed):
    """`posttrain deploy` into the pool `services up` made warns about nothing; a pool made with a plain `prefect
    work-pool create` (Prefect's default process template) and a missing pool are named, with the fix."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    from infra.services.work_pools import pool_warnings

    assert "warning" not in deployed.stderr, deployed.stderr[-2000:]
    url, auth = services[1]["PREFECT_API_URL"], services[1]["PREFECT_API_AUTH_STRING"]
    api(url, lambda c: c.create_work_pool(WorkPoolCreate(
        name="plain-pool", type="process", base_job_template=ProcessWorker.get_default_base_job_template())))
    warnings = pool_warnings(url, auth, [WORK_POOL, "plain-pool", "no-such-pool"])
    assert not [w for w in warnings if WORK_POOL in w]
    plain = [w for w in warnings if "'plain-pool'" in w]
    assert any("'command' lets a flow run or deployment set the run's command" in w for w in plain), warnings
    assert any("'env'" in w for w in plain) and all("prefect work-pool create plain-pool --overwrite" in w
                                                   for w in plain)
    assert any("'no-such-pool' does not exist" in w for w in warnings)


@pytest.mark.e2e
@pytest.mark.slow
def test_nightly_regression_schedule_produces_scheduled_runs(services, deployed):
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    url = services[1]["PREFECT_API_URL"]
    deployment = api(url, lambda c: c.read_deployment_by_name("regression/nightly-regression"))
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 3 * * *" and schedule.schedule.timezone == "UTC" and schedule.active

    async def scheduled(client):
        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly-regression"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED]))))

    deadline = time.monotonic() + 120  # the server's scheduler service runs on a loop
    while not (runs := api(url, scheduled)) and time.monotonic() < deadline:
        time.sleep(3)
    assert runs, "no scheduled runs of regression/nightly-regression"
    for run in runs:
        assert run.deployment_id == deployment.id
        start = run.expected_start_time.astimezone(__import__("datetime").UTC)
        assert (start.hour, start.minute) == (3, 0)
    # Keep tonight's 03:00 run from starting on this test worker.
    api(url, lambda c: c.pause_deployment(deployment.id))


def run_deployment(services, client_env, name: str, overrides: list[str], run_dir: Path):
    """`prefect deployment run NAME` with the overrides, waited for until it ends: (flow run, metrics records)."""
    _, env = services
    out = prefect(client_env, "deployment", "run", name, "--param", f"overrides={json.dumps(overrides)}")
    assert out.returncode == 0, out.stdout + out.stderr
    flow_run_id = UUID.search(out.stdout.split("UUID")[-1]).group(0)
    run = wait_for_flow_run(env["PREFECT_API_URL"], flow_run_id)
    assert run.state.type.value == "COMPLETED", run.state.message
    assert run.parameters["overrides"] == overrides
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run, metrics


@pytest.mark.e2e
@pytest.mark.slow
def test_arithmetic_deployment_run_completes_and_is_in_mlflow(services, deployed, client_env, workdir, tmp_path):
    from mlflow import MlflowClient

    _, env = services
    # The worker runs the flow in the project directory: model, data and outputs are absolute paths.
    overrides = [o for o in FAST if not o.startswith("model.") and o not in LEAN] + [
        f"model.name_or_path={workdir / 'artifacts' / 'tiny-model' / 'init'}",
        f"data.train={workdir / 'data' / 'arithmetic' / 'train.jsonl'}",
        f"data.val={workdir / 'data' / 'arithmetic' / 'val.jsonl'}",
        f"job.out_dir={tmp_path / 'runs'}", "job.name=deployed-arithmetic", "rl.max_steps=2",
        "tracking.experiment=posttrain-deployments"]
    run, metrics = run_deployment(services, client_env, "grpo/arithmetic", overrides,
                                  tmp_path / "runs" / "deployed-arithmetic")
    assert run.parameters["recipe"] == "recipes/arithmetic.py"
    flow_run_id = str(run.id)
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])  # the worker's MLflow: the services' server
    exp = client.get_experiment_by_name("posttrain-deployments")
    (mlflow_run,) = client.search_runs([exp.experiment_id],
                                       filter_string=f"tags.`posttrain.prefect_flow_run_id` = '{flow_run_id}'")
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "deployed-arithmetic"
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")] == [1, 2]
    # the flow run was created with a generated name and renamed job.name; its artifacts link the MLflow run
    assert api(env["PREFECT_API_URL"], lambda c: c.read_flow_run(flow_run_id)).name == "deployed-arithmetic"
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    artifacts = {a.key: a for a in api(env["PREFECT_API_URL"], lambda c: c.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))))}
    assert set(artifacts) == {"deployed-arithmetic-mlflow", "deployed-arithmetic-progress",
                              "deployed-arithmetic-summary", "deployed-arithmetic-completions"}
    assert artifacts["deployed-arithmetic-completions"].data.startswith("# Sample completions, step 2")
    run_id = mlflow_run.info.run_id
    assert artifacts["deployed-arithmetic-mlflow"].data == (
        f"[MLflow run {run_id}]({env['MLFLOW_TRACKING_URI']}/#/experiments/{exp.experiment_id}/runs/{run_id})")
    assert artifacts["deployed-arithmetic-progress"].data == 100.0


@pytest.mark.e2e
@pytest.mark.slow
def test_dpo_deployment_run_completes(services, deployed, client_env, workdir, tmp_path):
    """The DPO entry through the worker: its own flow (`dpo`), pairs and reference on CPU."""
    from rl_core.data.pair_building import make_arithmetic_pairs

    pairs = {split: make_arithmetic_pairs(workdir / "data" / "arithmetic" / f"{src}.jsonl",
                                          tmp_path / f"pairs_{split}.jsonl", seed=0, max_pairs=64)["path"]
             for split, src in (("train", "train"), ("val", "val"))}
    overrides = [f"model.name_or_path={workdir / 'artifacts' / 'tiny-model' / 'init'}",
                 f"data.train={pairs['train']}", f"data.val={pairs['val']}", "rollout.prompts_per_step=8",
                 "rl.validation.max_prompts=16", f"job.out_dir={tmp_path / 'runs'}", "job.name=deployed-dpo",
                 "rl.max_steps=2", "rl.save_every=0", "tracking.experiment=posttrain-deployments"]
    run, metrics = run_deployment(services, client_env, "dpo/dpo-arithmetic", overrides, tmp_path / "runs" / "deployed-dpo")
    assert run.parameters["recipe"] == "recipes/dpo_arithmetic.py"
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    # before any update the policy is its own reference: the held-out DPO loss is log 2
    assert metrics[0]["val/loss"] == pytest.approx(0.6931471805599453, abs=1e-5)


@pytest.mark.e2e
@pytest.mark.slow
def test_opd_deployment_run_completes(services, deployed, client_env, workdir, tmp_path):
    """The OPD entry through the worker: its own flow (`opd`), the teacher Ray actor scoring the student's samples."""
    from rl_core.training.warm_start import warm_start

    data = workdir / "data" / "arithmetic"
    warm_start(workdir / "artifacts" / "tiny-model" / "init", data / "train.jsonl", data / "val.jsonl",
               tmp_path / "teacher", steps=10, max_val_examples=8)  # differs from the student
    overrides = [f"model.name_or_path={workdir / 'artifacts' / 'tiny-model' / 'init'}", f"model.teacher={tmp_path / 'teacher'}",
                 f"data.train={data / 'train.jsonl'}", f"data.val={data / 'val.jsonl'}", "rollout.prompts_per_step=4",
                 "rollout.n=4", "rl.validation.max_prompts=16", f"job.out_dir={tmp_path / 'runs'}",
                 "job.name=deployed-opd", "rl.max_steps=2", "rl.save_every=0", "tracking.experiment=posttrain-deployments"]
    run, metrics = run_deployment(services, client_env, "opd/opd-arithmetic", overrides, tmp_path / "runs" / "deployed-opd")
    assert run.parameters["recipe"] == "recipes/opd_arithmetic.py"
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # the teacher scored the samples: a different model gives a non-zero sampled reverse KL at every step
    assert all(abs(m["train/reverse_kl"]) > 1e-4 for m in steps)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(visible_gpus() > 0, reason="this machine has a GPU")
def test_gspo_deployment_without_gpu_fails_in_preflight(services, deployed, client_env):
    _, env = services
    out = prefect(client_env, "deployment", "run", "grpo/gspo-gsm8k")
    assert out.returncode == 0, out.stdout + out.stderr
    flow_run_id = UUID.search(out.stdout.split("UUID")[-1]).group(0)
    run = wait_for_flow_run(env["PREFECT_API_URL"], flow_run_id, timeout=300)
    assert run.state.type.value == "FAILED"
    message = run.state.message or ""
    assert "invalid configuration (preflight)" in message and "no GPU on this machine" in message, message
    assert "cluster.gpus_per_worker=0 rollout.backend=hf model.name_or_path=artifacts/tiny-model/warm" in message
    assert "model.name_or_path='Qwen/Qwen2.5-3B-Instruct'" in message  # HF_HUB_OFFLINE=1 on the worker
    # fast: failed within seconds of starting, before Ray or any model was set up
    assert (run.end_time - run.start_time).total_seconds() < 60


@pytest.mark.e2e
@pytest.mark.slow
def test_a_deployment_run_with_a_foreign_recipe_fails_without_running_it(services, deployed, client_env, tmp_path):
    """The attack of the audit: `recipe=/any/file.py` through the API. The run fails in the guard, naming the
    parameter, and the file never runs."""
    evil = tmp_path / "evil.py"
    marker = tmp_path / "pwned"
    evil.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    _, env = services
    out = prefect(client_env, "deployment", "run", "grpo/arithmetic", "--param", f"recipe={evil}")
    assert UUID.search(out.stdout), out.stdout[-2000:] + out.stderr[-2000:]
    flow_run_id = UUID.search(out.stdout).group(0)
    run = wait_for_flow_run(env["PREFECT_API_URL"], flow_run_id, timeout=300)
    assert run.state.type.value == "FAILED"
    assert "recipes under" in (run.state.message or "") or "recipes under" in str(run.state)
    assert not marker.exists()


def create_run(url: str, name: str, parameters: dict | None = None, job_variables: dict | None = None):
    """A flow run of deployment NAME created on the API as any caller can: (its id, None), or (None, the refusal)."""
    import httpx

    d = api(url, lambda c: c.read_deployment_by_name(name))
    try:
        run = api(url, lambda c: c.create_flow_run_from_deployment(d.id, parameters=parameters,
                                                                    job_variables=job_variables))
    except httpx.HTTPStatusError as exc:
        return None, f"{exc.response.status_code} {exc.response.text}"
    return str(run.id), None


class Listener:
    """A TCP listener on 127.0.0.1 that records whether anything connected (a caller's endpoint)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536) or b"(connected)")
                except OSError:
                    self.received.append(b"(connected)")

    def close(self):
        self._stop = True
        self.thread.join(5)
        self.sock.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_flow_runs_job_variables_cannot_run_a_command_or_switch_the_opt_in(services, deployed, tmp_path):
    """The audit's attack: `command=touch FILE` as a flow run's job variable ran the command on the worker, and
    `env={POSTTRAIN_ALLOW_UNSAFE_OVERRIDES: 1}` switched the opt-in on. The pool's template has neither variable:
    the API refuses such a run (or the guard does), nothing runs, the opt-in stays off."""
    url = services[1]["PREFECT_API_URL"]
    marker = tmp_path / "pwned"
    out_dir = tmp_path / "elsewhere"
    attacks = [({}, {"command": f"touch {marker}"}),
               ({"overrides": [f"job.out_dir={out_dir}"]}, {"env": {"POSTTRAIN_ALLOW_UNSAFE_OVERRIDES": "1"}}),
               ({"overrides": [f"job.out_dir={out_dir}"]}, {"env.POSTTRAIN_ALLOW_UNSAFE_OVERRIDES": "1"}),
               ({}, {"working_dir": str(tmp_path)})]
    for parameters, job_variables in attacks:
        flow_run_id, refused = create_run(url, "grpo/dr-grpo-gsm8k", parameters, job_variables)
        if flow_run_id is None:
            assert refused.startswith("422"), refused
            continue
        run = wait_for_flow_run(url, flow_run_id, timeout=300)
        assert run.state.type.value == "FAILED", (job_variables, run.state.message)
        assert "not accepted" in (run.state.message or "") or "job variables" in (run.state.message or ""), \
            run.state.message
    assert not marker.exists() and not out_dir.exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_import_paths_models_and_endpoints_are_refused_from_the_api(services, deployed):
    """`data.rewards=[{path: timeit:timeit}]` would execute on each batch, `data.task=timeit:Timer` on load; `tracking.mlflow_uri` and
    `cluster.address` took the worker's credentials elsewhere. Outside the allowlist: refused, naming each key,
    before anything connects."""
    url = services[1]["PREFECT_API_URL"]
    listener = Listener()
    try:
        there = f"127.0.0.1:{listener.port}"
        refused = ["data.rewards=[{path: 'timeit:timeit'}]", "data.task=timeit:Timer", "rl.objective.import_path=timeit:timeit",
                   "model.name_or_path=/tmp/model", "rl.reference=/tmp/model", f"cluster.address=ray://{there}",
                   f"tracking.mlflow_uri=http://{there}", f"tracking.checkpoint_uri=s3://bucket/{there}",
                   "tracking.keep_checkpoints=1", "job.name=other", "data.train=/etc/passwd"]
        flow_run_id, _ = create_run(url, "grpo/dr-grpo-gsm8k", {"overrides": [*refused, "rl.max_steps=3"]})
        run = wait_for_flow_run(url, flow_run_id, timeout=300)
        message = run.state.message or ""
        assert run.state.type.value == "FAILED"
        for item in refused:
            assert f"override {item.partition('=')[0]}: not accepted" in message, (item, message)
        assert "rl.max_steps" not in message  # a recipe knob is accepted
        # the regression flow's own parameters: its MLflow store and output directory are the operator's
        flow_run_id, _ = create_run(url, "regression/nightly-regression",
                                    {"mlflow_uri": f"http://{there}", "out_dir": "/tmp/elsewhere",
                                     "thresholds": "/etc/passwd", "overrides": ["model.name_or_path=/tmp/m"]})
        run = wait_for_flow_run(url, flow_run_id, timeout=300)
        message = run.state.message or ""
        assert run.state.type.value == "FAILED"
        for name in ("mlflow_uri: not accepted", "out_dir: not accepted", "thresholds='/etc/passwd'",
                     "override model.name_or_path: not accepted"):
            assert name in message, (name, message)
        assert listener.received == []
    finally:
        listener.close()


@pytest.fixture
def project_artifacts(workdir, warm_model):
    """The project's data and warm tiny model (what `dvc repro` leaves in the checkout the worker runs in), added
    where missing; afterwards whatever the test added to the checkout (with the nightly run's outputs) is removed."""
    import shutil

    created = [p for p in (REPO / "data", REPO / "artifacts", REPO / "runs") if not p.exists()]
    added = []
    for src, dst in ((workdir / "data" / "arithmetic", REPO / "data" / "arithmetic"),
                     (warm_model[0], REPO / "artifacts" / "tiny-model" / "warm")):
        if not dst.exists():
            shutil.copytree(src, dst)
            added.append(dst)
    had_runs = (REPO / "runs" / "regression").exists()
    yield
    for path in [*added, *created]:
        shutil.rmtree(path, ignore_errors=True)
    if not had_runs:
        shutil.rmtree(REPO / "runs" / "regression", ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_nightly_regression_deployment_completes_without_the_opt_in(services, deployed, project_artifacts):
    """The scheduled run as the worker starts it, with no opt-in anywhere (the deployment is not tagged, the
    worker's environment has none): its grpo subflow's overrides (job.out_dir, ...) are the regression flow's own,
    not a caller's, so the guard does not judge them (it refused them, and the fixed run was reported crashed:
    `arithmetic.run`). The run completes with its report in MLflow. A warm start built on another CPU than the
    reference's differs bitwise (regression/reference_trajectory.json keeps one build per machine): then only
    the trajectory checks may fail, never the run."""
    from mlflow import MlflowClient

    from flows.guard import OPT_IN_TAG
    from flows.regression import EXPERIMENT, KIND_TAG

    _, env = services
    url = env["PREFECT_API_URL"]
    assert OPT_IN_TAG not in api(url, lambda c: c.read_deployment_by_name("regression/nightly-regression")).tags
    flow_run_id, refused = create_run(url, "regression/nightly-regression")
    assert refused is None
    run = wait_for_flow_run(url, flow_run_id, timeout=1200)
    message = run.state.message or ""
    assert "not accepted" not in message and "arithmetic.run" not in message, message
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name(EXPERIMENT)
    (report,) = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`posttrain.prefect_flow_run_id` = '{flow_run_id}' and tags.`{KIND_TAG}` = 'regression'"))
    failed = [name for name in report.data.tags["posttrain.regression.failed"].split(",") if name]
    assert all(name.startswith("trajectory.") for name in failed), failed
    assert (run.state.type.value == "COMPLETED") == (not failed), message
    training = client.get_run(report.data.tags["posttrain.training_run_id"])
    assert [m.step for m in client.get_metric_history(training.info.run_id, "train/loss")] == list(range(1, 21))


@pytest.mark.e2e
@pytest.mark.slow
def test_down_stops_exactly_the_service_processes(services):
    import psutil

    svc, env = services
    records = {name: json.loads(svc.pid_file(name).read_text()) for name in ("prefect-server", "prefect-worker",
                                                                               "mlflow")}
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        lines = svc.down(announce=lambda _: None)
        assert all(": stopped (pid" in line for line in lines), lines
        for rec in records.values():
            assert not psutil.pid_exists(rec["pid"]) or psutil.Process(rec["pid"]).status() == psutil.STATUS_ZOMBIE
        assert not any(svc.pid_file(n).exists() for n in records) and not svc.env_file.exists()
        assert not http_ok(env["PREFECT_API_URL"] + "/health") and not http_ok(env["MLFLOW_TRACKING_URI"] + "/health")
        assert bystander.poll() is None  # an unrelated process is untouched
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.e2e  # the pull step starts a Prefect API server
@pytest.mark.parametrize("env_value", [None, "", "checkout"], ids=["unset", "empty", "set"])
def test_the_pull_step_enters_the_checkout_with_or_without_posttrain_project_dir(env_value, tmp_path, monkeypatch):
    """prefect.yaml's pull steps, run by Prefect's own step runner in another directory: with
    POSTTRAIN_PROJECT_DIR unset or empty (plain `prefect deploy --all`) they enter the installed checkout
    (Prefect's set_working_directory crashed with FileNotFoundError: '')."""
    import asyncio

    from prefect.deployments.steps.core import run_steps

    steps = yaml.safe_load((REPO / "prefect.yaml").read_text())["pull"]
    monkeypatch.chdir(tmp_path)
    if env_value is None:
        monkeypatch.delenv("POSTTRAIN_PROJECT_DIR", raising=False)
    else:
        monkeypatch.setenv("POSTTRAIN_PROJECT_DIR", str(REPO) if env_value == "checkout" else env_value)
    out = asyncio.run(run_steps(steps))
    assert Path.cwd() == REPO.resolve() and out["directory"] == str(REPO.resolve())


def test_the_pull_step_refuses_a_directory_that_is_not_a_checkout(tmp_path, monkeypatch):
    from infra.services.deploy_steps import enter_project

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_PROJECT_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="not a posttrain checkout.*POSTTRAIN_PROJECT_DIR"):
        enter_project("")
    assert Path.cwd() == tmp_path


# ------------------------------------------------------------------ untrusted deployment parameters


def test_deployment_parameters_run_project_recipes_only_and_overrides_from_an_allowlist(tmp_path):
    from flows.guard import API_OVERRIDES, deployment_problems
    from rl_core.config.explain import all_keys

    ok = deployment_problems("recipes/arithmetic.py", ["rl.max_steps=3", " rl.optimizer.lr = 1e-5", "job.seed=1",
                                                       "rollout.prompts_per_step=4"], project=REPO, allow_unsafe=False)
    assert ok == []
    evil = tmp_path / "evil.py"
    evil.write_text("import os; os.system('touch pwned')\n")
    for candidate in (str(evil), "recipes/../tests/conftest.py", "/etc/passwd", "recipes/missing.py"):
        problems = deployment_problems(candidate, [], project=REPO, allow_unsafe=False)
        assert len(problems) == 1 and "recipes under" in problems[0], candidate
    # code, models, data, endpoints (the worker's credentials go there), outputs and pruning: not from the API
    unsafe = ["model.trust_remote_code=true", "job.out_dir=/", " job.overwrite = true", "data.task=timeit:Timer",
              "data.rewards=[{path: 'timeit:timeit'}]",
              "rl.objective.import_path=timeit:timeit", "model.name_or_path=/x", "model.teacher=/x", "rl.reference=/x",
              "cluster.address=ray://evil:10001", "tracking.mlflow_uri=http://evil", "tracking.checkpoint_uri=s3://b/p",
              "tracking.keep_checkpoints=1", "job.name=other", "data.train=/etc/passwd", "data.val=/x", "rl={}",
              "rl.max_steps=3"]
    problems = deployment_problems("recipes/arithmetic.py", unsafe, project=REPO, allow_unsafe=False)
    assert [p.split(":")[0] for p in problems] == [f"override {u.partition('=')[0].strip()}" for u in unsafe[:-1]]
    assert deployment_problems("recipes/arithmetic.py", unsafe, project=REPO, allow_unsafe=True) == []
    assert deployment_problems("recipes/arithmetic.py", [1, "x"], project=REPO, allow_unsafe=True) == [
        "override 1: not a key=value string", "override 'x': not a key=value string"]
    assert API_OVERRIDES <= set(all_keys())  # every allowed key is a real key


def test_the_regression_flows_own_parameters_are_checked():
    from flows.guard import regression_problems

    defaults = {"thresholds": "regression/thresholds.yaml", "reference": "regression/reference_trajectory.json",
                "out_dir": "runs/regression", "mlflow_uri": None, "overrides": None}
    assert regression_problems(defaults, project=REPO, allow_unsafe=False) == []
    bad = {"thresholds": "/etc/passwd", "reference": "regression/../README.md", "out_dir": "/", "overrides":
           ["model.name_or_path=/x", "rl.max_steps=2"], "mlflow_uri": "http://evil"}
    problems = regression_problems(bad, project=REPO, allow_unsafe=False)
    assert [p.split(":")[0].split("=")[0] for p in problems] == ["thresholds", "reference", "out_dir", "mlflow_uri",
                                                                 "override model.name_or_path"]
    assert len(regression_problems(bad, project=REPO, allow_unsafe=True)) == 2  # paths under regression/ only


def test_pool_templates_that_let_a_run_choose_its_command_are_named():
    from prefect.workers.process import ProcessWorker

    from cli.services import deployment_pools
    from infra.services.prefect_api import process_pool_template
    from infra.services.work_pools import gpu_pool_template, template_problems

    problems = template_problems(ProcessWorker.get_default_base_job_template())
    for field in ("command", "env", "working_dir"):
        assert any(f"job variable {field!r}" in p for p in problems), problems
    assert any("additionalProperties" in p for p in problems)
    assert template_problems(process_pool_template()) == []
    assert template_problems(gpu_pool_template()) == []
    loose = process_pool_template()
    loose["variables"]["additionalProperties"] = True
    assert template_problems(loose) == [
        "it accepts job variables it does not declare (variables.additionalProperties is not false)"]
    # the pools prefect.yaml's deployments go to (all of them, or those named)
    assert deployment_pools() == [WORK_POOL] == deployment_pools(["grpo/arithmetic"])
    assert deployment_pools(["grpo/no-such-deployment"]) == []


@pytest.mark.e2e  # a Prefect API server
def test_the_work_pool_template_fixes_the_command_and_environment(monkeypatch):
    """A flow run's job variables `command`, `env` (or `env.X`) and `working_dir`: with Prefect's default process
    template they reach the flow-run process; with posttrain's they do not, and the API refuses them."""
    import jsonschema
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    from infra.services.prefect_api import process_pool_template

    attack = {"command": "touch /tmp/pwned", "env": {"POSTTRAIN_ALLOW_UNSAFE_OVERRIDES": "1"}, "working_dir": "/tmp"}

    def configured(template, values):
        return asyncio.run(ProcessJobConfiguration.from_template_and_values(template, values))

    default = configured(ProcessWorker.get_default_base_job_template(), attack)
    assert default.command == "touch /tmp/pwned" and default.env["POSTTRAIN_ALLOW_UNSAFE_OVERRIDES"] == "1"
    template = process_pool_template()
    for values in (attack, {"env.POSTTRAIN_ALLOW_UNSAFE_OVERRIDES": "1"}):
        ours = configured(template, values)
        assert ours.command is None and ours.env == {} and ours.working_dir is None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"command": "x"}, template["variables"])
    jsonschema.validate({"stream_output": False}, template["variables"])


@pytest.mark.e2e
@pytest.mark.parametrize("user_value, expected", [(None, 180), ("45", 45)])
def test_posttrain_run_gives_the_ephemeral_api_time_to_start(user_value, expected):
    """Prefect's 20 s default for its temporary API server failed half the runs on a loaded 2-core machine;
    `posttrain run` (flows.entry) allows 180 s unless the user set a value."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    if user_value is not None:
        env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = user_value
    code = ("import cli.main, flows.entry\nfrom prefect.settings import get_current_settings\n"
            "print(get_current_settings().server.ephemeral.startup_timeout_seconds)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert int(float(out.stdout.strip().splitlines()[-1])) == expected


@pytest.mark.e2e
@pytest.mark.parametrize("user_value, expected", [(None, 100), ("7", 7)])
def test_posttrain_starts_prefect_servers_with_batched_task_run_recording(user_value, expected, tmp_path,
                                                                          monkeypatch):
    """The temporary API server of `posttrain run` (flows.entry) and the `prefect server` of `posttrain services`
    record task-run states in batches (about 40% less server CPU per task run), unless the user set the
    value."""
    from infra.services.prefect_api import PREFECT_SERVER_DEFAULTS

    key = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"
    env = {k: v for k, v in os.environ.items() if k not in PREFECT_SERVER_DEFAULTS}
    for k in PREFECT_SERVER_DEFAULTS:
        monkeypatch.delenv(k, raising=False)
    if user_value is not None:
        env[key] = user_value
        monkeypatch.setenv(key, user_value)
    code = ("import cli.main, flows.entry\nfrom prefect.settings import get_current_settings\n"
            "s = get_current_settings().server.services.task_run_recorder\nprint(s.batch_size, s.flush_interval)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    batch, flush = out.stdout.strip().splitlines()[-1].split()
    assert (int(batch), float(flush)) == (expected, 1.0)
    server_env = Services(tmp_path)._base_env()
    assert server_env[key] == str(expected)
    assert server_env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"] == "1"


@pytest.mark.e2e
def test_a_service_stays_recognised_when_the_system_clock_steps():
    """`services down/status` recognise their processes by the start time in ticks since boot: a wall-clock step
    (NTP, a VM resumed) once made every running service look gone; a reused pid is still told apart."""
    from infra.processes import process_alive, process_start_ticks

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = process_start_ticks(proc.pid)
        assert ticks is not None
        stepped = {"pid": proc.pid, "create_time": time.time() - 3600, "start_ticks": ticks}  # clock moved an hour
        assert process_alive(stepped)
        assert not process_alive({**stepped, "start_ticks": ticks - 1})  # another process that got the same pid
    finally:
        proc.kill()
        proc.wait()
    assert not process_alive(stepped)
