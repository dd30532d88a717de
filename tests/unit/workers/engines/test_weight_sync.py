"""workers.engines.weight_sync: with a timeout, a hung engine gets a typed EngineSyncTimeout while every healthy
engine's reply comes back, and the call returns while the hung engine is still loading."""

from __future__ import annotations

import pickle
import threading

from workers.engines.errors import EngineBusy, EngineSyncTimeout
from workers.engines.weight_sync import sync_state_dict_to_engines, sync_weights_to_engines


class Loaded:
    """A seed-protocol engine that loads at once."""

    def __init__(self, name: str) -> None:
        self.name, self.paths = name, list[str]()

    def update_weights_from_checkpoint(self, path: str, version: int | None = None) -> dict:
        self.paths.append(path)
        return {"success": True, "version": version}


class Hung:
    """An engine whose load does not return until ``release`` is set (the test sets it at the end)."""

    name = "hung-engine"

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.loads: list[str] = []

    def update_weights_from_checkpoint(self, path: str, version: int | None = None) -> dict:
        self.loads.append(path)
        self.entered.set()
        self.release.wait(10)
        return {"success": True, "version": version}

    def update_weights(self, version: int, state_dict=None, path=None) -> None:
        self.update_weights_from_checkpoint("memory", version)

    version = 0


class Failing:
    name = "failing-engine"

    def update_weights_from_checkpoint(self, path: str, version: int | None = None) -> dict:
        raise RuntimeError("disk full")


def test_a_hung_engine_is_a_typed_timeout_and_the_others_reply() -> None:
    first, hung, last = Loaded("first"), Hung(), Loaded("last")
    try:
        replies = sync_weights_to_engines([first, hung, Failing(), last], "/ckpt/step_2", version=2, timeout=0.5)
        # returned with the hung engine still inside its load: the call did not wait for it
        assert hung.entered.is_set() and not hung.release.is_set()
    finally:
        hung.release.set()
    assert [r["engine"] for r in replies] == ["first", "hung-engine", "failing-engine", "last"]
    assert [r["success"] for r in replies] == [True, False, False, True]
    assert [r.get("version") for r in replies] == [2, None, None, 2]
    assert first.paths == last.paths == ["/ckpt/step_2"]
    error = replies[1]["exception"]
    assert isinstance(error, EngineSyncTimeout) and isinstance(error, TimeoutError)
    assert (error.engine, error.timeout) == ("hung-engine", 0.5)
    assert replies[1]["error"] == (
        "EngineSyncTimeout: engine hung-engine did not finish loading the new weights within 0.5 s; expected it to "
        "answer within the sync's timeout (a late reply is dropped)"
    )
    assert isinstance(replies[2]["exception"], RuntimeError) and replies[2]["error"] == "RuntimeError: disk full"
    restored = pickle.loads(pickle.dumps(error))
    assert (type(restored), restored.engine, restored.timeout, str(restored)) == (
        EngineSyncTimeout,
        "hung-engine",
        0.5,
        str(error),
    )


def test_the_in_memory_sync_is_bounded_the_same_way() -> None:
    hung = Hung()
    try:
        [reply] = sync_state_dict_to_engines([hung], {}, version=1, timeout=0.2)
        assert not hung.release.is_set()
    finally:
        hung.release.set()
    assert reply["success"] is False and isinstance(reply["exception"], EngineSyncTimeout)


def test_without_a_timeout_every_engine_is_waited_for() -> None:
    hung = Hung()
    threading.Timer(0.2, hung.release.set).start()
    [reply] = sync_weights_to_engines([hung], "/ckpt", version=1)
    assert reply["success"] is True and reply["version"] == 1 and "exception" not in reply


def test_an_engine_still_loading_a_timed_out_sync_is_not_given_a_second_load() -> None:
    hung, other = Hung(), Loaded("other")
    try:
        [first] = sync_weights_to_engines([hung], "/ckpt/step_1", version=1, timeout=0.2)
        assert isinstance(first["exception"], EngineSyncTimeout)
        # the step-1 load still runs: a step-2 load beside it could finish first and be overwritten by step 1's
        busy, done = sync_weights_to_engines([hung, other], "/ckpt/step_2", version=2)
        assert hung.loads == ["/ckpt/step_1"] and other.paths == ["/ckpt/step_2"] and done["success"] is True
    finally:
        hung.release.set()
    assert busy["success"] is False and busy.get("version") is None
    error = busy["exception"]
    assert isinstance(error, EngineBusy) and error.engine == "hung-engine"
    assert busy["error"] == (
        "EngineBusy: engine hung-engine is still loading the weights of an earlier sync (it did not finish within "
        "that sync's timeout); expected it idle before a new load, so this sync did not load it"
    )
    restored = pickle.loads(pickle.dumps(error))
    assert (type(restored), restored.engine, str(restored)) == (EngineBusy, "hung-engine", str(error))
    # once the earlier load ends (the third sync waits for it: no timeout), the engine loads again
    for _ in range(100):
        [third] = sync_weights_to_engines([hung], "/ckpt/step_3", version=3)
        if third["success"]:
            break
        threading.Event().wait(0.05)  # the step-1 thread is between its load's return and releasing the engine
    assert third["success"] is True and third["version"] == 3
    assert hung.loads == ["/ckpt/step_1", "/ckpt/step_3"]


def test_no_engines_no_replies() -> None:
    assert sync_weights_to_engines([], "/ckpt", timeout=0.1) == []
