"""``AsyncSampler``: the base class of a sampling worker, as in AgentRL.

    class MySampler(AsyncSampler):
        async def run(self):
            messages = [{"role": "user", "content": self.task.question}]
            response = await self.create_chat_completions(messages, n=4)
            await self.record_completion(messages, response)      # scored by evaluate_record, queued, recorded

        async def evaluate_record(self, record):
            return float(record.messages[-1]["content"] == self.task.answer)

    async with MySampler(cfg) as sampler:     # claims a task (NoTaskAvailable if none), heart-beats its lease
        await sampler.run()                   # leaving: done; an exception: failed with it; cancelled: returned

Records are written once per (task, epoch, sample): a task re-dispatched after its worker died writes only the samples
that are missing. The trajectory's tensors go to the queue through a ``TrajectorySink`` (one put per GRPO group,
group id ``split/epoch/task_id``), and the records say where they went. With a ``convert_record_to_data_func``
(``SamplingScheduler(..., convert_record_to_data_func=fn)``), each record of a group passes through it on its way into
the queue (``workers.ledger.convert.sampled_row``): a record it skips (None or ``[]``) keeps its whole group out of the
queue (recorded, never trained; counted in ``skips``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field

from workers.ledger.blobs import BlobStore, open_blob_store
from workers.ledger.config import SamplingConfig
from workers.ledger.convert import sampled_row
from workers.ledger.errors import ClaimLost, LedgerUnavailable, NoTaskAvailable
from workers.ledger.models import DispatchedSamplingTask, Record, Task
from workers.ledger.multimodal import is_multimodal, preprocess_mm_messages_for_sample, store_mm_messages
from workers.ledger.retry import with_retry, with_retry_to_end
from workers.ledger.services import InferenceClient
from workers.ledger.store import Ledger

if TYPE_CHECKING:  # the endpoint's module imports the engines (torch): only when a completion is parsed
    from workers.agents.openai_api import ChatCompletion

log = logging.getLogger(__name__)

_LEDGERS: dict[tuple[str, int], Ledger] = {}


def shared_ledger(config: SamplingConfig) -> Ledger:
    """This process's ``Ledger`` for ``config`` (one engine and connection pool per database and process)."""
    key = (config.ledger_url, os.getpid())
    if key not in _LEDGERS:
        _LEDGERS[key] = Ledger(config.ledger_url, max_attempts=config.max_attempts)
    return _LEDGERS[key]


class Sample(BaseModel):
    """One sampled trajectory of a task, before it is scored and recorded."""

    messages: list[dict[str, Any]]
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] = Field(default_factory=list)
    policy_version: int = 0
    blobs: dict[str, str] = Field(default_factory=dict)


class TrajectorySink(Protocol):
    """Where the trajectories' tensors go (the queue): one call per GRPO group, rows in order."""

    def put_group(self, rows: list[dict[str, Any]], group_id: str, group_key: int) -> tuple[str, list[int]]:
        """Store the rows (``record_id``, ``prompt_ids``, ``response_ids``, ``response_logprobs``, ``reward``,
        ``policy_version``) of group ``group_id`` (``group_key``: the same as an int unique in the ledger); the
        partition id and the rows' global indexes."""
        ...


class AsyncSampler(ABC):
    """Claims one task on ``async with`` and owns it until the block ends (see the module docstring).

    Args:
        config: the run's ``SamplingConfig``.
        ledger, inference, sink, blobs: shared resources (the scheduler passes its own); by default this process's
            ledger for ``config``, an ``InferenceClient`` over it, no sink (records only), the configured blob store.
        split: the split to claim from (``config.split`` by default).
        owner: the claim's owner name (host:pid:random by default).

    Multi-modal messages (OpenAI content parts, ``workers/ledger/multimodal.py``): ``create_chat_completions``
    sends their images as base64 ``data:`` URLs; records keep them as ``image_ref`` parts (blob-store keys).
    ``fetch_image_urls``: whether http(s) image URLs are fetched (and stored, sent as data URLs) rather than passed
    through as they are.

    ``convert_record_to_data_func``: with a sink, the hook each record of a group passes through on its way into the
    queue (``workers.ledger.convert``; None: the sampled tokens as they are); ``skips`` counts the records and groups it
    kept out of the queue (``records_skipped``, ``groups_skipped``).
    """

    fetch_image_urls: bool = False
    convert_record_to_data_func: Callable[[Record], Any] | None = None

    def __init__(
        self,
        config: SamplingConfig,
        *,
        ledger: Ledger | None = None,
        inference: InferenceClient | None = None,
        sink: TrajectorySink | None = None,
        blobs: BlobStore | None = None,
        split: str | None = None,
        owner: str | None = None,
        convert_record_to_data_func: Callable[[Record], Any] | None = None,
    ):
        self.config = config
        if convert_record_to_data_func is not None:
            self.convert_record_to_data_func = convert_record_to_data_func
        self.skips: Counter[str] = Counter()
        self.ledger = ledger if ledger is not None else shared_ledger(config)
        self._own_inference = inference is None
        self.inference = inference if inference is not None else InferenceClient(self.ledger, config)
        self.sink = sink
        self.blobs = blobs if blobs is not None else open_blob_store(config.oss_connection_string, _blob_dir(config))
        self.split = split or config.split
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.task: Task | None = None
        self.claim: DispatchedSamplingTask | None = None
        self.lease_lost = False
        self._heartbeat: asyncio.Task | None = None
        self._adopted: tuple[DispatchedSamplingTask, Task] | None = None

    # -- the claim's lifecycle -------------------------------------------------------------------------------------
    def adopt(self, claimed: tuple[DispatchedSamplingTask, Task]) -> None:
        """Own a claim taken for this sampler (a ``SamplingScheduler`` claims the tasks of several samplers in one
        statement, ``Ledger.claim_many``): ``async with`` then runs it instead of claiming one itself."""
        if self.claim is not None or self._adopted is not None:
            raise RuntimeError(f"sampler {self.owner} already holds a claim; adopt() takes one before `async with`")
        self._adopted = claimed
        self.owner = claimed[0].owner

    async def __aenter__(self) -> AsyncSampler:
        got, self._adopted = self._adopted, None
        if got is None:
            got = await self._ledger_call(self.ledger.claim, self.split, self.owner, self.config.lease_s)
        if got is None:
            raise NoTaskAvailable(f"no task of split {self.split!r} can be claimed now (all done, failed or held)")
        self.claim, self.task = got
        self._heartbeat = asyncio.create_task(self._beat(), name=f"heartbeat-{self.claim.id}")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        assert self.claim is not None
        claim_id = self.claim.id
        # the claim's end reaches the ledger even when this task is cancelled meanwhile (the scheduler cancels the
        # running samplers when one fails for good): else the claim would stay running until its lease ran out
        try:
            if exc_type is None:
                await with_retry_to_end(lambda: self.ledger.complete(claim_id))
            elif issubclass(exc_type, asyncio.CancelledError):
                await with_retry_to_end(lambda: self.ledger.release(claim_id, "cancelled: returned by its sampler"))
            else:
                error = f"{exc_type.__name__}: {exc}"
                await with_retry_to_end(lambda: self.ledger.fail(claim_id, error))
        except ClaimLost as lost:  # the lease ran out meanwhile; the re-dispatched claim records what is missing
            log.warning("sampler %s: %s", self.owner, lost)
        finally:
            if self._own_inference:
                await self.inference.aclose()

    async def _beat(self) -> None:
        assert self.claim is not None
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                await asyncio.to_thread(self.ledger.heartbeat, self.claim.id, self.config.lease_s)
            except LedgerUnavailable as exc:
                log.warning("heartbeat of claim %s failed (will retry): %s", self.claim.id, exc)
            except ClaimLost as exc:
                self.lease_lost = True
                log.warning("sampler %s lost its claim: %s", self.owner, exc)
                return

    async def _ledger_call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(with_retry, lambda: fn(*args))

    # -- what a subclass writes ------------------------------------------------------------------------------------
    @abstractmethod
    async def run(self) -> None:
        """Sample the claimed task (``self.task``): call the policy, act, record."""

    @abstractmethod
    async def evaluate_record(self, record: Record) -> float:
        """The record's score (its reward)."""

    # -- helpers -------------------------------------------------------------------------------------------------
    async def create_chat_completions(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatCompletion:
        """A chat completion from the least-loaded healthy inference service; ``sampling`` overrides the config's
        (``n``: ``num_generations`` choices by default; ``temperature``, ``max_tokens``, ``top_p``, ``stop``,
        ``seed``). Choices carry ``token_ids`` and ``token_logprobs``; the completion carries ``prompt_token_ids``
        and ``policy_version``. Images in ``messages`` (``image_ref`` parts, paths, bytes, data URLs) go to the
        service as base64 ``data:`` URLs (``preprocess_mm_messages_for_sample``); ``messages`` is not changed."""
        if is_multimodal(messages):
            messages = await asyncio.to_thread(
                preprocess_mm_messages_for_sample, messages, self.blobs, fetch_http=self.fetch_image_urls
            )
        return await self.inference.chat(messages, **sampling)

    async def record_completion(self, messages: list[dict[str, Any]], completion: ChatCompletion) -> list[Record]:
        """Each choice of ``completion`` as one sample of this task (sample ``i`` is choice ``i``)."""
        samples = [
            Sample(
                messages=[*messages, {"role": "assistant", "content": choice.message.content}],
                prompt_ids=completion.prompt_token_ids,
                response_ids=choice.token_ids,
                response_logprobs=choice.token_logprobs,
                policy_version=completion.policy_version,
            )
            for choice in completion.choices
        ]
        return await self.write_records(samples)

    async def write_records(self, samples: Sequence[Sample], first_index: int = 0) -> list[Record]:
        """Score the samples (``evaluate_record``), record them (sample indexes ``first_index``, ...) and put the
        newly recorded ones into the queue as one group. Samples an earlier claim of this task recorded and queued
        are kept as they were (returned, not re-written or re-queued). Images in the samples' messages are stored in
        the blob store (once: it is content-addressed) and recorded as ``image_ref`` parts."""
        assert self.claim is not None and self.task is not None, "write_records needs a claimed task"
        if self.lease_lost:
            raise ClaimLost(
                f"claim {self.claim.id} of task {self.claim.task_id} (owner {self.owner}) is no longer the task's "
                f"live claim (its heartbeat found the lease expired or taken); nothing more is written or queued"
            )
        try:
            return await self._write_and_queue(samples, first_index)
        except ClaimLost:
            self.lease_lost = True
            raise

    async def _write_and_queue(self, samples: Sequence[Sample], first_index: int) -> list[Record]:
        assert self.claim is not None
        group_id = f"{self.claim.split}/{self.claim.epoch}/{self.claim.task_id}"
        records = []
        for i, sample in enumerate(samples):
            messages = sample.messages
            if is_multimodal(messages):
                messages = await asyncio.to_thread(
                    store_mm_messages, messages, self.blobs, fetch_http=self.fetch_image_urls
                )
            record = Record(
                task_key=self.claim.task_key,
                task_id=self.claim.task_id,
                split=self.claim.split,
                epoch=self.claim.epoch,
                sample_index=first_index + i,
                claim_id=self.claim.id,
                messages=messages,
                prompt_tokens=len(sample.prompt_ids),
                completion_tokens=len(sample.response_ids),
                policy_version=sample.policy_version,
                group_id=group_id,
                blobs=sample.blobs,
            )
            record.score = float(await self.evaluate_record(record))
            records.append(record)
        # with a sink, a sample an earlier claim recorded but never queued (its worker died in between) is replaced;
        # the store writes only while this claim is the task's live claim (ClaimLost otherwise)
        stored = await self._ledger_call(self.ledger.write_records, records, self.sink is not None)
        fresh = [(rec, sample) for (rec, written), sample in zip(stored, samples, strict=True) if written]
        if self.sink is not None and fresh:
            rows = [
                {
                    "record_id": rec.id,
                    "prompt_ids": sample.prompt_ids,
                    "response_ids": sample.response_ids,
                    "response_logprobs": sample.response_logprobs,
                    "reward": rec.score,
                    "policy_version": sample.policy_version,
                }
                for rec, sample in fresh
            ]
            if self.convert_record_to_data_func is not None:
                converted = await asyncio.to_thread(self._convert_rows, [rec for rec, _ in fresh], rows)
                if converted is None:  # a record skipped: its group is not trained (recorded, never queued)
                    return [rec for rec, _ in stored]
                rows = converted
            # still the live claim? The check renews the lease (ClaimLost if lost), so no other claimer can take the
            # task, and replace these unqueued records, for a whole lease_s while the put runs
            await self._ledger_call(self.ledger.heartbeat, self.claim.id, self.config.lease_s)
            partition_id, indexes = await asyncio.to_thread(self.sink.put_group, rows, group_id, self.claim.task_key)
            ids = [rec.id for rec, _ in fresh]
            await self._ledger_call(self.ledger.set_record_locations, ids, partition_id, indexes, self.claim.id)
            for (rec, _), index in zip(fresh, indexes, strict=True):
                rec.partition_id, rec.global_indexes = partition_id, [int(index)]
        return [rec for rec, _ in stored]

    def _convert_rows(self, records: list[Record], rows: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The group's queue rows through ``convert_record_to_data_func``; None (counted in ``skips``) when it skips
        any of the records."""
        fn = self.convert_record_to_data_func
        assert fn is not None
        converted = [sampled_row(fn, record, row) for record, row in zip(records, rows, strict=True)]
        kept = [row for row in converted if row is not None]
        if len(kept) < len(rows):
            self.skips["records_skipped"] += len(rows) - len(kept)
            self.skips["groups_skipped"] += 1
            log.info(
                "convert_record_to_data_func skipped %d of the %d records of group %s: the group is not queued",
                len(rows) - len(kept),
                len(rows),
                records[0].group_id,
            )
            return None
        return kept


def _blob_dir(config: SamplingConfig) -> str:
    return os.path.join(config.output_dir, "blobs")
