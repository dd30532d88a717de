"""``BatchesInFlight`` (rl_contracts/lost_rows.py): a worker about to be stopped while its queue goes on writes the
batches it is generating first (``finish``) and starts no other; ``rows`` counts what its death would cost."""

from __future__ import annotations

import threading

from rl_contracts.lost_rows import BatchesInFlight


class _Meta:
    def __init__(self, rows: int):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows


def test_finish_waits_for_the_batch_in_flight_counts_its_rows_and_holds_the_next_one():
    in_flight = BatchesInFlight()
    generating, write = threading.Event(), threading.Event()
    written: list[int] = []

    def worker() -> None:
        for rows in (4, 8):
            with in_flight.batch(_Meta(rows)):
                generating.set()
                write.wait(30)
                written.append(rows)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert generating.wait(30)
    assert in_flight.rows() == 4

    finished: list[int] = []
    finisher = threading.Thread(target=lambda: finished.append(in_flight.finish(30.0)))
    finisher.start()
    finisher.join(0.2)
    assert finisher.is_alive() and written == []  # it waits for the write

    write.set()
    finisher.join(30)
    assert finished == [0] and written == [4]
    thread.join(0.3)
    assert thread.is_alive() and written == [4] and in_flight.rows() == 0  # the second batch is held, unstarted


def test_finish_returns_the_batches_left_when_the_wait_runs_out():
    in_flight = BatchesInFlight()
    with in_flight.batch(_Meta(2)):
        assert in_flight.finish(0.05) == 1
        assert in_flight.rows() == 2
    assert in_flight.rows() == 0


def test_a_batch_whose_weights_still_load_is_held_but_not_counted_until_its_generation_starts():
    """``RolloutWorker`` enters a batch before the engine loads the step's weights (``pull_weights``) and marks it
    generating right before ``generate``: a death while the weights load generates nothing again."""
    in_flight = BatchesInFlight()
    first, second = _Meta(8), _Meta(4)
    with in_flight.batch(first, generating=False):
        assert in_flight.rows() == 0 and in_flight.finish(0.01) == 1  # held by finish all the same
        in_flight.generating(first)
        assert in_flight.rows() == 8
    in_flight.generating(first)  # after its write: nothing to count
    assert in_flight.rows() == 0
    in_flight = BatchesInFlight()
    with in_flight.batch(second):  # generating from the start (an agent's episodes)
        assert in_flight.rows() == 4
