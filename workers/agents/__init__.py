"""Agents: environments behind the task-server HTTP protocol (server side) and the workflows that drive them
(client side: multi-turn episodes, token in / token out); the rollout functions a run names in
``rollout.generate_fn`` (``rollout_fns.py``), the worker that runs them (``rollout_worker.py``) and the
OpenAI-compatible endpoint in front of the engines (``openai_api.py``).

The client names are imported on first use, so that ``python -m workers.agents.task_server`` starts without
importing torch or the HTTP client.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TaskServerWorkflow": "workers.agents.workflow",
    "HFChatFormat": "workers.agents.trajectory",
    "PlainChatFormat": "workers.agents.trajectory",
    "Sample": "workers.agents.trajectory",
    "Trajectory": "workers.agents.trajectory",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'workers.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
