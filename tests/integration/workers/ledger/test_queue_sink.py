"""QueueSink on the real queue: a sampler's groups arrive whole (GRPOSampler), each row naming its ledger record, and
the records point at their rows; a re-dispatched task's samples are queued once."""

from __future__ import annotations

import asyncio

import pytest

from workers.ledger import AsyncSampler, Ledger, SamplingConfig, Task, register_new_model
from workers.ledger.queue_sink import FIELDS, QueueSink
from workers.ledger.sampler import Sample


@register_new_model
class SinkTask(Task):
    text: str


class FixedSampler(AsyncSampler):
    """Writes four fixed samples (no inference): what reaches the queue is known exactly."""

    async def run(self):
        samples = [
            Sample(
                messages=[{"role": "assistant", "content": f"{self.task.text}{i}"}],
                prompt_ids=[1, 2],
                response_ids=[3] * (i + 1),
                response_logprobs=[-0.5] * (i + 1),
                policy_version=7,
            )
            for i in range(4)
        ]
        await self.write_records(samples)

    async def evaluate_record(self, record):
        return float(record.sample_index)


@pytest.fixture
def cfg(tmp_path):
    return SamplingConfig(output_dir=str(tmp_path), num_generations=4, heartbeat_s=5)


def test_groups_reach_the_queue_whole_and_records_know_their_rows(grpo_queue, cfg):
    ledger = Ledger(cfg.ledger_url)
    ledger.write_epoch("train", 0, [SinkTask(id=str(i), text=f"t{i}") for i in range(2)], owner="t")
    partition = grpo_queue.partition("ledger")
    sink = QueueSink(grpo_queue.client, partition)

    async def sample_all():
        for _ in range(2):
            async with FixedSampler(cfg, ledger=ledger, sink=sink) as sampler:
                await sampler.run()

    asyncio.run(sample_all())
    assert sink.rows_put == 8
    meta = grpo_queue.client.get_meta(list(FIELDS), 8, partition_id=partition, task_name="trainer", timeout=30)
    data = grpo_queue.client.get_data(meta)
    records = {r.id: r for r in ledger.records("train")}
    assert sorted(data["record_id"].tolist()) == sorted(records)
    for row, record_id in enumerate(data["record_id"].tolist()):
        record = records[record_id]
        assert record.partition_id == partition and record.global_indexes == [int(meta.global_indexes[row])]
        assert data["reward"][row].item() == record.score == float(record.sample_index)
        assert data["response_ids"][row].tolist() == [3] * (record.sample_index + 1)
        assert data["policy_version"][row].item() == 7
    by_group: dict[int, set[int]] = {}
    for row, group in enumerate(meta.group_ids):
        by_group.setdefault(int(group), set()).add(records[int(data["record_id"][row])].task_key)
    assert len(by_group) == 2 and all(len(keys) == 1 for keys in by_group.values())  # one task per group


def test_a_redispatched_task_queues_only_what_the_dead_claim_did_not(grpo_queue, cfg):
    ledger = Ledger(cfg.ledger_url)
    ledger.write_epoch("train", 0, [SinkTask(id="0", text="t")], owner="t")
    partition = grpo_queue.partition("ledger")
    sink = QueueSink(grpo_queue.client, partition)

    async def dead_then_rescued():
        # the first claim records and queues its group, then its worker "dies" (the claim is returned)
        async with FixedSampler(cfg, ledger=ledger, sink=sink) as first:
            await first.run()
            ledger.release(first.claim.id, "simulated death")
            first_ids = sorted(r.id for r in ledger.records("train"))
        async with FixedSampler(cfg, ledger=ledger, sink=sink) as second:
            await second.run()
        return first_ids

    first_ids = asyncio.run(dead_then_rescued())
    assert sink.rows_put == 4  # the second claim found every sample recorded and queued
    assert sorted(r.id for r in ledger.records("train")) == first_ids
