"""``SamplingScheduler``: writes a dataset's ``Task``s into the ledger epoch by epoch and keeps samplers running.

    scheduler = SamplingScheduler(config=cfg, sampler_class=MySampler, dataset=dataset, split="train")
    scheduler.run()          # or: await scheduler.run_async(); scheduler.stop() from another thread ends it early

Per epoch: under the split's distributed lock (a lease row in the ledger), the epoch's tasks are written unless
another scheduler already wrote them (then this one follows: it samples the same tasks, never writes them twice).
Then sampler coroutines are started while this process runs fewer than ``max_concurrent_samples_per_process`` and
the inference services carry less than ``target_concurrency`` requests each; each does
``async with sampler_class(cfg, ...) as s: await s.run()``. The scheduler claims the tasks of the samplers it starts
at once, all in one statement (``Ledger.claim_many``), and hands each sampler its claim (``AsyncSampler.adopt``); a
claim whose sampler never started is released when the run is cancelled. The next epoch starts when no task of this
one is left to claim (``sync_sampling``: when every task of it has finished). The run ends after ``num_epochs`` or on
``stop()``.

A sampler that fails with a non-retryable error of the user's code (``NON_RETRYABLE``: a
``convert_record_to_data_func`` that returned something other than a record's data) ends the run at once: every task
would fail alike. The scheduler keeps the first such error (``fatal_error``, set before anything is cleaned up, so a
trainer waiting on the queue can check it), cancels the running samplers (their claims are returned) and ``run()``
raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from workers.ledger.blobs import BlobStore, open_blob_store
from workers.ledger.config import SamplingConfig
from workers.ledger.errors import InvalidRecordData, LockNotAcquired, NoInferenceService, NoTaskAvailable, NotATask
from workers.ledger.models import BASE_TASK_FIELDS, DispatchedSamplingTask, Task, check_registered
from workers.ledger.multimodal import store_mm_payload
from workers.ledger.retry import with_retry, with_retry_to_end
from workers.ledger.sampler import AsyncSampler, TrajectorySink, _blob_dir, shared_ledger
from workers.ledger.services import InferenceClient
from workers.ledger.store import EpochProgress, Ledger

log = logging.getLogger(__name__)

# errors of the user's code that retrying a task cannot mend (every task would fail alike): the first ends the run
NON_RETRYABLE: tuple[type[Exception], ...] = (InvalidRecordData,)


class SamplingScheduler:
    """See the module docstring.

    Args:
        config: the run's ``SamplingConfig``.
        sampler_class: an ``AsyncSampler`` subclass, built as ``sampler_class(config, ledger=..., inference=...,
            sink=..., blobs=..., split=...)``.
        dataset: anything with ``__len__`` and ``__getitem__`` returning ``Task`` instances of registered types.
        split: the split the tasks are written to and claimed from.
        ledger, sink, inference, blobs: shared resources (defaults as for ``AsyncSampler``).
        stop_when: polled between sampler starts; ``True`` ends the run (e.g. the trainer has enough).
        pause_when: polled likewise; ``True`` starts no new sampler for now (e.g. the trainer is far behind).
        convert_record_to_data_func: the hook each sampler passes its groups' records through on their way into the
            sink (``AsyncSampler``); the records and groups it skips are counted in ``stats`` (``records_skipped``,
            ``groups_skipped``).

    ``fatal_error``: the first ``NON_RETRYABLE`` error a sampler failed with (None while there is none); ``run()``
    raises it.
    """

    def __init__(
        self,
        config: SamplingConfig,
        sampler_class: type[AsyncSampler],
        dataset: Any,
        split: str = "train",
        *,
        ledger: Ledger | None = None,
        sink: TrajectorySink | None = None,
        inference: InferenceClient | None = None,
        blobs: BlobStore | None = None,
        stop_when: Callable[[], bool] | None = None,
        pause_when: Callable[[], bool] | None = None,
        lock_ttl_s: float = 30.0,
        convert_record_to_data_func: Callable[[Any], Any] | None = None,
    ):
        if not (isinstance(sampler_class, type) and issubclass(sampler_class, AsyncSampler)):
            raise TypeError(f"sampler_class must be a subclass of AsyncSampler, got {sampler_class!r}")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"dataset must have __len__ and __getitem__ (a torch Dataset), got {type(dataset).__name__}"
            )
        self.config, self.sampler_class, self.dataset, self.split = config, sampler_class, dataset, split
        self.ledger = ledger if ledger is not None else shared_ledger(config)
        self.sink = sink
        self.inference = inference if inference is not None else InferenceClient(self.ledger, config)
        self.blobs = blobs if blobs is not None else open_blob_store(config.oss_connection_string, _blob_dir(config))
        self.owner = f"scheduler:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.stop_when, self.pause_when = stop_when, pause_when
        self.lock_ttl_s = lock_ttl_s
        self.convert_record_to_data_func = convert_record_to_data_func
        self.stats: Counter[str] = Counter()
        self.fatal_error: Exception | None = None
        self.epochs_written: list[int] = []
        self._stop = threading.Event()
        self._unstarted: dict[asyncio.Task, DispatchedSamplingTask] = {}  # claims handed to samplers not yet started

    # -- control ---------------------------------------------------------------------------------------------------
    def run(self, epochs: Iterable[int] | None = None) -> dict[str, int]:
        """Run to the end (``num_epochs`` or ``stop()``); counts of samplers started, completed, failed, ...
        ``epochs``: the epochs to write and sample, in order (``range(num_epochs)`` by default; an evaluation
        samples its split's one epoch per evaluation).

        Raises:
            InvalidRecordData (any ``NON_RETRYABLE`` error): the first one a sampler failed with, once the running
                samplers are cancelled.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.run_async(epochs))
        raise RuntimeError("SamplingScheduler.run() was called inside an event loop: await run_async() instead")

    def stop(self) -> None:
        """End the run: no new samplers start; the running ones finish their tasks. Thread-safe."""
        self._stop.set()

    def stopping(self) -> bool:
        return self._stop.is_set() or (self.stop_when is not None and self.stop_when())

    async def run_async(self, epochs: Iterable[int] | None = None) -> dict[str, int]:
        running: set[asyncio.Task] = set()
        try:
            for epoch in range(self.config.num_epochs) if epochs is None else epochs:
                if self.stopping():
                    break
                await asyncio.to_thread(self.write_epoch, epoch)
                await self._sample_epoch(epoch, running)
            self._raise_fatal()
            while running:  # the last tasks (or, after stop(), the ones under way)
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running -= done
                self._raise_fatal()
        except BaseException:
            for task in running:
                task.cancel()  # cancelled samplers return their claims
            await asyncio.gather(*running, return_exceptions=True)
            await self._release_unstarted()  # and so does the scheduler, for those that never started
            raise
        finally:
            await self.inference.aclose()
        return dict(self.stats)

    def _raise_fatal(self) -> None:
        if self.fatal_error is not None:
            raise self.fatal_error

    # -- tasks -----------------------------------------------------------------------------------------------------
    def epoch_tasks(self, epoch: int) -> list[Task]:
        """The dataset's tasks for ``epoch`` (ids: the task's own, else its index), checked before anything is
        written. Images in the tasks' messages (OpenAI content parts) are stored in the blob store and kept as
        ``image_ref`` parts (``workers/ledger/multimodal.py``)."""
        tasks = []
        for index in range(len(self.dataset)):
            item = self.dataset[index]
            if not isinstance(item, Task):
                raise NotATask(
                    f"dataset item {index} is a {type(item).__name__}; expected a Task instance (a subclass of Task "
                    f"decorated with @register_new_model)"
                )
            check_registered(item)
            tid = item.id if item.id is not None else str(index)
            update: dict[str, Any] = {"id": tid, "split": self.split, "epoch": epoch, "status": "pending"}
            for name in type(item).model_fields.keys() - set(BASE_TASK_FIELDS):  # images -> blob store, image_ref
                value = getattr(item, name)
                if (stored := store_mm_payload(value, self.blobs)) is not value:
                    update[name] = stored
            tasks.append(item.model_copy(update=update))
        ids = Counter(t.id for t in tasks if t.id is not None)  # every id is set above
        if dupes := sorted(i for i, n in ids.items() if n > 1):
            raise ValueError(f"task ids must be unique within a split; repeated: {dupes[:10]}")
        return tasks

    def write_epoch(self, epoch: int, wait_s: float = 120.0) -> bool:
        """Write ``epoch``'s tasks under the split's lock unless they are written; whether this call wrote them."""
        lock = f"epochs:{self.split}"
        deadline = time.monotonic() + wait_s
        while not with_retry(lambda: self.ledger.acquire_lock(lock, self.owner, self.lock_ttl_s)):
            if epoch in with_retry(lambda: self.ledger.written_epochs(self.split)):
                return False  # another scheduler wrote it: follow
            if time.monotonic() > deadline:
                raise LockNotAcquired(f"lock {lock!r} was held by another scheduler for {wait_s} s")
            time.sleep(0.1)
        try:
            if epoch in with_retry(lambda: self.ledger.written_epochs(self.split)):
                return False
            tasks = self.epoch_tasks(epoch)
            wrote = with_retry(lambda: self.ledger.write_epoch(self.split, epoch, tasks, self.owner))
            if wrote:
                self.epochs_written.append(epoch)
                log.info("scheduler %s wrote epoch %d of %r: %d tasks", self.owner, epoch, self.split, len(tasks))
            return wrote
        finally:
            with_retry(lambda: self.ledger.release_lock(lock, self.owner))

    # -- samplers --------------------------------------------------------------------------------------------------
    async def _sample_epoch(self, epoch: int, running: set[asyncio.Task]) -> None:
        cfg = self.config
        while not self.stopping():
            unfinished, claimable = await asyncio.to_thread(self.epoch_progress, epoch)
            if unfinished == 0 or (claimable == 0 and not cfg.sync_sampling):
                return
            room = min(cfg.max_concurrent_samples_per_process - len(running), claimable, await self._inference_room())
            if self.pause_when is not None and self.pause_when():
                room = 0
            for claimed in await self._claim(room):
                running.add(self._start(claimed, epoch))
            if running:
                done, _ = await asyncio.wait(running, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
                running -= done
            else:
                await asyncio.sleep(0.1)

    def epoch_progress(self, epoch: int) -> EpochProgress:
        """The scheduler's poll (every 0.2 s while it samples ``epoch``): how many of the epoch's tasks are unfinished
        (pending or running) and how many a claim would get now, each counted up to
        ``max_concurrent_samples_per_process`` (all the poll needs: whether any is unfinished, how many samplers to
        start), so that it reads index ranges, never the whole epoch."""
        cap = self.config.max_concurrent_samples_per_process
        return with_retry(lambda: self.ledger.epoch_progress(self.split, epoch, limit=cap))

    async def _inference_room(self) -> int:
        """How many more requests the healthy services take before each carries ``target_concurrency``."""
        try:
            services = await self.inference.services()
        except Exception as exc:  # the ledger is away: start nothing this round
            log.warning("could not read inference services: %s", exc)
            return 0
        if not services:
            self.stats["waited_for_inference"] += 1
            return 0
        target = self.config.target_concurrency
        return int(sum(max(target - self.inference.load(s), 0) for s in services))

    async def _claim(self, room: int) -> list[tuple[DispatchedSamplingTask, Task]]:
        """Claims for ``room`` samplers, taken in one statement (fewer when fewer tasks are claimable now)."""
        if room < 1:
            return []
        lease_s = self.config.lease_s
        claiming = asyncio.ensure_future(
            asyncio.to_thread(with_retry, lambda: self.ledger.claim_many(self.split, self.owner, room, lease_s))
        )
        try:
            got = await asyncio.shield(claiming)
        except asyncio.CancelledError:  # the statement runs on in its thread: return what it claims
            while not claiming.done():  # however often this task is cancelled meanwhile
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([claiming])
            claims = [] if claiming.cancelled() or claiming.exception() else claiming.result()
            await self._release([claim for claim, _ in claims], "returned: the run was cancelled")
            raise
        self.stats["no_task"] += room - len(got)  # another worker took them first
        return got

    def _start(self, claimed: tuple[DispatchedSamplingTask, Task], epoch: int) -> asyncio.Task:
        task = asyncio.create_task(self._one_sampler(claimed), name=f"sampler-{self.split}-{epoch}")
        self._unstarted[task] = claimed[0]
        self.stats["started"] += 1
        return task

    async def _release_unstarted(self) -> None:
        """Return the claims of samplers cancelled before they started (else each would wait out its lease and
        count as a failed attempt)."""
        claims, self._unstarted = list(self._unstarted.values()), {}
        await self._release(claims, "returned: its sampler never started")

    async def _release(self, claims: list[DispatchedSamplingTask], reason: str) -> None:
        """Return ``claims``, every one of them even when this task is cancelled meanwhile (the cancellation is raised
        once they are returned)."""
        cancelled: asyncio.CancelledError | None = None
        for claim in claims:
            try:
                await with_retry_to_end(functools.partial(self.ledger.release, claim.id, reason))
            except asyncio.CancelledError as exc:
                cancelled = exc
            except Exception as exc:  # the lease runs out instead: the task is claimed again then
                log.warning("could not return claim %s: %s", claim.id, exc)
        if cancelled is not None:
            raise cancelled

    async def _one_sampler(self, claimed: tuple[DispatchedSamplingTask, Task]) -> None:
        self._unstarted.pop(asyncio.current_task(), None)  # type: ignore[arg-type]  # always inside a task
        try:
            sampler = self.sampler_class(
                self.config,
                ledger=self.ledger,
                inference=self.inference,
                sink=self.sink,
                blobs=self.blobs,
                split=self.split,
            )
            if self.convert_record_to_data_func is not None:  # an attribute: a subclass's __init__ need not take it
                sampler.convert_record_to_data_func = self.convert_record_to_data_func
            sampler.adopt(claimed)
        except Exception as exc:  # the claim fails as one whose run() raised: the attempt counts, the error shows
            self.stats["failed"] += 1
            error = f"{type(exc).__name__}: {exc}"
            log.warning("sampler of task %s could not be built: %s", claimed[1].id, error)
            try:
                await with_retry_to_end(lambda: self.ledger.fail(claimed[0].id, error))
            except Exception as failing:  # its lease runs out instead
                log.warning("could not fail claim %s: %s", claimed[0].id, failing)
            return
        try:
            async with sampler:
                await sampler.run()
            self.stats["completed"] += 1
        except NoTaskAvailable:
            self.stats["no_task"] += 1  # another worker took the last one first
        except NoInferenceService as exc:
            self.stats["failed"] += 1
            log.warning("sampler failed: %s", exc)
        except asyncio.CancelledError:
            self.stats["returned"] += 1
            raise
        except NON_RETRYABLE as exc:  # recorded in the claim too; the run ends (run_async raises it)
            self.stats["failed"] += 1
            log.error(
                "sampler of task %s failed, ending the run: %s: %s",
                getattr(sampler.task, "id", "?"),
                type(exc).__name__,
                exc,
            )
            if self.fatal_error is None:
                self.fatal_error = exc
            self.stop()
        except Exception as exc:  # recorded in the claim by AsyncSampler.__aexit__
            self.stats["failed"] += 1
            log.warning("sampler of task %s failed: %s: %s", getattr(sampler.task, "id", "?"), type(exc).__name__, exc)
        finally:
            self.stats.update(getattr(sampler, "skips", {}))  # records and groups the hook kept out
