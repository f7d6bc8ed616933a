"""What other users of the machine (or network) can reach: the rendezvous store listens on the node IP only, and
what posttrain writes is its owner's only (the services' state directory: tests/flows/test_deployments.py)."""

from __future__ import annotations

import stat
import subprocess
import sys

import psutil
import pytest

from tests.conftest import REPO


def _listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_rendezvous_store_listens_on_the_node_ip_only():
    """torch's TCPStore server (no authentication) bound every interface (`LISTEN *:PORT`); now only the IP given."""
    from infra.workers.distributed import connect_store, open_store

    store, port = open_store("127.0.0.1", 2)
    try:
        assert _listening_addresses(port) in ({"127.0.0.1"}, {"::ffff:127.0.0.1"})
        client = connect_store("127.0.0.1", port, 2)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


@pytest.mark.e2e
def test_what_posttrain_writes_is_its_owners_only(tmp_path):
    """A run directory, a model and data built by `posttrain`: directories 0700, files 0600."""
    out = tmp_path / "models" / "tiny"
    subprocess.run([sys.executable, "-m", "cli.main", "init-model", "--out", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    assert stat.S_IMODE(out.parent.stat().st_mode) == 0o700 and stat.S_IMODE(out.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o600}, modes


def test_a_run_directory_is_made_private(tmp_path, monkeypatch):
    from infra.checkpoints.resume import record_run
    from infra.checkpoints.store import CheckpointStore
    from tests.run_helpers import small_config

    monkeypatch.chdir(tmp_path)
    cfg = small_config(f"job.out_dir={tmp_path / 'runs'}")
    (tmp_path / "runs" / "plan").mkdir(parents=True, mode=0o755)
    record_run(cfg, CheckpointStore(tmp_path / "runs" / "plan" / "checkpoints"), "0123456789abcdef")
    assert stat.S_IMODE((tmp_path / "runs" / "plan").stat().st_mode) == 0o700


@pytest.mark.e2e
def test_the_local_ray_a_run_starts_uses_token_authentication(tmp_path):
    """The local Ray of `posttrain run` (infra.cluster.ray_connect, no RAY_AUTH_MODE set) requires a token (Ray turns it on
    for a new local cluster); its workers carry the mode."""
    import os

    code = ("import ray\nfrom rl_core.config import load_config\nfrom infra.cluster.ray_connect import connect_ray\n"
            f"connect_ray(load_config({str(REPO / 'recipes' / 'arithmetic.py')!r}, []))\n"
            "print('mode', ray.get(ray.remote(lambda: __import__('os').environ.get('RAY_AUTH_MODE')).remote()))\n"
            "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=300, check=True)
    assert "mode token" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
