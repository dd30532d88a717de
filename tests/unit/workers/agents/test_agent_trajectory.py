"""Multi-turn trajectories: the builder's budget, Samples as queue fields, and the trainer honouring ``loss_mask``
(hand-computed loss and KL on a 2-turn trajectory whose environment tokens would dominate both if they leaked)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from orchestration.config import RLConfig
from rl_contracts.rows import rows_of
from rl_contracts.trajectories import split_trajectories
from trainers.config import TrainConfig, TrainerConfig
from trainers.grpo import build_train_batch
from trainers.losses import policy_loss
from workers.agents.trajectory import Sample, TrajectoryBuilder, samples_to_fields

# prompt [11, 12] | model turn 1 [21, 22] | env reply [31, 32] | model turn 2 [23]
TOKENS = [11, 12, 21, 22, 31, 32, 23]
MASK = [0, 0, 1, 1, 0, 0, 1]
LOGPROBS = [0.0, 0.0, -0.5, -0.7, 0.0, 0.0, -0.2]


def test_the_builder_marks_model_turns_and_env_replies_and_truncates_at_the_budget():
    b = TrajectoryBuilder([11, 12], max_total_tokens=7)
    assert b.add_model_turn([21, 22], [-0.5, -0.7], version=4)
    assert b.add_env_reply([31, 32])
    assert not b.add_model_turn([23, 24], [-0.2, -0.9], version=3)  # one token over: cut, and full
    t = b.build(reward=1.0)
    assert (t.tokens, t.loss_mask, t.logprobs) == (TOKENS, MASK, LOGPROBS)
    assert (t.num_turns, t.policy_version, t.prompt_len) == (2, 3, 2)  # the oldest version that sampled a turn
    exact = TrajectoryBuilder([11, 12], max_total_tokens=4)
    assert exact.add_model_turn([21, 22], [-0.5, -0.7], version=0) and exact.room == 0  # fits whole: it is sent
    with pytest.raises(ValueError, match="a turn has 2 tokens but 1 log-probs"):
        TrajectoryBuilder([1], 9).add_model_turn([1, 2], [0.0], version=0)
    with pytest.raises(ValueError, match="the first observation is 3 tokens, max_total_tokens=3 leaves no room"):
        TrajectoryBuilder([1, 2, 3], 3)


def test_samples_travel_as_jagged_fields_and_split_back_into_prompt_and_masked_response():
    sample = Sample("p", "r", TOKENS, [float(m) for m in MASK], 1.0, {"num_turns": 2, "success": True}, LOGPROBS)
    fields = samples_to_fields([sample, Sample("q", "s", [5, 6], [0.0, 1.0], 0.0)])
    assert rows_of(fields["tokens"]) == [TOKENS, [5, 6]]
    assert fields["num_turns"].tolist() == [2, 1] and fields["success"].tolist() == [True, False]
    prompts, responses, lps, masks = split_trajectories([TOKENS], [MASK], [LOGPROBS])
    assert lps == [[-0.5, -0.7, 0.0, 0.0, -0.2]]
    assert (prompts, responses, masks) == ([[11, 12]], [[21, 22, 31, 32, 23]], [[1, 1, 0, 0, 1]])
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        Sample("p", "r", [1, 2], [1.0])


def test_losses_and_kl_honour_the_loss_mask_on_a_two_turn_trajectory():
    rows = [TOKENS, [11, 12, 21, 22, 31, 32, 24]]
    data = TensorDict(
        samples_to_fields(
            [
                Sample("", "", rows[0], [float(m) for m in MASK], 1.0, {"policy_version": 0}, LOGPROBS),
                Sample("", "", rows[1], [float(m) for m in MASK], 0.0, {"policy_version": 0}, LOGPROBS),
            ]
        ),
        batch_size=[2],
    )
    config = TrainerConfig.from_run(RLConfig(prompts_per_step=1, n_samples=2, train=TrainConfig(world_size=1)))
    batch = build_train_batch(
        data, np.array([0, 0]), pad_token_id=0, trainer_version=0, max_staleness=0, config=config
    ).tensors
    assert batch["response_mask"].tolist() == [MASK, MASK]
    assert batch["old_logprobs"].tolist() == [pytest.approx(LOGPROBS)] * 2
    adv = batch["advantages"].tolist()
    assert adv == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)  # (1 - 0.5) / std([1, 0]) + eps

    # current policy: +0.1 over the sampled log-probs on the trained tokens; wild values on the env tokens
    logprobs = torch.tensor([[0.0, 0.0, -0.4, -0.6, -50.0, 40.0, -0.1]] * 2)
    ref = torch.tensor([[0.0, 0.0, -0.5, -0.5, 30.0, -60.0, -0.3]] * 2)
    loss, metrics = policy_loss(
        "ppo", logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"],
        ref_logprobs=ref, kl_coef=0.5, kl_kind="k3", clip_low=0.2, clip_high=0.2, loss_agg="token-mean",
    )  # fmt: skip
    ratio = math.exp(0.1)  # inside the clip range: the surrogate is -A * r on each trained token
    pg = sum(-a * ratio * 3 for a in adv) / 6  # 3 trained tokens per row, token-mean over 6
    d = [-0.1, 0.1, -0.2]  # ref - logprobs on the trained tokens
    kl = 2 * sum(math.exp(x) - x - 1 for x in d) / 6
    assert metrics["pg_loss"] == pytest.approx(pg, abs=1e-6)
    assert metrics["kl"] == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(pg + 0.5 * kl, abs=1e-6)


class ByteChatTokenizer:
    """A tokenizer with a ChatML chat template (rendered by jinja2, as transformers does) over raw bytes."""

    chat_template = (
        "{% if messages[0].role != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        import jinja2

        assert not tokenize
        return jinja2.Template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text, add_special_tokens):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode()


def test_hf_chat_format_templates_the_first_prompt_once_and_appends_only_the_new_turns():
    from workers.agents.trajectory import HFChatFormat

    chat = HFChatFormat(ByteChatTokenizer())
    first = chat.decode(chat.prompt_ids([{"role": "user", "content": "count files"}]))
    assert (
        first
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\ncount files<|im_end|>\n<|im_start|>assistant\n"
    )
    reply = chat.decode(chat.append_ids([{"role": "user", "content": "3"}]))
    assert reply == "<|im_start|>user\n3<|im_end|>\n<|im_start|>assistant\n"  # no second system prompt
    with pytest.raises(ValueError, match="has no chat_template; use PlainChatFormat"):
        HFChatFormat(object())
