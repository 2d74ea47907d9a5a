"""The autoscaler test's witness, run as its own Ray driver.

    python tests/nodes_watch.py ADDRESS OUT.jsonl

It records the cluster's alive nodes once a second until stopped: each line of OUT is
``{"t": epoch seconds, "nodes": {node id: CPUs}}``.
"""

from __future__ import annotations

import json
import sys
import time

import ray


def main() -> None:
    address, out = sys.argv[1], sys.argv[2]
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    with open(out, "a") as f:
        while True:
            alive = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]}
            f.write(json.dumps({"t": time.time(), "nodes": alive}) + "\n")
            f.flush()
            time.sleep(1.0)


if __name__ == "__main__":
    main()
