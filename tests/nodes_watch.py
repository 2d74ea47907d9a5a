"""The autoscaler test's helpers, each run as its own Ray driver.

    python tests/nodes_watch.py ADDRESS OUT.jsonl      # the witness
    python tests/nodes_watch.py ADDRESS --hold FILE    # a CPU held while FILE exists

The witness records the cluster's alive nodes once a second until stopped: each line of
OUT is ``{"t": epoch seconds, "nodes": {node id: CPUs}}``. The holder asks for one CPU
(the autoscaler launches a node for it when none is free) and keeps it until FILE goes.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ray


def hold_a_cpu(path: str) -> None:
    deadline = time.time() + 600
    while os.path.exists(path) and time.time() < deadline:
        time.sleep(0.5)


def main() -> None:
    address, out = sys.argv[1], sys.argv[2]
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    if out == "--hold":
        ray.get(ray.remote(num_cpus=1)(hold_a_cpu).remote(sys.argv[3]))
        return
    with open(out, "a") as f:
        while True:
            alive = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
            f.write(json.dumps({"t": time.time(), "nodes": alive}) + "\n")
            f.flush()
            time.sleep(1.0)


if __name__ == "__main__":
    main()
