"""What cleared partitions leave behind stays flat (issue 23 defect 9): per-task metric series and the controller's
tracked state, at the real bounds."""

from __future__ import annotations

from transfer_queue.metadata import FieldSchema
from transfer_queue.ops.metrics import ControllerMetrics
from transfer_queue.state import events as events_module
from transfer_queue.wire import protocol as p

X = {"x": FieldSchema("dense", "float32", ())}


def test_300_cleared_steps_with_distinct_task_names_leave_a_bounded_number_of_series(make_queue):
    q = make_queue(global_batch_size=2, num_global_batch=2, lease_s=1.0)
    metrics, events = ControllerMetrics(), q.state.events
    events.track(metrics.gets, metrics.get_rows)  # as the controller's server does
    for step in range(300):
        task = f"task-{step}"
        q.put(step, 2, X)
        get = q.get_request(step, "x", 2, task)
        metrics.answered("get_meta", 0.0, get, q.ok(get), None)
        q.advance(1.5)  # the lease expires: counted for this task
        metrics.answered("get_meta", 0.0, get, q.ok(get), None)  # redelivered
        q.clear(step)
    bound = events_module.IDLE_TASK_SERIES
    for counter in (metrics.gets, metrics.get_rows, events.lease_expiries, events.redeliveries):
        assert 0 < len(counter) <= bound, f"{len(counter)} task series after 300 steps"
        assert "task-299" in counter  # the most recent names stay
    assert "task-0" not in metrics.gets


def test_a_task_a_live_partition_follows_keeps_its_series(make_queue):
    q = make_queue(global_batch_size=2, num_global_batch=2)
    metrics, events = ControllerMetrics(), q.state.events
    events.track(metrics.gets)
    q.put("keep", 2, X)
    get = q.get_request("keep", "x", 1, "steady")
    metrics.answered("get_meta", 0.0, get, q.ok(get), None)
    for step in range(100):
        q.put(step, 2, X)
        get = q.get_request(step, "x", 2, f"once-{step}")
        metrics.answered("get_meta", 0.0, get, q.ok(get), None)
        q.clear(step)
    assert metrics.gets["steady"] == 1 and len(metrics.gets) <= events_module.IDLE_TASK_SERIES + 1


def tracked_entries(q) -> dict[str, int]:
    """The entries of every dict, set, list and deque the controller's state keeps (two levels down)."""
    out: dict[str, int] = {}

    def walk(obj, path: str, depth: int) -> None:
        for name, value in vars(obj).items():
            if isinstance(value, (dict, set, list)) or type(value).__name__ in ("deque", "Counter"):
                out[f"{path}.{name}"] = len(value)
            elif depth < 2 and type(value).__module__.startswith("transfer_queue.state"):
                walk(value, f"{path}.{name}", depth + 1)

    walk(q.state, "state", 0)
    out.pop("state.outbox")  # orders for storage units: the server sends and empties it every loop
    return out


def test_5000_cleared_named_partitions_leave_the_tracked_state_flat(make_queue):
    q = make_queue(global_batch_size=4)
    after: dict[int, dict[str, int]] = {}
    for i in range(5000):
        name = f"run-{i}"
        q.put(name, 4, X)
        meta = q.get(name, "x", 4, "train")
        q.ok(p.Ack(meta.partition_uid, "train", p.pack_indexes(meta.global_indexes)))
        q.clear(name)
        q.state.outbox.clear()
        q.advance(0.05)  # 20 steps a second: commits older than their put's deadline + put_grace are forgotten
        if i + 1 in (2000, 5000):
            after[i + 1] = tracked_entries(q)
    grown = {k: (after[2000][k], v) for k, v in after[5000].items() if v > after[2000].get(k, 0)}
    assert not grown, f"grows with cleared partitions (after 2,000 cycles, after 5,000): {grown}"
