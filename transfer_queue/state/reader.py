"""MetaReader: serving get_meta from a partition's ready rows, without Ray, sockets or the wire format.

A get_meta is validated (all of it, before any waiting) into a :class:`~transfer_queue.state.dp_rounds.GetMetaJob`;
serving it asks the task's sampler for ready rows (the built-in samplers select from the partition's incremental ready
index; a user sampler is handed the rows of that index, and only a ``filter_ready_indices`` of the seed's form sees the
whole table) and leases them to the caller, or, in a DP round, to the
round (:mod:`transfer_queue.state.dp_rounds`). A call that cannot be served yet returns ``None`` and waits (the caller
parks it); it is short only when no more rows can come (the partition is closed and nothing is in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from transfer_queue.config import QueueConfig
from transfer_queue.errors import GetMetaTimeout, IncompleteGroups, InvalidRequest
from transfer_queue.metadata import BatchMeta, describe_partition
from transfer_queue.samplers import BaseSampler
from transfer_queue.state.delivery import ROUND_OWNER, Delivery, check_lease_s
from transfer_queue.state.dp_rounds import MAX_DP_SIZE, DPRounds, GetMetaJob
from transfer_queue.state.partition import PartitionState
from transfer_queue.state.partition_table import PartitionTable
from transfer_queue.state.put_ledger import PutLedger
from transfer_queue.state.ready_index import AVAILABLE, ReadyIndex
from transfer_queue.state.selection import ReadyView, select_with_user_sampler
from transfer_queue.state.task_names import TaskNames


class MetaReader:
    """Validates and serves get_meta calls over the queue's partitions, leases and DP rounds.

    Args:
        config: the queue's config (``num_n_samples``).
        table, ledger, delivery, rounds: the partitions, the open puts (a partition with a put in flight is not
            finished), the leases and the DP rounds.
        sampler_for: the sampler of a task.
        task_names: the queue's known task names (a declared queue refuses others; else a new name may warn).
    """

    def __init__(
        self,
        config: QueueConfig,
        table: PartitionTable,
        ledger: PutLedger,
        delivery: Delivery,
        rounds: DPRounds,
        sampler_for: Callable[[str], BaseSampler],
        task_names: TaskNames | None = None,
    ):
        self.config = config
        self.table = table
        self.ledger = ledger
        self.delivery = delivery
        self.rounds = rounds
        self.sampler_for = sampler_for
        self.task_names = task_names if task_names is not None else TaskNames(config)

    def job(
        self,
        partition: Any,
        fields: list[str],
        batch_size: int,
        task_name: str,
        *,
        sampler_params: dict[str, Any] | None = None,
        get_n_samples: bool = False,
        timeout: float = 30.0,
        lease_s: float | None = None,
        owner: str = "",
        call_id: int = 0,
        peek: bool = False,
        connection: Any = None,
        next_auto_round: int | None = None,
    ) -> GetMetaJob:
        """Validate a get_meta before it takes anything or waits.

        ``connection``: the one it came on; it numbers the automatic DP rounds of a rank that gives no ``world_rank``,
        going on from ``next_auto_round`` (the round the calling thread expects) on a connection new to this
        controller.
        """
        key = self.table.check_key(partition)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidRequest(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise InvalidRequest(f"data_fields must be a non-empty list of field names, got {fields!r}")
        if len(set(fields)) != len(fields):
            raise InvalidRequest(f"data_fields names a field twice: {fields}")
        if not isinstance(task_name, str) or not task_name:
            raise InvalidRequest(f"task_name must be a non-empty str, got {task_name!r}")
        if not 0 < timeout < float("inf"):
            raise InvalidRequest(f"timeout must be a finite number of seconds > 0, got {timeout}")
        check_lease_s(lease_s)
        sampler = self.sampler_for(task_name)
        params = {**sampler.default_sampler_params(), **(sampler_params or {})}
        dp_size, dp_rank, dp_group_id = params.get("dp_size", 1), params.get("dp_rank", 0), params.get("dp_group_id")
        for name, value in (("dp_size", dp_size), ("dp_rank", dp_rank)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(f"sampler_params[{name!r}] must be an int, got {value!r}")
        if not 1 <= dp_size <= MAX_DP_SIZE:
            raise InvalidRequest(f"dp_size must lie in [1, {MAX_DP_SIZE}], got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise InvalidRequest(f"dp_rank must lie in [0, dp_size={dp_size}), got dp_rank={dp_rank}")
        if dp_group_id is not None and not isinstance(dp_group_id, (str, int)):
            raise InvalidRequest(f"dp_group_id must be a str or int, got {dp_group_id!r}")
        if peek and (dp_group_id is not None or dp_size > 1):
            raise InvalidRequest("a non-consuming get_meta (peek) cannot take part in a DP round")
        whole = get_n_samples or sampler.serves_whole_groups
        n = self.config.num_n_samples
        if whole and batch_size % n:
            raise IncompleteGroups(
                f"batch_size={batch_size} is not divisible by num_n_samples={n}; whole groups are served"
            )
        part = self.table.live(key)  # raises now if the partition was cleared
        if part is not None:
            part.check_new_task(task_name)
        warning = self.task_names.on_get_meta(task_name, part)
        auto_round = None
        if dp_group_id is None and dp_size > 1:
            world_rank = params.get("world_rank")
            if world_rank is not None and (not isinstance(world_rank, int) or isinstance(world_rank, bool)):
                raise InvalidRequest(f"sampler_params['world_rank'] must be an int, got {world_rank!r}")
            caller = connection if world_rank is None else world_rank
            call = (owner, call_id) if owner and call_id and owner != ROUND_OWNER else None
            client = owner if owner != ROUND_OWNER else ""
            hint = next_auto_round if world_rank is None else None
            if hint is not None and (not isinstance(hint, int) or isinstance(hint, bool) or hint < 0):
                raise InvalidRequest(f"next_auto_round must be an int >= 0 or None, got {hint!r}")
            dp_group_id, auto_round = self.rounds.number(key, task_name, dp_rank, caller, call, client, hint)
        return GetMetaJob(
            key,
            fields,
            batch_size,
            task_name,
            sampler,
            params,
            whole,
            dp_size,
            dp_rank,
            None if dp_group_id is None else str(dp_group_id),
            lease_s,
            owner,
            call_id,
            peek,
            auto_round,
            warning,
        )

    def serve(self, job: GetMetaJob) -> BatchMeta | None:
        """The job's meta (its rows leased to its owner, or to its DP round), or ``None`` to wait."""
        part = self.table.live(job.partition)
        if part is None:
            return None
        if job.dp_group_id is None:
            held = None if job.peek else self.delivery.rows_of_call(part, job.task_name, job.owner, job.call_id)
            if held is not None:  # asked again (ServerGone): what the call was served before, not new rows
                return part.meta(held, job.fields, job.task_name, {"warning": job.warning} if job.warning else {})
            rows = self.select(part, job, job.batch_size)
            if rows is None:
                return None
            if len(rows) and not job.peek:  # a peek leases nothing: the rows stay ready for the task
                lease_s = self.delivery.lease_s(job.task_name, job.lease_s)
                self.delivery.lease(part, job.task_name, rows, job.owner, lease_s, job.call_id)
            return part.meta(rows, job.fields, job.task_name, {"warning": job.warning} if job.warning else {})

        def lease_round(rows: np.ndarray, round_key: tuple[str, str]) -> tuple[int, float]:
            lease_s = self.delivery.lease_s(job.task_name, job.lease_s)
            return self.delivery.lease(part, job.task_name, rows, ROUND_OWNER, lease_s, 0, round_key).lease_id, lease_s

        served = self.rounds.serve(part, job, lambda count: self.select(part, job, count), lease_round)
        if served is None:
            return None
        share, extra = served
        return part.meta(share, job.fields, job.task_name, {**extra, "warning": job.warning} if job.warning else extra)

    def select(self, part: PartitionState, job: GetMetaJob, count: int) -> np.ndarray | None:
        """Rows to hand out (the caller leases them), or ``None`` to wait. Short only when no more can come."""
        index = part.ready_index(job.task_name, job.fields)
        finished = self._finished(part, index)
        if job.sampler.uses_fast_path:
            if index is None:
                return np.zeros(0, np.int64) if finished else None
            view = ReadyView(part, index)
            group = part.group_size if job.whole_groups else 1
            available = view.num_groups() * group if job.whole_groups else view.num_rows()
            if available < count and not finished:
                return None
            return job.sampler.select(view, min(count, available - available % group), job.whole_groups)
        rows = select_with_user_sampler(
            part, index, job.sampler, job.params, job.task_name, job.fields, job.whole_groups, count
        )
        return None if len(rows) < count and not finished else rows

    def finished(self, part: PartitionState, task_name: str, fields: Iterable[str]) -> bool:
        """No more rows can become ready for ``task_name``'s ``fields``: a waiting get_meta gets what is left."""
        return self._finished(part, part.ready_index(task_name, fields))

    def _finished(self, part: PartitionState, index: ReadyIndex | None) -> bool:
        produced = index.produced if index is not None else 0
        return part.sealed and produced == part.num_committed and not self.ledger.in_flight(part.uid)

    def timeout_error(self, job: GetMetaJob, waited: float) -> GetMetaTimeout:
        """What a get_meta that waited ``waited`` seconds is told at its deadline: what was missing."""
        return GetMetaTimeout(f"get_meta timed out after {waited:.1f} s: {self.explain(job)}")

    def explain(self, job: GetMetaJob) -> str:
        """What ``job`` asks and why it cannot be served now: rows ready and unconsumed, fields missing on how many
        rows, rows committed (what a timeout says, and ``status --why-stuck``). O(the partition's rows)."""
        ask = (
            f"task {job.task_name!r} asked {describe_partition(job.partition)} for {job.batch_size} rows of fields "
            f"{job.fields}"
        )
        part = self.table.partitions.get(job.partition)
        if part is None:
            return f"{ask}; the partition was never opened (no put reached it yet)"
        task = part.task(job.task_name)
        rows = part.committed_rows()
        rows = rows[task.consumption[rows] == AVAILABLE]
        missing = {}
        for f in job.fields:
            col = part.field_col.get(f)
            lacking = len(rows) if col is None else int(np.count_nonzero(part.block[rows, col] < 0))
            if lacking:
                missing[f] = lacking
        index = part.ready_index(job.task_name, job.fields)
        ready = 0 if index is None else index.num_rows
        detail = ", ".join(f"{f!r} missing on {c} rows" for f, c in missing.items()) or "no field missing"
        return (
            f"{ask}; {ready} rows are ready, {len(rows)} unconsumed rows exist ({detail}); "
            f"{part.num_committed} of {part.capacity or 'unbounded'} rows are committed"
        )
