"""The environments that ship: importing this package registers them."""

from workers.agents.envs import guess_number

__all__ = ["guess_number"]
