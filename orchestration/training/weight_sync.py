"""Push a checkpoint to inference engines: ``sync_weights_to_engines`` and the HTTP clients ``SGLangEngine`` and
``VLLMEngine``.

An engine is anything with ``update_weights_from_checkpoint(checkpoint_path)`` (the protocol, no inheritance):
sync or async, with or without a ``version`` keyword (passed only when the method takes it and a version is given),
returning a dict (merged into the engine's reply) or anything else (kept as ``reply["reply"]``). The path is a
Hugging Face directory: a ``PyTorchTrainingBackend`` checkpoint (``config.json`` + ``pytorch_model.bin``) or an
``export_hf`` directory.

>>> engines = [SGLangEngine("http://127.0.0.1:30000"), VLLMEngine("http://127.0.0.1:30001")]  # doctest: +SKIP
>>> path = await backend.save_checkpoint(step, metrics)  # doctest: +SKIP
>>> replies = await sync_weights_to_engines(engines, path)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from orchestration.training.types import LibraryError
from workers.engines.errors import EngineSyncTimeout
from workers.engines.sglang import SGLangEngine as _SGLangClient
from workers.engines.vllm_server import VLLMServerEngine


class SGLangEngine(_SGLangClient):
    """A client of an SGLang server at ``url`` (``workers.engines.sglang.SGLangEngine``):
    ``update_weights_from_checkpoint(path, version=None)`` POSTs ``/update_weights_from_disk``."""


class VLLMEngine(VLLMServerEngine):
    """A client of a vLLM OpenAI server at ``url`` started with our weight-sync extension
    (``workers.engines.vllm_server.VLLMServerEngine``): ``update_weights_from_checkpoint(path, version=None)`` POSTs
    ``/collective_rpc`` (``tq_load_weights_from_dir``), ``/reset_prefix_cache`` and ``/update_weight_version``."""


async def sync_weights_to_engines(
    engines: Sequence[Any],
    checkpoint_path: str | os.PathLike[str],
    *,
    version: int | None = None,
    timeout: float | None = 300.0,
) -> list[dict[str, Any]]:
    """Call every engine's ``update_weights_from_checkpoint(checkpoint_path)`` concurrently; one reply each, in order.

    A reply is ``{"engine": name, "success": bool, "seconds": float, ...}`` with the engine's own dict, and
    ``"error"`` (the message) and ``"exception"`` (the exception) when the call raised or did not finish within
    ``timeout`` seconds (an :class:`~workers.engines.errors.EngineSyncTimeout` naming the engine and the timeout):
    a failing or hung engine never stops the others, and the call never waits past the timeout. (A hung sync
    method keeps its daemon thread; an async one is cancelled.)

    Args:
        engines: objects with ``update_weights_from_checkpoint``.
        checkpoint_path: the weights' directory.
        version: the policy version, passed to engines whose method takes ``version`` (None: not passed).
        timeout: seconds each engine may take (None: no bound).

    Raises:
        LibraryError: (before any call) if an engine has no ``update_weights_from_checkpoint``, naming its type.
    """
    for index, engine in enumerate(engines):
        if not callable(getattr(engine, "update_weights_from_checkpoint", None)):
            raise LibraryError(
                f"engine {index} ({type(engine).__name__}) has no update_weights_from_checkpoint(checkpoint_path) "
                "method; an engine needs one (sync or async)"
            )
    path = str(checkpoint_path)
    return list(await asyncio.gather(*(_sync_one(i, e, path, version, timeout) for i, e in enumerate(engines))))


async def _sync_one(index: int, engine: Any, path: str, version: int | None, timeout: float | None) -> dict[str, Any]:
    method = engine.update_weights_from_checkpoint
    kwargs = {"version": version} if version is not None and _takes(method, "version") else {}
    reply: dict[str, Any] = {"engine": _name(engine, index)}
    t0 = time.perf_counter()
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            result = await _call(method, path, kwargs)
        reply.update(result if isinstance(result, dict) else {"reply": result})
        reply.setdefault("success", True)
    except Exception as exc:  # reported, never raised: the other engines go on
        if isinstance(exc, TimeoutError) and deadline.expired():  # the sync's wait ran out, not the engine's own
            assert timeout is not None  # only a bounded wait expires
            exc = EngineSyncTimeout(reply["engine"], timeout)
        reply.update(success=False, error=f"{type(exc).__name__}: {exc}", exception=exc)
    reply["seconds"] = time.perf_counter() - t0
    return reply


async def _call(method: Any, path: str, kwargs: dict[str, Any]) -> Any:
    """The engine's reply: an async method awaited, a sync one run in a daemon thread (its awaitable result awaited)."""
    if inspect.iscoroutinefunction(method):
        return await method(path, **kwargs)
    result = await _in_daemon_thread(lambda: method(path, **kwargs))
    return await result if inspect.isawaitable(result) else result


def _in_daemon_thread(call: Callable[[], Any]) -> asyncio.Future[Any]:
    """Run ``call`` in a daemon thread of its own: a hung engine never holds the event loop's executor (which
    ``asyncio.run`` waits for at exit) nor the interpreter's exit."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        # the awaiting side may have given up (timeout: the future is cancelled); then the outcome is dropped
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            try:
                result = call()
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            else:
                future.set_result(result)

    threading.Thread(target=run, name="weight-sync", daemon=True).start()
    return asyncio.wrap_future(future)


def _takes(method: Any, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _name(engine: Any, index: int) -> str:
    return str(getattr(engine, "name", None) or getattr(engine, "url", None) or f"{type(engine).__name__}[{index}]")
