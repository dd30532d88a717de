"""What cleared partitions leave behind stays flat (issue 23 defect 9): per-task metric series and the controller's
tracked state, at the real bounds."""

from __future__ import annotations

from transfer_queue.errors import NotLeased
from transfer_queue.metadata import FieldSchema
from transfer_queue.ops.metrics import ControllerMetrics
from transfer_queue.state import delivery
from transfer_queue.state import events as events_module
from transfer_queue.state.partition_status import row_state_counts
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


def owner_tables(q) -> dict[str, int]:
    """What the delivery bookkeeping keeps per owner (client instance) and per connection."""
    book = q.state.leases
    tables = ("_owner_ids", "by_owner", "peers", "owner_of_peer", "orphaned", "leases")
    return {f"state.delivery.leases.{name}": len(getattr(book, name)) for name in tables}


def test_10000_short_lived_clients_leave_the_delivery_bookkeeping_flat(make_queue):
    """A week of clients, each connecting, leasing, then acking, releasing, cancelling, letting its lease expire or
    vanishing with it, and disconnecting (issue 23 defect 9): nothing of them stays once their rows are gone."""
    q = make_queue(global_batch_size=64, lease_s=1.0, disconnect_grace=0.5)
    peak: dict[int, dict[str, int]] = {2000: {}, 10000: {}}

    def note(clients: int, sizes: dict[str, int]) -> None:
        most = peak[2000 if clients <= 2000 else 10000]
        for key, size in sizes.items():
            most[key] = max(most.get(key, 0), size)

    for step in range(10000 // 16):
        q.put(step, 64, X)
        expiring = []
        for i in range(step * 16, step * 16 + 16):
            note(i, owner_tables(q))  # the owner id table at its fullest: just before a new client's lease
            owner, conn = f"worker-{i}#{i:012x}", ("tcp", i)
            meta = q.send(p.GetMeta(step, ["x"], 4, "train", owner=owner, call_id=1), conn).result().to_meta()
            rows = (meta.partition_uid, "train", p.pack_indexes(meta.global_indexes))
            ending = i % 5
            if ending == 0:  # acknowledged, over a second connection of the same client
                q.send(p.Ack(*rows, owner=owner, explicit=True), ("unix", i)).result()
                q.state.on_disconnect(("unix", i))
            elif ending == 1:  # released, after a stranger tried to extend them
                stranger = q.send(p.ExtendLease(*rows, owner=f"stranger-{i}", seconds=5.0), ("tcp", -i))
                assert isinstance(stranger.error, NotLeased)
                q.state.on_disconnect(("tcp", -i))
                q.send(p.Release(*rows, owner=owner), conn).result()
            elif ending == 2:  # abandoned: the get_meta's cancel hands them back
                q.send(p.CancelGetMeta(owner, 1), conn).result()
            if ending == 3:  # its lease expires while it is connected; it disconnects later
                expiring.append(conn)
            else:  # 4: it vanishes holding its lease, which goes back after the grace
                q.state.on_disconnect(conn)
        q.advance(2.0)  # past lease_s and disconnect_grace: every lease of the step has ended
        for conn in expiring:
            q.state.on_disconnect(conn)
        q.advance(1.0)
        q.clear(step)
        q.state.outbox.clear()
        note((step + 1) * 16, {**tracked_entries(q), **owner_tables(q)})
    grown = {k: (peak[2000].get(k, 0), v) for k, v in peak[10000].items() if v > peak[2000].get(k, 0)}
    assert not grown, f"grows with the number of clients (most over the first 2,000, over all 10,000): {grown}"
    tables = owner_tables(q)
    # owner ids are swept when the table doubles: at most the sweep's threshold, whatever the clients seen
    assert tables.pop("state.delivery.leases._owner_ids") <= delivery.OWNER_SWEEP_MIN
    assert tables == dict.fromkeys(tables, 0)  # no lease, connection or grace of a client that left


def test_a_sweep_keeps_the_ids_of_owners_that_live_rows_carry(make_queue, monkeypatch):
    """Owner ids are forgotten only when no live row carries them: a client whose acknowledged rows are still there
    may release them after any number of sweeps, and a forgotten client that comes back leases as before."""
    monkeypatch.setattr(delivery, "OWNER_SWEEP_MIN", 8)  # a sweep every few clients
    q = make_queue(global_batch_size=4, lease_s=1.0, disconnect_grace=0.5)
    q.put("keep", 4, X)
    keeper = q.send(p.GetMeta("keep", ["x"], 4, "train", owner="keeper"), ("tcp", "keeper")).result().to_meta()
    kept_rows = (keeper.partition_uid, "train", p.pack_indexes(keeper.global_indexes))
    q.ok(p.Ack(*kept_rows, owner="keeper", explicit=True))
    q.state.on_disconnect(("tcp", "keeper"))
    q.advance(1.0)  # the keeper is gone past its grace; its acknowledged rows stay
    for step in range(40):
        q.put(step, 4, X)
        meta = q.send(p.GetMeta(step, ["x"], 4, "train", owner=f"churn-{step}"), ("tcp", step)).result().to_meta()
        q.ok(p.Ack(meta.partition_uid, "train", p.pack_indexes(meta.global_indexes), f"churn-{step}", True))
        q.state.on_disconnect(("tcp", step))
        q.clear(step)
    owners = q.state.leases._owner_ids
    assert "keeper" in owners and "churn-0" not in owners and len(owners) <= 2 * delivery.OWNER_SWEEP_MIN
    q.send(p.Release(*kept_rows, owner="keeper"), ("tcp", "keeper-again")).result()
    assert row_state_counts(q.state.partitions["keep"], "train")["ready"] == 4  # released by the keeper
    q.put(40, 4, X)  # a forgotten client leases, acknowledges and is refused others' rows as before
    meta = q.send(p.GetMeta(40, ["x"], 4, "train", owner="churn-0"), ("tcp", 0)).result().to_meta()
    rows = (meta.partition_uid, "train", p.pack_indexes(meta.global_indexes))
    assert isinstance(q.send(p.Ack(*rows, owner="churn-1", explicit=True)).error, NotLeased)
    assert q.ok(p.Ack(*rows, owner="churn-0", explicit=True)) == {"acknowledged": 4}
