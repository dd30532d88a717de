"""The two-digit addition task: tokenizer, problems, reward and supervised batches."""

import re

import pytest
import torch

from workers.tasks.addition import (
    AdditionTask,
    AdditionTokenizer,
    addition_reward,
    build_model,
    make_prompts,
    sft_batch,
)


@pytest.fixture(scope="module")
def tokenizer():
    return AdditionTokenizer()


def test_tokenizer_vocabulary(tokenizer):
    assert tokenizer.vocab_size == 15
    specials = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert len(specials) == 3
    assert specials.isdisjoint(tokenizer.encode("0123456789+="))


@pytest.mark.parametrize("text", ["07+35=", "042", "", "99+99=198"])
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_decode_stops_at_eos_and_skips_pad_and_bos(tokenizer):
    ids = [tokenizer.bos_token_id, *tokenizer.encode("04"), tokenizer.pad_token_id, *tokenizer.encode("2")]
    assert tokenizer.decode([*ids, tokenizer.eos_token_id, *tokenizer.encode("7")]) == "042"


def test_encode_rejects_unknown_characters(tokenizer):
    with pytest.raises(ValueError, match="character 'a' in '1a' is not in the vocabulary"):
        tokenizer.encode("1a")


def test_decode_rejects_out_of_range_ids(tokenizer):
    with pytest.raises(ValueError, match=r"token id 15 is outside \[0, 15\)"):
        tokenizer.decode([3, 15])


def test_make_prompts_is_deterministic_and_well_formed(tokenizer):
    problems = make_prompts(50, seed=7)
    assert problems == make_prompts(50, seed=7)
    assert problems != make_prompts(50, seed=8)
    for problem in problems:
        assert re.fullmatch(r"\d\d\+\d\d=", problem["prompt"])
        a, b = int(problem["prompt"][:2]), int(problem["prompt"][3:5])
        assert problem["answer"] == f"{a + b:03d}"
        assert problem["prompt_ids"] == [tokenizer.bos_token_id, *tokenizer.encode(problem["prompt"])]


def test_make_prompts_rejects_negative_num():
    with pytest.raises(ValueError, match="num=-1 must be >= 0"):
        make_prompts(-1, seed=0)


@pytest.mark.parametrize(
    ("response", "reward"),
    [("042", 1.0), (" 042\n", 1.0), ("42", 0.0), ("0420", 0.0), ("043", 0.0), ("", 0.0), ("04", 0.0)],
)
def test_addition_reward(response, reward):
    assert addition_reward(response, "042") == reward


def test_reward_sees_only_tokens_before_eos(tokenizer):
    eos = tokenizer.eos_token_id
    assert addition_reward(tokenizer.decode([*tokenizer.encode("042"), eos, *tokenizer.encode("9")]), "042") == 1.0
    assert addition_reward(tokenizer.decode(tokenizer.encode("0429")), "042") == 0.0


def test_sft_batch_puts_the_loss_on_answer_and_eos_only(tokenizer):
    problems = make_prompts(4, seed=0)
    batch = sft_batch(problems, tokenizer)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (4, 11)
    first = problems[0]
    expected = [*first["prompt_ids"], *tokenizer.encode(first["answer"]), tokenizer.eos_token_id]
    assert batch["input_ids"][0].tolist() == expected
    assert batch["labels"][0].tolist() == [-100] * 7 + expected[7:]
    assert batch["attention_mask"].all()


def test_build_model_is_small_seeded_and_trains_on_sft_batches(tokenizer):
    model = build_model(tokenizer.vocab_size, seed=0)
    assert 80_000 < sum(p.numel() for p in model.parameters()) < 130_000
    assert model.config.max_position_embeddings == 32
    same = build_model(tokenizer.vocab_size, seed=0).state_dict()
    other = build_model(tokenizer.vocab_size, seed=1).state_dict()
    assert all(torch.equal(value, same[name]) for name, value in model.state_dict().items())
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"], other["model.embed_tokens.weight"])

    batch = sft_batch(make_prompts(16, seed=0), tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_the_policy_takes_longer_sequences_when_asked_and_refuses_fewer_than_an_answer_needs() -> None:
    assert AdditionTask().build_policy().config.max_position_embeddings == 32
    assert AdditionTask(max_positions=256).build_policy().config.max_position_embeddings == 256
    with pytest.raises(ValueError, match=r"max_positions must be at least 32 \(the longest prompt \+ answer\), got 8"):
        AdditionTask(max_positions=8)


def test_task_accuracy_counts_every_sample_of_every_prompt_alike(tokenizer):
    task = AdditionTask()
    prompts = [{"prompt_ids": [], "answer": "042"}, {"prompt_ids": [], "answer": "100"}]
    right, wrong = [*tokenizer.encode("042"), tokenizer.eos_token_id], tokenizer.encode("041")
    hundred = [*tokenizer.encode("100"), tokenizer.eos_token_id]
    # 2 of 4 samples right on the first prompt, 1 of 1 on the second: 3 of 5 responses
    assert task.accuracy(prompts, [[right, wrong, right, wrong], [hundred]]) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="accuracy: 2 prompts but responses for 1"):
        task.accuracy(prompts, [[right]])
    with pytest.raises(ValueError, match="accuracy: no responses to score"):
        task.accuracy(prompts, [[], []])
