"""The sampler contract (CONTRIBUTING.md, "A sampler in ten minutes"): one parametrized test every sampler must pass,
built-in or user, driven through QueueState with seeded random puts, field writes, consumptions, releases and clears.
Plus the errors a broken user sampler gets, the fast-path switch, and length-balanced DP shares."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer_queue.errors import (
    GetMetaTimeout,
    IncompleteGroups,
    InvalidRequest,
    PartitionOverfilled,
    SamplerError,
    StaleBatchMeta,
)
from transfer_queue.metadata import BatchMeta, FieldSchema
from transfer_queue.samplers import (
    BaseSampler,
    DPSampler,
    GRPOSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    balanced_shares,
    make_sampler,
)
from transfer_queue.state.partition import COMMITTED
from transfer_queue.state.ready_index import AVAILABLE

F32 = FieldSchema("dense", "float32", ())
X = {"x": F32}
N = 2  # rows per GRPO group in the contract runs


class RandomGroups(BaseSampler):
    """A user sampler overriding only ``sample``: groups in a seeded random order; its state is its RNG."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def sample(self, ready_indices, batch_size, **kwargs):
        ready = np.asarray(ready_indices, dtype=np.int64)
        groups = np.asarray(kwargs["group_ids"], dtype=np.int64)
        order = self.rng.permutation(np.unique(groups))
        chosen = [ready[groups == g] for g in order]
        return np.concatenate(chosen)[:batch_size].tolist() if chosen else []

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class EvenGroupsOnly(SequentialSampler):
    """A user sampler overriding ``filter_ready_indices``: only rows of even groups count as ready."""

    def filter_ready_indices(
        self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
    ):
        ready = super().filter_ready_indices(
            all_indices, production_status, consumption_status, data_fields, field_mapping
        )
        group_of = dict(zip(np.asarray(all_indices).tolist(), np.asarray(kwargs["group_ids"]).tolist(), strict=True))
        return [i for i in ready.tolist() if group_of[i] % 2 == 0]


class EvenGroupsOnlyReadyRows(EvenGroupsOnly):
    """The same rule, its ``filter_ready_indices`` handed only the rows ready for the task."""

    ready_rows_only = True


SAMPLERS: dict[str, tuple[Callable[[], BaseSampler], bool]] = {  # name -> (factory, drives DP rounds)
    "sequential": (SequentialSampler, False),
    "grpo": (lambda: GRPOSampler(N), False),
    "dp": (lambda: DPSampler(dp_rank=0, dp_size=2), True),
    "seqlen-balanced": (SeqlenBalancedSampler, True),
    "user-sample": (lambda: RandomGroups(seed=3), False),
    "user-filter": (EvenGroupsOnly, False),
    "user-filter-ready-rows": (EvenGroupsOnlyReadyRows, False),
}


def ready_rows(part, task: str, fields: list[str]) -> set[int]:
    """Brute force: committed rows with every field produced that the task has not consumed (global indexes)."""
    if any(f not in part.field_col for f in fields):
        return set()
    rows = np.flatnonzero(part.state[: part.num_rows] == COMMITTED)
    m = np.uint64(part.field_mask(fields))
    rows = rows[(part.produced_mask[rows] & m) == m]
    if task in part.tasks:
        rows = rows[part.tasks[task].consumption[rows] == AVAILABLE]
    return set((rows + part.base_index).tolist())


def check_served(q, metas: list[BatchMeta], ready: set[int], held: set, whole: bool) -> None:
    part = q.state.partitions[metas[0].partition_id]
    rows = [i for m in metas for i in m.global_indexes.tolist()]
    assert len(rows) == len(set(rows)), f"a row was served twice in one call: {rows}"
    assert set(rows) <= ready, f"unready rows served: {set(rows) - ready}"
    keyed = {(part.uid, i) for i in rows}
    assert not keyed & held, f"rows served twice to a task: {keyed & held}"
    held |= keyed
    for meta in metas:
        assert meta.group_ids.tolist() == part.group[meta.global_indexes - part.base_index].tolist()
        if whole:  # every group in the batch is whole, and its members sit side by side
            groups = meta.group_ids.tolist()
            assert all(groups.count(g) == N for g in groups), f"a GRPO group was split: {groups}"
            assert all(len(set(groups[i : i + N])) == 1 for i in range(0, len(groups), N)), groups


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_sampler_contract(make_queue, name, seed):
    factory, dp_rounds = SAMPLERS[name]
    sampler = factory()
    q = make_queue(global_batch_size=6, num_global_batch=3, num_n_samples=N, sampler=sampler)
    rng = random.Random(seed)
    held: dict[str, set] = {"a": set(), "b": set()}  # (partition uid, global index) a task holds
    metas: list[tuple[str, BatchMeta]] = []
    partial: dict[Any, int] = {}  # partition -> an explicit group with one member so far
    groups = itertools.count(1000)
    served = 0
    for _ in range(150):
        op = rng.random()
        key = rng.choice([0, 1, "s"])
        if op < 0.3:  # put: whole default groups, or one member of an explicit group
            try:
                if rng.random() < 0.6:
                    k = N * rng.randint(1, 2)
                    q.put(key, k, X, lengths=[rng.randint(1, 50) for _ in range(k)])
                else:
                    g = partial.pop(key, None)
                    if g is None:
                        g = partial[key] = next(groups)
                    q.put(key, 1, X, group_ids=[g], lengths=[rng.randint(1, 50)])
            except (PartitionOverfilled, IncompleteGroups):
                pass
        elif op < 0.4 and key in q.state.partitions:  # write field y into some rows
            part = q.state.partitions[key]
            rows = part.committed_rows()
            if "y" in part.field_col:
                rows = rows[part.block[rows, part.field_col["y"]] < 0]
            if len(rows):
                pick = np.asarray(rng.sample(rows.tolist(), rng.randint(1, len(rows)))) + part.base_index
                meta = BatchMeta(key, part.uid, pick, part.group[pick - part.base_index], {}, [], [])
                q.put(key, len(pick), {"y": F32}, metadata=meta)
        elif op < 0.85 and key in q.state.partitions:  # get_meta
            task = rng.choice(["a", "b"])
            fields = rng.choice([["x"], ["x", "y"]])
            batch_size = N * rng.randint(1, 3)
            whole = sampler.serves_whole_groups or rng.random() < 0.5
            part = q.state.partitions[key]
            ready = ready_rows(part, task, fields)
            params = [{"dp_rank": r, "dp_size": 2, "dp_group_id": f"round{rng.random()}"} for r in range(2)]
            if dp_rounds:
                params[0].pop("dp_rank")  # rank 0 from the sampler's defaults, where it has some
                params[0]["dp_rank"] = sampler.default_sampler_params().get("dp_rank", 0)
                params[1]["dp_group_id"] = params[0]["dp_group_id"]
            asks = params if dp_rounds else [None]
            first = q.get_async(key, fields, batch_size, task, sampler_params=asks[0], get_n_samples=whole)
            if not first.done:
                q.advance(11.0)
                assert isinstance(first.error, GetMetaTimeout)
                continue
            got = [first.result().to_meta()]
            for more in asks[1:]:  # the other ranks of the round: served at once, from the same round
                got.append(q.get(key, fields, batch_size, task, sampler_params=more, get_n_samples=whole))
            if any(len(m) for m in got):
                check_served(q, got, ready, held[task], whole)
                served += 1
                metas += [(task, m) for m in got if len(m)]
        elif op < 0.95 and metas:  # release a batch: its rows are the task's again
            task, meta = metas.pop(rng.randrange(len(metas)))
            if q.state._by_uid(meta.partition_uid) is None:  # its partition was cleared since: the meta is stale
                with pytest.raises(StaleBatchMeta, match="was cleared"):
                    q.release(meta, task)
            else:
                q.release(meta, task)
            held[task] -= {(meta.partition_uid, i) for i in meta.global_indexes.tolist()}
        elif op >= 0.95 and key == 0:
            q.clear(0)
            partial.pop(0, None)
            q.state.max_cleared_step = -1  # let step 0 open again, so the run keeps going
    assert served > 5, "the run never served anything: the test drives nothing"
    # state round trip: a fresh sampler loaded with the state chooses exactly what the original chooses
    clone = factory()
    clone.load_state_dict(sampler.state_dict())
    assert clone.state_dict().keys() == sampler.state_dict().keys()
    ready = np.arange(12, dtype=np.int64)
    group_ids = ready // N
    assert list(clone.sample(ready, 4, group_ids=group_ids)) == list(sampler.sample(ready, 4, group_ids=group_ids))


# ---- user samplers breaking the contract ----------------------------------------------------------------------
def indexes(meta: BatchMeta) -> list[int]:
    return meta.global_indexes.tolist()


def dp(rank: int, size: int = 2, group: str = "g0") -> dict:
    return {"dp_rank": rank, "dp_size": size, "dp_group_id": group}


def assert_whole_groups(meta: BatchMeta, n: int) -> None:
    groups = meta.group_ids.tolist()
    assert all(len(set(groups[i : i + n])) == 1 for i in range(0, len(groups), n)), groups
    assert len(set(groups)) == len(groups) // n


class Returns(BaseSampler):
    def __init__(self, result):
        self.result = result

    def sample(self, ready_indices, batch_size, **kwargs):
        return self.result(list(ready_indices), batch_size)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (
            lambda ready, k: [4],
            r"sample of the task's sampler returned rows that are not ready or already served: \[4\]",
        ),
        (lambda ready, k: [ready[0], ready[0]], "sample returned the same global index twice"),
        (lambda ready, k: ready[: k + 1], r"Returns\.sample returned 3 rows for batch_size=2"),
        (lambda ready, k: [-5], "sample returned global indexes outside global_step=0"),
        (lambda ready, k: ["a"], "Returns raised ValueError"),
        (lambda ready, k: None, "Returns raised TypeError"),
        (lambda ready, k: 1 / 0, "Returns raised ZeroDivisionError: division by zero"),
    ],
    ids=["unready", "duplicate", "too-many", "outside", "not-ints", "none", "raises"],
)
def test_a_user_sampler_breaking_its_contract_gets_sampler_error(make_queue, result, message):
    q = make_queue(global_batch_size=8)
    q.state.register_sampler("train", Returns(result))
    q.put(0, 4, X)
    q.reserve(0, 2, X)  # rows 4, 5: reserved, not ready
    with pytest.raises(SamplerError, match=message):
        q.get(0, "x", 2)
    q.state.register_sampler("train", Returns(lambda ready, k: ready[:k]))
    assert indexes(q.get(0, "x", 2)) == [0, 1]  # nothing was consumed by the broken call


def test_a_user_sampler_error_while_a_getter_waits_reaches_that_getter(make_queue):
    q = make_queue()
    q.state.register_sampler("train", Returns(lambda ready, k: [99] if ready else []))
    waiting = q.get_async(0, "x", 2)
    q.put(0, 4, X)  # the commit retries the waiter, whose sampler now breaks its contract
    with pytest.raises(SamplerError, match="sample returned global indexes outside global_step=0"):
        waiting.result()


class Interleaved(BaseSampler):
    """Returns whole groups, but with their members interleaved."""

    def sample(self, ready_indices, batch_size, **kwargs):
        ready = np.asarray(ready_indices)
        groups = np.asarray(kwargs["group_ids"])
        order = np.lexsort((groups, np.arange(len(ready)) % 2))
        return ready[order][:batch_size].tolist()


def test_dp_shares_of_a_user_sampler_keep_groups_whole(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2)
    q.state.register_sampler("train", Interleaved())
    q.put(0, 8, X)
    r0 = q.get(0, "x", 4, sampler_params=dp(0), get_n_samples=True)
    r1 = q.get(0, "x", 4, sampler_params=dp(1), get_n_samples=True)
    assert_whole_groups(r0, 2)
    assert_whole_groups(r1, 2)


def test_seqlen_balanced_rounds_split_by_the_lengths_the_puts_sent(make_queue):
    q = make_queue(global_batch_size=8, sampler=SeqlenBalancedSampler())
    lengths = np.array([100, 90, 1, 1, 2, 2, 3, 1])
    q.put(0, 8, X, lengths=lengths)
    shares = [q.get(0, "x", 4, sampler_params=dp(r)) for r in range(2)]
    assert [indexes(m) for m in shares] == [[0, 2, 3, 7], [1, 4, 5, 6]]  # contiguous: 194 vs 8 tokens
    assert [int(lengths[indexes(m)].sum()) for m in shares] == [103, 97]


class EveryOther(BaseSampler):
    """Splits groups on purpose."""

    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices)[::2][:batch_size]


def test_a_user_sampler_splitting_a_group_gets_sampler_error(make_queue):
    q = make_queue(global_batch_size=4, num_n_samples=2)
    q.state.register_sampler("train", EveryOther())
    q.put(0, 8, X)
    with pytest.raises(SamplerError, match=r"EveryOther\.sample split a GRPO group; whole groups were asked for"):
        q.get(0, "x", 2, get_n_samples=True)
    assert indexes(q.get(0, "x", 2)) == [0, 2]  # without whole groups, any rows will do


class BadFilter(SequentialSampler):
    def filter_ready_indices(self, all_indices, *args, **kwargs):
        return list(all_indices)  # claims every row is ready


def test_a_user_filter_claiming_unready_rows_gets_sampler_error(make_queue):
    q = make_queue()
    meta = q.put(0, 4, X)
    q.put(0, 1, {"y": F32}, metadata=meta.select_samples([0]))
    message = r"filter_ready_indices of the task's sampler returned rows that are not ready or already served: \[1, 2"
    q.state.register_sampler("train", BadFilter())
    with pytest.raises(SamplerError, match=message):
        q.get(0, ["x", "y"], 1)


# ---- the fast path -------------------------------------------------------------------------------------------
class OnlySample(SequentialSampler):
    def sample(self, ready_indices, batch_size, **kwargs):
        return list(ready_indices)[:batch_size]


class OwnSelect(SequentialSampler):
    def select(self, ready, batch_size, whole_groups):
        return super().select(ready, batch_size, whole_groups)


@pytest.mark.parametrize(
    ("sampler", "fast"),
    [
        (SequentialSampler(), True),
        (GRPOSampler(2), True),
        (DPSampler(0, 2), True),
        (SeqlenBalancedSampler(), True),
        (OwnSelect(), True),
        (OnlySample(), False),
        (EvenGroupsOnly(), False),
        (EvenGroupsOnlyReadyRows(), False),
        (RandomGroups(), False),
        (BadFilter(), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseSampler) else str(v),
)
def test_uses_fast_path_only_when_no_seed_method_is_overridden(sampler, fast):
    assert sampler.uses_fast_path is fast


# ---- constructing samplers -----------------------------------------------------------------------------------
def test_make_sampler_takes_an_instance_a_class_or_a_callable():
    grpo = GRPOSampler(4)
    assert make_sampler(grpo) is grpo
    assert isinstance(make_sampler(None), SequentialSampler)
    assert isinstance(make_sampler(SeqlenBalancedSampler), SeqlenBalancedSampler)
    assert make_sampler(lambda: GRPOSampler(4)).num_n_samples == 4
    with pytest.raises(TypeError, match="a sampler constructor must return a BaseSampler, got int"):
        make_sampler(lambda: 3)
    with pytest.raises(TypeError, match="sampler must be a BaseSampler, a BaseSampler class or a callable, got str"):
        make_sampler("grpo")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: GRPOSampler(0), "GRPOSampler: num_n_samples must be an int >= 1, got 0"),
        (lambda: DPSampler(0, 0), "DPSampler: dp_size must be an int >= 1, got 0"),
        (lambda: DPSampler(2, 2), r"DPSampler: dp_rank must lie in \[0, dp_size=2\), got 2"),
        (lambda: DPSampler(0, 2, world_size=3), "DPSampler: world_size=3 must be a multiple of dp_size=2"),
        (lambda: DPSampler(0, 2, 4, 4), r"DPSampler: world_rank must lie in \[0, world_size=4\), got 4"),
    ],
)
def test_sampler_arguments_are_checked(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_grpo_sampler_must_match_the_queue(make_queue):
    with pytest.raises(
        InvalidRequest, match="GRPOSampler\\(num_n_samples=2\\) does not match the queue's num_n_samples=4"
    ):
        make_queue(num_n_samples=4, sampler=GRPOSampler(2))
    q = make_queue(num_n_samples=4)
    with pytest.raises(InvalidRequest, match="GRPOSampler\\(num_n_samples=2\\)"):
        q.state.register_sampler("t", GRPOSampler(2))
    with pytest.raises(InvalidRequest, match="task_name must be a non-empty str, got ''"):
        q.state.register_sampler("", SequentialSampler())


def test_the_seeds_custom_sampler_runs_unchanged(make_queue):
    import torch

    class MyCustomSampler(BaseSampler):  # verbatim from upstream TransferQueue's sampler guide
        def sample(self, ready_indices, batch_size, **kwargs):
            """Select batch_size indices from ready_indices."""
            return ready_indices[:batch_size]

        def filter_ready_indices(
            self, all_indices, production_status, consumption_status, data_fields, field_mapping, **kwargs
        ):
            """Filter indices to find those ready for consumption."""
            ready_mask = torch.zeros(len(all_indices), dtype=torch.bool)
            return [all_indices[i] for i in range(len(all_indices)) if ready_mask[i]]

    q = make_queue(global_batch_size=8)
    q.state.register_sampler("custom", MyCustomSampler())
    q.put(0, 4, X)
    waiting = q.get_async(0, "x", 2, "custom", timeout=1.0)
    q.advance(1.0)  # its filter never finds a ready row: the call waits, then times out
    with pytest.raises(GetMetaTimeout, match="task 'custom' asked global_step=0 for 2 rows"):
        waiting.result()


# ---- balanced shares -----------------------------------------------------------------------------------------
def optimum(lengths: list[int], num_shares: int) -> int:
    """The smallest largest total over all splits into shares of equal count (±1), by brute force."""
    best = None
    for assign in itertools.product(range(num_shares), repeat=len(lengths)):
        counts = [assign.count(s) for s in range(num_shares)]
        if max(counts) - min(counts) <= 1:
            totals = [sum(x for x, a in zip(lengths, assign, strict=True) if a == s) for s in range(num_shares)]
            best = min(best if best is not None else max(totals), max(totals))
    assert best is not None
    return best


@given(st.lists(st.integers(0, 10_000), min_size=0, max_size=40), st.integers(1, 6))
def test_balanced_shares_have_equal_counts_and_the_list_scheduling_bound(lengths, num_shares):
    array = np.asarray(lengths, dtype=np.int64)
    shares = balanced_shares(array, num_shares)
    assert len(shares) == num_shares
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    assert all(s == sorted(s) for s in shares)
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1
    if lengths:
        worst = max(int(array[s].sum()) for s in shares)
        assert worst <= array.sum() / num_shares + array.max()


def test_balanced_shares_stay_within_the_lpt_bound_of_the_optimum():
    rng = random.Random(0)
    for _ in range(150):
        num_shares = rng.choice([2, 3])
        lengths = [rng.randint(0, rng.choice([5, 100])) for _ in range(rng.randint(num_shares, 8 - num_shares))]
        worst = max(sum(lengths[i] for i in s) for s in balanced_shares(np.asarray(lengths), num_shares))
        assert worst <= (4 / 3 - 1 / (3 * num_shares)) * optimum(lengths, num_shares) + 1e-9, lengths
    # where the extra item goes is free: [20] [14] [7, 7] is optimal, not [20, 7] [14] [7]
    assert balanced_shares(np.array([7, 7, 20, 14]), 3) == [[2], [3], [0, 1]]


def test_seqlen_balanced_split_keeps_groups_whole():
    rows = np.arange(8, dtype=np.int64)
    lengths = np.array([50, 50, 40, 40, 2, 2, 1, 1])  # contiguous halves would hold 180 and 6 tokens
    shares = SeqlenBalancedSampler().split(rows, 2, lengths, 2)
    assert [s.tolist() for s in shares] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    contiguous = BaseSampler.split(SequentialSampler(), rows, 3, lengths, 2)
    assert [s.tolist() for s in contiguous] == [[0, 1], [2, 3, 4, 5], [6, 7]]


class KeepsEverything(SequentialSampler):
    """Overrides ``filter_ready_indices`` without changing it: the inherited ``sample`` takes a prefix."""

    def filter_ready_indices(self, *args, **kwargs):
        return super().filter_ready_indices(*args, **kwargs)


def test_a_prefix_of_ready_indices_holds_whole_groups_when_whole_groups_are_asked(make_queue):
    q = make_queue(global_batch_size=2, num_n_samples=2)
    q.state.register_sampler("train", KeepsEverything())
    q.put(0, 2, X, group_ids=[0, 1])
    q.put(0, 2, X, group_ids=[0, 1])  # in index order the groups interleave: 0 1 0 1
    meta = q.get(0, "x", 2, get_n_samples=True)
    assert meta.group_ids.tolist() == [0, 0] and indexes(meta) == [0, 2]
