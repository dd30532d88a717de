"""RequestTable: the controller's translation between the wire and the queue's bookkeeping.

The controller's server decodes a request (a :mod:`transfer_queue.wire.protocol` struct) and hands it to
:meth:`RequestTable.handle` with a ``respond`` callback. The table unpacks the request's packed index arrays and
wire structs into plain values, calls :class:`~transfer_queue.state.queue_state.QueueState` (which knows no wire
format), and packs what it answers, now or when a parked call is served later: a
:class:`~transfer_queue.metadata.BatchMeta` goes out as a ``MetaWire``, a
:class:`~transfer_queue.state.put_ledger.Reserved` as a ``Reservation``. The state's orders for storage units are packed
by :meth:`RequestTable.take_outbox`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transfer_queue.errors import InvalidRequest
from transfer_queue.metadata import BatchMeta
from transfer_queue.ops.trace import RequestTrace
from transfer_queue.state.delivery import TaskOptions
from transfer_queue.state.lost_rows import lost_rows_report
from transfer_queue.state.partition_status import consumption_status, dead_letters, production_status
from transfer_queue.state.put_ledger import PutRequest, Reserved
from transfer_queue.state.queue_state import DropBlocks, DropPartition, QueueState
from transfer_queue.state.waiting import Respond
from transfer_queue.wire import protocol as p

_unpack = p.unpack_indexes


def _optional(packed: Any) -> Any:
    return None if packed is None else _unpack(packed)


def to_wire(value: Any) -> Any:
    """A state's answer as the wire carries it (values without a wire form of their own pass as they are)."""
    if isinstance(value, BatchMeta):
        return p.MetaWire.from_meta(value)
    if isinstance(value, Reserved):
        return p.Reservation(
            value.put_id,
            value.partition_uid,
            p.pack_indexes(value.global_indexes),
            p.pack_indexes(value.group_ids),
            [p.Placement(*place) for place in value.placements],
            value.commit_within,
        )
    return value


def storage_message(order: DropBlocks | DropPartition) -> p.DropBlocks | p.DropPartition:
    """A state's order for a storage unit as the unit's request."""
    if isinstance(order, DropBlocks):
        return p.DropBlocks(order.partition_uid, order.block_ids, order.floor)
    return p.DropPartition(order.partition_uid, order.live_uids, order.max_uid, order.floor)


class RequestTable:
    """Decodes controller requests into :class:`QueueState` calls and encodes their answers."""

    def __init__(self, state: QueueState):
        self.state = state
        self.trace: RequestTrace | None = None  # on: every answered request is a span (transfer_queue.ops.trace)
        s = state
        self._calls: dict[type, Callable[[Any], Any]] = {
            p.Reserve: self._reserve,
            p.Commit: lambda req: s.ledger.commit(req.put_id),
            p.Abort: lambda req: s.ledger.abort(req.put_id),
            p.GetMeta: self._get_meta,
            p.Release: lambda req: s.delivery.release(
                req.partition_uid, req.task_name, _unpack(req.global_indexes), req.owner, req.dp_group_id
            ),
            p.Ack: lambda req: s.delivery.ack(
                req.partition_uid,
                req.task_name,
                _unpack(req.global_indexes),
                req.owner,
                req.explicit,
                req.dp_group_id,
                req.again,
            ),
            p.ExtendLease: lambda req: s.delivery.extend(
                req.partition_uid, req.task_name, _unpack(req.global_indexes), req.owner, req.seconds, req.dp_group_id
            ),
            p.CancelGetMeta: lambda req: s.cancel_get_meta(req.owner, req.call_id),
            p.SetTaskOptions: lambda req: s.set_task_options(
                req.task_name, TaskOptions(req.ack, req.lease_s, req.max_deliveries)
            ),
            p.DeadLetters: lambda req: dead_letters(s.table.known(req.partition), req.task_name),
            p.Clear: lambda req: s.clear(req.partition),
            p.ResetConsumption: lambda req: s.reset_consumption(req.partition, req.task_name),
            p.ProductionStatus: lambda req: production_status(s.table.known(req.partition)),
            p.ConsumptionStatus: lambda req: consumption_status(s.table.known(req.partition), req.task_name),
            p.ListPartitions: lambda req: list(s.partitions),
            p.ClosePartition: lambda req: s.close_partition(req.partition),
            p.KvLookup: lambda req: s.kv.lookup(req.partition, req.keys, req.fields),
            p.KvList: lambda req: s.kv.list_keys(req.partition, req.with_tags),
            p.KvClear: lambda req: s.kv_clear(req.partition, req.keys),
            p.KvTag: lambda req: s.kv.tag(req.partition, req.keys, req.values),
            p.SetCustomMeta: lambda req: s.kv.set_custom_meta(
                req.partition_uid, _unpack(req.global_indexes), req.values
            ),
            p.GetCustomMeta: lambda req: s.kv.get_custom_meta(req.partition_uid, _unpack(req.global_indexes)),
            p.ClearSamples: lambda req: s.kv.clear_samples(req.partition_uid, _unpack(req.global_indexes)),
            p.LostRows: lambda req: lost_rows_report(s, s.table.known(req.partition)),
        }

    def handle(self, request: Any, respond: Respond, peer: Any = None) -> None:
        """Answer ``request`` through ``respond(value, error)`` with wire values, now or (for waits) later.

        ``peer``: the connection it came on (None: unknown, e.g. unit tests). Requests that name an ``owner`` tie
        that connection to their client; when the connection closes, its waits are dropped and, after a grace,
        its open puts aborted and its leases handed back (:meth:`QueueState.on_disconnect`).
        """
        call = self._calls.get(type(request))
        if call is None:
            respond(None, InvalidRequest(f"the controller does not handle {type(request).__name__} requests"))
            return
        self.state.connected(getattr(request, "owner", ""), peer)

        def packed(value: Any, error: BaseException | None) -> None:
            respond(to_wire(value), error)

        answer: Respond = packed if self.trace is None else self.trace.wrap(request, packed)
        reserve = isinstance(request, p.Reserve)
        if reserve and peer is not None:
            answer = self.state.owned_by(peer, answer)
        self.state.serve(
            lambda: call(request),
            answer,
            peer,
            timeout=getattr(request, "timeout", 0.0),
            wait_key=None if reserve else getattr(request, "partition", None),
            kind=type(request).__name__,
        )

    @property
    def outbox(self) -> list[tuple[int, p.DropBlocks | p.DropPartition]]:
        """The state's pending orders for storage units, as their requests (left in place)."""
        return [(unit, storage_message(order)) for unit, order in self.state.outbox]

    def take_outbox(self) -> list[tuple[int, p.DropBlocks | p.DropPartition]]:
        """The state's pending orders for storage units, as their requests, emptying it."""
        out = self.outbox
        self.state.outbox = []
        return out

    # ---- requests with more to unpack ----------------------------------------------------------------------
    def _reserve(self, req: p.Reserve) -> Any:
        return self.state.reserve(
            PutRequest(
                req.partition,
                req.num_rows,
                req.fields,
                req.nbytes,
                _optional(req.group_ids),
                req.target_uid,
                _optional(req.target_indexes),
                _optional(req.lengths),
                req.keys,
                req.timeout,
                req.length_fields,
            )
        )

    def _get_meta(self, req: p.GetMeta) -> Any:
        return self.state.get_meta(
            req.partition,
            req.fields,
            req.batch_size,
            req.task_name,
            sampler_params=req.sampler_params,
            get_n_samples=req.get_n_samples,
            timeout=req.timeout,
            lease_s=req.lease_s,
            owner=req.owner,
            call_id=req.call_id,
            peek=req.peek,
            next_auto_round=req.next_auto_round,
        )
