"""Rows lost with a storage unit that Ray restarted empty: which, and what the queue does about them (no Ray here).

With ``replicas=1`` a storage unit holds the only copy of its blocks. When it dies and Ray restarts it, the controller
attaches the new incarnation (new ports) and calls :func:`lose_unit`: every committed row with a field on that unit
becomes LOST, together with the rest of its GRPO group (groups are never served split). A lost row

- keeps its global index (never reused, so a BatchMeta from before can never name a newer row); a step makes room
  for as many new rows after its capacity, so a producer can put the same prompts again and the step still fills;
- leaves every ready index: ``get_meta`` never hands it out, and a waiting ``get_meta`` waits for the new rows (or
  its timeout) instead of for a group that can no longer complete;
- keeps each task's delivery state, so a consumer that read it before the loss can still ``ack`` it;
- cannot be read: ``get_data`` of it raises ``RowsLost`` (the client knows every block below the unit's
  ``lost_below`` on it is gone, from the controller's replies) and a put into it raises ``RowsLost``.

:class:`LostRowBook` remembers, per partition, which rows were lost, which of their fields were on the unit and which
unit, for ``client.lost_rows`` and the status calls. Open puts with a block on the unit are aborted.

With ``replicas=2`` every block has a second copy on its replica's unit (``PutLedger.replica_of``): a restarted unit
loses only the rows whose *other* copy is gone too (its unit was restarted empty since), and clients read the other
copy of the rest (their blocks are left with one copy, counted by :func:`single_copies` for the status calls). The
controller then copies those blocks back onto the restarted unit (:func:`plan_refill`, in block id order): every
block below the unit's ``refilled_below`` is on it again, so a block is missing from unit ``u`` only when
``refilled_below[u] <= block < lost_below[u]`` (:func:`missing_on`).

A unit retired for good (Ray will not restart it) is not refilled: the controller copies each block that had a copy
on it onto another unit instead (:func:`start_move`, :func:`plan_move`), per unit holding the other copy onto a third
unit, on another Ray node where there is one (:func:`~transfer_queue.state.placement.move_targets`), in block id
order. :class:`CopiesMoved` records where and how far (``below``); clients learn it from every reply and read the moved
copies (:func:`~transfer_queue.state.placement.current_holders`); refills and losses count them the same way
(:func:`holders_now`): a restarted unit gets back the copies it holds now, read from the other holder now. A queue of
two units has no third: its status says the copies cannot be moved (``cannot_rereplicate``) and the blocks stay
single-copy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from transfer_queue.state.partition import COMMITTED, LOST
from transfer_queue.state.placement import current_holders, move_targets
from transfer_queue.state.ready_index import AVAILABLE, CONSUMED, DEAD, LEASED

if TYPE_CHECKING:
    from transfer_queue.state.partition import PartitionState
    from transfer_queue.state.queue_state import QueueState

DELIVERY_NAMES = {AVAILABLE: "ready", LEASED: "leased", CONSUMED: "acknowledged", DEAD: "dead_lettered"}


@dataclass
class LostRecord:
    """One lost row: which unit took it, which of its fields were on that unit (empty: it was lost with its group)."""

    unit: int
    fields: list[str]
    restart: int  # the unit's restart count that lost it
    key: str | None = None  # partitions used by key: the row's key (forgotten: a kv_put of it makes a new row)


@dataclass
class CopiesMoved:
    """Retired unit ``unit``'s copies being moved: the blocks below ``upto`` (every block handed out when it was
    retired) that had a copy on it, per unit ``s`` holding the other copy onto unit ``to[s]``; done below ``below``.
    ``restart``: the unit's restart count then (a unit Ray brings back and that is retired again has the copies it
    took since moved by a move of their own: :meth:`LostRowBook.move_of`)."""

    unit: int
    to: dict[int, int]
    upto: int
    below: int = 0
    restart: int = 0

    @property
    def done(self) -> bool:
        return self.below >= self.upto


@dataclass
class LostRowBook:
    """Per partition uid, the rows lost (local row -> record); per unit, its restarts and its ``lost_below``."""

    by_uid: dict[int, dict[int, LostRecord]] = field(default_factory=dict)
    lost_below: dict[int, int] = field(default_factory=dict)  # unit -> block ids below this on it are gone
    restarts: dict[int, int] = field(default_factory=dict)
    total: int = 0  # rows lost since the queue started
    # replicas=2: unit -> the blocks below this that it lost are on it again (copied back from their other copy)
    refilled_below: dict[int, int] = field(default_factory=dict)
    blocks_refilled: int = 0  # blocks copied back onto restarted units since the queue started
    refill_waiting: dict[int, int] = field(default_factory=dict)  # unit -> the down unit its refill waits for
    # unit -> (partner, lo, hi) per restart: the blocks it shares with partner in [lo, hi) lost both copies then
    lost_with: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    # per lost_with entry: each move's ``below`` then (in the order of ``moves``; those started since not listed)
    lost_with_moved: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    # replicas=2: the retired units whose copies were moved onto others, in the order they were retired
    moves: list[CopiesMoved] = field(default_factory=list)
    blocks_rereplicated: int = 0  # blocks copied onto another unit for a retired one since the queue started
    cannot_rereplicate: dict[int, str] = field(default_factory=dict)  # retired unit -> why its copies are not moved
    # the units down for good (Ray said it will not restart them; a unit it brings back after all leaves it: its
    # copies a move reached stay where they were moved, the others are refilled like any restarted unit's)
    retired: set[int] = field(default_factory=set)

    def move_of(self, unit: int) -> CopiesMoved | None:
        """The move of ``unit``'s copies since it was retired last (None: none since its last restart; a move of an
        earlier retirement stays in ``moves``: the blocks it reached are where it moved them)."""
        restart = self.restarts.get(unit, 0)
        return next((move for move in self.moves if move.unit == unit and move.restart == restart), None)

    def refilling(self) -> list[int]:
        """The units that lost blocks not all copied back yet."""
        return sorted(u for u, below in self.lost_below.items() if self.refilled_below.get(u, 0) < below)

    def forget_cleared(self, live_uids: set[int]) -> None:
        for uid in [u for u in self.by_uid if u not in live_uids]:
            del self.by_uid[uid]

    def count(self, uid: int) -> int:
        return len(self.by_uid.get(uid, ()))


def lose_unit(state: QueueState, unit: int) -> dict[str, Any]:
    """Storage unit ``unit`` came back empty: mark what it held lost (see the module docstring).

    Returns ``{"lost_below", "restarts", "rows", "partitions"}``: the unit's new floor (every block id below it on the
    unit is gone), its restart count, and the rows lost per partition.
    """
    book: LostRowBook = state.lost
    units = state.config.num_storage_units
    floor = state._next_block * units  # every block of this unit handed out so far is gone
    book.retired.discard(unit)  # back after all (Ray restarted it elsewhere): no longer down for good
    if state.ledger.replica_of is not None:  # the blocks it shares now whose other copy is gone lose both now
        pairs = _lost_with(state, unit, floor)
        book.lost_with.setdefault(unit, []).extend(pairs)
        then = tuple(move.below for move in book.moves)
        book.lost_with_moved.setdefault(unit, []).extend(then for _ in pairs)
    book.lost_below[unit] = floor
    book.refilled_below[unit] = 0
    book.refill_waiting.pop(unit, None)
    restart = book.restarts[unit] = book.restarts.get(unit, 0) + 1
    for put in list(state.open_puts.values()):  # a put that wrote (or would write) there can never commit whole
        if len(put.blocks) and np.any(copy_on(state, put.blocks, unit)):
            state.ledger.abort(put.put_id)
    lost_per_partition = _lose_rows(state, unit, restart)
    return {"lost_below": floor, "restarts": restart, "rows": sum(lost_per_partition.values()),
            "partitions": lost_per_partition, "lost_with": list(book.lost_with.get(unit, [])),
            "lost_with_moved": list(book.lost_with_moved.get(unit, []))}  # fmt: skip


def retire_unit(state: QueueState, unit: int) -> dict[str, Any]:
    """Storage unit ``unit`` is down for good (Ray will not restart it): its copies a move has not reached are gone
    for good (``LostRowBook.retired``, :func:`all_gone`). With replicas=2, a block whose other copy was gone already
    (on a unit restarted and not refilled yet) has no copy left now: its rows are lost, put on that unit's restart,
    whose ``lost_with`` names ``unit`` from now on (so clients tell them lost: the pair held them then), and its
    refill passes them by (it never claims a copy it did not get back).

    Returns ``{"units", "rows", "partitions"}``: the restarted units whose ``lost_with`` grew, the rows lost in all
    and per partition."""
    book: LostRowBook = state.lost
    lost_per_partition: dict[Any, int] = {}
    grown: list[int] = []
    if unit in book.retired:  # told again
        return {"units": grown, "rows": 0, "partitions": lost_per_partition}
    book.retired.add(unit)
    if state.ledger.replica_of is not None:
        then = tuple(move.below for move in book.moves)
        for other in book.refilling():
            if other == unit or other in book.retired:
                continue
            lo, hi = book.refilled_below.get(other, 0), book.lost_below[other]
            book.lost_with.setdefault(other, []).append((unit, lo, hi))
            book.lost_with_moved.setdefault(other, []).append(then)
            grown.append(other)
            for key, rows in _lose_rows(state, other, book.restarts.get(other, 0)).items():
                lost_per_partition[key] = lost_per_partition.get(key, 0) + rows
    return {"units": grown, "rows": sum(lost_per_partition.values()), "partitions": lost_per_partition}


def _lose_rows(state: QueueState, unit: int, restart: int) -> dict[Any, int]:
    """Mark lost the committed rows with a field whose last copy was on ``unit`` (with replicas=2: each of its copies
    is gone), with the rest of their GRPO groups, as taken by ``unit``'s restart ``restart``; puts into them are
    aborted and their blocks forgotten. Returns the rows lost per partition."""
    book: LostRowBook = state.lost
    lost_per_partition: dict[Any, int] = {}
    for part in list(state.partitions.values()):
        rows, fields_of = _rows_on_unit(state, part, unit)
        if not len(rows):
            continue
        for put in [put for put in state.open_puts.values() if put.uid == part.uid]:
            if np.isin(put.rows, rows).any():  # a write into a lost row: abort it
                state.ledger.abort(put.put_id)
        rows = _with_whole_groups(part, rows)
        records = book.by_uid.setdefault(part.uid, {})
        for row in rows.tolist():
            records[row] = LostRecord(unit, fields_of.get(row, []), restart, part.row_keys.get(row))
        part.lose_rows(rows)
        ids = np.fromiter(part.block_nbytes, dtype=np.int64, count=len(part.block_nbytes))
        gone = ids[copy_on(state, ids, unit) & all_gone(state, ids)].tolist()
        part.mark_blocks(gone)
        freed = sum(part.block_nbytes.pop(b) for b in gone)
        part.nbytes -= freed
        state.bytes_held -= freed
        book.total += len(rows)
        lost_per_partition[part.key] = len(rows)
        state._retry_getters(part.key)
    book.forget_cleared({part.uid for part in state.partitions.values()})
    state._retry_putters()
    return lost_per_partition


def _lost_with(state: QueueState, unit: int, floor: int) -> list[tuple[int, int, int]]:
    """replicas=2, ``unit`` restarting empty: per unit ``u`` that could share blocks with it (with the copies held
    now, :func:`holders_now`), ``(u, lo, hi)``: the blocks the two hold in ``[lo, hi)`` lost both copies now. A unit
    restarted and not refilled yet: the blocks it has not got back; a retired unit: those whose copy its move has not
    reached (``below``; a unit retired without a move, every block). A client tells which blocks the two held then by
    the holders with the moves of neither of them (later moves of other units do not change them)."""
    book = state.lost
    retired = book.retired
    out = []
    for other in range(state.config.num_storage_units):
        lo, hi = book.refilled_below.get(other, 0), book.lost_below.get(other, 0)
        if other == unit:
            continue
        if other in retired:
            move = book.move_of(other)
            lo, hi = (0, floor) if move is None else (move.below, move.upto)
        if lo < hi:
            out.append((other, lo, hi))
    return out


def copy_on(state: QueueState, blocks: np.ndarray, unit: int) -> np.ndarray:
    """Per block id (>= 0), whether ``unit`` holds a copy of it: its own unit, or with replicas=2 one of the two units
    holding its copies now (:func:`holders_now`: a retired unit's copy is on the unit it was moved to)."""
    if state.ledger.replica_of is None:
        return blocks % state.config.num_storage_units == unit
    first, second = holders_now(state, blocks)
    return (first == unit) | (second == unit)


def missing_on(state: QueueState, blocks: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Per block id, whether unit ``units[i]`` (one holding a copy of it) lost its copy: the unit was restarted empty
    since the block was written (below its ``lost_below``) and the copy was not copied back (not below its
    ``refilled_below``)."""
    n = state.config.num_storage_units
    lost_below, refilled_below = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for u, below in state.lost.lost_below.items():
        lost_below[u] = below
    for u, below in state.lost.refilled_below.items():
        refilled_below[u] = below
    return (blocks < lost_below[units]) & (blocks >= refilled_below[units])


def all_gone(state: QueueState, blocks: np.ndarray | list[int]) -> np.ndarray:
    """Per block id (>= 0), whether every copy of it is gone: each unit holding one now (:func:`holders_now`) lost it
    (:func:`missing_on`) or is retired (a copy a move has not reached yet: gone for good)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    if state.ledger.replica_of is None:
        return missing_on(state, blocks, blocks % state.config.num_storage_units)
    first, second = holders_now(state, blocks)
    retired = np.fromiter(state.lost.retired, dtype=np.int64)  # their copies not moved yet are gone for good
    return (missing_on(state, blocks, first) | np.isin(first, retired)) & (
        missing_on(state, blocks, second) | np.isin(second, retired)
    )


@dataclass
class RefillStep:
    """One block to copy back onto a restarted unit: its partition, the unit holding the other copy, and what to read
    of it there (every field a cell of the partition still takes from it, rows ``0..num_rows-1``); ``target``: the
    unit to write it to when it is a retired unit's copy being moved (-1: the refilled unit)."""

    block: int
    uid: int
    source: int
    num_rows: int
    fields: list[str]
    nbytes: int
    target: int = -1


@dataclass
class RefillPlan:
    """A restarted unit's refill, planned once: every block of a live partition that the unit lost then, in block id
    order, with what copying it back takes. A block's cells never change after its write, so the plan stays right;
    a block cleared, dropped or lost since is skipped when its turn comes (:func:`still_needed`). Another restart of
    the unit needs a new plan."""

    unit: int
    restart: int  # the unit's restart count it was planned for
    blocks: list[int]
    steps: list[RefillStep]

    def from_block(self, block: int) -> list[RefillStep]:
        """The steps of blocks ``>= block`` (the unit's ``refilled_below``: those below it are done)."""
        return self.steps[bisect.bisect_left(self.blocks, block) :]


def plan_refill(state: QueueState, unit: int) -> RefillPlan:
    """replicas=2: the refill of ``unit`` from where it stands (its ``refilled_below``): one pass over each live
    partition's cells, not one per block."""
    book = state.lost
    below, done = book.lost_below.get(unit, 0), book.refilled_below.get(unit, 0)
    replica_of = state.ledger.replica_of
    steps: list[RefillStep] = []
    if replica_of is not None and done < below:
        for part in state.partitions.values():
            steps.extend(_part_refill(state, part, unit, done, below))
    steps.sort(key=lambda step: step.block)
    return RefillPlan(unit, book.restarts.get(unit, 0), [step.block for step in steps], steps)


def _part_refill(
    state: QueueState,
    part: PartitionState,
    unit: int,
    done: int,
    below: int,
    move: CopiesMoved | None = None,
) -> list[RefillStep]:
    n, cols = part.num_rows, len(part.fields)
    block = part.block[:n, :cols]
    wanted = (block >= done) & (block < below)
    first, second = holders_now(state, block[wanted], before=move)  # a refill: with every move (before=None)
    wanted[wanted] = (first == unit) | (second == unit)
    if not wanted.any():
        return []
    _, col = np.nonzero(wanted)  # row-major: per block, its cells' columns
    ids, offsets = block[wanted], part.offset[:n, :cols][wanted]
    order = np.lexsort((col, ids))
    ids, col, offsets = ids[order], col[order], offsets[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    num_rows = np.maximum.reduceat(offsets, starts) + 1
    names = list(part.field_col)
    one, other = holders_now(state, ids[starts], before=move)  # read from the unit holding the other copy now
    sources = np.where(one == unit, other, one).tolist()
    steps = []
    for i, start in enumerate(starts.tolist()):
        b, source = int(ids[start]), sources[i]
        if b not in part.block_nbytes:
            continue
        stop = int(starts[i + 1]) if i + 1 < len(starts) else len(ids)
        fields = [names[c] for c in np.unique(col[start:stop]).tolist()]
        if move is None:
            steps.append(RefillStep(b, part.uid, source, int(num_rows[i]), fields, part.block_nbytes[b]))
        elif source in move.to:  # else its other copy is on a unit retired before it was moved: nothing to copy
            steps.append(
                RefillStep(b, part.uid, source, int(num_rows[i]), fields, part.block_nbytes[b], move.to[source])
            )
    return steps


def holders_now(
    state: QueueState, blocks: np.ndarray, before: CopiesMoved | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """replicas=2: per block id, the two units holding its copies now (the retired units' copies moved: every move
    recorded, or those before ``before``)."""
    moves = state.lost.moves
    if before is not None:
        moves = moves[: moves.index(before)]
    assert state.ledger.replica_of is not None
    return current_holders(blocks, state.config.num_storage_units, state.ledger.replica_of, moves)


def start_move(state: QueueState, unit: int, node_ids: list[str], retired: set[int]) -> CopiesMoved | str:
    """replicas=2: retired unit ``unit``'s copies are to be moved: record where (a :class:`CopiesMoved`, from block 0
    up to every block handed out so far), or say why not now (a str, also kept for the status: a unit holding the
    other copies is down, or there is no unit to copy to). ``retired``: the units down for good; ``unit`` is marked
    so too. A unit still being refilled takes them only when no other can: a copy written there counts as missing
    (:func:`missing_on`) until its refill passes the block, so the controller's move waits for that first."""
    book = state.lost
    units = state.config.num_storage_units
    up = [u for u in range(units) if u not in retired and u not in state.down_units and u != unit]
    if len(up) < 2:  # without scanning the blocks: no unit to copy to (a queue of two units)
        why = (
            f"the copies of retired storage unit {unit} cannot be re-replicated: a second copy needs a unit other "
            f"than the one holding the first, and only {len(up)} unit{'' if len(up) == 1 else 's'} {up} "
            f"{'is' if len(up) == 1 else 'are'} up; its blocks stay single-copy"
        )
        book.cannot_rereplicate[unit] = why
        return why
    survivors: set[int] = set()
    for part in state.partitions.values():
        ids = np.fromiter(part.block_nbytes, dtype=np.int64, count=len(part.block_nbytes))
        first, second = holders_now(state, ids)
        survivors |= set(second[first == unit].tolist()) | set(first[second == unit].tolist())
    survivors -= retired  # both copies gone for good: nothing to copy
    waiting = sorted(survivors & state.down_units)
    targets = (
        f"storage unit {waiting[0]}, which holds the other copies, is down"
        if waiting
        else move_targets(unit, survivors, node_ids, state.down_units | retired | set(book.refilling()))
    )
    if isinstance(targets, str) and not waiting:  # only a unit still refilling can take them: it does (see above)
        targets = move_targets(unit, survivors, node_ids, state.down_units | retired)
    if isinstance(targets, str):
        book.cannot_rereplicate[unit] = targets
        return targets
    book.cannot_rereplicate.pop(unit, None)
    move = CopiesMoved(unit, targets, state._next_block * units, restart=book.restarts.get(unit, 0))
    book.moves.append(move)
    book.retired.add(unit)  # its copies the move has not reached are gone for good
    return move


def plan_move(state: QueueState, move: CopiesMoved) -> RefillPlan:
    """replicas=2: the copies of a retired unit still to move (from ``move.below``), in block id order: each block of a
    live partition with a copy on it, read from the unit holding its other copy, written to the unit chosen for that
    one. Planned once per move, like a refill (a block cleared or dropped meanwhile is skipped when its turn comes)."""
    replica_of = state.ledger.replica_of
    steps: list[RefillStep] = []
    if replica_of is not None and not move.done:
        for part in state.partitions.values():
            steps.extend(_part_refill(state, part, move.unit, move.below, move.upto, move))
    steps.sort(key=lambda step: step.block)
    return RefillPlan(move.unit, -1, [step.block for step in steps], steps)


def still_needed(state: QueueState, step: RefillStep) -> bool:
    """Whether a planned block is still to be copied back: its partition holds it (not cleared or dropped) and its
    other copy lives (else its rows were lost: nothing to copy)."""
    return block_live(state, step.uid, step.block) and not all_gone(state, [step.block])[0]


def block_live(state: QueueState, uid: int, block: int) -> bool:
    """Whether ``block`` of partition ``uid`` is still held (not cleared, dropped or lost): a refill writes it only
    then, so a copy never outlives its drop."""
    part = state.table.by_uid(uid)
    return part is not None and block in part.block_nbytes


def single_copies(state: QueueState) -> dict[str, int]:
    """For status (replicas=2): blocks of live partitions one of whose two copies is gone (its unit restarted empty
    since) or on a unit that is down now, and the rows with a field in one; ``{}`` with one copy."""
    replica_of = state.ledger.replica_of
    if replica_of is None:
        return {}
    down = np.fromiter(state.down_units, dtype=np.int64, count=len(state.down_units))
    blocks = rows = 0
    for part in state.partitions.values():
        ids = np.fromiter(part.block_nbytes, dtype=np.int64, count=len(part.block_nbytes))
        weak_mask = np.zeros(len(ids), dtype=bool)
        for holders in holders_now(state, ids):  # a retired unit's copies moved are on the unit they were moved to
            weak_mask |= missing_on(state, ids, holders) | np.isin(holders, down)
        weak = ids[weak_mask].tolist()
        blocks += len(weak)
        if weak:
            n, cols = part.num_rows, len(part.fields)
            on = (
                np.isin(part.block[:n, :cols], np.fromiter(weak, dtype=np.int64))
                & (part.state[:n] == COMMITTED)[:, None]
            )
            rows += int(on.any(axis=1).sum())
    return {"blocks_single_copy": blocks, "rows_single_copy": rows}


def refill_summary(state: QueueState) -> dict[str, Any]:
    """For status (replicas=2): the restarted units whose lost copies are being copied back (``refilling``), those of
    them waiting for a down unit that holds the other copy (``refill_waiting``: unit -> that unit), and the blocks
    copied back since the queue started (``blocks_refilled``); the retired units whose copies are being moved onto
    others (``rereplicating``), those whose copies were all moved (``rereplicated``: unit -> {unit holding the other
    copy: unit it was moved to}), those whose copies cannot be moved and why (``cannot_rereplicate``), and the blocks
    moved since the queue started (``blocks_rereplicated``)."""
    book: LostRowBook = state.lost
    moves = [move for unit in sorted(book.retired) if (move := book.move_of(unit)) is not None]
    return {
        "refilling": book.refilling(),
        "refill_waiting": dict(book.refill_waiting),
        "blocks_refilled": book.blocks_refilled,
        "rereplicating": [move.unit for move in moves if not move.done],
        "rereplicated": {move.unit: dict(move.to) for move in moves if move.done},
        "cannot_rereplicate": dict(book.cannot_rereplicate),
        "blocks_rereplicated": book.blocks_rereplicated,
    }


def _rows_on_unit(state: QueueState, part: PartitionState, unit: int) -> tuple[np.ndarray, dict[int, list[str]]]:
    """Committed rows with a field whose last copy was on ``unit``, and per row the names of those fields."""
    n, cols = part.num_rows, len(part.fields)
    block = part.block[:n, :cols]
    used = block >= 0
    on = np.zeros_like(used)
    on[used] = copy_on(state, block[used], unit) & all_gone(state, block[used])
    on &= (part.state[:n] == COMMITTED)[:, None]
    rows = np.flatnonzero(on.any(axis=1))
    names = list(part.field_col)  # column order
    return rows, {int(r): [names[c] for c in np.flatnonzero(on[r]).tolist()] for r in rows}


def _with_whole_groups(part: PartitionState, rows: np.ndarray) -> np.ndarray:
    """``rows`` plus the other committed members of their GRPO groups."""
    if part.group_size == 1:
        return rows
    groups = set(part.group[rows].tolist())
    members = [r for g in groups for r in part.group_rows.get(g, [])]
    return np.unique(np.concatenate([rows, np.asarray(members, dtype=np.int64)]))


def lost_rows_report(state: QueueState, part: PartitionState) -> list[dict[str, Any]]:
    """``client.lost_rows``: one dict per lost row of ``part`` (oldest loss first), with its global index, GRPO group
    id, custom meta (tags), kv key, the unit and the fields that were on it, and each task's delivery state of it now
    (``ready``: never handed out or handed back; ``leased``; ``acknowledged``; ``dead_lettered``)."""
    records = state.lost.by_uid.get(part.uid, {})
    out = []
    for row, record in records.items():
        if part.state[row] != LOST:  # cannot happen today (a lost row stays lost until its partition is cleared)
            continue
        tasks = {name: DELIVERY_NAMES[int(task.consumption[row])] for name, task in part.tasks.items()}
        out.append(
            {
                "global_index": part.base_index + row,
                "group_id": int(part.group[row]),
                "unit": record.unit,
                "fields": record.fields,
                "custom_meta": part.custom_meta.get(row, {}),
                "key": record.key,
                "tasks": tasks,
            }
        )
    return out


def lost_summary(state: QueueState) -> dict[str, Any]:
    """For ``status()``: rows lost since start, per unit its restarts, and the lost rows per live partition."""
    return {
        "rows_lost_total": state.lost.total,
        "unit_restarts": dict(state.lost.restarts),
        "rows_lost": {part.key: part.num_lost for part in state.partitions.values() if part.num_lost},
    }
