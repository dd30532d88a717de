"""EngineActor.generate when its server fails under a call: made again only when the server was seen down (a server
that answers its health route did not die: a timeout of a slow generation is raised, not asked again forever); a
checkpointed generation asked again resumes from the chunks its failed try wrote; a checkpoint that cannot be
written does not stop the generation."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from rl_contracts.inflight import InflightCall, Partial
from transfer_queue.errors import ServerGone
from workers.engines import SamplingParams
from workers.engines import host as host_module
from workers.engines.base import Generation
from workers.engines.errors import EngineUnavailable
from workers.engines.host import EngineActor, EngineSpec

PARAMS = SamplingParams(max_new_tokens=4)


class StubServerEngine:
    """A server engine's client: ``health`` answers from ``healthy`` (one value per check, the last repeated);
    ``generate`` fails with EngineUnavailable ``failures`` times, then answers."""

    url = "http://127.0.0.1:9"
    version = 3
    resumed_tokens = 0

    def __init__(self, failures: int, healthy: list[bool], restarted: bool = False):
        self.failures, self.healthy, self.calls, self.resumes = failures, list(healthy), 0, []
        self.restarted = restarted  # the server reports another weight version than the one this client loaded

    def server_restarted(self) -> bool:
        return self.restarted

    def health(self) -> dict[str, Any]:
        ok = self.healthy.pop(0) if len(self.healthy) > 1 else self.healthy[0]
        return {"ok": ok}

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 5:
            raise RuntimeError("asked again and again")
        self.resumes.append(kwargs.get("resume"))
        self.resumed_tokens += sum(len(p.token_ids) for p in kwargs.get("resume") or [] if p is not None)
        if self.calls <= self.failures:
            if "on_chunk" in kwargs:  # row 0 went on from what it resumed by two tokens
                kwargs["on_chunk"]([0], [Partial([5, 7, 8], [-0.3, -0.1, -0.2], [2, 3, 3])])
            raise EngineUnavailable("sglang server at http://127.0.0.1:9: POST /generate failed: ReadTimeout()")
        return [[Generation([1], [-0.5], "stop") for _ in range(n)] for _ in prompts]


def actor_over(engine: StubServerEngine, partial: bool = False) -> Any:
    spec = EngineSpec(kind="sglang", url=engine.url, api_key="k", partial_rollout=partial)
    actor = EngineActor.__ray_metadata__.modified_class(spec)
    actor._engine, actor._kind = engine, "sglang" + (" with partial_rollout" if partial else "")
    return actor


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "SERVER_POLL_S", 0.0)


def test_a_failure_of_a_server_that_answers_its_health_route_is_raised_not_asked_again():
    engine = StubServerEngine(failures=10, healthy=[True])  # a slow generation timing out, the server alive
    with pytest.raises(EngineUnavailable, match="ReadTimeout"):
        actor_over(engine).generate([[1, 2]], 2, PARAMS)
    assert engine.calls == 1


def test_a_generation_whose_server_was_seen_down_is_made_again_once_it_is_back():
    engine = StubServerEngine(failures=1, healthy=[False, False, True])
    version, generations = actor_over(engine).generate([[1, 2]], 2, PARAMS)
    assert engine.calls == 2 and version == 3 and len(generations[0]) == 2


def test_a_server_restarted_before_the_first_health_check_is_told_by_its_weights_and_asked_again():
    # the server died and its restart answered before the actor's first health check: never seen down, but it
    # lost the weights this client loaded (another weight version), so it did die under the call
    engine = StubServerEngine(failures=1, healthy=[True], restarted=True)
    version, generations = actor_over(engine).generate([[1, 2]], 2, PARAMS)
    assert engine.calls == 2 and version == 3 and len(generations[0]) == 2


class Store:
    """InflightCheckpoints over a dict: what the queue holds, by key."""

    held: ClassVar[dict[str, Partial]] = {}
    fail_saves = False

    def __init__(self, client: Any, partition: str):
        pass

    def save(self, keys: list[str], partials: list[Partial]) -> None:
        if Store.fail_saves:
            raise ServerGone("the controller is gone (restarting)")
        Store.held.update(zip(keys, partials, strict=True))

    def load(self, keys: list[str]) -> dict[str, Partial]:
        return {k: Store.held[k] for k in keys if k in Store.held}


def test_a_checkpointed_generation_asked_again_resumes_from_what_its_failed_try_wrote(monkeypatch):
    monkeypatch.setattr(host_module, "InflightCheckpoints", Store)
    stale = Partial([9] * 5, [-0.1] * 5, [0] * 5)  # in the queue from before: the rollout found it too stale
    Store.held, Store.fail_saves = {"g0/1": stale}, False
    engine = StubServerEngine(failures=1, healthy=[False, True])
    actor = actor_over(engine, partial=True)
    actor._inflight = ("info", object())
    first = Partial([5], [-0.3], [2])
    call = InflightCall("info", "inflight/step_1", ["g0/0", "g0/1"], [first, None])
    actor.generate([[1, 2]], 2, PARAMS, inflight=call)
    assert engine.resumes[0] == [first, None]
    # the second try resumes row 0 from the two tokens the first try checkpointed on top, counted once; row 1, which
    # the rollout started from its prompt, does not take the stale partial the queue still holds
    assert engine.resumes[1] == [Partial([5, 7, 8], [-0.3, -0.1, -0.2], [2, 3, 3]), None]
    assert engine.resumed_tokens == 3
    # the rollout worker counts the 1 token it passed; the 2 more the retry took are the actor's to report
    assert actor.resumed_tokens_on_retry() == 2


def test_the_rollout_worker_adds_what_its_engine_resumed_on_retries_once_and_a_new_engine_from_zero(monkeypatch):
    from types import SimpleNamespace

    from workers import rollout as rollout_module

    def engine(*counts: int) -> Any:
        answers = iter(counts)
        return SimpleNamespace(resumed_tokens_on_retry=SimpleNamespace(remote=lambda: next(answers)))

    monkeypatch.setattr(rollout_module.ray, "get", lambda ref, timeout=None: ref)  # the stub answers at once
    worker = object.__new__(rollout_module.RolloutWorker.__ray_metadata__.modified_class)
    worker._retry_seen = (None, 0)
    worker.slot = SimpleNamespace(engine=engine(3, 3, 5))
    assert [worker._resumed_on_retry() for _ in range(3)] == [3.0, 0.0, 2.0]
    worker.slot = SimpleNamespace(engine=engine(2))  # restarted after its actor died: it counts from 0
    assert worker._resumed_on_retry() == 2.0


def test_a_checkpoint_that_cannot_be_written_does_not_stop_the_generation(monkeypatch):
    monkeypatch.setattr(host_module, "InflightCheckpoints", Store)
    Store.held, Store.fail_saves = {}, True

    class Chunking(StubServerEngine):
        def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, **kwargs: Any) -> Any:
            kwargs["on_chunk"]([0], [Partial([7], [-0.1], [3])])
            return [[Generation([7, 1], [-0.1, -0.5], "stop") for _ in range(n)] for _ in prompts]

    actor = actor_over(Chunking(failures=0, healthy=[True]), partial=True)
    actor._inflight = ("info", object())
    call = InflightCall("info", "inflight/step_1", ["g0/0"], [None])
    _, generations = actor.generate([[1, 2]], 1, PARAMS, inflight=call)
    assert generations[0][0].token_ids == [7, 1] and actor.checkpoint_failures == 1


class Channel:
    """A weight channel holding version 4 (serial 9)."""

    def newest(self) -> tuple[int, int]:
        return 9, 4

    def wait(self, min_version: int, timeout: float) -> tuple[int, int]:
        return 9, 4

    def load(self, version: int, timeout: float) -> tuple[int, int, dict]:
        return 9, 4, {"w": 1}


def test_a_weight_load_whose_server_was_seen_down_is_made_again_once_it_is_back():
    """The rollout asks its engine to load the newest weights (``pull_weights``) and the server dies under the load:
    the load waits for the server and is made again (before: EngineUnavailable ended the run)."""
    engine = StubServerEngine(failures=0, healthy=[False, True])
    loads: list[int] = []

    def update_weights(version: int, state_dict: Any = None, path: Any = None) -> None:
        loads.append(version)
        if len(loads) == 1:
            raise EngineUnavailable("sglang server at http://127.0.0.1:9: POST /update_weights failed: ConnectError()")
        engine.version = version

    engine.update_weights = update_weights  # type: ignore[method-assign]
    actor = actor_over(engine)
    actor._channel = Channel()
    assert actor.pull_weights(4) == 4 and loads == [4, 4]


def test_a_weight_load_failing_on_a_server_that_answers_is_raised():
    engine = StubServerEngine(failures=0, healthy=[True])

    def update_weights(version: int, state_dict: Any = None, path: Any = None) -> None:
        raise EngineUnavailable("sglang server at http://127.0.0.1:9: POST /update_weights failed: ReadTimeout()")

    engine.update_weights = update_weights  # type: ignore[method-assign]
    actor = actor_over(engine)
    actor._channel = Channel()
    with pytest.raises(EngineUnavailable, match="ReadTimeout"):
        actor.pull_weights(4)


def test_a_call_made_again_after_its_caller_died_waits_for_the_dead_call_and_goes_on_from_what_it_wrote(monkeypatch):
    """The rollout worker died mid-generation; its engine (the run's actor, not the worker's) goes on with the dead
    call and checkpoints its chunks. The call made again (after the worker's restart) read the queue while the dead
    call still ran: it waits for the dead call and resumes from its last chunks, not from what it read (before: the
    engine died with the worker, and what the dead call had generated since its last read was generated again)."""
    import threading

    monkeypatch.setattr(host_module, "InflightCheckpoints", Store)
    Store.held, Store.fail_saves = {}, False
    first_chunk, release = threading.Event(), threading.Event()

    class Dying(StubServerEngine):
        def generate(self, prompts: list[list[int]], n: int, params: SamplingParams, **kwargs: Any) -> Any:
            self.calls += 1
            self.resumes.append(kwargs.get("resume"))
            if self.calls == 1:  # the dead worker's call: two chunks, the second after the new call read the queue
                kwargs["on_chunk"]([0, 1], [Partial([4], [-0.4], [3]), Partial([6], [-0.6], [3])])
                first_chunk.set()
                release.wait(10)
                kwargs["on_chunk"]([0, 1], [Partial([4, 1], [-0.4, -0.1], [3, 3], "stop"),
                                            Partial([6, 5], [-0.6, -0.5], [3, 3])])  # fmt: skip
                return [[Generation([4, 1], [-0.4, -0.1], "stop"), Generation([6, 5], [-0.6, -0.5], "length")]]
            return [[Generation(list(p.token_ids) if p else [0], list(p.logprobs) if p else [-1.0], "stop")
                     for p in kwargs["resume"]]]  # fmt: skip

    engine = Dying(failures=0, healthy=[True])
    actor = actor_over(engine, partial=True)
    actor._inflight = ("info", object())
    keys = ["g7/0", "g7/1"]
    dead = threading.Thread(
        target=actor.generate,
        args=([[1, 2]], 2, PARAMS),
        kwargs={"inflight": InflightCall("info", "p", keys, [None, None])},
    )
    dead.start()
    assert first_chunk.wait(10)
    read = [Store.held[k] for k in keys]  # what the restarted worker read from the queue: the first chunk
    again: list[Any] = []
    redo = threading.Thread(
        target=lambda: again.append(actor.generate([[1, 2]], 2, PARAMS, inflight=InflightCall("info", "p", keys, read)))
    )
    redo.start()
    redo.join(0.3)
    assert redo.is_alive() and engine.calls == 1  # it waits for the dead call
    release.set()
    dead.join(10), redo.join(10)
    assert engine.resumes[1] == [Partial([4, 1], [-0.4, -0.1], [3, 3], "stop"), Partial([6, 5], [-0.6, -0.5], [3, 3])]
    assert actor.resumed_tokens_on_retry() == 2  # one more token of each row than the worker read
    # another prompt under the same keys (a step's rows put again) takes nothing it did not write for
    _, _ = actor.generate([[9, 9]], 2, PARAMS, inflight=InflightCall("info", "p", keys, [None, None]))
    assert engine.resumes[2] == [None, None]


def test_finish_generating_waits_for_the_checkpointed_generation_running_and_says_whether_it_ended():
    import threading

    actor = actor_over(StubServerEngine(failures=0, healthy=[True]), partial=True)
    assert actor.finish_generating(0.0) is True  # nothing runs
    actor._checkpointed_calls.acquire()  # a generation (a dead worker's) runs
    assert actor.finish_generating(0.05) is False
    threading.Timer(0.1, actor._checkpointed_calls.release).start()
    assert actor.finish_generating(5.0) is True
