"""The stages of the GRPO loop, by the queue task name each stage reads its rows under.

A row of a global step is read once per stage: the rollout workers read its prompt (``ROLLOUT_TASK``), the reward
workers its response (``REWARD_TASK``), the trainer ranks the scored row (``TRAIN_TASK``). Workers, trainers and
the run's orchestration (which resumes and audits these tasks) all name them from here.
"""

from __future__ import annotations

ROLLOUT_TASK = "rollout"
REWARD_TASK = "reward"
TRAIN_TASK = "train"

# The Ray concurrency group a rollout or reward worker runs a step again in (the driver's relaunch, after rows of the
# step died with a storage unit). Its own group, so the step launched ahead of it (whose rollout waits for weights the
# trainer publishes only after this step, and whose scoring waits for that rollout) cannot hold it up: queued behind
# that call, the redo would wait for the trainer, which waits for the redo.
REDO_GROUP = "redo"
# How many calls of the redo group a worker runs at once. More than one: the run's supervisor makes a dead worker's
# calls of several steps again there (orchestration/supervisor.py), and a scoring call of step s + 1 waits for rows
# that exist only once step s trained; run one at a time, the call of step s could be queued behind it. A run with
# more steps in flight than this (max_staleness + 2) could still queue one behind the others.
REDO_CONCURRENCY = 8
