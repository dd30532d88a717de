"""Tasks and rollout functions used by the integration tests, importable by dotted name from engine processes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from workers.agents.rollout_fns import task_server_generate
from workers.tasks.addition import AdditionTask


class SlowAdditionTask(AdditionTask):
    """The addition task whose policy takes ``forward_s`` seconds a forward pass: a generation stays in flight long
    enough for a test to act while it runs."""

    def __init__(self, forward_s: float = 0.2, **kwargs: Any):
        super().__init__(**kwargs)
        self.forward_s = forward_s

    def build_policy(self) -> Any:
        policy = super().build_policy()
        policy.register_forward_pre_hook(lambda module, args: time.sleep(self.forward_s))
        return policy


async def slow_task_server_generate(
    prompts: list[dict[str, Any]], engine: Any, *, delay_s: float, **kwargs: Any
) -> Any:
    """The built-in task-server rollout, ``delay_s`` seconds before its episodes start: a batch stays in flight."""
    await asyncio.sleep(delay_s)
    return await task_server_generate(prompts, engine, **kwargs)
