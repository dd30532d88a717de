"""HTTPEngine: the part of the server engines (vLLM's OpenAI server, SGLang's native API) that does not depend on
which server it is: the HTTP client, typed errors, policy versions, and new weights as a directory.

Weights reach a server as a Hugging Face directory it can read (``update_weights(version, path=...)``, or the seed's
``update_weights_from_checkpoint(path)``); a state dict from memory is first written as safetensors (plus the
model's config files) into a fresh directory in ``/dev/shm`` that is removed after the server loaded it (named
``tq-engine-weights-<pid>-...``: one left by an engine process killed during a load is swept by the next one made on
the host, ``rl_contracts/scratch.py``).
"""

from __future__ import annotations

import shutil
import time
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch

from rl_contracts.scratch import ScratchDir
from workers.api_key import bearer_headers, key_from_env
from workers.engines.base import AbortCheck, Engine, check_version, check_weight_update
from workers.engines.errors import EngineRequestError, EngineUnavailable

CONFIG_FILES = ("config.json", "generation_config.json")


T = TypeVar("T")


class HTTPEngine(Engine):
    """An engine behind an HTTP server at ``url`` (see the module docstring).

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:30000``.
        model_path: the model directory the server loaded (its config files go next to in-memory weights);
            asked from the server when not given.
        version: the policy version the server's weights are (0 for the initial weights).
        timeout: seconds a request may take (a generation included).
        api_key: the server's API key, sent as ``Authorization: Bearer``; None: ``TQ_API_KEY`` from the environment
            if set (``EngineServer`` hands its server's key to the engine it builds with :meth:`use_api_key`).
    """

    kind = "http"
    health_path = "/health"  # a GET that answers 200 while the server can generate
    weight_version_path = ""  # a GET answering {"weight_version": ...}, the version of the last load ("": none)

    def __init__(
        self,
        url: str,
        *,
        model_path: str | None = None,
        version: int = 0,
        timeout: float = 300.0,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._model_path = model_path
        self._version = version
        self._loaded = False  # whether this client loaded weights into the server (version 0 too: the SFT warm-up's)
        # trust_env=False: the servers are local; a proxy from the environment must not intercept loopback calls
        self._client = httpx.Client(base_url=self.url, timeout=timeout, trust_env=False)
        self.use_api_key(api_key if api_key is not None else key_from_env())

    def use_api_key(self, api_key: str | None) -> None:
        """Send ``api_key`` with every later request (None: none)."""
        self._client.headers.pop("Authorization", None)
        self._client.headers.update(bearer_headers(api_key))

    @property
    def version(self) -> int:
        return self._version

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; the JSON reply (or the text when it is not JSON).

        Raises:
            EngineUnavailable: the server could not be reached or did not answer in time.
            EngineRequestError: it answered with a status >= 400 (the message quotes its body).
        """
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.kind} server at {self.url}: {method} {path} failed: {exc!r}") from exc
        if response.status_code >= 400:
            raise EngineRequestError(
                f"{self.kind} server at {self.url}: {method} {path} answered HTTP {response.status_code}, expected "
                f"2xx: {response.text[:500]}"
            )
        try:
            return response.json()
        except ValueError:
            return response.text

    def call_abortable(
        self, pool: ThreadPoolExecutor, call: Callable[[], T], should_abort: AbortCheck | None, abort: Callable[[], Any]
    ) -> T:
        """Run ``call`` (a generate request); with ``should_abort``, run it on ``pool`` while this thread polls, and
        once ``should_abort()`` turns True call ``abort`` (the server's abort endpoint) once, then wait for ``call``
        to return what the server kept (the unfinished responses as they stand)."""
        if should_abort is None:
            return call()
        future = pool.submit(call)
        aborted = False
        while not future.done():
            if not aborted and should_abort():
                abort()
                aborted = True
            time.sleep(0.002)
        return future.result()

    def update_weights(
        self, version: int, state_dict: dict[str, torch.Tensor] | None = None, path: str | None = None
    ) -> None:
        """Load weights from memory or a directory (exactly one) into the server and record ``version``.

        Raises:
            ValueError: if not exactly one source is given or the version goes backwards.
            EngineRequestError: if the server refused the weights.
        """
        check_weight_update(self._version, version, state_dict, path)
        if path is not None:
            self._load_directory(str(path), version)
        else:
            assert state_dict is not None
            scratch = self.save_state_dict(state_dict)
            try:
                self._load_directory(str(scratch.path), version)
            finally:
                scratch.remove()
        self._version, self._loaded = version, True

    def update_weights_from_checkpoint(self, checkpoint_path: str, version: int | None = None) -> dict[str, Any]:
        """The seed's protocol (``sync_weights_to_engines``): load a directory; ``version`` defaults to the next one.
        Returns ``{"success", "version", "reply"}`` with the server's own reply."""
        version = self._version + 1 if version is None else version
        check_version(self._version, version)
        reply = self._load_directory(str(checkpoint_path), version)
        self._version, self._loaded = version, True
        return {"success": True, "version": version, "reply": reply}

    def save_state_dict(self, state_dict: dict[str, torch.Tensor]) -> ScratchDir:
        """Write a state dict as a Hugging Face directory (safetensors + the model's config files) in a scratch
        directory of this process; returns it (the caller removes it)."""
        from safetensors.torch import save_file

        scratch = ScratchDir("tq-engine-weights-")
        try:
            # clone: tied tensors share storage, which safetensors refuses to save twice
            tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
            save_file(tensors, str(scratch.path / "model.safetensors"), metadata={"format": "pt"})
            source = self.model_path()
            for name in CONFIG_FILES:
                if source is not None and (Path(source) / name).is_file():
                    shutil.copy(Path(source) / name, scratch.path / name)
        except BaseException:
            scratch.remove()
            raise
        return scratch

    def served_version(self) -> str | None:
        """The ``weight_version`` the server reports (what the last load named; the engine's own initial value, e.g.
        SGLang's ``"default"``, before any), or None when this engine has no such route."""
        if not self.weight_version_path:
            return None
        reply = self.request("GET", self.weight_version_path)
        version = reply.get("weight_version") if isinstance(reply, dict) else None
        return None if version is None else str(version)

    def server_restarted(self) -> bool:
        """Whether the server no longer holds the weights this client loaded into it: it reports another weight
        version than the client's (a server restarted after a crash comes back with the weights on its command
        line). False while the client has loaded none (at version 0: the initial weights), or without a version
        route; a load of version 0 (the SFT warm-up's weights) counts.

        Raises:
            EngineUnavailable: the server could not be reached.
        """
        held = self._loaded or self._version > 0
        return held and self.weight_version_path != "" and self.served_version() != str(self._version)

    def model_path(self) -> str | None:
        if self._model_path is None:
            self._model_path = self._served_model_path()
        return self._model_path

    def health(self) -> dict[str, Any]:
        """``ok`` when the server's ``health_path`` answers 200."""
        status: dict[str, Any] = {"engine": self.kind, "url": self.url, "version": self._version, "device": "server"}
        try:
            self.request("GET", self.health_path)
            status["ok"] = True
        except (EngineUnavailable, EngineRequestError) as exc:
            status.update(ok=False, error=str(exc))
        return status

    def close(self) -> None:
        self._client.close()

    @abstractmethod
    def _load_directory(self, path: str, version: int) -> Any:
        """Ask the server to load the weights of directory ``path`` as ``version``; returns its reply."""

    @abstractmethod
    def _served_model_path(self) -> str | None:
        """The model directory the server says it serves."""
