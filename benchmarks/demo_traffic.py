"""The demo's queue traffic without models: what each GRPO step costs the queue in CPU, server and clients.

Replays one demo step's calls (32 prompts x 8 samples): the driver's put of prompts; the rollout client's
get_meta + get_data + put into the rows + the get_meta that finds the step done; the same for the reward client;
two trainer ranks' DP get_meta + get_data, each from its own thread; the clear. Prints per step the wall time, the
controller's and storage units' CPU (minus their idle CPU) and each client's CPU inside queue calls.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python benchmarks/demo_traffic.py --steps 300
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfer_queue as tq
from rl_contracts.rows import jagged
from rl_contracts.stages import REWARD_TASK, ROLLOUT_TASK, TRAIN_TASK
from transfer_queue import TransferQueueClient

PROMPTS, N = 32, 8
ROWS = PROMPTS * N
TRAIN_FIELDS = ["prompt_ids", "response_ids", "response_logprobs", "reward", "reward_failed", "policy_version"]


class Replay:
    def __init__(self) -> None:
        self.driver = tq.init(global_batch_size=PROMPTS, num_n_samples=N, num_global_batch=1)
        info = self.driver.controller_info
        self.rollout = TransferQueueClient("rollout", info)
        self.reward = TransferQueueClient("reward", info)
        self.trainer = [TransferQueueClient(f"trainer-{r}", info) for r in range(2)]
        self.cpu = {"driver": 0.0, "rollout": 0.0, "reward": 0.0, "trainer": 0.0}
        self._lock = threading.Lock()

    def timed(self, who: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        out = fn(*args, **kwargs)
        with self._lock:
            self.cpu[who] += time.thread_time() - started
        return out

    def step(self, s: int) -> None:
        lengths = torch.randint(6, 9, (ROWS,)).tolist()
        prompts = {
            "prompt_ids": jagged([[1] * n for n in lengths], torch.int64),
            "answer": [str(i) for i in range(ROWS)],
        }
        self.timed("driver", self.driver.put, prompts, global_step=s)

        ask = {"global_step": s, "task_name": ROLLOUT_TASK, "get_n_samples": True}
        meta = self.timed("rollout", self.rollout.get_meta, ["prompt_ids"], ROWS, **ask)
        self.timed("rollout", self.rollout.get_data, meta)
        responses = {
            "response_ids": jagged([[2] * 4] * ROWS, torch.int64),
            "response_logprobs": jagged([[-0.5] * 4] * ROWS, torch.float32),
            "policy_version": torch.full((ROWS,), s),
            "finish_reason": ["stop"] * ROWS,
        }
        self.timed("rollout", self.rollout.put, responses, metadata=meta)
        assert len(self.timed("rollout", self.rollout.get_meta, ["prompt_ids"], ROWS, **ask)) == 0

        ask = {"global_step": s, "task_name": REWARD_TASK, "get_n_samples": True}
        meta = self.timed("reward", self.reward.get_meta, ["response_ids", "answer"], ROWS, **ask)
        self.timed("reward", self.reward.get_data, meta)
        scored = {"reward": torch.rand(ROWS), "reward_failed": torch.zeros(ROWS, dtype=torch.bool)}
        self.timed("reward", self.reward.put, scored, metadata=meta)
        assert len(self.timed("reward", self.reward.get_meta, ["response_ids", "answer"], ROWS, **ask)) == 0

        def train(rank: int) -> None:
            dp = {"dp_rank": rank, "dp_size": 2, "dp_group_id": f"train/{s}"}
            client = self.trainer[rank]
            meta = self.timed(
                "trainer", client.get_meta, TRAIN_FIELDS, ROWS // 2, global_step=s, task_name=TRAIN_TASK,
                sampler_params=dp, get_n_samples=True,
            )  # fmt: skip
            self.timed("trainer", client.get_data, meta)

        threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.timed("driver", self.driver.clear, global_step=s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    steps = parser.parse_args().steps
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    replay = Replay()
    controller = tq.get_controller()
    for s in range(10):  # warm-up
        replay.step(s)
    replay.cpu = dict.fromkeys(replay.cpu, 0.0)
    start = ray.get(controller.cpu_seconds.remote())
    time.sleep(2.0)
    idle_per_s = (ray.get(controller.cpu_seconds.remote()) - start) / 2.0
    start, t0 = ray.get(controller.cpu_seconds.remote()), time.perf_counter()
    for s in range(10, 10 + steps):
        replay.step(s)
    wall = time.perf_counter() - t0
    server = ray.get(controller.cpu_seconds.remote()) - start - idle_per_s * wall
    clients = "; ".join(f"{who} {1e3 * cpu / steps:.2f} ms" for who, cpu in replay.cpu.items())
    print(
        f"per step: wall {1e3 * wall / steps:.2f} ms; queue servers' CPU {1e3 * server / steps:.2f} ms "
        f"(their idle CPU taken out); clients' CPU in queue calls: {clients}"
    )
    tq.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
