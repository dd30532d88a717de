"""The base of the environments whose episodes act in a sandbox on generated tasks (os-interaction, dbbench-dev):
samples named ``{kind}-{index:03d}``, one :class:`~workers.agents.sandbox.Sandbox` per episode, closed with it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from workers.agents.environment import Environment
from workers.agents.sandbox import Sandbox, SandboxLimits

#: samples of each task kind
SAMPLES_PER_KIND = 20


class SandboxedEnvironment(Environment):
    """An environment over generated tasks whose episodes run commands in a sandbox.

    Args:
        limits: the sandbox's per-command limits (default :class:`SandboxLimits`).
    """

    #: task kind -> its generator (a subclass sets it); sample ``{kind}-{i:03d}`` is one of that kind's tasks
    task_kinds: ClassVar[Mapping[str, Callable[..., Any]]] = {}
    episode_memory_bytes = SandboxLimits().episode_memory_bytes

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits
        self.sandbox: Sandbox | None = None

    @classmethod
    def sample_ids(cls) -> list[str]:
        return [f"{kind}-{i:03d}" for kind in cls.task_kinds for i in range(SAMPLES_PER_KIND)]

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
