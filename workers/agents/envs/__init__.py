"""The environments that ship: importing this package registers them."""

from workers.agents.envs import calculator, guess_number, os_interaction

__all__ = ["calculator", "guess_number", "os_interaction"]
