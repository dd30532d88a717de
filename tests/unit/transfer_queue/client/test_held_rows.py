"""How the client names a meta's rows to the controller for ack, extend_lease and release (no Ray, no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from transfer_queue.client.rows import _held_rows
from transfer_queue.errors import InvalidRequest
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.wire import protocol as p

F32 = FieldSchema("dense", "float32", ())


def meta(task_name: str | None) -> BatchMeta:
    return BatchMeta(3, 7, [4, 5], [0, 0], {"a": F32}, [[1], [1]], [[0], [1]], task_name)


def test_a_meta_from_get_meta_names_its_partition_task_and_rows():
    uid, task, packed = _held_rows(meta("train"), "ack", "leased")
    assert (uid, task) == (7, "train")
    assert np.asarray(p.unpack_indexes(packed)).tolist() == [4, 5]


@pytest.mark.parametrize(("call", "how"), [("ack", "leased"), ("extend_lease", "leased"), ("release", "consumed")])
def test_a_put_meta_is_refused_naming_the_call_and_what_it_needs(call, how):
    with pytest.raises(
        InvalidRequest, match=f"^{call} needs a BatchMeta from get_meta \\(it names the task that {how} it\\)$"
    ):
        _held_rows(meta(None), call, how)
