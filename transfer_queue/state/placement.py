"""Which storage unit holds which rows of a put: a pure function."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from transfer_queue.errors import StorageUnavailable
from transfer_queue.metadata import current_holders

__all__ = ["current_holders", "move_targets", "place_rows", "replica_units"]

MIN_BYTES_PER_UNIT = 1 << 20


def place_rows(
    num_rows: int,
    nbytes: int,
    num_units: int,
    first_unit: int,
    min_bytes_per_unit: int = MIN_BYTES_PER_UNIT,
    down: Collection[int] = (),
    replica_of: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Split rows ``[0, num_rows)`` of a put into contiguous chunks, one per storage unit used.

    A put is spread over as many units as its size justifies (at least ``min_bytes_per_unit`` each), so a large
    put moves over several sockets in parallel while a small one costs a single message. Units are taken round
    robin from ``first_unit`` so that successive small puts spread out. Units in ``down`` (their connection to
    the controller is lost: dead or unreachable) are skipped. With ``replica_of`` (replicas=2: each unit's partner,
    which gets a copy of its chunk) a unit is used only if neither it nor its partner already takes a chunk or a
    copy, so each unit gets at most one write per put (a client sends one request per unit and call).

    Returns:
        ``(unit, start, stop)`` per chunk, chunks in row order.

    Raises:
        StorageUnavailable: every unit is down.

    >>> place_rows(8, 100, 2, 1)
    [(1, 0, 8)]
    >>> place_rows(8, 4 << 20, 2, 0)
    [(0, 0, 4), (1, 4, 8)]
    >>> place_rows(8, 4 << 20, 4, 0, replica_of=[1, 2, 3, 0])
    [(0, 0, 4), (2, 4, 8)]
    """
    if num_rows < 1 or num_units < 1:
        raise ValueError(f"place_rows needs num_rows >= 1 and num_units >= 1, got {num_rows} and {num_units}")
    start = first_unit % num_units
    live = [u for u in (*range(start, num_units), *range(start)) if u not in down]  # round robin from first_unit
    if replica_of is not None:
        used: set[int] = set()
        for u in list(live):
            if u in used or replica_of[u] in used:
                live.remove(u)
            else:
                used |= {u, replica_of[u]}
    if not live:
        raise StorageUnavailable(f"every storage unit is down ({sorted(down)}); no put can be placed")
    chunks = max(1, min(len(live), num_rows, nbytes // max(1, min_bytes_per_unit)))
    bounds = [i * num_rows // chunks for i in range(chunks + 1)]
    return [(live[i], bounds[i], bounds[i + 1]) for i in range(chunks)]


def replica_units(node_ids: Sequence[str], replicas: int) -> list[int] | None:
    """Which unit holds the second copy of each unit's blocks (``replicas=2``; ``None`` for one copy): the next unit
    round robin that runs on another Ray node (or any other unit when all run on one node, or outside Ray), taking
    the one holding the fewest copies so far, so that copies spread evenly.

    Fixed when the queue starts (a unit Ray restarts elsewhere keeps its partner), so every client, the controller
    and the units agree on it from ``ControllerInfo.replica_units``.

    >>> replica_units(["a", "a", "b", "b"], 2)
    [2, 3, 0, 1]
    >>> replica_units(["", "", ""], 2)
    [1, 2, 0]
    """
    if replicas == 1:
        return None
    n = len(node_ids)
    if n < 2:
        raise StorageUnavailable(f"replicas={replicas} needs at least 2 storage units, got {n}")
    out: list[int] = []
    for u in range(n):
        others = [(u + i) % n for i in range(1, n)]  # round robin from the next unit
        candidates = [v for v in others if node_ids[v] != node_ids[u]] or others
        out.append(min(candidates, key=out.count))  # the one holding the fewest copies so far (the first of those)
    return out


def move_targets(
    unit: int, survivors: Collection[int], node_ids: Sequence[str], unusable: Collection[int]
) -> dict[int, int] | str:
    """replicas=2: where the copies that retired unit ``unit`` held go, per unit holding their other copy: the next
    unit round robin after it that is usable (not retired nor down, not ``unit``) and on another Ray node than it
    (any usable one when none is), as :func:`replica_units` chooses a partner. Returns why not (a str) when some
    survivor has no such unit: a queue of two units has no third to copy to.

    >>> move_targets(0, [1, 2], ["a", "b", "c"], {0})
    {1: 2, 2: 1}
    >>> move_targets(0, [1], ["", ""], {0})
    'no storage unit other than 0 and 1 is up to take the copies of storage unit 0 whose other copy is on 1'
    """
    n = len(node_ids)
    out: dict[int, int] = {}
    for survivor in sorted(survivors):
        others = [(survivor + i) % n for i in range(1, n)]
        usable = [v for v in others if v != unit and v not in unusable]
        elsewhere = [v for v in usable if node_ids[v] != node_ids[survivor] or not node_ids[v]]
        if not usable:
            return (
                f"no storage unit other than {unit} and {survivor} is up to take the copies of storage unit {unit} "
                f"whose other copy is on {survivor}"
            )
        out[survivor] = (elsewhere or usable)[0]
    return out
