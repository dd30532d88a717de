"""Task names over the wire: a queue that declares its ``task_names`` refuses a typo at once, and one that does not
warns the caller about a task name never seen before that starts a new consumer of a partition."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from transfer_queue.errors import UnknownTask, UnknownTaskWarning


def rows(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, batch_size=[n])


def test_a_queue_that_declares_its_task_names_refuses_a_typo_at_once(make_view: Callable[..., Any]) -> None:
    view = make_view(global_batch_size=4, num_storage_units=1, default_timeout=30.0, task_names=["rollout", "train"])
    client, step = view.client, view.step()
    client.put(rows(4), global_step=step)
    with pytest.raises(
        UnknownTask,
        match=r"^task_name='rolout' is not one of the queue's task_names \['rollout', 'train'\] \(did you mean "
        r"'rollout'\?\)$",
    ):
        client.get_meta(["x"], 4, global_step=step, task_name="rolout")
    assert client.config.task_names == ("rollout", "train")
    assert len(client.get_meta(["x"], 4, global_step=step, task_name="rollout")) == 4


def test_a_new_task_name_that_reads_every_row_again_warns_the_caller_once(queue: Any) -> None:
    client, first, second = queue.client, queue.step(), queue.step()
    known, typo = f"rollout-{uuid.uuid4().hex[:6]}", f"rolout-{uuid.uuid4().hex[:6]}"
    for step in (first, second):
        client.put(rows(4), global_step=step)
        client.get_data(client.get_meta(["x"], 4, global_step=step, task_name=known))
    with pytest.warns(
        UnknownTaskWarning, match=rf"^task_name='{typo}' was never seen before and starts a new consumer"
    ):
        meta = client.get_meta(["x"], 4, global_step=second, task_name=typo)
    assert len(meta) == 4 and "warning" not in meta.extra  # served every row again: the warning says so
    client.reset_consumption(task_name=typo, global_step=second)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownTaskWarning)
        client.get_meta(["x"], 4, global_step=second, task_name=typo)  # once
