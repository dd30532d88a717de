"""The queue under stalls and long steps (issue 23, defect 11): a sampler whose claim was lost stops writing and
queuing; the ledger trainer frees the rows it trained; a heartbeat slower than the lease is refused; a connection
string's password never shows in an error."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from workers.ledger import AsyncSampler, ClaimLost, Ledger, Record, SamplingConfig, Task, register_new_model
from workers.ledger.errors import InvalidSamplingConfig, LedgerUnavailable, MalformedConnectionString
from workers.ledger.queue_sink import QueueSink
from workers.ledger.sampler import Sample
from workers.ledger.schema import parse_connection_string


@register_new_model
class StallTask(Task):
    text: str


class ListSink:
    def __init__(self):
        self.groups: list[tuple[str, list[dict]]] = []

    def put_group(self, rows, group_id, group_key):
        start = sum(len(r) for _, r in self.groups)
        self.groups.append((group_id, rows))
        return "sampling", list(range(start, start + len(rows)))


class TaggedSampler(AsyncSampler):
    """Writes two samples whose reward is its tag (which claimer's samples reached the sink is then known)."""

    tag = 0.0

    async def run(self):
        samples = [
            Sample(messages=[{"role": "assistant", "content": f"{self.owner}{i}"}], prompt_ids=[1], response_ids=[2])
            for i in range(2)
        ]
        return await self.write_records(samples)

    async def evaluate_record(self, record):
        return self.tag


def tagged(tag: float) -> type[TaggedSampler]:
    return type(f"Tagged{int(tag)}", (TaggedSampler,), {"tag": tag})


def record(claim, i: int = 0, score: float = 0.0) -> Record:
    return Record(
        task_key=claim.task_key,
        task_id=claim.task_id,
        split=claim.split,
        epoch=claim.epoch,
        sample_index=i,
        claim_id=claim.id,
        score=score,
    )


# -- a. a lost claim writes and queues nothing ----------------------------------------------------------------------
def test_the_store_refuses_writes_by_a_claimer_whose_lease_another_took(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [StallTask(id="t0", text="x")], owner="s")
    first, _ = ledger.claim("train", owner="stalled", lease_s=0.05)
    time.sleep(0.1)
    second, _ = ledger.claim("train", owner="rescuer", lease_s=30)
    lost = rf"claim {first.id} of task t0 \(owner stalled\) is no longer the task's live claim"
    with pytest.raises(ClaimLost, match=lost):
        ledger.write_records([record(first, score=1.0)])
    with pytest.raises(ClaimLost, match=lost):
        ledger.write_records([record(first, score=1.0)], replace_unqueued=True)
    [(kept, written)] = ledger.write_records([record(second, score=2.0)], replace_unqueued=True)
    assert written and kept.score == 2.0 and kept.claim_id == second.id
    with pytest.raises(ClaimLost, match=lost):  # a stale claimer cannot overwrite the live claim's record either
        ledger.write_records([record(first, score=1.0)], replace_unqueued=True)
    with pytest.raises(ClaimLost, match=lost):
        ledger.set_record_locations([kept.id], "p", [0], claim_id=first.id)
    with pytest.raises(ClaimLost, match=lost):
        ledger.heartbeat(first.id, 30)
    assert [(r.score, r.claim_id, r.partition_id) for r in ledger.records("train")] == [(2.0, second.id, None)]


def test_a_sampler_whose_claim_was_taken_stops_writing_and_queuing(tmp_path):
    cfg = SamplingConfig(output_dir=str(tmp_path), lease_s=0.3, heartbeat_s=0.1)
    ledger = Ledger(cfg.ledger_url)
    ledger.write_epoch("train", 0, [StallTask(id="t0", text="x")], owner="s")
    sink = ListSink()

    async def stalled_then_rescued():
        async with tagged(1.0)(cfg, ledger=ledger, sink=sink, owner="stalled") as stalled:
            time.sleep(0.5)  # the whole process stalls (no heartbeat runs): the lease runs out
            async with tagged(2.0)(cfg, ledger=ledger, sink=sink, owner="rescuer") as rescuer:
                await asyncio.sleep(0.3)  # the stalled sampler's heartbeat finds its claim gone
                assert stalled.lease_lost
                with pytest.raises(ClaimLost, match=r"claim \d+ of task t0 \(owner stalled\) is no longer"):
                    await stalled.run()
                await rescuer.run()

    asyncio.run(stalled_then_rescued())
    assert [(gid, [r["reward"] for r in rows]) for gid, rows in sink.groups] == [("train/0/t0", [2.0, 2.0])]
    assert [r.score for r in ledger.records("train")] == [2.0, 2.0]
    assert ledger.task_counts("train") == {"done": 1}


def test_a_claim_lost_between_recording_and_queuing_queues_nothing(tmp_path):
    """The stalled claim recorded its samples, then lost the claim before its put: only the rescuer's group is queued,
    and the records are the rescuer's samples (replace_unqueued swapped them), never a mix."""
    cfg = SamplingConfig(output_dir=str(tmp_path), lease_s=30, heartbeat_s=10)
    ledger = Ledger(cfg.ledger_url)
    ledger.write_epoch("train", 0, [StallTask(id="t0", text="x")], owner="s")
    sink = ListSink()
    real_write = ledger.write_records

    def write_then_stall(records, replace_unqueued=False):
        out = real_write(records, replace_unqueued)
        if records[0].score == 1.0:  # the first claimer: its lease runs out and the rescuer claims the task
            with ledger._tx() as conn:
                from workers.ledger import schema

                conn.execute(schema.tasks.update().values(lease_deadline=time.time() - 1))
            assert ledger.claim("train", owner="rescuer", lease_s=30) is not None
        return out

    ledger.write_records = write_then_stall  # type: ignore[method-assign]

    async def stall():
        async with tagged(1.0)(cfg, ledger=ledger, sink=sink, owner="stalled") as stalled:
            with pytest.raises(ClaimLost, match=r"claim \d+ of task t0 \(owner stalled\) is no longer"):
                await stalled.run()
            raise ClaimLost("stopped")

    with pytest.raises(ClaimLost, match="stopped"):
        asyncio.run(stall())
    assert sink.groups == []
    assert all(r.partition_id is None for r in ledger.records("train"))


# -- b. the ledger trainer frees what it trained ---------------------------------------------------------------------
def test_the_ledger_trainer_frees_the_rows_it_trained(grpo_queue, tmp_path):
    from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerTrainingConfig
    from workers.models import build_tiny_causal_lm

    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    partition = grpo_queue.partition("ledger")
    sink = QueueSink(grpo_queue.client, partition)
    policy = build_tiny_causal_lm(16, hidden_size=16, num_layers=1, num_heads=2, max_position_embeddings=16, seed=0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    trainer = LedgerGRPOTrainer(
        policy, optimizer, grpo_queue.client, ledger, partition, LedgerTrainingConfig(batch_rows=4, queue_timeout=15)
    )
    rows_seen = []
    for step in range(6):
        rows = [
            dict(record_id=-1, prompt_ids=[3, 4], response_ids=[5, 6], response_logprobs=[-1.0, -1.0], reward=float(i))
            | {"policy_version": step}
            for i in range(4)
        ]
        sink.put_group(rows, f"g{step}", step)
        metrics = trainer.step(step)
        assert metrics["rows_trained"] == 4
        rows_seen.append(grpo_queue.client.get_production_status(partition_id=partition)["rows"])
    assert max(rows_seen) <= 4, f"the partition keeps trained rows: {rows_seen}"


# -- c. a heartbeat slower than the lease ---------------------------------------------------------------------------
@pytest.mark.parametrize("heartbeat_s", [60.0, 90.0])
def test_a_heartbeat_no_faster_than_the_lease_is_refused(tmp_path, heartbeat_s):
    with pytest.raises(
        InvalidSamplingConfig, match=rf"heartbeat_s: expected < lease_s = 60.0 .*, got heartbeat_s = {heartbeat_s}"
    ):
        SamplingConfig(output_dir=str(tmp_path), lease_s=60, heartbeat_s=heartbeat_s)
    with pytest.raises(InvalidSamplingConfig, match=r"expected < lease_s"):
        SamplingConfig.model_validate({"lease_s": 1, "heartbeat_s": 1})
    assert SamplingConfig(output_dir=str(tmp_path), lease_s=60, heartbeat_s=59).heartbeat_s == 59


# -- d. passwords never show ---------------------------------------------------------------------------------------
SECRET = "hunter2-s3cret"


@pytest.mark.parametrize(
    "value",
    [
        f"postgresql://alice:{SECRET}@db host:5432/ledger",  # a space: malformed
        f"postgresql://alice:{SECRET}@h/x?a b",
        f"postgres://alice:{SECRET}@ho st/x",
    ],
)
def test_a_refused_connection_string_never_shows_its_password(value, tmp_path):
    with pytest.raises(MalformedConnectionString, match=r"expected 'sqlite:///PATH' .*, got .*alice:\*\*\*@") as exc:
        parse_connection_string(value)
    assert SECRET not in str(exc.value)
    with pytest.raises(Exception, match=r"alice:\*\*\*@") as exc:
        SamplingConfig(output_dir=str(tmp_path), db_connection_string=value)
    assert SECRET not in str(exc.value) and SECRET not in repr(exc.value)


def test_an_unreachable_ledger_never_shows_its_password(caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(LedgerUnavailable, match=r"ledger postgresql\+psycopg://alice:\*\*\*@127\.0\.0\.1:1/x") as exc:
        Ledger(f"postgresql://alice:{SECRET}@127.0.0.1:1/x")
    assert SECRET not in str(exc.value) and SECRET not in caplog.text


def test_a_sampling_config_never_shows_its_password(tmp_path):
    cfg = SamplingConfig(output_dir=str(tmp_path), db_connection_string=f"postgresql://alice:{SECRET}@h:5/x")
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)
    assert cfg.ledger_url.endswith(f"alice:{SECRET}@h:5/x")  # the real URL is still there to connect with
