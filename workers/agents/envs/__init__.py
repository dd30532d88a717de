"""The environments that ship: importing this package registers them."""

from workers.agents.envs import calculator, db_bench, guess_number, os_interaction

__all__ = ["calculator", "db_bench", "guess_number", "os_interaction"]
