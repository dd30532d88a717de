"""Rollout generation: ``AsyncRolloutManager`` (concurrent, over-sampled, filtered, with partial caching) and
``generate_rollout_batches`` (the plain synchronous generator)."""

from orchestration.training.rollout_gen.async_rollout_manager import AsyncRolloutManager
from orchestration.training.rollout_gen.rollout_generation import PromptBuffer, generate_rollout_batches

__all__ = ["AsyncRolloutManager", "PromptBuffer", "generate_rollout_batches"]
