"""AsyncSampler and SamplingScheduler against a real OpenAI-compatible endpoint (workers/agents/openai_api.py over a
tiny in-process model on 127.0.0.1), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from tests.integration.workers.ledger.conftest import ENDPOINT_KEY, encode
from workers.ledger import (
    AsyncSampler,
    InferenceClient,
    InferenceFailed,
    InferenceService,
    Ledger,
    NoInferenceService,
    NoTaskAvailable,
    NotATask,
    SamplingConfig,
    SamplingScheduler,
    ServiceRegistration,
    Task,
    register_new_model,
)


@register_new_model
class QuestionTask(Task):
    question: str


class QuestionDataset:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> QuestionTask:
        return QuestionTask(question=f"{idx}+{idx}=")


class QuestionSampler(AsyncSampler):
    async def run(self):
        messages = [{"role": "user", "content": self.task.question}]
        completion = await self.create_chat_completions(messages, n=self.config.num_generations)
        await self.record_completion(messages, completion)

    async def evaluate_record(self, record):
        return float(len(record.messages[-1]["content"]) % 2)


class ListSink:
    """A TrajectorySink keeping rows in memory (the queue's own sink is exercised by the demo's test)."""

    def __init__(self):
        self.groups: list[tuple[str, list[dict]]] = []
        self.lock = threading.Lock()

    def put_group(self, rows, group_id, group_key):
        with self.lock:
            start = sum(len(r) for _, r in self.groups)
            self.groups.append((group_id, rows))
        return "sampling", list(range(start, start + len(rows)))


@pytest.fixture
def cfg(ledger_url, tmp_path, endpoint_url):
    config = SamplingConfig(
        output_dir=str(tmp_path),
        db_connection_string=ledger_url,
        model="tiny",
        max_new_tokens=4,
        num_generations=2,
        heartbeat_s=0.2,
        lease_s=5,
        max_concurrent_samples_per_process=4,
        target_concurrency=4,
    )
    Ledger(ledger_url).register_service(InferenceService(name="tiny-0", url=endpoint_url, model="tiny"))
    return config


def write_tasks(ledger: Ledger, n: int) -> None:
    ledger.write_epoch("train", 0, [QuestionTask(id=str(i), question=f"{i}+1=") for i in range(n)], owner="t")


def test_async_with_claims_samples_records_and_completes(cfg):
    ledger = Ledger(cfg.ledger_url)
    write_tasks(ledger, 1)

    async def main():
        async with QuestionSampler(cfg) as sampler:
            assert isinstance(sampler.task, QuestionTask) and sampler.claim.status == "running"
            await sampler.run()

    asyncio.run(main())
    assert ledger.task_counts("train") == {"done": 1}
    records = ledger.records("train")
    assert [r.sample_index for r in records] == [0, 1]
    for r in records:
        assert r.messages[0] == {"role": "user", "content": "0+1="} and r.messages[-1]["role"] == "assistant"
        assert 1 <= r.completion_tokens <= 4 and r.prompt_tokens == len(encode("user: 0+1=\nassistant: "))
        assert r.score == float(len(r.messages[-1]["content"]) % 2) and r.group_id == "train/0/0"


def test_an_exception_fails_the_claim_with_the_error_and_cancellation_returns_it(cfg):
    ledger = Ledger(cfg.ledger_url)
    write_tasks(ledger, 1)

    class Broken(QuestionSampler):
        async def run(self):
            raise RuntimeError("environment crashed")

    async def failing():
        async with Broken(cfg) as sampler:
            await sampler.run()

    with pytest.raises(RuntimeError, match="environment crashed"):
        asyncio.run(failing())
    (task,) = ledger.tasks("train")
    assert (task.status, task.last_error) == ("pending", "RuntimeError: environment crashed")
    assert [(c.status, c.last_error) for c in ledger.claims()] == [("failed", "RuntimeError: environment crashed")]

    async def cancelled():
        async def hang():
            async with QuestionSampler(cfg):
                await asyncio.sleep(60)

        job = asyncio.create_task(hang())
        await asyncio.sleep(0.5)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(cancelled())
    (task,) = ledger.tasks("train")
    assert (task.status, task.attempts) == ("pending", 1)  # returned: the attempt does not count
    assert ledger.claims()[-1].status == "expired" and "cancelled" in ledger.claims()[-1].last_error


def test_no_claimable_task_is_a_typed_error(cfg):
    async def main():
        async with QuestionSampler(cfg):
            pass

    with pytest.raises(NoTaskAvailable, match="no task of split 'train' can be claimed"):
        asyncio.run(main())


def test_requests_go_to_the_least_loaded_healthy_service(cfg, endpoint_url):
    ledger = Ledger(cfg.ledger_url)
    ledger.register_service(InferenceService(name="busy", url="http://127.0.0.1:9/v1", model="tiny", load=50))
    ledger.register_service(InferenceService(name="other-model", url="http://127.0.0.1:9/v1", model="x"))
    client = InferenceClient(ledger, cfg)

    async def main():
        assert (await client.pick()).name == "tiny-0"
        completion = await client.chat([{"role": "user", "content": "1+1="}], n=3)
        await client.aclose()
        return completion

    completion = asyncio.run(main())
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert len(choice.token_ids) == len(choice.token_logprobs) >= 1
        assert all(lp <= 0 for lp in choice.token_logprobs)
    ledger.set_service_status("tiny-0", "down")
    ledger.set_service_status("busy", "down")
    with pytest.raises(NoInferenceService, match="no healthy inference service for model 'tiny'"):
        asyncio.run(InferenceClient(ledger, cfg).pick())


def test_a_service_with_a_key_refuses_a_client_without_it(cfg, keyed_endpoint_url, monkeypatch):
    monkeypatch.delenv("TQ_API_KEY", raising=False)
    ledger = Ledger(cfg.ledger_url)
    ledger.register_service(InferenceService(name="keyed-0", url=keyed_endpoint_url, model="keyed"))
    keyed = cfg.model_copy(update={"model": "keyed"})
    messages = [{"role": "user", "content": "1+1="}]

    async def chat(client: InferenceClient):
        try:
            return await client.chat(messages, n=1)
        finally:
            await client.aclose()

    with pytest.raises(InferenceFailed, match=r"keyed-0 at .* answered 401: .*missing or wrong API key") as refused:
        asyncio.run(chat(InferenceClient(ledger, keyed)))
    assert ENDPOINT_KEY not in str(refused.value)
    assert len(asyncio.run(chat(InferenceClient(ledger, keyed, api_key=ENDPOINT_KEY))).choices) == 1
    monkeypatch.setenv("TQ_API_KEY", ENDPOINT_KEY)  # a sampler process given the key through its environment
    assert len(asyncio.run(chat(InferenceClient(ledger, keyed))).choices) == 1


def test_service_registration_heartbeats_and_goes_down_on_exit(cfg, endpoint_url):
    ledger = Ledger(cfg.ledger_url)
    load = iter(range(1000))
    service = InferenceService(name="hb", url=endpoint_url, model="tiny")
    with ServiceRegistration(ledger, service, load=lambda: float(next(load)), every_s=0.05):
        deadline = asyncio.run(asyncio.sleep(0.4, result=None))
        assert deadline is None
        (hb,) = [s for s in ledger.services() if s.name == "hb"]
        assert hb.status == "up" and hb.load >= 1
    (hb,) = [s for s in ledger.services() if s.name == "hb"]
    assert hb.status == "down"


def test_scheduler_writes_epochs_and_records_every_task_once_per_epoch(cfg):
    cfg = cfg.model_copy(update={"num_epochs": 2})
    sink = ListSink()
    stats = SamplingScheduler(
        config=cfg, sampler_class=QuestionSampler, dataset=QuestionDataset(5), split="train", sink=sink
    ).run()
    ledger = Ledger(cfg.ledger_url)
    assert ledger.written_epochs("train") == [0, 1]
    assert ledger.task_counts("train") == {"done": 10}
    records = ledger.records("train")
    assert Counter((r.epoch, r.task_id) for r in records) == Counter(
        {(e, str(i)): 2 for e in range(2) for i in range(5)}
    )
    assert stats["completed"] == 10
    # one put per GRPO group, the group whole; records know their queue rows
    assert sorted(g for g, _ in sink.groups) == sorted(f"train/{e}/{i}" for e in range(2) for i in range(5))
    assert all(len(rows) == 2 for _, rows in sink.groups)
    assert all(r.partition_id == "sampling" and len(r.global_indexes) == 1 for r in records)
    by_id = {row["record_id"]: row for _, rows in sink.groups for row in rows}
    assert {r.id: r.score for r in records} == {i: row["reward"] for i, row in by_id.items()}


def test_run_epochs_samples_just_those_epochs_of_the_split_without_a_sink(cfg):
    """An evaluation's run: one named epoch of split eval, recorded and scored, nothing queued."""
    stats = SamplingScheduler(config=cfg, sampler_class=QuestionSampler, dataset=QuestionDataset(3), split="eval").run(
        epochs=[4]
    )
    ledger = Ledger(cfg.ledger_url)
    assert ledger.written_epochs("eval") == [4] and ledger.written_epochs("train") == []
    records = ledger.records("eval")
    assert stats["completed"] == 3 and len(records) == 6 and {r.epoch for r in records} == {4}
    assert all(r.partition_id is None and r.score is not None for r in records)


def test_two_schedulers_on_one_split_write_each_epoch_once(cfg):
    cfg = cfg.model_copy(update={"num_epochs": 2})
    schedulers = [
        SamplingScheduler(config=cfg, sampler_class=QuestionSampler, dataset=QuestionDataset(6)) for _ in "ab"
    ]
    threads = [threading.Thread(target=s.run) for s in schedulers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ledger = Ledger(cfg.ledger_url)
    assert sorted(e for s in schedulers for e in s.epochs_written) == [0, 1]
    assert len(ledger.tasks("train")) == 12
    assert Counter((r.epoch, r.task_id, r.sample_index) for r in ledger.records("train")).most_common(1)[0][1] == 1
    assert len(ledger.records("train")) == 24


def test_stop_when_ends_the_run_early(cfg):
    cfg = cfg.model_copy(update={"num_epochs": 5, "max_concurrent_samples_per_process": 1})
    ledger = Ledger(cfg.ledger_url)
    scheduler = SamplingScheduler(
        config=cfg,
        sampler_class=QuestionSampler,
        dataset=QuestionDataset(2),
        stop_when=lambda: len(ledger.records("train")) >= 6,
    )
    scheduler.run()
    assert ledger.written_epochs("train") == [0, 1]
    assert len(ledger.records("train")) == 6  # one sampler at a time: it stops right after the third task


def test_a_dataset_item_that_is_not_a_task_is_a_typed_error(cfg):
    scheduler = SamplingScheduler(config=cfg, sampler_class=QuestionSampler, dataset=[{"question": "1+1="}])
    with pytest.raises(NotATask, match="dataset item 0 is a dict; expected a Task instance"):
        scheduler.run()
    assert Ledger(cfg.ledger_url).written_epochs("train") == []
    with pytest.raises(TypeError, match="sampler_class must be a subclass of AsyncSampler"):
        SamplingScheduler(config=cfg, sampler_class=dict, dataset=[])


def test_the_scheduler_claims_for_all_the_samplers_it_starts_in_one_statement(cfg):
    ledger = Ledger(cfg.ledger_url)
    calls: list[tuple[str, int]] = []
    claim_many = ledger.claim_many
    ledger.claim = lambda *a, **k: calls.append(("claim", 1))  # type: ignore[method-assign]

    def spy(split, owner, n, *args, **kwargs):
        got = claim_many(split, owner, n, *args, **kwargs)
        calls.append(("claim_many", n))
        return got

    ledger.claim_many = spy  # type: ignore[method-assign]
    stats = SamplingScheduler(
        config=cfg, sampler_class=QuestionSampler, dataset=QuestionDataset(4), ledger=ledger
    ).run()
    assert stats["completed"] == 4 and ledger.task_counts("train") == {"done": 4}
    assert calls[0] == ("claim_many", 4)  # max_concurrent_samples_per_process=4 samplers: their 4 claims at once
    assert all(kind == "claim_many" for kind, _ in calls)  # no sampler claimed a task of its own
    owners = {c.owner for c in ledger.claims("train")}
    assert len(owners) == 1 and owners.pop().startswith("scheduler:")


def test_claims_of_samplers_cancelled_before_they_start_go_back(cfg):
    ledger = Ledger(cfg.ledger_url)
    write_tasks(ledger, 3)
    scheduler = SamplingScheduler(config=cfg, sampler_class=QuestionSampler, dataset=QuestionDataset(3), ledger=ledger)

    async def main():
        started = [scheduler._start(claimed, 0) for claimed in await scheduler._claim(3)]
        for task in started:  # cancelled before their first step: no sampler ever held these claims
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        await scheduler._release_unstarted()

    asyncio.run(main())
    assert ledger.task_counts("train") == {"pending": 3}
    assert {t.attempts for t in ledger.tasks("train")} == {0}  # returned: the attempts do not count
    claims = ledger.claims("train")
    assert len(claims) == 3 and {(c.status, c.last_error) for c in claims} == {
        ("expired", "returned: its sampler never started")
    }


class BrokenSampler(QuestionSampler):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("broken sampler")


def test_a_sampler_that_cannot_be_built_fails_its_claim_with_the_error(cfg):
    ledger = Ledger(cfg.ledger_url)
    stats = SamplingScheduler(config=cfg, sampler_class=BrokenSampler, dataset=QuestionDataset(1), ledger=ledger).run()
    (task,) = ledger.tasks("train")
    assert task.status == "failed" and task.last_error == "RuntimeError: broken sampler", task
    claims = ledger.claims("train")
    assert claims and all(c.status == "failed" for c in claims)  # none left to wait out its lease
    assert stats["failed"] == len(claims)


def a_string(record):
    """A ``convert_record_to_data_func`` of the wrong shape."""
    return "not the data"


def test_a_non_retryable_error_of_the_users_hook_ends_the_scheduler_run_with_it(cfg):
    from workers.ledger import InvalidRecordData

    ledger, sink = Ledger(cfg.ledger_url), ListSink()
    scheduler = SamplingScheduler(
        config=cfg.model_copy(update={"num_epochs": 3}),
        sampler_class=QuestionSampler,
        dataset=QuestionDataset(8),
        ledger=ledger,
        sink=sink,
        convert_record_to_data_func=a_string,
    )
    with pytest.raises(
        InvalidRecordData,
        match=r"convert_record_to_data_func a_string of record \d+ \(task \d\): expected a dict \{'prompt_ids': "
        r"\[int, \.\.\.\], 'response_ids': \[int, \.\.\.\]\} .*, got a str: 'not the data'",
    ) as raised:
        scheduler.run()

    assert scheduler.fatal_error is raised.value
    assert not sink.groups  # nothing reached the queue
    assert ledger.written_epochs("train") == [0]  # the run ended in its first epoch
    tasks = ledger.tasks("train")
    assert not [t for t in tasks if t.status == "running"]  # the running samplers were cancelled, their claims returned
    failed = [c for c in ledger.claims("train") if c.status == "failed"]
    assert failed and all(c.last_error.startswith("InvalidRecordData: convert_record_to_data_func") for c in failed)
