"""Inference engines: token ids in, sampled token ids and their log-probs out.

``HFEngine`` (in-process Hugging Face model), ``VLLMEngine`` (in-process ``vllm.LLM``), ``VLLMServerEngine`` and
``SGLangEngine`` (HTTP clients of a server), ``EngineServer`` (a server process's lifecycle), ``InferenceManager``
(the run's servers, one per DP group) and ``sync_weights_to_engines``. Imported lazily: ``workers.engines.server``
does not pull in transformers or vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

from workers.engines.base import Engine, Generation, SamplingParams

_LAZY = {
    "HFEngine": "workers.engines.hf",
    "VLLMEngine": "workers.engines.vllm_engine",
    "VLLMServerEngine": "workers.engines.vllm_server",
    "SGLangEngine": "workers.engines.sglang",
    "EngineServer": "workers.engines.server",
    "InferenceManager": "workers.engines.manager",
    "ServiceRegistry": "workers.engines.server",
    "PartialRollout": "workers.engines.partial",
    "sync_weights_to_engines": "workers.engines.weight_sync",
    "sync_state_dict_to_engines": "workers.engines.weight_sync",
}

__all__ = ["Engine", "Generation", "SamplingParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workers.engines' has no attribute {name!r}")
