"""Push new policy weights to many engines at once: from a checkpoint directory (the seed's
``sync_weights_to_engines``) or from memory (``sync_state_dict_to_engines``), each engine recording the version.

Both are concurrent (one thread per engine) and never let one engine's failure stop the others: every engine gets
a reply dict, ``{"engine", "success", "version", "seconds", ...}`` with ``error`` when it failed.

Engines can be any :class:`~workers.engines.base.Engine` (``update_weights(version, path=...)``), an
:class:`~workers.engines.server.EngineServer` (its client engine is used and the server's registry record gets the
version), or any object with the seed's ``update_weights_from_checkpoint(path)`` returning a dict.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


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
    def one(item: tuple[int, Any]) -> dict[str, Any]:
        index, engine = item
        t0 = time.perf_counter()
        reply: dict[str, Any] = {"engine": _name(engine, index)}
        try:
            target, server = _target(engine)
            reply.update(load(target) or {})
            version = reply.get("version", getattr(target, "version", None))
            if server is not None and version is not None:
                server.set_version(int(version))
            reply.setdefault("success", True)
            reply["version"] = version
        except Exception as exc:  # reported, never raised: the other engines go on
            reply.update(success=False, error=f"{type(exc).__name__}: {exc}")
        reply["seconds"] = time.perf_counter() - t0
        return reply

    if not engines:
        return []
    with ThreadPoolExecutor(len(engines), thread_name_prefix="weight-sync") as pool:
        futures = [pool.submit(one, item) for item in enumerate(engines)]
        return [f.result(timeout=timeout) for f in futures]


def sync_weights_to_engines(
    engines: Sequence[Any], checkpoint_path: str, version: int | None = None, timeout: float | None = None
) -> list[dict[str, Any]]:
    """Load the Hugging Face directory ``checkpoint_path`` into every engine concurrently; one reply per engine,
    in order. ``version``: the policy version to record (default: each engine's current version + 1)."""
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
    """Load ``state_dict`` (Hugging Face names) into every engine concurrently as ``version``; one reply each."""

    def load(engine: Any) -> dict[str, Any]:
        engine.update_weights(version, state_dict=state_dict)
        return {"success": True, "version": engine.version}

    return _run(engines, load, timeout)
