"""What producers (workers/) and consumers (trainers/) of the RL loop both need, so neither imports the other.

- :mod:`rl_contracts.task`: the task contract (:class:`Task`, :func:`load_task`, :func:`load_reward_fn`).
- :mod:`rl_contracts.prompts`: :class:`PromptSource`, a prompt list served in resumable, shuffled epochs.
- :mod:`rl_contracts.rows`: :func:`jagged` and :func:`rows_of`, the token rows of the queue's jagged fields.
- :mod:`rl_contracts.stages`: ``ROLLOUT_TASK``, ``REWARD_TASK``, ``TRAIN_TASK``, the queue task name of each stage.
- :mod:`rl_contracts.actors`: :func:`actor_class`, a ``@ray.remote`` class typed as the actor class it is.
- :mod:`rl_contracts.queue_clock`: :class:`QueueClock`, what a stage's queue calls cost apart from waiting.

Layers: ``transfer_queue`` <- ``rl_contracts`` <- ``workers`` | ``trainers`` <- ``orchestration`` <- ``recipe``.
"""
