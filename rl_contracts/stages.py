"""The stages of the GRPO loop, by the queue task name each stage reads its rows under.

A row of a global step is read once per stage: the rollout workers read its prompt (``ROLLOUT_TASK``), the reward
workers its response (``REWARD_TASK``), the trainer ranks the scored row (``TRAIN_TASK``). Workers, trainers and
the run's orchestration (which resumes and audits these tasks) all name them from here.
"""

from __future__ import annotations

ROLLOUT_TASK = "rollout"
REWARD_TASK = "reward"
TRAIN_TASK = "train"
