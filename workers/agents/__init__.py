"""Agents: multi-turn episodes against task servers (issue 9), token in / token out."""

from workers.agents.trajectory import HFChatFormat, PlainChatFormat, Sample, Trajectory
from workers.agents.workflow import TaskServerWorkflow

__all__ = ["HFChatFormat", "PlainChatFormat", "Sample", "TaskServerWorkflow", "Trajectory"]
