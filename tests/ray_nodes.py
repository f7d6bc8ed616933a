"""Start a Ray head and more nodes on 127.0.0.1 in this process, write the head's address, wait for SIGTERM.

Used by `tests/servers.ray_nodes` for multi-node tests on one machine (`ray start --address` refuses to
add a worker node on loopback), and by `tests/servers.start_shared_ray` for the one Ray the pytest workers of a
run share (`--exit-with-pid`: it also stops when the pytest process that owns the run is gone). The environment
sets loopback, auth mode and the temp dir.

    python tests/ray_nodes.py --nodes 2 --cpus-per-node 2 --address-file ADDR --temp-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def _stop_when_gone(pid: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            stop.set()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--object-store-mb", type=int, default=128)
    parser.add_argument("--system-config", default="{}", help="the head's _system_config, as JSON")
    parser.add_argument("--exit-with-pid", type=int, default=0, help="stop when this process is gone")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    node = {"node_ip_address": "127.0.0.1", "num_cpus": args.cpus_per_node, "num_gpus": 0,
            "object_store_memory": args.object_store_mb * 1024 * 1024}
    head = {**node, "include_dashboard": False, "temp_dir": args.temp_dir}
    if system_config := json.loads(args.system_config):
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.exit_with_pid:
        threading.Thread(target=_stop_when_gone, args=(args.exit_with_pid, stop), daemon=True).start()
    with open(args.address_file + ".tmp", "w") as f:
        f.write(cluster.address)
    os.replace(args.address_file + ".tmp", args.address_file)
    stop.wait()
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
