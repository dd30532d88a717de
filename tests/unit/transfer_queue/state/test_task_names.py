"""Task names that fail fast: a queue that declares its ``task_names`` refuses any other, and one that does not warns
once about a name never seen before that starts a new consumer of a partition other tasks already consume."""

from __future__ import annotations

import pytest

from transfer_queue.config import QueueConfig
from transfer_queue.errors import InvalidRequest, UnknownTask
from transfer_queue.metadata import FieldSchema
from transfer_queue.wire import protocol as p

X = {"x": FieldSchema("dense", "float32", ())}


def test_a_queue_that_declares_its_task_names_refuses_any_other_at_once(make_queue):
    q = make_queue(task_names=("rollout", "reward", "train"))
    q.put(0, 4, X)
    with pytest.raises(UnknownTask) as caught:
        q.ok(q.get_request(0, "x", 2, "rolout"))
    assert str(caught.value) == (
        "task_name='rolout' is not one of the queue's task_names ['rollout', 'reward', 'train'] (did you mean "
        "'rollout'?)"
    )
    assert isinstance(caught.value, InvalidRequest)
    assert len(q.get(0, "x", 4, "rollout")) == 4  # nothing was taken for the typo


def test_declared_task_names_also_guard_task_options_and_samplers(make_queue):
    q = make_queue(task_names=("train",))
    with pytest.raises(UnknownTask, match=r"^task_name='trian' is not one of the queue's task_names \['train'\] "):
        q.ok(p.SetTaskOptions("trian", "explicit"))
    with pytest.raises(UnknownTask, match=r"^task_name='eval' is not one of the queue's task_names \['train'\]$"):
        q.state.register_sampler("eval", None)


@pytest.mark.parametrize(
    ("task_names", "message"),
    [
        (("a", ""), r"task_names must be non-empty strs, got \('a', ''\)"),
        (("a", "a"), r"task_names names 'a' twice"),
        ("train", r"task_names must be a list or tuple of task names, got 'train'"),
    ],
)
def test_task_names_are_validated(task_names, message):
    with pytest.raises(InvalidRequest, match=message):
        QueueConfig(4, task_names=task_names)


def test_a_new_task_name_on_a_partition_that_known_tasks_consume_is_warned_about_once(make_queue):
    q = make_queue()
    for step in (0, 1):
        q.put(step, 4, X)
    assert "warning" not in q.get(0, "x", 2, "rollout").extra
    assert "warning" not in q.get(0, "x", 2, "reward").extra  # the first partition: every task is new there
    assert "warning" not in q.get(1, "x", 2, "rollout").extra
    typo = q.get(1, "x", 2, "rolout")
    assert typo.extra["warning"] == (
        "task_name='rolout' was never seen before and starts a new consumer of global_step=1, which the tasks "
        "['rollout'] already consume: it will be served every row again (did you mean 'rollout'?). Declare the "
        "queue's task_names to refuse unknown names"
    )
    assert "warning" not in q.get(1, "x", 2, "rolout").extra  # once


def test_a_task_announced_with_options_is_not_warned_about(make_queue):
    q = make_queue()
    for step in (0, 1):
        q.put(step, 4, X)
    q.get(0, "x", 2, "rollout")
    q.get(1, "x", 2, "rollout")
    q.ok(p.SetTaskOptions("train", "explicit"))
    assert "warning" not in q.get(1, "x", 2, "train").extra


def test_a_new_task_on_a_partition_nobody_consumes_yet_is_not_warned_about(make_queue):
    q = make_queue()
    for step in (0, 1):
        q.put(step, 4, X)
    q.get(0, "x", 2, "rollout")
    assert "warning" not in q.get(1, "x", 2, "eval").extra
