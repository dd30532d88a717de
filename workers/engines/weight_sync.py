"""Push new policy weights to many engines at once: from a checkpoint directory (the seed's
``sync_weights_to_engines``) or from memory (``sync_state_dict_to_engines``), each engine recording the version.

Both are concurrent (one thread per engine) and never let one engine's failure stop the others: every engine gets
a reply dict, ``{"engine", "success", "version", "seconds", ...}`` with ``error`` (the message) and ``exception``
(the exception itself) when it failed. With ``timeout``, the call returns after at most ``timeout`` seconds
whatever the engines do: an engine still loading then gets a failed reply whose ``exception`` is an
:class:`~workers.engines.errors.EngineSyncTimeout` naming it and the timeout, and every other engine its own reply.
Until that engine's load ends, a later sync does not load it again (two loads at once could leave the older weights
served): its reply there is a failure whose ``exception`` is an :class:`~workers.engines.errors.EngineBusy`.

Engines can be any :class:`~workers.engines.base.Engine` (``update_weights(version, path=...)``), an
:class:`~workers.engines.server.EngineServer` (its client engine is used and the server's registry record gets the
version), or any object with the seed's ``update_weights_from_checkpoint(path)`` returning a dict.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from workers.engines.errors import EngineBusy, EngineSyncTimeout

# ids of the engines being loaded now: a load that outlived its sync's timeout still runs in its daemon thread, and a
# second load beside it could finish first and be overwritten with the older weights (so the next sync skips them)
_LOADING: set[int] = set()
_LOADING_LOCK = threading.Lock()


@contextlib.contextmanager
def _only_load(engine: Any, name: str) -> Iterator[None]:
    """Hold ``engine`` for one load; raise :class:`EngineBusy` if an earlier load of it still runs."""
    with _LOADING_LOCK:
        if id(engine) in _LOADING:
            raise EngineBusy(name)
        _LOADING.add(id(engine))  # the id stays this engine's: the loading thread holds a reference until discard
    try:
        yield
    finally:
        with _LOADING_LOCK:
            _LOADING.discard(id(engine))


def _name(engine: Any, index: int) -> str:
    return getattr(engine, "name", None) or getattr(engine, "url", None) or f"{type(engine).__name__}[{index}]"


def _target(engine: Any) -> tuple[Any, Any]:
    """``(engine to load into, server to record the version on)``."""
    from workers.engines.server import EngineServer

    if isinstance(engine, EngineServer):
        if engine.engine is None:
            raise ValueError(f"EngineServer {engine.name} has no engine client (give it an engine_factory)")
        return engine.engine, engine
    return engine, None


def _run(engines: Sequence[Any], load: Any, timeout: float | None) -> list[dict[str, Any]]:
    """``load`` every engine in a daemon thread of its own; wait for them all, but never past ``timeout`` seconds.

    An engine still loading at the deadline gets a failed reply with an :class:`EngineSyncTimeout` (its thread is
    left to finish in the background: a daemon thread, so it holds neither this call nor the interpreter's exit;
    its late reply is dropped). A thread pool would do neither: its ``shutdown`` (and the interpreter's exit) waits
    for the hung call. Until that load ends, a later sync gives the engine a failed reply with an :class:`EngineBusy`
    and does not load it.
    """

    def one(index: int, engine: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        reply: dict[str, Any] = {"engine": _name(engine, index)}
        try:
            target, server = _target(engine)
            with _only_load(target, reply["engine"]):
                reply.update(load(target) or {})
            version = reply.get("version", getattr(target, "version", None))
            if server is not None and version is not None:
                server.set_version(int(version))
            reply.setdefault("success", True)
            reply["version"] = version
        except Exception as exc:  # reported, never raised: the other engines go on
            reply.update(success=False, error=f"{type(exc).__name__}: {exc}", exception=exc)
        reply["seconds"] = time.perf_counter() - t0
        return reply

    t0 = time.perf_counter()
    futures = [_in_daemon_thread(one, index, engine) for index, engine in enumerate(engines)]
    concurrent.futures.wait(futures, timeout)
    replies = []
    for index, (engine, future) in enumerate(zip(engines, futures, strict=True)):
        if future.done():
            replies.append(future.result())
            continue
        assert timeout is not None  # without a timeout every future is done
        error = EngineSyncTimeout(_name(engine, index), timeout)
        replies.append(
            {
                "engine": error.engine,
                "success": False,
                "version": None,
                "error": f"EngineSyncTimeout: {error}",
                "exception": error,
                "seconds": time.perf_counter() - t0,
            }
        )
    return replies


def _in_daemon_thread(call: Any, *args: Any) -> concurrent.futures.Future[dict[str, Any]]:
    future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as exc:  # handed to the waiting side
            future.set_exception(exc)

    threading.Thread(target=run, name="weight-sync", daemon=True).start()
    return future


def sync_weights_to_engines(
    engines: Sequence[Any], checkpoint_path: str, version: int | None = None, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Load the Hugging Face directory ``checkpoint_path`` into every engine concurrently; one reply per engine,
    in order. ``version``: the policy version to record (default: each engine's current version + 1).
    ``timeout``: seconds the whole call may take (None: wait for every engine); an engine still loading then has a
    failed reply with an ``EngineSyncTimeout``, the others their own replies."""
    path = str(checkpoint_path)

    def load(engine: Any) -> dict[str, Any]:
        if hasattr(engine, "update_weights_from_checkpoint"):
            return engine.update_weights_from_checkpoint(path, version=version)
        new = engine.version + 1 if version is None else version
        engine.update_weights(new, path=path)
        return {"success": True, "version": engine.version}

    return _run(engines, load, timeout)


def sync_state_dict_to_engines(
    engines: Sequence[Any], state_dict: dict[str, torch.Tensor], version: int, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Load ``state_dict`` (Hugging Face names) into every engine concurrently as ``version``; one reply each
    (``timeout``: as ``sync_weights_to_engines``)."""

    def load(engine: Any) -> dict[str, Any]:
        engine.update_weights(version, state_dict=state_dict)
        return {"success": True, "version": engine.version}

    return _run(engines, load, timeout)
