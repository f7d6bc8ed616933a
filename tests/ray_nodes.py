"""Start a Ray head and more nodes on 127.0.0.1 in this process, write the head's address, wait for SIGTERM.

Used by `tests/servers.ray_nodes` for multi-node tests on one machine (`ray start --address` refuses to
add a worker node on loopback). The environment sets loopback, auth mode and the temp dir.

    python tests/ray_nodes.py --nodes 2 --cpus-per-node 2 --address-file ADDR --temp-dir DIR
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--temp-dir", required=True)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    node = {"node_ip_address": "127.0.0.1", "num_cpus": args.cpus_per_node, "num_gpus": 0,
            "object_store_memory": 128 * 1024 * 1024}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**node, "include_dashboard": False, "temp_dir": args.temp_dir})
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(args.address_file + ".tmp", "w") as f:
        f.write(cluster.address)
    import os

    os.replace(args.address_file + ".tmp", args.address_file)
    stop.wait()
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
