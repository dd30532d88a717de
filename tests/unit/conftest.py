"""Shared pieces of the unit tier: a hypothesis profile sized for CI and a QueueState driven without Ray.

``make_queue(...)`` builds a :class:`QueueHarness`: a QueueState on a fake clock, fed protocol request structs
through the controller's request table (``RequestTable.handle``) with a ``respond`` that records ``(value,
error)``. Nothing here imports Ray or opens a socket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from transfer_queue.config import QueueConfig
from transfer_queue.controller.requests import RequestTable
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.state.queue_state import QueueState
from transfer_queue.wire import protocol as p

settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("deep", max_examples=3000, deadline=None)  # HYPOTHESIS_PROFILE=deep, now and then
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

F32 = FieldSchema("dense", "float32", ())


@dataclass
class Reply:
    """What ``respond`` was called with; ``calls`` counts answers (a request is answered exactly once)."""

    value: Any = None
    error: BaseException | None = None
    calls: int = 0

    @property
    def done(self) -> bool:
        return self.calls > 0

    def result(self) -> Any:
        assert self.calls == 1, f"expected one answer, got {self.calls}"
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class QueueHarness:
    """A QueueState on a fake clock (``now[0]``), with helpers that speak its protocol."""

    state: QueueState
    now: list[float] = field(default_factory=lambda: [0.0])
    table: RequestTable = field(init=False)

    def __post_init__(self) -> None:
        self.table = RequestTable(self.state)

    @property
    def config(self) -> QueueConfig:
        return self.state.config

    # ---- raw requests ------------------------------------------------------------------------------------
    def send(self, request: Any, peer: Any = None) -> Reply:
        """Hand ``request`` to the state as if it came on connection ``peer`` (None: unknown)."""
        reply = Reply()

        def respond(value: Any, error: BaseException | None) -> None:
            reply.value, reply.error = value, error
            reply.calls += 1

        self.table.handle(request, respond, peer)
        return reply

    def ok(self, request: Any) -> Any:
        """Send and return the answer; raises the error it got; fails if the request is still waiting."""
        reply = self.send(request)
        assert reply.done, f"{type(request).__name__} is waiting; expected an answer at once"
        return reply.result()

    def advance(self, seconds: float) -> None:
        self.now[0] += seconds
        self.state.tick()

    # ---- puts --------------------------------------------------------------------------------------------
    def reserve_request(
        self,
        partition: int | str,
        num_rows: int,
        fields: dict[str, FieldSchema] | None = None,
        *,
        group_ids: Any = None,
        lengths: Any = None,
        nbytes: int | None = None,
        keys: list[str] | None = None,
        metadata: BatchMeta | None = None,
        timeout: float = 30.0,
    ) -> p.Reserve:
        fields = fields if fields is not None else {"x": F32}
        return p.Reserve(
            partition,
            num_rows,
            fields,
            4 * num_rows * len(fields) if nbytes is None else nbytes,
            None if group_ids is None else p.pack_indexes(np.asarray(group_ids)),
            None if metadata is None else metadata.partition_uid,
            None if metadata is None else p.pack_indexes(metadata.global_indexes),
            None if lengths is None else p.pack_indexes(np.asarray(lengths)),
            keys,
            timeout,
        )

    def reserve(self, partition: int | str, num_rows: int, fields: dict[str, FieldSchema] | None = None, **kw: Any):
        return self.ok(self.reserve_request(partition, num_rows, fields, **kw))

    def commit(self, reservation: p.Reservation) -> BatchMeta:
        return self.ok(p.Commit(reservation.put_id)).to_meta()

    def put(
        self, partition: int | str, num_rows: int, fields: dict[str, FieldSchema] | None = None, **kw: Any
    ) -> BatchMeta:
        return self.commit(self.reserve(partition, num_rows, fields, **kw))

    def kv_put(self, partition: str, keys: list[str], fields: dict[str, FieldSchema] | None = None, **kw: Any):
        return self.put(partition, len(keys), fields, keys=keys, **kw)

    # ---- reads -------------------------------------------------------------------------------------------
    def get_request(
        self,
        partition: int | str,
        fields: list[str] | str,
        batch_size: int,
        task: str = "train",
        *,
        sampler_params: dict[str, Any] | None = None,
        get_n_samples: bool = False,
        timeout: float = 10.0,
    ) -> p.GetMeta:
        fields = [fields] if isinstance(fields, str) else list(fields)
        return p.GetMeta(partition, fields, batch_size, task, sampler_params, get_n_samples, timeout)

    def get_async(self, *args: Any, **kw: Any) -> Reply:
        return self.send(self.get_request(*args, **kw))

    def get(self, *args: Any, **kw: Any) -> BatchMeta:
        return self.ok(self.get_request(*args, **kw)).to_meta()

    def release(self, meta: BatchMeta, task: str | None = None) -> None:
        task = task or meta.task_name or "train"  # the Release a client sends, naming the meta's DP round (if any)
        group = meta.extra.get("dp_group_id")
        self.ok(p.Release(meta.partition_uid, task, p.pack_indexes(meta.global_indexes), dp_group_id=group))

    def clear(self, partition: int | str) -> None:
        self.ok(p.Clear(partition))


@pytest.fixture
def make_queue():
    """``make_queue(global_batch_size=4, num_global_batch=2, num_n_samples=1, sampler=None, **config)``."""

    def make(
        global_batch_size: int = 4,
        num_global_batch: int = 2,
        num_n_samples: int = 1,
        sampler: Any = None,
        **config: Any,
    ) -> QueueHarness:
        cfg = QueueConfig(global_batch_size, num_global_batch, num_n_samples, **config)
        now = [0.0]
        return QueueHarness(QueueState(cfg, sampler, clock=lambda: now[0]), now)

    return make
