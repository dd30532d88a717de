"""The policy side of a task-server environment for a chat model: SmolLM2-135M-Instruct playing ``os-interaction``.

Prompts are the environment's sample ids (the task server builds each episode's first observation); the tokenizer's
chat template formats the turns (``workers.agents.rollout_fns.chat_format``); the environment scores episodes. Used by
``recipe/configs/agent_os_smollm2.yaml``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import workers.agents.envs  # noqa: F401 (registers the shipped environments)
from rl_contracts.task import Task
from workers.agents.environment import environment_class
from workers.agents.sample_dataset import load_sample_ids
from workers.hf_models import require_prepared, smollm2_path


class ChatEnvTask(Task):
    """Episodes of the registered environment ``env`` for the prepared chat model at ``model_path``.

    Args:
        env: a registered environment name (``os-interaction``) or ``"module:Class"``.
        model_path: a prepared Hugging Face directory; default: :func:`workers.hf_models.smollm2_path`.
        cache_dir: the model cache root of the default path.
        dataset: a JSONL file of sample ids as AReaL's examples ship them (``{"index": ..., "messages": [...]}``,
            workers/agents/sample_dataset.py): prompts are drawn from its samples only; default: every sample.
    """

    reward_fields = ()

    def __init__(
        self,
        env: str = "os-interaction",
        model_path: str | None = None,
        cache_dir: str | None = None,
        dataset: str | None = None,
    ):
        self.env = env
        self.sample_ids = list(environment_class(env).sample_ids())
        if dataset is not None:
            self.sample_ids = load_sample_ids(dataset, self.sample_ids)
        self.model_path = Path(model_path).expanduser() if model_path else smollm2_path(cache_dir)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(require_prepared(self.model_path))
        return self._tokenizer

    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        """``num`` sample ids drawn (seeded) from the environment's samples (or the dataset's); no prompt ids, the
        server makes them."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{split}-{seed}")
        return [{"sample_id": rng.choice(self.sample_ids), "prompt_ids": []} for _ in range(num)]

    def reward(self, response_text: str, **fields: str) -> float:
        raise NotImplementedError(f"{self.env} episodes are scored by the task server")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def build_policy(self) -> Any:
        """The chat model from the prepared directory, float32 on CPU, in train mode."""
        path = require_prepared(self.model_path)
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
