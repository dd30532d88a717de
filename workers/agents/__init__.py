"""Agents: environments behind the task-server HTTP protocol (server side) and the workflows that drive them."""
