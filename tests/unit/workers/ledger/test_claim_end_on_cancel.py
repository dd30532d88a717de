"""A claim's end (fail, release) reaches the ledger even when its task is cancelled before a pool thread ran the call.

The scheduler cancels the running samplers when one fails for good (``NON_RETRYABLE``); a sampler cancelled while
its ``__aexit__`` awaited ``asyncio.to_thread(ledger.fail, ...)``, the call still queued for a pool thread, lost the
call (cancelling the await cancels the queued call), and its task stayed 'running' after the run had ended
(tests/integration/workers/ledger/test_agentrl_demo.py's wrong-shape hook test, about 1 run in 3). Here the loop's
one pool thread is held busy, so that the call is queued when the task is cancelled: deterministic, no timing.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from workers.ledger import AsyncSampler, InferenceClient, Ledger, SamplingConfig, SamplingScheduler, Task


class GatedPool(ThreadPoolExecutor):
    """One thread, held by ``hold()`` until ``gate`` is set; counts the calls submitted."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0
        self.gate = threading.Event()

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


async def queued_behind(pool: GatedPool, n: int) -> None:
    """Until ``n`` calls were submitted to ``pool`` (the first: the one holding its thread)."""
    while pool.submitted < n:
        await asyncio.sleep(0)


class FailingSampler(AsyncSampler):
    async def run(self):
        raise ValueError("no answer")

    async def evaluate_record(self, record):
        return 0.0


class WaitingSampler(AsyncSampler):
    async def run(self):
        await asyncio.Event().wait()  # until cancelled

    async def evaluate_record(self, record):
        return 0.0


@pytest.fixture
def ledger_url(tmp_path):
    return f"sqlite:///{tmp_path}/ledger.db"


@pytest.fixture
def ledger(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.write_epoch("train", 0, [Task(id=str(i)) for i in range(3)], owner="test")
    yield ledger
    ledger.close()


@pytest.fixture
def cfg(tmp_path, ledger_url):
    return SamplingConfig(output_dir=str(tmp_path), db_connection_string=ledger_url, heartbeat_s=30, lease_s=60)


async def sample_and_cancel(sampler: AsyncSampler, cancels: int) -> None:
    """Run ``sampler`` on a claim in a task; cancel it ``cancels`` times, the last while the call ending its claim is
    queued behind the held pool thread; then let the pool run."""
    loop = asyncio.get_running_loop()
    pool = GatedPool()
    loop.set_default_executor(pool)
    holding = loop.run_in_executor(None, pool.gate.wait)

    async def sample() -> None:
        async with sampler:
            await sampler.run()

    task = asyncio.create_task(sample())
    for _ in range(cancels - 1):  # the sampler is cancelled while it runs: __aexit__ returns its claim
        await asyncio.sleep(0)
        task.cancel()
    await queued_behind(pool, 2)  # __aexit__'s ledger call (fail or release) waits for the pool's thread
    task.cancel()
    pool.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await holding


@pytest.mark.parametrize(
    ("sampler_class", "cancels", "status", "attempts", "claim_status", "error"),
    [
        (FailingSampler, 1, "pending", 1, "failed", "ValueError: no answer"),
        (WaitingSampler, 2, "pending", 0, "expired", "cancelled: returned by its sampler"),
    ],
    ids=["fail", "release"],
)
def test_a_sampler_cancelled_while_its_claims_end_is_queued_still_ends_the_claim(
    ledger, cfg, sampler_class, cancels, status, attempts, claim_status, error
):
    sampler = sampler_class(cfg, ledger=ledger, inference=InferenceClient(ledger, cfg), split="train")
    sampler.adopt(ledger.claim_many("train", "scheduler:test", 1, lease_s=60)[0])

    asyncio.run(sample_and_cancel(sampler, cancels))

    task = next(t for t in ledger.tasks("train") if t.id == "0")
    assert (task.status, task.attempts) == (status, attempts)  # not 'running' until the lease runs out
    [claim] = ledger.claims("train")
    assert (claim.status, claim.last_error) == (claim_status, error)


def test_the_scheduler_returns_every_claim_it_releases_when_cancelled_meanwhile(ledger, cfg):
    scheduler = SamplingScheduler(cfg, WaitingSampler, [], ledger=ledger, inference=InferenceClient(ledger, cfg))
    claims = [claim for claim, _ in ledger.claim_many("train", scheduler.owner, 3, lease_s=60)]

    async def release_and_cancel() -> None:
        loop = asyncio.get_running_loop()
        pool = GatedPool()
        loop.set_default_executor(pool)
        holding = loop.run_in_executor(None, pool.gate.wait)
        releasing = asyncio.create_task(scheduler._release(claims, "returned: its sampler never started"))
        await queued_behind(pool, 2)  # the first release waits for the pool's thread
        releasing.cancel()
        pool.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        await holding

    asyncio.run(release_and_cancel())

    assert [t.status for t in ledger.tasks("train")] == ["pending"] * 3
    assert [c.status for c in ledger.claims("train")] == ["expired"] * 3
