"""Every error the queue raises on purpose reaches the caller as the same type with the same message (docs/api.md
"Errors"): the wire carries its name, and the receiving process must know that name without importing the module
that raised it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import transfer_queue
from transfer_queue.errors import TransferQueueError, error_from_wire, error_to_wire


def _every_queue_error() -> list[type[TransferQueueError]]:
    for module in pkgutil.walk_packages(transfer_queue.__path__, "transfer_queue."):
        if module.name != "transfer_queue.__main__":
            importlib.import_module(module.name)
    found: list[type[TransferQueueError]] = []
    todo = [TransferQueueError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted({c for c in found if c.__module__.startswith("transfer_queue")}, key=lambda c: c.__name__)


QUEUE_ERRORS = _every_queue_error()


def test_the_walk_finds_the_errors_defined_outside_errors_py():
    names = {cls.__name__ for cls in QUEUE_ERRORS}
    assert {"CheckpointError", "SnapshotError", "QueueBusy", "NotLeased"} <= names


@pytest.mark.parametrize("cls", QUEUE_ERRORS, ids=lambda cls: cls.__name__)
def test_every_queue_error_round_trips_through_the_wire_with_its_type_and_message(cls):
    sent = cls(f"{cls.__name__}: what was expected, what arrived")
    received = error_from_wire(*error_to_wire(sent))
    assert type(received) is cls, f"{cls.__name__} came back as {type(received).__name__}"
    assert str(received) == f"{cls.__name__}: what was expected, what arrived"


@pytest.mark.parametrize("cls", QUEUE_ERRORS, ids=lambda cls: cls.__name__)
def test_every_queue_error_is_defined_where_every_client_imports_it(cls):
    # A client rebuilds the type by name; one defined in a module the client never imports (storage/, state/) would
    # come back as a bare TransferQueueError in that process.
    assert cls.__module__ == "transfer_queue.errors", f"{cls.__name__} is defined in {cls.__module__}"
