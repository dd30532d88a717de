"""sync_weights_to_engines: sync, async and version-taking engines all load; a hung or failing engine is reported
while the others succeed; an object without the method is refused; SGLangEngine and VLLMEngine POST to a loopback
stub server's weight-update routes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from fastapi import FastAPI

from orchestration.training import LibraryError, SGLangEngine, VLLMEngine, sync_weights_to_engines
from workers.agents.task_server import serve_in_background
from workers.engines.errors import EngineSyncTimeout


class SyncEngine:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def update_weights_from_checkpoint(self, checkpoint_path: str) -> dict:
        self.paths.append(checkpoint_path)
        return {"success": True}


class AsyncVersionedEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []

    async def update_weights_from_checkpoint(self, checkpoint_path: str, version: int | None = None) -> dict:
        self.calls.append((checkpoint_path, version))
        return {"success": True, "version": version}


class HungEngine:
    def __init__(self) -> None:
        self.release = threading.Event()

    def update_weights_from_checkpoint(self, checkpoint_path: str) -> dict:
        self.release.wait(30)
        return {"success": True}


class AsyncHungEngine:
    async def update_weights_from_checkpoint(self, checkpoint_path: str) -> dict:
        await asyncio.sleep(30)
        return {"success": True}


class FailingEngine:
    def update_weights_from_checkpoint(self, checkpoint_path: str) -> None:
        raise RuntimeError("disk full")


def test_a_hung_engine_times_out_while_the_others_load() -> None:
    sync, versioned, hung = SyncEngine(), AsyncVersionedEngine(), HungEngine()
    engines = [sync, hung, versioned, AsyncHungEngine(), FailingEngine()]
    try:
        replies = asyncio.run(sync_weights_to_engines(engines, "/ckpt/step_3", version=3, timeout=0.5))
    finally:
        hung.release.set()

    assert [r["success"] for r in replies] == [True, False, True, False, False]
    assert sync.paths == ["/ckpt/step_3"]  # no version keyword: not passed
    assert versioned.calls == [("/ckpt/step_3", 3)] and replies[2]["version"] == 3
    for index, name in ((1, "HungEngine[1]"), (3, "AsyncHungEngine[3]")):
        assert replies[index]["error"] == (
            f"EngineSyncTimeout: engine {name} did not finish loading the new weights within 0.5 s; expected it "
            "to answer within the sync's timeout (a late reply is dropped)"
        )
        error = replies[index]["exception"]
        assert isinstance(error, EngineSyncTimeout) and (error.engine, error.timeout) == (name, 0.5)
    assert replies[4]["error"] == "RuntimeError: disk full"
    assert [r["engine"] for r in replies][:2] == ["SyncEngine[0]", "HungEngine[1]"]


class SocketTimeoutEngine:
    """An engine whose own call times out (a socket timeout is a TimeoutError): its failure, not the sync's."""

    def update_weights_from_checkpoint(self, checkpoint_path: str) -> None:
        raise TimeoutError("timed out reading from 127.0.0.1:30000")


class AsyncSocketTimeoutEngine:
    async def update_weights_from_checkpoint(self, checkpoint_path: str) -> None:
        raise TimeoutError("timed out reading from 127.0.0.1:30001")


@pytest.mark.parametrize("timeout", [None, 60.0])
def test_an_engines_own_timeout_error_is_its_failure_not_the_syncs_timeout(timeout: float | None) -> None:
    sync = SyncEngine()
    engines = [SocketTimeoutEngine(), AsyncSocketTimeoutEngine(), sync]
    replies = asyncio.run(sync_weights_to_engines(engines, "/ckpt/step_4", timeout=timeout))

    assert [r["success"] for r in replies] == [False, False, True] and sync.paths == ["/ckpt/step_4"]
    for reply, port in zip(replies[:2], ("30000", "30001"), strict=True):
        assert reply["error"] == f"TimeoutError: timed out reading from 127.0.0.1:{port}"
        assert type(reply["exception"]) is TimeoutError


def test_an_engine_without_the_method_is_refused_before_any_call() -> None:
    sync = SyncEngine()
    with pytest.raises(LibraryError, match=r"engine 1 \(dict\) has no update_weights_from_checkpoint"):
        asyncio.run(sync_weights_to_engines([sync, {}], "/ckpt"))
    assert sync.paths == []


def stub_app() -> tuple[FastAPI, list[tuple[str, Any]]]:
    app, seen = FastAPI(), []

    @app.post("/update_weights_from_disk")
    def sglang_update(body: dict[str, Any]) -> Any:
        seen.append(("sglang", body))
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/collective_rpc")
    def vllm_rpc(body: dict[str, Any]) -> Any:
        seen.append(("rpc", body))
        return {"results": [1]}

    @app.post("/reset_prefix_cache")
    def vllm_reset() -> Any:
        seen.append(("reset", None))
        return {}

    @app.post("/update_weight_version")
    def vllm_version(body: dict[str, Any]) -> Any:
        seen.append(("version", body))
        return {}

    return app, seen


def test_sglang_and_vllm_clients_post_to_their_weight_update_routes() -> None:
    app, seen = stub_app()
    with serve_in_background(app) as url:
        engines = [SGLangEngine(url), VLLMEngine(url)]
        replies = asyncio.run(sync_weights_to_engines(engines, "/ckpt/step_5", version=5))
    assert [r["success"] for r in replies] == [True, True] and [r["engine"] for r in replies] == [url, url]
    sglang = [body for kind, body in seen if kind == "sglang"]
    assert sglang == [
        {"model_path": "/ckpt/step_5", "weight_version": "5", "flush_cache": True, "abort_all_requests": False}
    ]
    assert [item for item in seen if item[0] != "sglang"] == [
        ("rpc", {"method": "tq_load_weights_from_dir", "args": ["/ckpt/step_5"]}),
        ("reset", None),
        ("version", {"new_version": "5"}),
    ]
    assert all(engine.version == 5 for engine in engines)
