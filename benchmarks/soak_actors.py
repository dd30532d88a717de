"""The producer and consumer actors of benchmarks/fault_soak.py.

Every error a queue call raises is counted, typed (a ``TransferQueueError``) or not, and the call is tried again; a
call that outlives its timeout by ``HANG_SLACK_S`` counts as a hang.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import ray

HANG_SLACK_S = 30.0
PUT_TIMEOUT_S = 30.0
MAX_ATTEMPTS = 50


def partition_name(j: int) -> str:
    return f"soak-{j}"


class Calls:
    """Errors and hangs of one worker's queue calls."""

    def __init__(self) -> None:
        self.typed: Counter = Counter()
        self.untyped: Counter = Counter()
        self.hangs = 0
        self.lock = threading.Lock()

    def error(self, exc: BaseException) -> None:
        from transfer_queue.errors import TransferQueueError

        with self.lock:
            (self.typed if isinstance(exc, TransferQueueError) else self.untyped)[type(exc).__name__] += 1

    def timed(self, started: float, timeout: float) -> None:
        if time.monotonic() - started > timeout + HANG_SLACK_S:
            with self.lock:
                self.hangs += 1


@ray.remote
class Producers:
    """``clients`` producer clients (one thread and one TransferQueueClient each), numbered from ``first``."""

    def __init__(self, info: Any, first: int, clients: int, puts: int, rotate: int):
        self.info, self.first, self.clients, self.puts, self.rotate = info, first, clients, puts, rotate
        self.done = [0] * clients
        self.rows: list[tuple[int, int, int, float]] = []  # (partition, global index, unit, done at)
        self.calls = Calls()
        self.failed = 0
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in range(self.clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, c: int) -> None:
        import torch

        from transfer_queue import TransferQueueClient

        client = TransferQueueClient(f"producer-{self.first + c}", self.info)
        units = len(self.info.storage_units)
        for seq in range(self.puts):
            j = seq // self.rotate
            row = torch.tensor([[self.first + c, seq, j, 0]], dtype=torch.int64)
            for _ in range(MAX_ATTEMPTS):
                started = time.monotonic()
                try:
                    meta = client.put({"x": row}, partition_id=partition_name(j), timeout=PUT_TIMEOUT_S)
                except Exception as exc:  # counted; a failed put leaves nothing visible: try again
                    self.calls.error(exc)
                    time.sleep(0.05)
                    continue
                finally:
                    self.calls.timed(started, PUT_TIMEOUT_S)
                self.rows.append((j, int(meta.global_indexes[0]), int(meta.blocks[0, 0]) % units, time.time()))
                break
            else:
                self.failed += 1
            self.done[c] = seq + 1
        client.close()

    def progress(self) -> tuple[int, int]:
        """Puts done by all clients, and by the slowest one."""
        return sum(self.done), min(self.done)

    def result(self) -> dict[str, Any]:
        for thread in self.threads:
            thread.join(timeout=1.0)
        return {
            "rows": self.rows,
            "failed": self.failed,
            "errors_typed": dict(self.calls.typed),
            "errors_untyped": dict(self.calls.untyped),
            "hangs": self.calls.hangs + sum(t.is_alive() for t in self.threads),
        }


@ray.remote
class Consumer:
    """One consumer of ``task``: reads the partitions in order, acknowledges each batch explicitly, then writes its
    global indexes to ``journal`` (so rows a task acknowledged twice show up twice)."""

    def __init__(self, info: Any, task: str, journal: str, partitions: int, batch: int):
        self.info, self.task, self.journal, self.partitions, self.batch = info, task, journal, partitions, batch
        self.calls = Calls()
        self.first_ack_at = 0.0
        self.corrupt = 0
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from transfer_queue import TransferQueueClient
        from transfer_queue.errors import GetMetaTimeout, PartitionCleared, UnknownPartition

        client = TransferQueueClient(f"consumer-{self.task}", self.info)
        j = 0
        with open(self.journal, "a") as journal:
            while j < self.partitions:
                name = partition_name(j)
                started = time.monotonic()
                try:
                    meta = client.get_meta(["x"], self.batch, partition_id=name, task_name=self.task, timeout=2.0)
                except (GetMetaTimeout, UnknownPartition):
                    continue  # not opened yet, or nothing ready for now
                except PartitionCleared:
                    j += 1
                    continue
                except Exception as exc:
                    self.calls.error(exc)
                    time.sleep(0.05)
                    continue
                finally:
                    self.calls.timed(started, 2.0)
                if not len(meta):
                    if self._done(client, name):
                        j += 1
                    else:
                        time.sleep(0.05)
                    continue
                data = self._read(client, meta)
                if data is None:
                    continue
                x = data["x"]
                self.corrupt += int((x[:, 2] != j).sum())
                try:
                    client.ack(meta)
                except Exception as exc:  # its lease expired: the rows come again
                    self.calls.error(exc)
                    continue
                journal.write(f"{j} {' '.join(map(str, meta.global_indexes.tolist()))}\n")  # acknowledged
                journal.flush()
                self.first_ack_at = self.first_ack_at or time.time()
        client.close()

    def _read(self, client: Any, meta: Any) -> Any:
        """get_data; while a unit is down, ask again (keeping the lease: handing the rows back would wear out their
        deliveries); None when rows were lost (handed back: the lost ones stay lost, the others are served again)."""
        from transfer_queue.errors import RowsLost, StorageUnitDown

        while True:
            try:
                return client.get_data(meta)
            except StorageUnitDown as exc:
                self.calls.error(exc)
                if isinstance(exc, RowsLost):
                    client.release(meta)
                    return None
                time.sleep(0.2)
                client.ping()  # the controller's reply says when the unit is back or restarted

    def _done(self, client: Any, name: str) -> bool:
        """The partition is closed and nothing is left for this task (nothing ready, nothing leased)."""
        from transfer_queue.errors import UnknownPartition

        try:
            production = client.get_production_status(partition_id=name)
            counts = client.get_consumption_status(partition_id=name, task_name=self.task)["tasks"][self.task]
        except UnknownPartition:  # cleared (done) or not opened (get_meta waits for it)
            return False
        return (
            bool(production["closed"]) and not production["rows_in_flight"] and not counts["ready"] + counts["leased"]
        )

    def result(self) -> dict[str, Any]:
        if self.thread is not None:
            self.thread.join(timeout=1.0)
        return {
            "errors_typed": dict(self.calls.typed),
            "errors_untyped": dict(self.calls.untyped),
            "hangs": self.calls.hangs + int(self.thread is not None and self.thread.is_alive()),
            "first_ack_at": self.first_ack_at,
            "corrupt": self.corrupt,
        }
