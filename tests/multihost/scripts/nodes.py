"""Waits until the three hosts' Ray nodes are up; prints the hostname each host's node reports."""

import json
import socket
import sys
import time

import ray

address, node_ip = sys.argv[1], sys.argv[2]
ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR")
deadline = time.monotonic() + 90
while sum(n["Alive"] for n in ray.nodes()) < 3:
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.5)


@ray.remote(num_cpus=0)
def where() -> str:
    return socket.gethostname()


names = ray.get([where.options(resources={f"host_{h}": 1}).remote() for h in "abc"])
print(json.dumps({"hostnames": names}))
