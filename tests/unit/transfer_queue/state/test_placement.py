"""place_rows: which storage unit holds which rows of a put (a pure function), checked by its properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer_queue.errors import StorageUnavailable
from transfer_queue.state.placement import MIN_BYTES_PER_UNIT, place_rows


@given(
    num_rows=st.integers(1, 10_000),
    nbytes=st.integers(0, 64 * MIN_BYTES_PER_UNIT),
    num_units=st.integers(1, 16),
    first_unit=st.integers(0, 100),
    min_bytes=st.integers(1, 4 * MIN_BYTES_PER_UNIT),
)
def test_place_rows_properties(num_rows, nbytes, num_units, first_unit, min_bytes):
    chunks = place_rows(num_rows, nbytes, num_units, first_unit, min_bytes)
    # contiguous, in row order, covering every row exactly once, no empty chunk
    assert chunks[0][1] == 0 and chunks[-1][2] == num_rows
    assert all(a[2] == b[1] for a, b in itertools.pairwise(chunks))
    assert all(start < stop for _, start, stop in chunks)
    # units: valid, distinct, round robin from first_unit
    units = [unit for unit, _, _ in chunks]
    assert units == [(first_unit + i) % num_units for i in range(len(chunks))]
    assert len(set(units)) == len(units)
    # as many units as the size justifies, never more than there are units or rows
    assert len(chunks) == max(1, min(num_units, num_rows, nbytes // min_bytes))
    if len(chunks) > 1:
        assert nbytes / len(chunks) >= min_bytes  # every unit used gets its minimum share (rows evenly)
    sizes = [stop - start for _, start, stop in chunks]
    assert max(sizes) - min(sizes) <= 1


def test_place_rows_examples():
    assert place_rows(8, 100, 2, 1) == [(1, 0, 8)]  # small: one message
    assert place_rows(8, 4 * MIN_BYTES_PER_UNIT, 2, 0) == [(0, 0, 4), (1, 4, 8)]
    assert place_rows(3, 100 * MIN_BYTES_PER_UNIT, 8, 7) == [(7, 0, 1), (0, 1, 2), (1, 2, 3)]  # at most one per row
    assert place_rows(5, 3 * MIN_BYTES_PER_UNIT, 4, 2) == [(2, 0, 1), (3, 1, 3), (0, 3, 5)]


@pytest.mark.parametrize(("num_rows", "num_units"), [(0, 1), (1, 0), (-1, 2)])
def test_place_rows_needs_rows_and_units(num_rows, num_units):
    with pytest.raises(ValueError, match=f"place_rows needs num_rows >= 1 and num_units >= 1, got {num_rows} and"):
        place_rows(num_rows, 10, num_units, 0)


@given(
    num_rows=st.integers(1, 1000),
    nbytes=st.integers(0, 64 * MIN_BYTES_PER_UNIT),
    num_units=st.integers(2, 16),
    first_unit=st.integers(0, 100),
    data=st.data(),
)
def test_units_that_are_down_are_skipped(num_rows, nbytes, num_units, first_unit, data):
    down = data.draw(st.sets(st.integers(0, num_units - 1), max_size=num_units - 1))
    chunks = place_rows(num_rows, nbytes, num_units, first_unit, down=down)
    units = [unit for unit, _, _ in chunks]
    assert not set(units) & down and len(set(units)) == len(units)
    assert chunks[0][1] == 0 and chunks[-1][2] == num_rows
    assert len(chunks) == max(1, min(num_units - len(down), num_rows, nbytes // MIN_BYTES_PER_UNIT))


def test_place_rows_skips_down_units_examples():
    assert place_rows(8, 100, 3, 1, down={1}) == [(2, 0, 8)]  # the next live unit in turn
    assert place_rows(8, 100, 3, 2, down={2}) == [(0, 0, 8)]
    assert place_rows(4, 8 * MIN_BYTES_PER_UNIT, 3, 0, down={1}) == [(0, 0, 2), (2, 2, 4)]
    with pytest.raises(StorageUnavailable, match=r"every storage unit is down \(\[0, 1\]\); no put can be placed"):
        place_rows(8, 100, 2, 0, down={0, 1})
