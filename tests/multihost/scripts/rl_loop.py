"""The demo's RL loop across hosts, a short run: controller and reward worker on host A, the two FSDP2 trainer ranks
(gloo) on host B, the rollout worker and its engine on host C, one storage unit on B and one on C. Weights travel
through Ray's object store (``weight_sync: memory``; the shared-memory channel is for one host).

Args after the cluster's: the output directory (on a filesystem every host sees, as a cluster's shared storage).
Prints one JSON line: the GRPO rows' steps, versions and rewards, and the hostname each actor ran on.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import ray

import transfer_queue  # the checkout, on PYTHONPATH (the fixture sets it for every host)
from orchestration import grpo_run
from orchestration.config import config_from_cli

address, node_ip, output_dir = sys.argv[1], sys.argv[2], sys.argv[3]
ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR")
DEMO = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"
SHORT = [
    f"output_dir={output_dir}",
    "steps=3",
    "weight_sync=memory",
    "prompts_per_step=8",
    "n_samples=4",
    "rollout.groups_per_request=4",
    "rollout.reward_groups_per_request=4",
    "task.num_train_prompts=64",
    "task.num_eval_prompts=16",
    "sft.max_steps=4",
    "sft.eval_every=2",
    "sft.batch_size=16",
    "queue_timeout=120",
]


def on(host: str) -> dict[str, Any]:
    return {"resources": {f"host_{host}": 1}}


class Pinned:
    """An actor class whose actors all land on one host (test glue around the recipe's actor classes)."""

    def __init__(self, cls: Any, host: str, engine_options_at: int | None = None):
        self.cls, self.host, self.engine_options_at = cls, host, engine_options_at

    def options(self, **kwargs: Any) -> Any:
        return self.cls.options(**kwargs, **on(self.host))

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine_options_at is not None:  # the rollout worker's engine goes to the same host
            args = list(args)
            args[self.engine_options_at] = {**args[self.engine_options_at], **on(self.host)}
        return self.cls.options(**on(self.host)).remote(*args, **kwargs)


start_queue = transfer_queue.init
transfer_queue.init = lambda **kw: start_queue(
    **kw, controller_options=on("a"), storage_unit_options=[on("b"), on("c")]
)
grpo_run.GRPOTrainerRank = Pinned(grpo_run.GRPOTrainerRank, "b")
grpo_run.RolloutWorker = Pinned(grpo_run.RolloutWorker, "c", engine_options_at=7)
grpo_run.RewardWorker = Pinned(grpo_run.RewardWorker, "a")


def host_of(actor: Any) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: socket.gethostname()))


config = config_from_cli("", DEMO, SHORT)
run = grpo_run.GRPORun(config)
try:
    hosts = {
        "trainer": [host_of(rank) for rank in run.trainer],
        "rollout": [host_of(worker) for worker in run.rollout],
        "reward": [host_of(worker) for worker in run.reward],
        "storage": [u.hostname for u in run.client.controller_info.storage_units],
    }
    rows = run.run()
finally:
    run.shutdown()
print(
    json.dumps(
        {
            "hosts": hosts,
            "steps": [r["step"] for r in rows],
            "versions": [r["policy_version"] for r in rows],
            "rewards": [r["reward"] for r in rows],
        }
    )
)
