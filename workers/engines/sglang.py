"""SGLangEngine: the Engine contract over SGLang's native HTTP API (``python -m sglang.launch_server``).

    POST /generate                  {"input_ids": [[...], ...], "sampling_params": {...} or [{...} per input],
                                     "return_logprob": true}
                                    -> one {"output_ids", "meta_info": {"output_token_logprobs": [[logprob, id,
                                       text], ...], "finish_reason": {"type": "stop" | "length" | "abort", ...},
                                       "weight_version", ...}} per input
    POST /update_weights_from_disk  {"model_path", "weight_version", "flush_cache", "abort_all_requests"}
                                    -> {"success", "message", "num_paused_requests"}
    GET  /health_generate, /health  200 once the server can generate (both run a one-token generation)
    POST /flush_cache               drops the radix (prefix) cache; 400 while requests run or wait
    POST /pause_generation          {"mode": "abort" | "retract" | "in_place"}; POST /continue_generation
    POST /abort_request             {"abort_all": true}: unfinished requests return what they have, finish "abort"
    POST /release_memory_occupation, /resume_memory_occupation: free and take back the GPU memory (colocated)
    GET  /get_model_info            {"model_path", ...};  GET /get_weight_version {"weight_version"}

Authentication: started with ``--api-key KEY``, SGLang refuses every route but ``/health*`` and ``/metrics``
without ``Authorization: Bearer KEY`` (401); the client sends it (``api_key=``, or ``TQ_API_KEY``).
:func:`sglang_server_command` puts ``KEY_PLACEHOLDER`` after ``--api-key``, which ``EngineServer`` replaces by its
server's key at launch and shows redacted in its log (SGLang reads the key from no environment variable, so it is
on the server's command line, visible to the node's local users in ``ps``).

SGLang needs CUDA (or Intel AMX on CPU), so here it is tested against a loopback server that reproduces these
request and response schemas (``tests/engine_fakes.py``), not against SGLang itself; see docs/rl.md.

Log-probs: SGLang reports ``log_softmax(logits / T)`` of the sampled token before top-k/top-p renormalisation
(unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, which reports temperature 1), the convention of
docs/rl-conventions.md. Each of the ``n`` responses of a prompt is its own request (the prompt repeated), so the
order of the replies is the order of the requests whatever the server does with parallel sampling. A seeded call
sends one ``sampling_params`` per row, row ``i`` with ``sampling_seed = seed + i`` (as the vLLM clients seed request
``i``): with one seed the ``n`` samples of a prompt would be identical on a deterministic server.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.api_key import KEY_PLACEHOLDER
from workers.engines.base import AbortCheck, Generation, SamplingParams, check_prompts
from workers.engines.errors import EngineRequestError
from workers.engines.http_base import HTTPEngine


def sglang_server_command(
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    *,
    served_model: str = "policy",
    extra: list[str] | None = None,
) -> list[str]:
    """The command line of an SGLang server for ``EngineServer`` (which puts its key where ``KEY_PLACEHOLDER``
    stands): ``EngineServer(lambda h, p: sglang_server_command(path, p, h), health_path="/health_generate",
    engine_factory=SGLangEngine)``. ``served_model``: the model name its OpenAI routes answer to and report (SGLang's
    ``--served-model-name``; without it, the model path): the ledger services' model, which the samplers ask for."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--served-model-name",
        served_model,
        "--host",
        host,
        "--port",
        str(port),
        "--api-key",
        KEY_PLACEHOLDER,
        *(extra or []),
    ]


class SGLangEngine(HTTPEngine):
    """A client of one SGLang server at ``url``; see the module docstring and :class:`HTTPEngine`."""

    kind = "sglang"
    health_path = "/health_generate"  # answers once the server generated one token
    weight_version_path = "/get_weight_version"
    supports_abort = True

    def __init__(self, url: str, **kwargs: Any):
        super().__init__(url, **kwargs)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-generate")
        self._abort_lock = threading.Lock()

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, should_abort: AbortCheck | None = None
    ) -> list[list[Generation]]:
        """Sample ``n`` responses per prompt; see ``Engine.generate``.

        With ``should_abort``, the request runs in a helper thread while this one polls; once it returns True the
        server is told ``/abort_request`` (all requests) and the unfinished responses come back as they stand.

        Raises:
            ValueError: if ``n < 1`` or a prompt is empty.
            EngineRequestError: if the server refused the request or answered with another number of outputs.
        """
        check_prompts(prompts, n, params)
        rows = [list(prompt) for prompt in prompts for _ in range(n)]
        body = {
            "input_ids": rows,
            "sampling_params": self.row_sampling_params(params, len(rows)),
            "return_logprob": True,
        }
        reply = self.call_abortable(
            self._pool,
            lambda: self.request("POST", "/generate", json=body),
            should_abort,
            lambda: self.request("POST", "/abort_request", json={"rid": "", "abort_all": True}),
        )
        if isinstance(reply, dict):
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != len(rows):
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise EngineRequestError(f"sglang server at {self.url}: expected {len(rows)} outputs, got {got}")
        generations = [_to_generation(item) for item in reply]
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]

    @staticmethod
    def sampling_params(params: SamplingParams) -> dict[str, Any]:
        """SGLang's ``sampling_params`` for ours (SGLang: ``top_k=-1`` keeps all tokens)."""
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.seed is not None:
            sp["sampling_seed"] = params.seed
        return sp

    @classmethod
    def row_sampling_params(cls, params: SamplingParams, rows: int) -> dict[str, Any] | list[dict[str, Any]]:
        """The ``sampling_params`` of a request of ``rows`` rows: one dict for all rows when unseeded; seeded, one
        per row, row ``i`` with ``sampling_seed = seed + i`` (as ``VLLMServerEngine`` seeds request ``i``). One seed
        for all rows would make the ``n`` samples of a prompt identical on a deterministic server."""
        sp = cls.sampling_params(params)
        if params.seed is None:
            return sp
        return [{**sp, "sampling_seed": params.seed + i} for i in range(rows)]

    def _load_directory(self, path: str, version: int) -> Any:
        reply = self.request(
            "POST",
            "/update_weights_from_disk",
            json={"model_path": path, "weight_version": str(version), "flush_cache": True, "abort_all_requests": False},
        )
        if not isinstance(reply, dict) or not reply.get("success", False):
            raise EngineRequestError(
                f"sglang server at {self.url} did not load the weights of {path} as version {version}: {reply}"
            )
        return reply

    def _served_model_path(self) -> str | None:
        info = self.request("GET", "/get_model_info")
        return info.get("model_path") if isinstance(info, dict) else None

    def flush_cache(self) -> Any:
        return self.request("POST", "/flush_cache")

    def pause_generation(self, mode: str = "abort") -> Any:
        """``mode``: ``abort`` (unfinished requests return now), ``retract`` or ``in_place`` (they wait)."""
        return self.request("POST", "/pause_generation", json={"mode": mode})

    def continue_generation(self) -> Any:
        return self.request("POST", "/continue_generation", json={})

    def release_memory(self) -> Any:
        """Free the weights' and KV cache's memory for training (colocated); ``resume_memory`` takes it back."""
        return self.request("POST", "/release_memory_occupation", json={})

    def resume_memory(self) -> Any:
        return self.request("POST", "/resume_memory_occupation", json={})

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        super().close()


def _to_generation(item: dict[str, Any]) -> Generation:
    meta = item.get("meta_info", {})
    token_ids = [int(t) for t in item["output_ids"]]
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise EngineRequestError(
            f"sglang output has {len(token_ids)} output_ids but {len(logprobs)} output_token_logprobs; expected one "
            "log-prob per token (was return_logprob sent?)"
        )
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    if reason not in ("stop", "length", "abort"):
        raise EngineRequestError(f"sglang finish_reason type {reason!r}; expected 'stop', 'length' or 'abort'")
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)
