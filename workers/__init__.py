"""Workers of the RL loop: inference engines, reward tasks and the models they run."""
