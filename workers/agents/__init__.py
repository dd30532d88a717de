"""Agents: environments behind the task-server HTTP protocol (server side) and the workflows that drive them
(client side: multi-turn episodes, token in / token out)."""

from workers.agents.trajectory import HFChatFormat, PlainChatFormat, Sample, Trajectory
from workers.agents.workflow import TaskServerWorkflow

__all__ = ["HFChatFormat", "PlainChatFormat", "Sample", "TaskServerWorkflow", "Trajectory"]
