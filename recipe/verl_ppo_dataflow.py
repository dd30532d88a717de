"""A verl-style PPO data flow on transfer_queue: DataProto-shaped batches between a rollout and a trainer process.

verl moves a ``DataProto`` (a TensorDict ``batch``, a dict of numpy ``non_tensor_batch`` arrays, ``meta_info``)
from stage to stage through its driver. Here the driver only puts the prompts; the rollout actor and the trainer
actor (two Ray worker processes) read what they need from the queue and write back what they produce:

    driver:  prompts (DataProto, repeated n times, uid per prompt) --put--> step partition
    rollout: get_meta([input_ids, uid]) -> get_data -> generate -> put(responses, old_log_probs, rewards, metadata=meta)
    trainer: get_meta([... all ...], get_n_samples=True) -> get_data -> to_dataproto -> GRPO advantages by uid
             -> PPO-clip loss -> optimizer step

The policy is a toy (a bigram table over a 16-token vocabulary) and the reward counts even tokens: the point is the
data flow, not the learning. The rollout keeps its own copy of the initial policy (weight sync is out of scope).

Run: ``python recipe/verl_ppo_dataflow.py`` (starts a local Ray, or joins the one ``ray job submit`` gives it).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray binds 127.0.0.1

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from tensordict import TensorDict

import transfer_queue as tq
from rl_contracts.actors import actor_class
from transfer_queue.interop import META_INFO_FIELD, from_dataproto, to_dataproto
from transfer_queue.runtime import init_ray

VOCAB, PROMPT_LEN, MAX_RESPONSE = 16, 4, 6


@dataclass
class DataProto:
    """The shape of ``verl.DataProto`` (this recipe does not need verl installed)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Embedding(VOCAB, VOCAB)  # logits of the next token given the previous one


def token_log_probs(model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    previous = torch.cat([prompt[-1:], response[:-1]])
    return torch.log_softmax(model(previous), dim=-1).gather(1, response[:, None])[:, 0]


@ray.remote
class Rollout:
    def __init__(self, n_samples: int):
        self.client, self.model, self.n = tq.get_client("rollout"), policy(), n_samples

    def generate(self, step: int) -> int:
        rows = self.client.config.rows_per_step  # the whole step: its prompts x n_samples
        meta = self.client.get_meta(["input_ids", "uid"], rows, global_step=step, task_name="rollout")
        prompts = to_dataproto(self.client.get_data(meta))
        gen = torch.Generator().manual_seed(step)
        responses, old_log_probs, rewards = [], [], []
        with torch.no_grad():
            for prompt in prompts.batch["input_ids"]:
                length = int(torch.randint(1, MAX_RESPONSE + 1, (1,), generator=gen))
                tokens = [int(prompt[-1])]
                for _ in range(length):
                    probs = torch.softmax(self.model(torch.tensor(tokens[-1])), dim=-1)
                    tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
                response = torch.tensor(tokens[1:])
                responses.append(response)
                old_log_probs.append(token_log_probs(self.model, prompt, response))
                rewards.append(float((response % 2 == 0).float().mean()))
        out = DataProto(
            TensorDict(
                {
                    "responses": torch.nested.nested_tensor(responses, layout=torch.jagged),
                    "old_log_probs": torch.nested.nested_tensor(old_log_probs, layout=torch.jagged),
                    "rewards": torch.tensor(rewards),
                },
                batch_size=[len(meta)],
            ),
            {"generator": np.array(["toy"] * len(meta))},
        )
        self.client.put(from_dataproto(out), metadata=meta)  # new fields into the prompts' rows
        return len(meta)


@ray.remote
class Trainer:
    def __init__(self, n_samples: int, clip: float = 0.2):
        self.client, self.model, self.n, self.clip = tq.get_client("trainer"), policy(), n_samples, clip
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train(self, step: int) -> dict[str, float]:
        fields = ["input_ids", "responses", "old_log_probs", "rewards", "uid", "generator", META_INFO_FIELD]
        rows = self.client.config.rows_per_step
        meta = self.client.get_meta(fields, rows, global_step=step, task_name="train", get_n_samples=True)
        batch = to_dataproto(self.client.get_data(meta), dataproto_cls=DataProto)
        rewards, uids = batch.batch["rewards"], batch.non_tensor_batch["uid"]
        advantages = torch.zeros_like(rewards)
        for uid in np.unique(uids):  # GRPO: normalise within the responses of one prompt (verl groups by uid)
            group = torch.from_numpy(uids == uid)
            advantages[group] = (rewards[group] - rewards[group].mean()) / (rewards[group].std() + 1e-6)
        losses = []
        columns = (batch.batch["input_ids"], batch.batch["responses"].unbind(), batch.batch["old_log_probs"].unbind())
        for (prompt, response, old), advantage in zip(zip(*columns, strict=True), advantages, strict=True):
            ratio = torch.exp(token_log_probs(self.model, prompt, response) - old)
            clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
            losses.append(-torch.min(ratio * advantage, clipped * advantage).mean())
        loss = torch.stack(losses).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {
            "step": step,
            "rows": len(meta),
            "loss": float(loss),
            "reward": float(rewards.mean()),
            "temperature": batch.meta_info["temperature"],
        }


def prompts(step: int, num_prompts: int, n_samples: int) -> DataProto:
    """verl's prompt batch after ``repeat(n, interleave=True)``: every prompt n times, one uid per prompt."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (num_prompts, PROMPT_LEN), generator=gen).repeat_interleave(n_samples, dim=0)
    uids = np.array([f"step{step}-prompt{i}" for i in range(num_prompts)], dtype=object).repeat(n_samples)
    return DataProto(TensorDict({"input_ids": ids}, batch_size=[len(ids)]), {"uid": uids}, {"temperature": 1.0})


def main(steps: int = 3, num_prompts: int = 4, n_samples: int = 4) -> list[dict[str, float]]:
    if not ray.is_initialized():
        init_ray(num_cpus=4, include_dashboard=False)
    client = tq.init(
        global_batch_size=num_prompts,
        num_n_samples=n_samples,
        num_global_batch=2,
        num_storage_units=1,
        task_names=["rollout", "train"],  # the two stages below: any other name is refused at once
    )
    rollout, trainer = actor_class(Rollout).remote(n_samples), actor_class(Trainer).remote(n_samples)
    metrics = []
    try:
        for step in range(steps):
            client.put(from_dataproto(prompts(step, num_prompts, n_samples)), global_step=step)
            generated, stats = ray.get([rollout.generate.remote(step), trainer.train.remote(step)])
            assert generated == stats["rows"] == num_prompts * n_samples
            metrics.append(stats)
            print(f"step {step}: {stats['rows']} rows, reward {stats['reward']:.3f}, loss {stats['loss']:+.4f}")
            client.clear(global_step=step)
    finally:
        for actor in (rollout, trainer):
            ray.kill(actor)
        tq.shutdown()
    return metrics


if __name__ == "__main__":
    main()
