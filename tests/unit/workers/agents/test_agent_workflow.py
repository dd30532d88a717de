"""TaskServerWorkflow against live task servers (fake ones in threads on 127.0.0.1): token-exact trajectories,
the hooks, balancing over several servers, and every failure path (failed start, timeout, malformed JSON, dead
server) ending the episode with a typed error and dropping its group whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import pytest

from tests.agent_fakes import ScriptedSampler, WordGame
from workers.agents.environment import environment_class
from workers.agents.servers import EpisodeStartError, MalformedResponse, ServerUnavailable, StepTimeout, TaskServerPool
from workers.agents.task_server import create_app, serve_in_background
from workers.agents.trajectory import PlainChatFormat
from workers.agents.workflow import TaskServerWorkflow, TurnFailed
from workers.engines.base import Generation, SamplingParams
from workers.engines.errors import EngineUnavailable

EOS = 1
CHARS = " abcdefghijklmnopqrstuvwxyz0123456789:\n"
BASE = 2
MERGED_AB = 100  # decodes to "ab", but "ab" encodes as [a, b]
ALT_A = 101  # decodes to "a", but "a" encodes as the canonical id


def encode(text: str) -> list[int]:
    return [BASE + CHARS.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    special = {MERGED_AB: "ab", ALT_A: "a", EOS: "", 0: ""}
    return "".join(special[i] if i in special else CHARS[i - BASE] for i in ids)


CHAT = PlainChatFormat(encode, decode)
PARAMS = SamplingParams(max_new_tokens=8)


def workflow(url, **kwargs) -> TaskServerWorkflow:
    kwargs.setdefault("timeout", 5.0)
    return TaskServerWorkflow(url, CHAT, PARAMS, **kwargs)


def run(coro):
    return asyncio.run(coro)


def test_the_ids_trained_on_are_the_ids_sampled_even_when_decode_encode_does_not_round_trip():
    assert encode(decode([MERGED_AB, ALT_A])) != [MERGED_AB, ALT_A]  # the tokenizer really does not round-trip
    game = WordGame()
    turn1 = ([MERGED_AB, ALT_A, EOS], [-0.1, -0.2, -0.3])  # "aba": wrong
    turn2 = ([*encode("cab"), EOS], [-0.4, -0.5, -0.6, -0.7])  # right
    sampler = ScriptedSampler([turn1, turn2], version=3, stop_id=EOS)
    with serve_in_background(game.app()) as url:
        flow = workflow(url)
        t = run(flow.run_episode(sampler, "s:cab"))
    prompt = encode("user: guess 3\nassistant: ")
    reply = encode("\nuser: no: aba\nassistant: ")
    assert game.actions == ["aba", "cab"]
    assert t.tokens == prompt + turn1[0] + reply + turn2[0]
    assert t.loss_mask == [0] * len(prompt) + [1] * 3 + [0] * len(reply) + [1] * 4
    assert t.logprobs == [0.0] * len(prompt) + turn1[1] + [0.0] * len(reply) + turn2[1]
    # the history is never re-tokenised: turn 2 was sampled from exactly the tokens of turn 1 plus the reply
    assert sampler.prompts == [prompt, prompt + turn1[0] + reply]
    assert (t.reward, t.num_turns, t.success, t.policy_version, t.finish_reason) == (1.0, 2, True, 3, "done")


class ShapedWorkflow(TaskServerWorkflow):
    """The seed's CustomOSWorkflow."""

    def format_observation_to_messages(self, observation, history):
        return history + [{"role": "user", "content": "obs " + observation["content"]}]  # noqa: RUF005 (the seed)

    def postprocess_reward(self, reward, num_turns, info):
        return reward + 1.0 / num_turns if info.get("success") else reward


def test_a_subclass_overriding_the_hooks_changes_the_rollouts():
    sampler = ScriptedSampler([(encode("x"), [-1.0]), (encode("ab"), [-1.0, -1.0])])
    with serve_in_background(WordGame().app()) as url:
        flow = ShapedWorkflow(url, CHAT, PARAMS, timeout=5.0)
        t = run(flow.run_episode(sampler, "s:ab"))
    assert CHAT.decode(t.tokens[: t.prompt_len]) == "user: obs guess 2\nassistant: "
    assert "user: obs no: x" in CHAT.decode(t.tokens)
    assert t.reward == pytest.approx(1.5)


def test_max_turns_and_max_total_tokens_end_the_trajectory_and_say_why():
    sampler = ScriptedSampler([(encode("zz"), [-1.0, -1.0])])
    game = WordGame(max_turns=10)
    with serve_in_background(game.app()) as url:
        t = run(workflow(url, max_turns=2).run_episode(sampler, "s:ab"))
        assert (t.finish_reason, t.num_turns, t.reward, t.success) == ("max_turns", 2, 0.0, False)
        short = run(workflow(url, max_total_tokens=30).run_episode(sampler, "s:ab"))
    assert len(short.tokens) == 30 and short.finish_reason == "max_tokens"
    assert len(game.cancelled) == 2  # neither episode was done on the server: both were cancelled


def test_episodes_balance_over_servers_least_busy_and_stay_on_their_server():
    games = [WordGame(), WordGame()]
    sampler = ScriptedSampler([(encode("no"), [-1.0, -1.0]), (encode("ab"), [-1.0, -1.0])])
    with serve_in_background(games[0].app()) as a, serve_in_background(games[1].app()) as b:
        flow = workflow([a, b])
        groups = run(flow.run_groups(sampler, ["s:ab", "t:ab"], n=4))
    assert all(g.trajectories is not None and len(g.trajectories) == 4 for g in groups)
    assert [len(g.started) for g in games] == [4, 4]
    assert [len(g.actions) for g in games] == [8, 8]  # each episode's two steps went to the server that started it
    assert flow.pool.active == {a: 0, b: 0}


def test_a_failed_start_is_retried_on_another_server():
    games = [WordGame(fail_starts=100), WordGame()]
    sampler = ScriptedSampler([(encode("ab"), [-1.0, -1.0])])
    with serve_in_background(games[0].app()) as a, serve_in_background(games[1].app()) as b:
        t = run(workflow([a, b]).run_episode(sampler, "s:ab"))
        assert t.success and len(games[1].started) == 1
        with pytest.raises(EpisodeStartError, match=r"no task server could start sample 's:ab'.*500"):
            run(workflow(a).run_episode(sampler, "s:ab"))


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [("SLEEP", StepTimeout, "timed out after 0.5 s"), ("GARBAGE", MalformedResponse, "answered non-JSON")],
)
def test_a_step_timeout_or_malformed_json_ends_the_episode_with_a_typed_error_and_drops_the_group(
    action, error, match, caplog
):
    game = WordGame()
    sampler = ScriptedSampler([(encode("x"), [-1.0])])
    with serve_in_background(game.app()) as url:
        # the model "says" the action whatever it sampled: the fake server misbehaves on it
        flow = TaskServerWorkflow(url, PlainChatFormat(encode, lambda ids: action), PARAMS, timeout=0.5)
        with pytest.raises(error, match=match):
            run(flow.run_episode(sampler, "s:ab"))
        group = run(flow.run_group(sampler, "s:ab", n=3))
    assert group.trajectories is None and group.error.startswith(error.__name__)
    assert flow.stats.dropped_groups == 1 and flow.stats.errors == {error.__name__: 1}
    assert f"dropping the group of sample 's:ab': an episode failed with {error.__name__}" in caplog.text
    assert len(game.cancelled) == 4  # the failed episode (x2 runs) and its siblings were cancelled on the server


def test_a_server_that_dies_is_skipped_and_its_episodes_end_their_groups():
    games = [WordGame(), WordGame()]
    sampler = ScriptedSampler([(encode("no"), [-1.0, -1.0]), (encode("ab"), [-1.0, -1.0])])
    with serve_in_background(games[0].app()) as a, contextlib.ExitStack() as dying:
        b = dying.enter_context(serve_in_background(games[1].app()))
        flow = workflow([a, b])
        pool: TaskServerPool = flow.pool

        async def scenario():
            first = await pool.start("s:ab")
            second = await pool.start("s:ab")
            assert {first.server, second.server} == {a, b}
            dead = next(e for e in (first, second) if e.server == b)
            dying.close()  # server b goes away mid-episode
            with pytest.raises(ServerUnavailable, match=f"{b}/api/episode/step failed"):
                await pool.step(dead, {"type": "text", "content": "x"})
            await pool.finish(dead, cancel=True)
            assert pool.healthy == {a: True, b: False}
            return await flow.run_groups(sampler, ["s:ab"], n=3)

        groups = run(scenario())
    assert groups[0].trajectories is not None and len(games[0].started) == 4


class BinarySearchPolicy:
    """A TokenSampler that plays guess-number perfectly: it reads the feedback in its prompt and bisects."""

    async def sample(self, prompt_ids, params):
        lo, hi = 1, 16
        lines = decode(prompt_ids).split("\n")
        for said, heard in zip(lines[1::2], lines[2::2], strict=False):
            guess = int(said.removeprefix("assistant: "))
            lo, hi = (guess + 1, hi) if heard == "user: higher" else (lo, guess - 1)
        ids = encode(str((lo + hi) // 2))
        return 0, Generation([*ids, EOS], [-0.5] * (len(ids) + 1), "stop")


def test_the_workflow_plays_the_real_guess_number_server_to_the_end():
    app = create_app(environment_class("guess-number"))
    with serve_in_background(app) as url:
        flow = workflow(url, max_turns=6)
        groups = run(flow.run_groups(BinarySearchPolicy(), ["game-00", "game-05", "game-11"], n=2))
    trajectories = [t for g in groups for t in g.trajectories]
    assert all(t.success and t.reward == 1.0 and t.finish_reason == "done" for t in trajectories)
    assert all(1 <= t.num_turns <= 5 for t in trajectories) and max(t.num_turns for t in trajectories) > 1
    for t in trajectories:  # every model turn is its guess's digits then EOS, with mask 1; the rest mask 0
        trained = [tok for tok, m in zip(t.tokens, t.loss_mask, strict=True) if m]
        assert trained.count(EOS) == t.num_turns and decode(trained).isdigit()


def test_a_broken_connection_to_a_live_server_is_retried_once_and_does_not_mark_it_dead():
    import httpx

    with serve_in_background(WordGame().app()) as url:
        pool = TaskServerPool(url, timeout=5.0)

        async def scenario(breaks: int):
            episode = await pool.start("s:ab")
            real, left = pool.client.request, [breaks]

            async def breaking(method, endpoint, **kwargs):
                if "/episode/step" in endpoint and left[0] > 0:
                    left[0] -= 1
                    raise httpx.ReadError("")  # what reusing a connection the server just closed looks like
                return await real(method, endpoint, **kwargs)

            pool.client.request = breaking
            try:
                return await pool.step(episode, {"type": "text", "content": "ab"})
            finally:
                pool.client.request = real

        result = run(scenario(breaks=1))
        assert result.done and result.reward == 1.0 and pool.healthy[url]
        with pytest.raises(ServerUnavailable, match="episode/step failed: ReadError"):
            run(scenario(breaks=2))
        assert pool.healthy[url]


def test_a_step_whose_reply_was_lost_after_the_server_applied_it_is_retried_without_a_second_step():
    import httpx

    with serve_in_background(create_app(environment_class("guess-number"))) as url:  # the real server
        pool = TaskServerPool(url, timeout=5.0)

        async def scenario():
            episode = await pool.start("game-05")  # hides 7
            real, sent = pool.client.request, []

            async def lose_the_first_reply(method, endpoint, **kwargs):
                response = await real(method, endpoint, **kwargs)
                if "/episode/step" in endpoint:
                    sent.append(kwargs["json"])
                    if len(sent) == 1:  # applied (the episode is now done), but the reply never arrives
                        raise httpx.ReadError("")
                return response

            pool.client.request = lose_the_first_reply
            try:
                return await pool.step(episode, {"type": "text", "content": "7"}), sent
            finally:
                pool.client.request = real

        result, sent = run(scenario())
    assert result.done and result.reward == 1.0  # the winning step's reply, not "episode ... is already done"
    assert len(sent) == 2 and sent[0] == sent[1] and len(sent[0]["request_id"]) == 32


def test_a_step_reply_missing_the_protocols_fields_is_malformed():
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/api/episode/start")
    async def start(body: dict) -> dict:
        return {"episode_id": "e1", "observation": {"type": "text", "content": "hi"}, "reward": 0, "done": False,
                "info": {}}  # fmt: skip

    @app.post("/api/episode/step")
    async def step(body: dict) -> dict:
        return {"episode_id": "e1", "observation": None, "done": False}  # no reward, no info

    with serve_in_background(app) as url:
        pool = TaskServerPool(url, timeout=5.0)

        async def scenario():
            episode = await pool.start("s")
            await pool.step(episode, {"type": "text", "content": "x"})

        with pytest.raises(MalformedResponse, match=r"a step of episode e1 that is not the protocol's EpisodeResponse"):
            run(scenario())


class FailingOnLongWords:
    """A ScriptedSampler that raises ``error`` on the first turn of one episode of a 3-letter word (prompt
    "guess 3"); every other turn is scripted."""

    def __init__(self, error: Exception):
        self.error = error
        self.inner = ScriptedSampler([(encode("no"), [-1.0, -1.0]), (encode("ab"), [-1.0, -1.0])])
        self.raised = 0

    async def sample(self, prompt_ids, params):
        if decode(prompt_ids).startswith("user: guess 3") and not self.raised:
            self.raised += 1
            raise self.error
        await asyncio.sleep(0.05)  # siblings are still playing when the failing turn raises
        return await self.inner.sample(prompt_ids, params)


@pytest.mark.parametrize(
    "error",
    [EngineUnavailable("engine at http://127.0.0.1:1 refused the connection"), ValueError("prompt_ids is empty")],
    ids=["engine-unavailable", "value-error"],
)
def test_an_engine_or_sampler_error_costs_its_group_and_cancels_its_siblings_but_not_the_step(error, caplog):
    game = WordGame()
    with serve_in_background(game.app()) as url:
        flow = workflow(url)
        groups = run(flow.run_groups(FailingOnLongWords(error), ["s:ab", "t:abc"], n=3))
    kept, dropped = groups
    assert kept.trajectories is not None and len(kept.trajectories) == 3  # the run goes on: the other group trains
    assert dropped.trajectories is None
    assert dropped.error.startswith("TurnFailed: episode ") and f"{type(error).__name__}: {error}" in dropped.error
    assert (flow.stats.groups, flow.stats.dropped_groups, flow.stats.errors) == (1, 1, {"TurnFailed": 1})
    assert game.episodes == {}  # nothing is left open on the server: the failed episode and its siblings were cancelled
    assert len(game.cancelled) == 3
    assert "dropping the group of sample 't:abc': an episode failed with TurnFailed" in caplog.text


def test_a_failed_turn_ends_its_episode_with_a_typed_error_naming_episode_server_and_cause():
    game = WordGame()
    with serve_in_background(game.app()) as url:
        expected = rf"episode \w+ of sample 't:abc' on {url} failed at turn 1: ValueError: bad"
        with pytest.raises(TurnFailed, match=expected):
            run(workflow(url).run_episode(FailingOnLongWords(ValueError("bad")), "t:abc"))
    assert game.episodes == {} and len(game.cancelled) == 1


def test_a_start_whose_reply_was_lost_after_the_server_started_it_is_retried_without_a_second_episode():
    import httpx

    app = create_app(environment_class("guess-number"))
    with serve_in_background(app) as url:  # the real server
        pool = TaskServerPool(url, timeout=5.0)

        async def scenario():
            real, sent = pool.client.request, []

            async def lose_the_first_reply(method, endpoint, **kwargs):
                response = await real(method, endpoint, **kwargs)
                if "/episode/start" in endpoint:
                    sent.append(kwargs["json"])
                    if len(sent) == 1:  # started (a sandbox is held for it), but the reply never arrives
                        raise httpx.ReadError("")
                return response

            pool.client.request = lose_the_first_reply
            try:
                return await pool.start("game-05"), sent
            finally:
                pool.client.request = real

        episode, sent = run(scenario())
        assert len(app.state.task_server.table) == 1  # one episode on the server, the one the retry was answered
        app.state.task_server.table.get(episode.episode_id)  # live (an unknown id raises)
    assert len(sent) == 2 and sent[0] == sent[1] and len(sent[0]["request_id"]) == 32


def free_port_url() -> str:
    import socket

    with socket.socket() as sock:  # bound then closed: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_unreachable_server_is_named_with_the_error_it_gave():
    dead = free_port_url()
    sampler = ScriptedSampler([(encode("ab"), [-1.0, -1.0])])
    flow = workflow(dead)
    with pytest.raises(EpisodeStartError, match=rf"no task server could start sample 's:ab': {dead}: .*ConnectError"):
        run(flow.run_episode(sampler, "s:ab"))  # tried: the call fails and the server is marked dead
    (group,) = run(flow.run_groups(sampler, ["s:ab"], n=2))  # marked dead by the health check: not tried
    assert group.trajectories is None
    assert f"{dead}: not tried, not healthy: GET {dead}/api/health failed: ConnectError" in group.error


def test_a_start_refused_at_max_episodes_is_retried_with_backoff_until_a_slot_frees():
    app = create_app(environment_class("guess-number"), max_episodes=2)
    with serve_in_background(app) as url:
        flow = workflow(url, max_turns=6)
        groups = run(flow.run_groups(BinarySearchPolicy(), ["game-00", "game-05", "game-11", "game-03"], n=2))
    assert [g.error for g in groups] == [None] * 4 and flow.stats.dropped_groups == 0


def test_a_start_refused_at_max_episodes_gives_up_after_start_wait():
    app = create_app(environment_class("guess-number"), max_episodes=1)
    with serve_in_background(app) as url:
        pool = TaskServerPool(url, timeout=5.0, start_wait=0.3)

        async def scenario():
            await pool.start("game-00")  # holds the server's only slot
            await pool.start("game-01")

        with pytest.raises(EpisodeStartError, match=rf"within start_wait=0.3 s: {url}: .* answered 503: 1 episodes"):
            run(scenario())


def test_the_backoff_between_start_retries_doubles_is_jittered_and_bounded():
    import random

    from workers.agents.servers import start_backoff

    rng = random.Random(0)
    delays = [start_backoff(attempt, rng) for attempt in range(12)]
    bounds = [min(0.05 * 2**a, 2.0) for a in range(12)]
    assert all(b / 2 <= d <= b for d, b in zip(delays, bounds, strict=True))
    assert len(set(delays)) == 12 and max(delays) <= 2.0


def test_a_complete_final_turn_that_exactly_fills_max_total_tokens_is_sent_to_the_environment():
    prompt = encode("user: guess 2\nassistant: ")
    game = WordGame()
    sampler = ScriptedSampler([([*encode("ab"), EOS], [-1.0] * 3)], stop_id=EOS)
    with serve_in_background(game.app()) as url:
        t = run(workflow(url, max_total_tokens=len(prompt) + 3).run_episode(sampler, "s:ab"))
    assert game.actions == ["ab"]  # the complete answer reached the environment and was scored
    assert (t.reward, t.success, t.finish_reason, len(t.tokens)) == (1.0, True, "done", len(prompt) + 3)
    assert game.cancelled == []


def test_a_final_turn_cut_short_by_max_total_tokens_is_trained_on_but_never_sent():
    prompt = encode("user: guess 2\nassistant: ")
    game = WordGame()
    sampler = ScriptedSampler([([*encode("ab"), EOS], [-1.0] * 3)], stop_id=EOS)
    with serve_in_background(game.app()) as url:
        t = run(workflow(url, max_total_tokens=len(prompt) + 2).run_episode(sampler, "s:ab"))
    assert game.actions == []  # "ab" without its end: the budget cut it, so the environment never sees it
    assert (t.finish_reason, t.tokens[len(prompt) :], t.loss_mask[len(prompt) :]) == (
        "max_tokens",
        encode("ab"),
        [1, 1],
    )
    assert len(game.cancelled) == 1


def test_an_episode_cancelled_while_its_start_waits_for_a_busy_server_stops_waiting(caplog):
    caplog.set_level(logging.DEBUG, logger="workers.agents.servers")
    app = create_app(environment_class("guess-number"), max_episodes=1)
    with serve_in_background(app) as url:
        flow = workflow(url, start_wait=120.0)

        async def scenario():
            await flow.pool.start("game-00")  # holds the server's only slot
            waiting = asyncio.create_task(flow.run_episode(BinarySearchPolicy(), "game-01"))
            while "answered 503" not in caplog.text:
                await asyncio.sleep(0.01)
            waiting.cancel()  # its group was dropped: the start gives up now, not after start_wait
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(waiting, timeout=30.0)

        run(scenario())
        assert len(app.state.task_server.table) == 1  # only the episode holding the slot
