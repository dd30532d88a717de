"""What a user sampler is handed (transfer_queue.state.selection): the rows ready for its task (its requested fields
produced, not consumed, leased or dead-lettered for the task, not lost), read from the task's ready index, never the
whole table; only a ``filter_ready_indices`` left at ``ready_rows_only = False`` (the seed's form) still sees every
committed row. Driven without Ray through ``RequestTable.handle`` (tests/unit/conftest.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.samplers import BaseSampler, DPSampler, GroupSampler
from transfer_queue.state.partition import PartitionState

F32 = FieldSchema("dense", "float32", ())
X = {"x": F32}
Y = {"y": F32}


def indexes(meta: Any) -> list[int]:
    return meta.global_indexes.tolist()


def dp(rank: int, group: str, size: int = 2) -> dict[str, Any]:
    return {"dp_rank": rank, "dp_size": size, "dp_group_id": group}


class OnlyEvenRows(BaseSampler):  # docs/samplers.md, "Only the ready rows (`ready_rows_only`)", verbatim
    """A custom readiness rule, handed only the rows ready for the task: O(ready rows) per get_meta."""

    ready_rows_only = True

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        return all_indices[all_indices % 2 == 0]

    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices[:batch_size])


class SpyFilter(BaseSampler):
    """Records what its two methods are handed; its filter keeps every unconsumed row, its sample takes a prefix."""

    ready_rows_only = True

    def __init__(self) -> None:
        self.filtered: list[dict[str, Any]] = []
        self.sampled: list[dict[str, Any]] = []

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        self.filtered.append(
            {
                "all_indices": np.array(all_indices),
                "production_status": np.array(production_status),
                "consumption_status": np.array(consumption_status),
                "data_fields": list(data_fields),
                "field_mapping": dict(field_mapping),
                **{k: np.array(v) if k == "group_ids" else v for k, v in kwargs.items()},
            }
        )
        return all_indices[~np.asarray(consumption_status, dtype=bool)]  # every ready row, in either form

    def sample(self, ready_indices, batch_size, **kwargs):
        self.sampled.append({"ready_indices": np.array(ready_indices), **kwargs})
        return list(ready_indices[:batch_size])


class SpySample(BaseSampler):
    """A user sampler written to the seed's protocol that overrides ``sample`` only: it records what it is handed."""

    def __init__(self) -> None:
        self.sampled: list[dict[str, Any]] = []

    def sample(self, ready_indices, batch_size, **kwargs):
        self.sampled.append({"ready_indices": np.array(ready_indices), **kwargs})
        return sorted(ready_indices, reverse=True)[:batch_size]


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every read of a partition's whole table (``committed_rows``) and every production matrix built, with its rows."""
    seen: list[tuple[str, int]] = []
    committed_rows, production_matrix = PartitionState.committed_rows, PartitionState.production_matrix

    def spy_committed(self: PartitionState) -> np.ndarray:
        rows = committed_rows(self)
        seen.append(("committed_rows", len(rows)))
        return rows

    def spy_matrix(self: PartitionState, rows: np.ndarray) -> np.ndarray:
        seen.append(("production_matrix", len(rows)))
        return production_matrix(self, rows)

    monkeypatch.setattr(PartitionState, "committed_rows", spy_committed)
    monkeypatch.setattr(PartitionState, "production_matrix", spy_matrix)
    return seen


def mostly_consumed(make_queue: Any) -> Any:
    """A step of 64 rows of ``x``: task ``train`` holds rows 0..47 (leased); 48..63 are ready for it."""
    q = make_queue(global_batch_size=64, num_global_batch=1)
    q.put(0, 64, X)
    assert indexes(q.get(0, "x", 48)) == list(range(48))  # the default sampler
    return q


# ---- what a user sampler is handed -------------------------------------------------------------------------
def test_a_ready_rows_only_filter_is_handed_only_the_rows_ready_for_the_task(make_queue):
    q = mostly_consumed(make_queue)
    spy = SpyFilter()
    q.state.register_sampler("train", spy)
    assert indexes(q.get(0, "x", 4)) == [48, 49, 50, 51]
    part = q.state.partitions[0]
    (handed,) = spy.filtered
    assert handed["all_indices"].tolist() == list(range(48, 64))
    assert handed["all_indices"].dtype == np.int64
    assert handed["production_status"].shape == (16, len(part.fields)) and handed["production_status"].all()
    assert handed["consumption_status"].dtype == bool and not handed["consumption_status"].any()
    assert handed["group_ids"].tolist() == part.group[48:64].tolist()
    assert (handed["data_fields"], handed["field_mapping"]) == (["x"], {"x": 0})
    assert (handed["task_name"], handed["partition_id"], handed["num_n_samples"]) == ("train", 0, 1)
    assert spy.sampled[0]["ready_indices"].tolist() == list(range(48, 64))


def test_a_ready_rows_only_filter_sees_only_rows_with_every_requested_field(make_queue):
    q = mostly_consumed(make_queue)
    part = q.state.partitions[0]
    rows = np.array([50, 52, 53, 60])
    q.put(0, 4, Y, metadata=BatchMeta(0, part.uid, rows, part.group[rows], {}, [], []))
    spy = SpyFilter()
    q.state.register_sampler("train", spy)
    assert indexes(q.get(0, ["x", "y"], 4)) == [50, 52, 53, 60]
    (handed,) = spy.filtered
    assert handed["all_indices"].tolist() == [50, 52, 53, 60]
    assert handed["production_status"].shape == (4, 2) and handed["production_status"].all()


def test_a_sample_only_user_sampler_is_handed_the_ready_rows_without_a_scan_of_the_table(make_queue, scans):
    q = mostly_consumed(make_queue)
    scans.clear()
    spy = SpySample()
    q.state.register_sampler("train", spy)
    assert indexes(q.get(0, "x", 4)) == [63, 62, 61, 60]
    assert spy.sampled[0]["ready_indices"].tolist() == list(range(48, 64))
    assert spy.sampled[0]["group_ids"].tolist() == q.state.partitions[0].group[48:64].tolist()
    assert scans == []  # neither the committed rows nor a production matrix of the table was read


def test_a_ready_rows_only_filter_costs_no_scan_of_the_table(make_queue, scans):
    q = mostly_consumed(make_queue)
    scans.clear()
    q.state.register_sampler("train", SpyFilter())
    q.get(0, "x", 4)
    assert scans == [("production_matrix", 16)]


def test_a_filter_of_the_seeds_form_still_sees_every_committed_row(make_queue):
    q = mostly_consumed(make_queue)

    class WholeTable(SpyFilter):
        ready_rows_only = False

    spy = WholeTable()
    q.state.register_sampler("train", spy)
    assert indexes(q.get(0, "x", 4)) == [48, 49, 50, 51]
    (handed,) = spy.filtered
    assert handed["all_indices"].tolist() == list(range(64))
    assert handed["consumption_status"].tolist() == [True] * 48 + [False] * 16
    assert spy.sampled[0]["ready_indices"].tolist() == list(range(48, 64))


def test_the_docs_ready_rows_only_example_serves_even_rows(make_queue, scans):
    q = mostly_consumed(make_queue)
    scans.clear()
    q.state.register_sampler("train", OnlyEvenRows())
    assert indexes(q.get(0, "x", 4)) == [48, 50, 52, 54]
    assert indexes(q.get(0, "x", 4)) == [56, 58, 60, 62]
    assert all(rows <= 16 for _, rows in scans)


# ---- which rows: handed back, lost, in order -------------------------------------------------------------
def test_rows_handed_back_are_handed_to_the_user_sampler_again_in_index_order(make_queue):
    q = mostly_consumed(make_queue)
    spy = SpyFilter()
    q.state.register_sampler("train", spy)
    first = q.get(0, "x", 4)
    q.release(first)  # back behind the ready rows in the ready index; the sampler still sees index order
    q.get(0, "x", 2)
    assert spy.filtered[1]["all_indices"].tolist() == list(range(48, 64))
    assert spy.sampled[1]["ready_indices"].tolist() == list(range(48, 64))


@pytest.mark.parametrize("sampler", [SpyFilter, SpySample], ids=["ready-rows-filter", "sample-only"])
def test_lost_rows_are_never_handed_to_a_user_sampler(make_queue, sampler):
    q = make_queue(global_batch_size=8, num_global_batch=1, num_storage_units=2)
    first = q.put(0, 4)  # a small put goes whole to one unit, the units taken in turn
    q.put(0, 4)
    unit = int(np.unique(first.blocks % 2)[0])
    q.state.unit_restarted(unit)  # rows 0..3 are lost
    spy = sampler()
    q.state.register_sampler("train", spy)
    assert sorted(indexes(q.get(0, "x", 4))) == [4, 5, 6, 7]
    assert spy.sampled[0]["ready_indices"].tolist() == [4, 5, 6, 7]
    if isinstance(spy, SpyFilter):
        assert spy.filtered[0]["all_indices"].tolist() == [4, 5, 6, 7]


# ---- whole groups ------------------------------------------------------------------------------------------
def groups_of(meta: Any) -> list[int]:
    return meta.group_ids.tolist()


def test_a_ready_rows_only_filter_asked_for_whole_groups_gets_complete_groups_only(make_queue):
    q = make_queue(global_batch_size=8, num_global_batch=1, num_n_samples=4)
    q.put(0, 32, X)  # groups 0..7, four rows each
    q.get(0, "x", 20, get_n_samples=False)  # rows 0..19: groups 0..4 held by the task
    q.get(0, "x", 1)  # row 20: group 5 is no longer complete for the task
    spy = SpyFilter()
    q.state.register_sampler("train", spy)
    meta = q.get(0, "x", 8, get_n_samples=True)
    assert indexes(meta) == list(range(24, 32)) and groups_of(meta) == [6] * 4 + [7] * 4
    assert spy.filtered[0]["all_indices"].tolist() == list(range(21, 32))
    assert spy.sampled[0]["ready_indices"].tolist() == list(range(24, 32))  # complete groups only


def test_a_group_sampler_serves_whole_ready_groups_of_a_mostly_consumed_partition(make_queue, scans):
    class NewestGroupsFirst(GroupSampler):  # docs/samplers.md
        def sample_groups(self, group_ids, num_groups, **kwargs):
            return group_ids[::-1][:num_groups]

    q = make_queue(global_batch_size=8, num_global_batch=1, num_n_samples=4)
    q.put(0, 32, X)
    q.get(0, "x", 20)  # groups 0..4
    q.get(0, "x", 1)  # a member of group 5
    scans.clear()
    q.state.register_sampler("train", NewestGroupsFirst())
    meta = q.get(0, "x", 4)
    assert groups_of(meta) == [7] * 4
    assert groups_of(q.get(0, "x", 4)) == [6] * 4
    assert scans == []


# ---- DP rounds -----------------------------------------------------------------------------------------------
def test_a_dp_round_of_a_ready_rows_only_user_sampler_is_chosen_from_the_ready_rows(make_queue):
    q = make_queue(global_batch_size=32, num_global_batch=1)
    q.put(0, 32, X)
    q.get(0, "x", 16)  # rows 0..15 held by the task
    spy = SpyFilter()
    q.state.register_sampler("train", spy)
    shares = [q.get(0, "x", 4, sampler_params=dp(r, "r1")) for r in (1, 0)]
    assert sorted(indexes(shares[0]) + indexes(shares[1])) == list(range(16, 24))
    assert [h["all_indices"].tolist() for h in spy.filtered] == [list(range(16, 32))]  # one call for the round
    q.get(0, "x", 4, sampler_params=dp(0, "r2"))
    assert spy.filtered[1]["all_indices"].tolist() == list(range(24, 32))
    assert spy.filtered[1]["dp_rank"] == 0 and spy.filtered[1]["dp_size"] == 2


def test_a_dp_aware_user_sampler_is_handed_the_ready_rows_with_its_rank(make_queue, scans):
    class MyDP(DPSampler):  # a user's DP sampler overriding the seed's ``sample``
        def __init__(self) -> None:
            super().__init__(dp_rank=1, dp_size=2)
            self.sampled: list[dict[str, Any]] = []

        def sample(self, ready_indices, batch_size, **kwargs):
            self.sampled.append({"ready_indices": np.array(ready_indices), **kwargs})
            return list(ready_indices[-batch_size:])

    q = make_queue(global_batch_size=32, num_global_batch=1)
    q.put(0, 32, X)
    q.get(0, "x", 16)
    scans.clear()
    sampler = MyDP()
    q.state.register_sampler("train", sampler)
    rank1 = q.get(0, "x", 4)  # its registered rank; the k-th call of the caller is round k
    (handed,) = sampler.sampled
    assert handed["ready_indices"].tolist() == list(range(16, 32))
    assert (handed["dp_rank"], handed["dp_size"]) == (1, 2)
    assert indexes(rank1) == [28, 29, 30, 31]  # the second half of the round's rows 24..31
    assert scans == []


# ---- the ready rows only find what the whole table finds -------------------------------------------------------
class NoThirdGroups(BaseSampler):
    """A row-wise readiness rule in the seed's form: produced, not consumed, and not of a group divisible by 3."""

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        cols = [field_mapping[f] for f in data_fields]
        ready = production_status[:, cols].all(axis=1) & ~consumption_status & (kwargs["group_ids"] % 3 != 0)
        return all_indices[ready]

    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices[:batch_size])


class NoThirdGroupsReadyRows(NoThirdGroups):
    ready_rows_only = True


class PrefixWholeTable(BaseSampler):
    """The default readiness rule, overridden without a change: the seed's form reads the whole table."""

    def filter_ready_indices(self, *args, **kwargs):
        return super().filter_ready_indices(*args, **kwargs)

    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices[:batch_size])


class Prefix(BaseSampler):
    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices[:batch_size])


def run(make_queue: Any, sampler: BaseSampler, seed: int) -> list[Any]:
    """Seeded random puts, field writes, get_metas (whole groups or not, DP rounds), releases and a lost unit;
    returns what every get_meta answered."""
    import random

    rng = random.Random(seed)
    q = make_queue(global_batch_size=16, num_global_batch=1, num_n_samples=2, num_storage_units=2, sampler=sampler)
    answers: list[Any] = []
    metas: list[Any] = []
    for step in range(120):
        op = rng.random()
        key = rng.choice([0, "s"])
        if op < 0.25:
            try:
                q.put(key, 2 * rng.randint(1, 3), X)
            except Exception as exc:  # the step is full
                answers.append(type(exc).__name__)
        elif op < 0.35 and key in q.state.partitions:
            part = q.state.partitions[key]
            rows = part.committed_rows()
            if "y" in part.field_col:
                rows = rows[part.block[rows, part.field_col["y"]] < 0]
            if len(rows):
                pick = np.asarray(rng.sample(rows.tolist(), rng.randint(1, len(rows))))
                q.put(key, len(pick), Y, metadata=BatchMeta(key, part.uid, pick, part.group[pick], {}, [], []))
        elif op < 0.85 and key in q.state.partitions:
            fields = rng.choice([["x"], ["x", "y"]])
            task = rng.choice(["a", "b"])
            params = dp(rng.randint(0, 1), f"round{step}") if rng.random() < 0.2 else None
            reply = q.get_async(key, fields, 2 * rng.randint(1, 3), task, sampler_params=params, get_n_samples=True)
            if not reply.done:
                q.advance(11.0)
            if reply.error is not None:
                answers.append(type(reply.error).__name__)
            else:
                meta = reply.value.to_meta()
                answers.append(indexes(meta))
                metas.append((task, meta))
        elif op < 0.97 and metas:
            task, meta = metas.pop(rng.randrange(len(metas)))
            q.release(meta, task)
        elif op >= 0.97:
            q.state.unit_restarted(rng.randint(0, 1))
    return answers


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("seed_form", "ready_rows"),
    [(NoThirdGroups, NoThirdGroupsReadyRows), (PrefixWholeTable, Prefix)],
    ids=["own-filter", "default-filter"],
)
def test_the_ready_rows_serve_exactly_what_the_whole_table_serves(make_queue, seed_form, ready_rows, seed):
    whole = run(make_queue, seed_form(), seed)
    assert sum(isinstance(a, list) and len(a) > 0 for a in whole) > 5, "the run served nothing: it tests nothing"
    assert run(make_queue, ready_rows(), seed) == whole
