"""Trainers: the pure RL math (advantages, losses, sample filters) and the training backends."""
