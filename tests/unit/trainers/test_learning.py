"""GRPO learns, and the engine samples from the weights the trainer sends: a short loop in one process, no Ray.

The pieces are the run's own (``HFEngine`` samples and reports log-probs, ``pad_sequences``, ``token_logprobs``,
``group_advantages``, ``policy_loss("grpo")``, and ``update_weights`` with the trainer's state dict after every
step); only the task is a toy: the reward is 1 when the response's first token is ``TARGET``. A learning rate of 0,
or an engine that keeps its first weights while reporting new versions, fails these tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from trainers.advantages import group_advantages
from trainers.fsdp import token_logprobs
from trainers.grpo import pad_sequences
from trainers.losses import policy_loss
from workers.engines import HFEngine, SamplingParams
from workers.models import build_tiny_causal_lm

VOCAB, PAD, EOS, TARGET = 16, 0, 2, 7
PROMPTS = [[1, 5, 6], [1, 3], [1, 4, 4, 9]]
N = 8  # responses per prompt
LR = 3e-3


class StaleEngine(HFEngine):
    """An engine that reports every new version but keeps the weights it started with."""

    def update_weights(self, version, state_dict=None, path=None) -> None:
        self._version = version


@dataclass
class Loop:
    """The trained policy and, per step: the mean reward of the samples, the mean |engine - trainer| log-prob of the
    sampled tokens (the trainer's weights are the ones last sent), and the version the engine reported."""

    policy: torch.nn.Module
    rewards: list[float] = field(default_factory=list)
    logprob_gaps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def run_grpo(steps: int, lr: float = LR, engine_type: type[HFEngine] = HFEngine) -> Loop:
    policy = build_tiny_causal_lm(VOCAB, seed=0)
    engine = engine_type(copy.deepcopy(policy), pad_token_id=PAD, eos_token_id=EOS)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    loop = Loop(policy)
    for step in range(steps):
        groups = engine.generate(PROMPTS, n=N, params=SamplingParams(max_new_tokens=3, seed=step))
        prompts = [p for p, group in zip(PROMPTS, groups, strict=True) for _ in group]
        samples = [g for group in groups for g in group]
        batch = pad_sequences(prompts, [g.token_ids for g in samples], PAD)
        mask = batch["response_mask"]
        rollout = torch.zeros_like(mask)
        for i, (p, g) in enumerate(zip(prompts, samples, strict=True)):
            rollout[i, len(p) : len(p) + len(g.token_ids)] = torch.tensor(g.logprobs)
        logits = policy(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs = token_logprobs(logits, batch["input_ids"], batch["attention_mask"])
        loop.versions.append(engine.version)
        loop.logprob_gaps.append(float(((logprobs.detach() - rollout).abs() * mask).sum() / mask.sum()))
        rewards = torch.tensor([float(g.token_ids[0] == TARGET) for g in samples])
        loop.rewards.append(float(rewards.mean()))
        advantages = group_advantages(rewards, N)[:, None].expand_as(mask)
        loss, _ = policy_loss("grpo", logprobs, rollout, advantages, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        engine.update_weights(step + 1, {k: v.detach().clone() for k, v in policy.state_dict().items()})
    return loop


def target_probability(model: torch.nn.Module) -> float:
    """The model's mean probability, over the prompts, that a response starts with ``TARGET``."""
    with torch.no_grad():
        return float(sum(model(torch.tensor([p])).logits[0, -1].softmax(-1)[TARGET] for p in PROMPTS) / len(PROMPTS))


def test_grpo_raises_the_probability_of_rewarded_answers():
    loop = run_grpo(steps=30)
    first, last = sum(loop.rewards[:5]) / 5, sum(loop.rewards[-5:]) / 5
    # from about 1/16 (a random first token) to nearly always TARGET; with lr=0 the last five stay at ~0.05
    assert first < 0.2 and last > 0.7, loop.rewards
    assert target_probability(loop.policy) > 0.7 > 0.2 > target_probability(build_tiny_causal_lm(VOCAB, seed=0))


def test_the_engine_samples_from_the_weights_of_every_sync():
    loop = run_grpo(steps=12)
    assert loop.versions == list(range(12))
    assert loop.rewards[-1] > loop.rewards[0]  # the weights changed between syncs, so the check below has teeth
    # after each sync the engine's log-probs of its samples are the trainer's (float noise only)
    assert max(loop.logprob_gaps) < 1e-4, loop.logprob_gaps


def test_an_engine_that_keeps_its_first_weights_is_caught():
    loop = run_grpo(steps=12, engine_type=StaleEngine)
    assert loop.versions == list(range(12))  # it reports every version ...
    assert max(loop.logprob_gaps) > 1e-2, loop.logprob_gaps  # ... but samples from its first weights
