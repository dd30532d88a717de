"""EngineActor: one inference engine in its own Ray actor, so that a dead engine can be replaced.

The actor runs one call at a time, so a weight update queued behind a generation lands between generations and a
batch never mixes two policy versions. Weights arrive from memory (an ObjectRef of a state dict, or the dict) or
from a Hugging Face directory, each with the policy version they are; or, with a weight channel on this host
(``EngineSpec.weights_channel``), the engine pulls the newest published weights itself before each generation.

Waiting for a version not yet published (``wait_for_weights``) runs beside the engine, in its own concurrency group:
a generation that needs no newer weights (a step's redo after a storage unit died) must not queue behind a wait for
weights that only its own training step can publish.

A server engine's generation that fails because its server is unreachable (``EngineUnavailable``: the server died
under it, e.g. SIGKILLed) waits for the server to answer its health route again (``EngineServer`` restarts a crashed
server on the same URL) and is made again, with the weights it had loaded (``restore_server_weights``): the rollout
worker's rows stay leased by it meanwhile and get one generation, neither lost nor written twice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rl_contracts.inflight import InflightCall, InflightCheckpoints, Partial, WrittenPartials
from rl_contracts.task import load_task
from rl_contracts.weight_channel import WeightChannel
from transfer_queue.errors import TransferQueueError
from workers.engines.base import Engine, Generation, SamplingParams
from workers.engines.errors import EngineUnavailable, ImagesNotSupported

logger = logging.getLogger(__name__)

#: how long a generation whose server died waits for it to answer again before it fails (a server's restart loads
#: the model again: minutes for a large one)
SERVER_BACK_S = 600.0
SERVER_POLL_S = 0.2


@dataclass(frozen=True)
class EngineSpec:
    """How to build an engine in any process: the task names the model to start from (or ``model_path``)."""

    kind: str = "hf"  # "hf" | "vllm" (in-process) | "vllm-server" | "sglang" (clients of a server at ``url``)
    task_name: str = "workers.tasks.addition:AdditionTask"
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    model_path: str | None = None
    device: str = "cpu"
    max_batch_size: int = 256
    weights_channel: str | None = None  # a WeightChannel directory on this host to pull published weights from
    weights_timeout: float = 300.0  # seconds a generation may wait for the policy version it needs
    url: str | None = None  # the server of a "vllm-server" or "sglang" engine
    partial_rollout: bool = False  # a weight update stops generation mid-way and resumes it (engines/partial.py)
    chunk_tokens: int = 16  # partial rollouts: tokens per chunk (engines without abort, in-flight checkpoints)
    seed: int = 0  # the engine's own seed (vLLM)
    # the key of the "vllm-server" / "sglang" server (sent as a bearer token; None: TQ_API_KEY of the actor's env)
    api_key: str | None = field(default=None, repr=False)

    def build(self) -> Engine:
        if self.kind in ("vllm-server", "sglang"):
            if self.url is None:
                raise ValueError(f"engine kind {self.kind!r} is a client of a running server: give url=...")
            if self.kind == "sglang":
                from workers.engines.sglang import SGLangEngine

                return SGLangEngine(self.url, model_path=self.model_path, api_key=self.api_key)
            from workers.engines.vllm_server import VLLMServerEngine

            return VLLMServerEngine(self.url, model_path=self.model_path, api_key=self.api_key)
        task = load_task(self.task_name, self.task_kwargs)
        tok = task.tokenizer
        if self.kind == "vllm":
            from workers.engines.vllm_engine import VLLMEngine

            if self.model_path is not None:
                return VLLMEngine(model_path=self.model_path, eos_token_id=tok.eos_token_id, seed=self.seed)
            return VLLMEngine(task.build_policy(), eos_token_id=tok.eos_token_id, seed=self.seed)
        if self.kind == "hf":
            from workers.engines.hf import HFEngine

            # a vision task's images travel as blob keys (a row's image_refs): the engine resolves them through the
            # task's image source, the trainer's too, so both passes see the same pixels
            source = task.image_source()
            return HFEngine(
                task.build_policy() if self.model_path is None else None,
                model_path=self.model_path,
                device=self.device,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                max_batch_size=self.max_batch_size,
                image_processor=source.pixel_values if source is not None else None,
            )
        raise ValueError(f"engine kind {self.kind!r} is unknown; expected 'hf', 'vllm', 'vllm-server' or 'sglang'")


WAIT_GROUP = "weights_wait"  # the concurrency group of wait_for_weights: never the thread that runs the engine


@ray.remote(concurrency_groups={WAIT_GROUP: 4})  # type: ignore[call-overload]  # Ray's overloads omit it
class EngineActor:
    """Hosts one Engine; see the module docstring."""

    def __init__(self, spec: EngineSpec, seed: int = 0):
        torch.manual_seed(seed)
        self._engine: Any = spec.build()
        self._kind = spec.kind + (" with partial_rollout" if spec.partial_rollout else "")
        self._calls = 0
        self._seed = seed
        self._channel = WeightChannel(spec.weights_channel) if spec.weights_channel else None
        self._weights_timeout = spec.weights_timeout
        self._serial = -1  # the channel write these weights came from
        self._latest: tuple[int, Any, str | None] | None = None  # the last update_weights, for a restarted server
        if spec.partial_rollout:
            from workers.engines.partial import PartialRollout

            # a newer version in the weight channel (or an update_weights call: the actor then runs with
            # max_concurrency=2) stops the running generation, which resumes on the new weights
            self._engine = PartialRollout(
                self._engine, self._channel_update if self._channel else None, chunk_tokens=spec.chunk_tokens
            )
        self._inflight: tuple[Any, Any] | None = None  # (controller info, its queue client): in-flight checkpoints
        self.checkpoint_failures = 0  # in-flight checkpoints that could not be written (the generation went on)
        # Checkpointed generations run one at a time: a call made again after its rollout worker died waits for the
        # dead call (this actor outlives the worker when the run made it) and goes on from what it wrote
        self._checkpointed_calls = threading.Lock()
        self._written = WrittenPartials()
        # tokens checkpointed generations took from partials this actor wrote after their caller read the queue (not
        # generated again; the rollout worker adds them to its ``resumed_tokens``): a try made again after the
        # server died under the first, or a dead caller's generation this actor went on with
        self.resumed_on_retry = 0

    def _channel_update(self) -> tuple[int, Any, None] | None:
        """The channel's newest weights when they are newer than the engine's (polled by partial rollouts)."""
        assert self._channel is not None
        newest = self._channel.newest()
        if newest is None or newest[0] <= self._serial:
            return None
        self._serial, version, state = self._channel.load(newest[1], self._weights_timeout)
        return version, state, None

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        min_version: int | None = None,
        image_refs: list[list[str]] | None = None,
        inflight: InflightCall | None = None,
    ) -> tuple[int, list[list[Generation]]]:
        """``(policy version, generations)``: the version is the one every generation of the call came from.

        With a weight channel, the newest published weights are loaded first; ``min_version`` makes the call wait
        until weights at least that new are published (on-policy generation right after a training step).

        ``image_refs``: a vision task's prompts' images, one list of blob keys per prompt (the rows'
        ``rl_contracts.images.IMAGE_REFS``); the ``hf`` engine resolves them through the task's image source.

        ``inflight`` (partial rollouts only; ``rollout.checkpoint_inflight``): each chunk's partial responses go into
        the queue under ``inflight.keys`` as they are generated, and responses resume from ``inflight.resume``
        (rl_contracts/inflight.py).
        A server engine whose server died under the call waits for it to answer again (``SERVER_BACK_S``) and
        generates again, after loading the weights it had into it (see the module docstring).

        Raises:
            ImagesNotSupported: ``image_refs`` for an engine that takes no images (any but ``hf``, or ``hf`` with
                partial rollouts).
            ValueError: ``inflight`` for an engine without partial rollouts.
            EngineUnavailable: a server engine's server did not answer again within ``SERVER_BACK_S``.
        """
        self._calls += 1
        if inflight is None:
            return self._server_retried(
                lambda: self._generate(prompts, n, params, min_version, image_refs, None), "generating"
            )
        with self._checkpointed_calls:  # after a dead caller's generation: what it wrote since its caller read
            rows = [list(prompt) for prompt in prompts for _ in range(n)]
            asked = [inflight]

            def take_newer() -> None:  # resume from the partials this actor wrote since, counted once
                asked[0], gained = self._written.newer(asked[0], rows)
                self.resumed_on_retry += gained

            take_newer()
            resumed_before = getattr(self._engine, "resumed_tokens", None)

            def again() -> None:  # and, after the server died under a try, from the chunks that try wrote
                take_newer()
                if resumed_before is not None:
                    self._engine.resumed_tokens = resumed_before

            return self._server_retried(
                lambda: self._generate(prompts, n, params, min_version, image_refs, asked[0]), "generating", again
            )

    def _server_retried(self, call: Any, what: str, again: Any = None) -> Any:
        """``call()``, made again when it failed because the engine's server died under it (``EngineUnavailable``
        and the server seen down, or back having lost its weights) once the server answers again (``again()`` first);
        a failure of a server that answers with its weights is raised (e.g. a generation slower than the client's
        timeout: not a death)."""
        deadline: float | None = None
        while True:
            try:
                return call()
            except EngineUnavailable as exc:
                deadline = deadline if deadline is not None else time.monotonic() + SERVER_BACK_S
                if not self._wait_for_server(deadline, exc):
                    raise
                logger.warning("%s; the server is back: %s again", exc, what)
                if again is not None:
                    again()

    def _wait_for_server(self, deadline: float, cause: EngineUnavailable) -> bool:
        """Until the server answers its health route; whether it died under the call: seen down meanwhile, or
        answering at once but restarted (it lost the weights this client loaded: a restart quicker than the first
        health check). A server that answers at once with its weights did not die: its failure is not retried.

        Raises:
            EngineUnavailable: not back by ``deadline`` (``cause`` chained).
        """
        down = False
        while not self._engine.health().get("ok"):
            down = True
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the server at {getattr(self._engine, 'url', None)} did not answer again within "
                    f"{SERVER_BACK_S:.0f} s after a generation failed: {cause}"
                ) from cause
            time.sleep(SERVER_POLL_S)
        if down:
            return True
        restarted = getattr(self._engine, "server_restarted", None)
        try:
            return restarted is not None and bool(restarted())
        except EngineUnavailable:  # gone again between the two checks: wait for it once more
            return self._wait_for_server(deadline, cause)

    def _generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        min_version: int | None,
        image_refs: list[list[str]] | None,
        inflight: InflightCall | None,
    ) -> tuple[int, list[list[Generation]]]:
        self.restore_server_weights()
        self._pull_weights(min_version)
        if inflight is not None:
            return self._engine.version, self._generate_checkpointed(prompts, n, params, inflight)
        if image_refs is None:
            return self._engine.version, self._engine.generate(prompts, n, params)
        if self._kind != "hf":
            raise ImagesNotSupported(
                f"engine {self._kind!r} was given image_refs for {len(image_refs)} prompts; only the in-process "
                "'hf' engine without partial rollouts takes a vision task's images"
            )
        return self._engine.version, self._engine.generate(prompts, n, params, images=image_refs)

    def _generate_checkpointed(
        self, prompts: list[list[int]], n: int, params: SamplingParams, inflight: InflightCall
    ) -> list[list[Generation]]:
        if not self._kind.endswith("with partial_rollout"):
            raise ValueError(
                "in-flight checkpoints need a partial-rollout engine (rollout.partial_rollout=true); got "
                f"{self._kind!r}"
            )
        if self._inflight is None or self._inflight[0] != inflight.controller_info:
            from transfer_queue import TransferQueueClient

            self._inflight = (
                inflight.controller_info,
                TransferQueueClient(f"engine-{os.getpid()}", inflight.controller_info),
            )
        store = InflightCheckpoints(self._inflight[1], inflight.partition)
        keys = inflight.keys

        def checkpoint(rows: list[int], partials: list[Partial]) -> None:
            for i, partial in zip(rows, partials, strict=True):
                self._written.write(inflight.partition, keys[i], prompts[i // n], partial)
            try:
                store.save([keys[i] for i in rows], partials)
            except TransferQueueError as exc:  # a checkpoint is best effort: the generation goes on without it
                self.checkpoint_failures += 1
                logger.warning("an in-flight checkpoint of %d rows was not written (%s); generating on", len(rows), exc)

        return self._engine.generate(prompts, n, params, resume=inflight.resume, on_chunk=checkpoint)

    @ray.method(concurrency_group=WAIT_GROUP)
    def finish_generating(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the checkpointed generation running now, if any, to end (a run about to stop
        this engine while its queue goes on: a trainer-group restart); whether none runs. Its chunks are in the queue
        then, so the next start resumes them whole: a rollout worker's batches are waited for by the worker
        (``RolloutWorker.finish_writes``), this covers the generation a dead worker left running."""
        if not self._checkpointed_calls.acquire(timeout=max(0.0, timeout_s)):
            return False
        self._checkpointed_calls.release()
        return True

    def resumed_tokens_on_retry(self) -> int:
        """Tokens this actor's checkpointed generations (``rollout.checkpoint_inflight``) took, since it started, from
        partials it had written after their caller read the queue: chunks a failed try checkpointed before its server
        died, and the chunks of a generation whose rollout worker died under it (this actor went on with it)."""
        return self.resumed_on_retry

    @ray.method(concurrency_group=WAIT_GROUP)
    def wait_for_weights(self, min_version: int) -> int:
        """Wait until the channel holds weights of at least ``min_version`` (not loading them: ``pull_weights``
        does, on the engine's thread); returns the newest published version. Without a channel, the engine's version.

        Raises:
            WeightChannelTimeout: if no such version is published within ``EngineSpec.weights_timeout``.
        """
        if self._channel is None:
            return self._engine.version
        return self._channel.wait(min_version, self._weights_timeout)[1]

    def pull_weights(self, min_version: int | None = None) -> int:
        """Load the channel's newest weights if they are newer than the engine's (waiting for ``min_version``);
        returns the engine's version. Without a channel, the engine's version (``min_version`` must hold). A server
        engine whose server died under the load waits for it to answer again and loads again, as ``generate``
        does."""

        return int(
            self._server_retried(lambda: self._pull_weights(min_version), "loading the weights", self._lost_weights)
        )

    def _lost_weights(self) -> None:
        """The server came back (restarted): what it serves is not what this client loaded any more."""
        self._serial = -1  # the channel's newest is loaded whole again
        self.restore_server_weights()

    def _pull_weights(self, min_version: int | None = None) -> int:
        if self._channel is None:
            if min_version is not None and self._engine.version < min_version:
                raise RuntimeError(
                    f"the engine has version {self._engine.version}, needs {min_version}, and has no weight channel"
                )
            return self._engine.version
        channel = self._channel
        newest = channel.newest() if min_version is None else channel.wait(min_version, self._weights_timeout)
        if newest is not None and newest[0] > self._serial:
            in_place = getattr(self._engine, "update_weights_in_place", None)
            if in_place is None:
                self._serial, version, state = channel.load(newest[1], self._weights_timeout)
                self._engine.update_weights(version, state_dict=state)
                return self._engine.version
            have, self._serial = self._serial, -1  # until the copy is whole

            def fill(targets: dict[str, torch.Tensor]) -> int:
                stats = channel.read_into(targets, have, newest[1], self._weights_timeout)
                self._serial = stats.serial
                return stats.version

            in_place(fill)  # straight from the shared file into the parameters; only changed chunks one write behind
        return self._engine.version

    def update_weights(self, version: int, weights: Any = None, path: str | None = None) -> int:
        """Load weights (a state dict, or a list holding one ObjectRef of it, or a directory); returns the version."""
        if hasattr(self._engine, "server_restarted"):  # kept (the ObjectRef, not its value) for a restarted server
            self._latest = (version, weights, path)
        if isinstance(weights, list) and weights and isinstance(weights[0], ray.ObjectRef):
            weights = ray.get(weights[0])
        self._engine.update_weights(version, state_dict=weights, path=path)
        self._serial = -1  # no longer the channel's write: its next one is loaded whole
        return self._engine.version

    def restore_server_weights(self) -> bool:
        """A client of a server (``vllm-server``, ``sglang``) whose server was restarted since it loaded weights
        into it (the server reports another weight version: it came back with the weights on its command line,
        ``EngineServer.restart``) loads them again: the newest of the weight channel, or those of the last
        ``update_weights``. Runs before each generation; returns whether it reloaded."""
        restarted = getattr(self._engine, "server_restarted", None)
        if restarted is None or not restarted():
            return False
        logger.warning("the server at %s lost version %s (restarted): loading it again", self._engine.url,
                       self._engine.version)  # fmt: skip
        if self._channel is not None:
            self._serial = -1  # pull_weights loads the channel's newest again
            self._pull_weights()
        elif self._latest is not None:
            self.update_weights(*self._latest)
        return True

    def health(self) -> dict[str, Any]:
        return {**self._engine.health(), "calls": self._calls}

    def pid(self) -> int:
        import os

        return os.getpid()
