"""Custom rollout functions (``rollout.generate_fn`` / ``filter_fn`` / ``reward_fn``): loading with config kwargs and
context, groups kept whole or dropped whole, the built-in single-turn and task-server rollouts as such functions,
and a task server started as an owned subprocess."""

from __future__ import annotations

import asyncio
import os

import pytest

from workers.agents.environment import environment_class
from workers.agents.rollout_fns import collect_groups, load_rollout_fn, single_turn_generate
from workers.agents.server_process import TaskServerError, TaskServerProcess
from workers.agents.task_server import create_app, serve_in_background
from workers.agents.trajectory import Sample
from workers.engines.base import Generation, SamplingParams
from workers.engines.errors import EngineUnavailable
from workers.tasks.guess_number import GuessNumberTask

PARAMS = SamplingParams(max_new_tokens=2)


async def two_per_prompt(prompts, engine, *, n_samples, bonus=0.0):
    """A custom generate_fn: group 1 comes back one sample short."""
    out = []
    for i, _ in enumerate(prompts):
        for _ in range(n_samples - (i == 1)):
            out.append(Sample("p", "r", [5, 6], [0.0, 1.0], bonus, {"group": i}))
    return out


def keep_if_any_reward(samples):
    return any(s.reward > 0 for s in samples)


async def score_by_length(sample):
    return float(len(sample.tokens))


def test_a_generate_fn_is_loaded_with_its_kwargs_and_the_context_it_names():
    fn = load_rollout_fn(f"{__name__}:two_per_prompt", {"bonus": 1.0}, n_samples=2, sampling=PARAMS, task=None)
    samples = asyncio.run(fn([{}, {}, {}], engine=None))
    assert len(samples) == 5 and all(s.reward == 1.0 for s in samples)  # sampling/task not in its signature: unsent
    with pytest.raises(ValueError, match=r"module '[\w.]*test_rollout_fns' has no 'nope'"):
        load_rollout_fn(f"{__name__}:nope")
    with pytest.raises(ValueError, match=r"'os:sep' is a str, expected a function"):
        load_rollout_fn("os:sep")


def test_groups_are_kept_whole_dropped_whole_when_short_and_filtered_by_filter_fn():
    fn = load_rollout_fn(f"{__name__}:two_per_prompt", n_samples=2)
    groups, stats = asyncio.run(collect_groups(fn, [{}, {}, {}], None, 2))
    assert [g is None for g in groups] == [False, True, False]
    assert (stats.groups, stats.dropped_groups, stats.filtered_groups) == (2, 1, 0)
    groups, stats = asyncio.run(collect_groups(fn, [{}, {}, {}], None, 2, score_by_length, keep_if_any_reward))
    assert [s.reward for s in groups[0]] == [2.0, 2.0] and stats.groups == 2
    groups, stats = asyncio.run(collect_groups(fn, [{}, {}], None, 2, None, keep_if_any_reward))
    assert groups == [None, None] and (stats.dropped_groups, stats.filtered_groups) == (1, 1)


class FakeSampler:
    async def sample(self, prompt_ids, params):
        return 7, Generation([3, 4], [-0.1, -0.2], "length")


class AddOne:
    reward_fields = ("answer",)

    def decode(self, ids):
        return " ".join(map(str, ids))

    def reward(self, text, answer):
        return float(text == answer)


def test_the_built_in_single_turn_rollout_is_a_generate_fn():
    prompts = [{"prompt_ids": [1, 2], "answer": "3 4"}, {"prompt_ids": [9], "answer": "0"}]
    samples = asyncio.run(single_turn_generate(prompts, FakeSampler(), n_samples=2, sampling=PARAMS, task=AddOne()))
    assert [s.metadata["group"] for s in samples] == [0, 0, 1, 1]
    assert samples[0].tokens == [1, 2, 3, 4] and samples[0].loss_mask == [0.0, 0.0, 1.0, 1.0]
    assert samples[0].logprobs == [0.0, 0.0, -0.1, -0.2] and samples[0].metadata["policy_version"] == 7
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]


def test_the_built_in_task_server_rollout_is_a_generate_fn_over_a_live_server():
    task = GuessNumberTask()
    with serve_in_background(create_app(environment_class("guess-number"))) as url:
        fn = load_rollout_fn(
            "workers.agents.rollout_fns:task_server_generate", {"task_server_url": [url], "max_turns": 6},
            n_samples=2, sampling=PARAMS, task=task,
        )  # fmt: skip
        groups, stats = asyncio.run(
            collect_groups(fn, [{"sample_id": "game-03"}, {"sample_id": "game-99"}], _Bisect(), 2)
        )
    assert stats.groups == 1 and stats.dropped_groups == 1  # game-99 is unknown: 404 on start, its group dropped
    assert all(s.metadata["success"] and s.reward == 1.0 for s in groups[0])
    assert task.tokenizer.decode(groups[0][0].tokens[:11]) == "user: game 4 guess a number from 1 to 16 assistant:"


class _Bisect:
    """A TokenSampler that plays guess-number perfectly over the task's word tokenizer (it bisects on feedback)."""

    tok = GuessNumberTask().tokenizer

    async def sample(self, prompt_ids, params):
        lo, hi = 1, 16
        # "user: game 4 guess a number from 1 to 16 assistant: 8 user: higher assistant: 12 user: lower assistant:"
        for turn in self.tok.decode(prompt_ids).split("assistant:")[1:-1]:
            guess, _, heard = turn.split()[:3]
            lo, hi = (int(guess) + 1, hi) if heard == "higher" else (lo, int(guess) - 1)
        return 0, Generation([*self.tok.encode(str((lo + hi) // 2)), 1], [-0.5, -0.5], "stop")


class _EngineDownForGame8(_Bisect):
    """_Bisect, but the engine is unreachable for the turns of game-07 ("game 8")."""

    async def sample(self, prompt_ids, params):
        if "game 8 " in self.tok.decode(prompt_ids):
            raise EngineUnavailable("engine at http://127.0.0.1:1 refused the connection")
        return await super().sample(prompt_ids, params)


def test_an_engine_error_in_one_group_is_counted_as_that_group_dropped_and_the_step_goes_on():
    task = GuessNumberTask()
    app = create_app(environment_class("guess-number"))
    with serve_in_background(app) as url:
        fn = load_rollout_fn(
            "workers.agents.rollout_fns:task_server_generate", {"task_server_url": [url], "max_turns": 6},
            n_samples=2, sampling=PARAMS, task=task,
        )  # fmt: skip
        prompts = [{"sample_id": "game-03"}, {"sample_id": "game-07"}, {"sample_id": "game-11"}]
        groups, stats = asyncio.run(collect_groups(fn, prompts, _EngineDownForGame8(), 2))
        assert len(app.state.task_server.table) == 0  # the failed group's episodes were all cancelled on the server
    assert [g is None for g in groups] == [False, True, False]
    assert (stats.groups, stats.dropped_groups) == (2, 1)  # the step's dropped_groups metric


def test_a_task_server_process_is_owned_healthy_then_gone_and_a_bad_one_reports_its_log():
    with TaskServerProcess("guess-number") as server:
        assert server.url.startswith("http://127.0.0.1:")
        pid = server.process.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(
        TaskServerError,
        match=r"(?s)task server 'no-such-env' not healthy within 30 s \(exited with 2\).*no environment named",
    ):
        TaskServerProcess("no-such-env", start_timeout=30)
