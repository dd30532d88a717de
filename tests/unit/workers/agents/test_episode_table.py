"""EpisodeTable on a fake clock: admission, the turn limit, idle expiry and why an id no longer steps."""

from __future__ import annotations

import asyncio

import pytest

from workers.agents import episodes as episodes_module
from workers.agents.environment import Step
from workers.agents.envs.guess_number import GuessNumberEnvironment
from workers.agents.episodes import (
    BadRequest,
    EnvironmentFailure,
    EpisodeTable,
    TooManyEpisodes,
    UnknownEpisode,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(**kwargs: object) -> tuple[EpisodeTable, Clock]:
    clock = Clock()
    return EpisodeTable(clock=clock, **kwargs), clock  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_episodes": 0}, r"max_episodes=0 must be >= 1"), ({"idle_timeout": 0.0}, r"idle_timeout=0.0 must be > 0")],
)
def test_settings_are_validated(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EpisodeTable(**kwargs)  # type: ignore[arg-type]


def test_admission_stops_at_max_episodes_and_resumes_when_one_ends() -> None:
    episodes, _ = table(max_episodes=2)
    first = episodes.open("a", GuessNumberEnvironment(), 3)
    episodes.open("b", GuessNumberEnvironment(), 3)
    with pytest.raises(TooManyEpisodes, match=r"2 episodes are running, the server's --max-episodes=2"):
        episodes.open("c", GuessNumberEnvironment(), 3)
    assert episodes.end(first, "cancelled") is first.environment
    assert episodes.end(first, "cancelled") is None  # ended once: its environment is closed once
    episodes.open("c", GuessNumberEnvironment(), 3)
    with pytest.raises(UnknownEpisode, match=r"is no longer running: cancelled"):
        episodes.get(first.episode_id)


def test_turn_limit_and_terminal_info() -> None:
    episodes, _ = table()
    episode = episodes.open("a", GuessNumberEnvironment(), 2)
    assert episodes.record_step(episode, Step("higher", 0.0, False, {"valid": True})) == (
        False,
        {"valid": True, "turn": 1},
    )
    done, info = episodes.record_step(episode, Step("lower", 0.0, False, {}))
    assert done and info == {"turn": 2, "truncated": True, "success": False, "num_turns": 2}
    with pytest.raises(BadRequest, match=r"is already done"):
        episodes.get(episode.episode_id)


@pytest.mark.parametrize("bad", [("x", float("nan"), False, {}), ("x", 1.0, False, []), (3, 1.0, True, {}), "x"])
def test_malformed_steps_are_environment_failures(bad: object) -> None:
    episodes, _ = table()
    episode = episodes.open("a", GuessNumberEnvironment(), 2)
    with pytest.raises(EnvironmentFailure, match=r"expected Step\(observation: str \| None, reward: finite float"):
        episodes.record_step(episode, bad)  # type: ignore[arg-type]


def test_idle_episodes_expire_but_not_while_a_call_is_in_flight() -> None:
    episodes, clock = table(idle_timeout=10.0)
    idle = episodes.open("a", GuessNumberEnvironment(), 3)
    busy = episodes.open("b", GuessNumberEnvironment(), 3)
    clock.now = 9.0
    assert episodes.expire_idle() == []
    episodes.get(idle.episode_id)  # a call restarts its idle clock
    clock.now = 15.0
    asyncio.run(busy.lock.acquire())
    assert episodes.expire_idle() == []  # idle has 4 s left; busy has a call in flight
    clock.now = 19.5
    assert episodes.expire_idle() == [idle]
    with pytest.raises(UnknownEpisode, match=r"no longer running: expired after 10 s without a call"):
        episodes.get(idle.episode_id)
    assert len(episodes) == 1
    assert episodes.drain() == [busy] and len(episodes) == 0


def test_ended_ids_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(episodes_module, "_ENDED_KEPT", 2)
    episodes, _ = table()
    opened = [episodes.open(str(i), GuessNumberEnvironment(), 1) for i in range(3)]
    for episode in opened:
        episodes.end(episode, "cancelled")
    with pytest.raises(UnknownEpisode, match=r"unknown episode_id="):
        episodes.get(opened[0].episode_id)
    with pytest.raises(UnknownEpisode, match=r"no longer running: cancelled"):
        episodes.get(opened[2].episode_id)


def test_start_replies_are_remembered_by_request_id_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(episodes_module, "_ENDED_KEPT", 2)
    episodes, _ = table()
    episodes.remember_start(None, "unkeyed")  # a start without a request_id is not remembered
    for request_id in ("r1", "r2", "r3"):
        episodes.remember_start(request_id, f"reply of {request_id}")
    assert [episodes.replay_start(r) for r in (None, "r1", "r2", "r3")] == [None, None, "reply of r2", "reply of r3"]
