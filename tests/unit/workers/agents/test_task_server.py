"""The task-server protocol, end to end over HTTP: a real uvicorn server on 127.0.0.1 (port 0) and an httpx client.

Every endpoint and every error status of issue 9 §1, idle expiry, the turn limit, environment failures, and the CLI
as a subprocess (banner, health, clean exit on SIGTERM).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from tests.conftest import wait_until
from workers.agents.environment import (
    Environment,
    InvalidAction,
    Step,
    UnknownEnvironment,
    available_environments,
    environment_class,
    register_environment,
)
from workers.agents.envs.guess_number import GuessNumberEnvironment
from workers.agents.envs.os_interaction import OsInteractionEnvironment
from workers.agents.task_server import create_app, default_max_episodes, main, serve_in_background

REPO = Path(__file__).resolve().parents[4]


#: seconds a test's client waits for an answer: the sandboxed environments bound a command by its wall time (20 s in
#: the tests' limits), and httpx's default of 5 s failed a step of 8 processes on a loaded CI machine (ReadTimeout)
CLIENT_TIMEOUT_S = 60.0


@contextmanager
def served(environment: type[Environment], **kwargs: Any) -> Iterator[httpx.Client]:
    with (
        serve_in_background(create_app(environment, **kwargs)) as url,
        httpx.Client(base_url=f"{url}/api", timeout=CLIENT_TIMEOUT_S) as client,
    ):
        yield client


def start(client: httpx.Client, sample_id: Any = "game-00", **config: Any) -> dict[str, Any]:
    response = client.post("/episode/start", json={"sample_id": sample_id, "config": config})
    assert response.status_code == 200, response.text
    return response.json()


def step(client: httpx.Client, episode_id: str, content: str, kind: str = "text") -> httpx.Response:
    return client.post("/episode/step", json={"episode_id": episode_id, "action": {"type": kind, "content": content}})


class Scripted(Environment):
    """Test double: records calls; sample 'boom' fails in reset, action 'boom' fails in step, 'junk' is malformed."""

    description = "scripted"
    max_turns = 3
    closed: ClassVar[list[str]] = []
    release = threading.Event()
    entered = threading.Event()

    @classmethod
    def sample_ids(cls) -> list[str]:
        return ["a", "b", "boom"]

    def reset(self, sample_id: str, config: dict[str, Any]) -> str:
        self.sample_id = self.resolve_sample_id(sample_id)
        if config.get("mode") == "bad":
            raise InvalidAction("config mode='bad' is not accepted")
        if self.sample_id == "boom":
            raise RuntimeError("reset exploded")
        if config.get("mode") == "wait":
            self.entered.set()
            self.release.wait(10)
        return f"start {self.sample_id}"

    def step(self, action: str) -> Any:
        if action == "boom":
            raise RuntimeError("step exploded")
        if action == "junk":
            return ("obs", float("nan"), False, {})
        if action == "wait":
            self.entered.set()
            self.release.wait(10)
        return Step(
            None if action == "win" else f"echo {action}",
            1.0 if action == "win" else 0.0,
            action == "win",
            {"success": action == "win"},
        )

    def close(self) -> None:
        Scripted.closed.append(self.sample_id)


@pytest.fixture(scope="module")
def guess_number() -> Iterator[httpx.Client]:
    """One guess-number server shared by the tests that only read or are refused."""
    with served(GuessNumberEnvironment) as client:
        yield client


@pytest.fixture()
def scripted() -> Iterator[type[Scripted]]:
    Scripted.closed.clear()
    Scripted.release.clear()
    Scripted.entered.clear()
    yield Scripted
    Scripted.release.set()


def test_health_info_and_samples() -> None:
    assert {"guess-number"} <= set(available_environments())
    with served(environment_class("guess-number")) as client:
        assert client.get("/health").json() == {"status": "healthy", "active_episodes": 0, "task_name": "guess-number"}
        assert client.get("/task/info").json() == {
            "name": "guess-number",
            "num_samples": 16,
            "max_episode_length": 6,
            "observation_type": "text",
            "action_type": "text",
            "description": GuessNumberEnvironment.description,
        }
        assert client.get("/task/samples").json()["sample_ids"][:2] == ["game-00", "game-01"]


def test_a_guess_number_episode_by_binary_search() -> None:
    with served(GuessNumberEnvironment) as client:
        first = start(client, "game-05")
        assert first["observation"] == {"type": "text", "content": "game 6 guess a number from 1 to 16"}
        assert (first["reward"], first["done"]) == (0, False)
        assert first["info"] == {"max_turns": 6, "sample_id": "game-05", "turn": 0}
        assert client.get("/health").json()["active_episodes"] == 1
        low, high, turn = 1, 16, 0
        while True:
            guess = (low + high) // 2
            reply = step(client, first["episode_id"], f"I guess {guess}").json()
            turn += 1
            assert reply["info"]["turn"] == turn
            if reply["done"]:
                break
            assert reply["reward"] == 0
            low, high = (guess + 1, high) if reply["observation"]["content"] == "higher" else (low, guess - 1)
        assert reply["observation"]["content"] == "correct" and reply["reward"] == 1.0
        assert reply["info"]["success"] is True and reply["info"]["num_turns"] == turn <= 5
        again = step(client, first["episode_id"], "3")
        assert again.status_code == 400 and again.json() == {
            "detail": f"episode {first['episode_id']!r} is already done"
        }
        assert client.get("/health").json()["active_episodes"] == 0
        # a decimal index names the sample at that position
        assert start(client, 5)["info"]["sample_id"] == "game-05"


def test_turn_limit_truncates_without_success() -> None:
    with served(GuessNumberEnvironment) as client:
        episode = start(client, "game-00", max_turns=2)
        assert episode["info"]["max_turns"] == 2
        assert step(client, episode["episode_id"], "nonsense").json()["observation"]["content"] == "invalid"
        last = step(client, episode["episode_id"], "nothing").json()
        assert last["done"] is True and last["reward"] == 0
        assert last["info"] == {"valid": False, "turn": 2, "truncated": True, "success": False, "num_turns": 2}


@pytest.mark.parametrize(
    ("path", "body", "status", "detail"),
    [
        ("/episode/start", {"sample_id": "zzz"}, 404, r"sample_id='zzz' is not a sample of 'guess-number'"),
        ("/episode/start", {"sample_id": "16"}, 404, r"or an index in \[0, 16\)"),
        ("/episode/start", {"config": {}}, 400, r"bad request: body.sample_id: Field required"),
        (
            "/episode/start",
            {"sample_id": 1, "config": {"max_turns": 7}},
            400,
            r"max_turns=7 must be an int in \[1, 6\]",
        ),
        ("/episode/start", {"sample_id": 1, "config": []}, 400, r"body.config: Input should be a valid dictionary"),
        (
            "/episode/step",
            {"episode_id": "nope", "action": {"type": "text", "content": "1"}},
            404,
            r"unknown episode_id='nope'",
        ),
        (
            "/episode/step",
            {"episode_id": "nope", "action": {"type": "image", "content": "1"}},
            400,
            r"action type 'image' is not supported; expected 'text'",
        ),
        ("/episode/step", {"episode_id": "nope"}, 400, r"body.action: Field required"),
        ("/episode/cancel", {"episode_id": "nope"}, 404, r"unknown episode_id='nope'"),
    ],
)
def test_error_statuses_carry_a_detail(
    guess_number: httpx.Client, path: str, body: dict[str, Any], status: int, detail: str
) -> None:
    response = guess_number.post(path, json=body)
    assert response.status_code == status
    assert re.search(detail, response.json()["detail"]), response.json()


def test_malformed_json_is_a_400(guess_number: httpx.Client) -> None:
    response = guess_number.post("/episode/start", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["detail"].startswith("bad request: ")


def test_max_episodes_answers_503_until_one_ends() -> None:
    with served(GuessNumberEnvironment, max_episodes=2) as client:
        first, _ = start(client, 0), start(client, 1)
        refused = client.post("/episode/start", json={"sample_id": 2})
        assert refused.status_code == 503
        assert refused.json()["detail"].startswith("2 episodes are running, the server's --max-episodes=2")
        cancelled = client.post("/episode/cancel", json={"episode_id": first["episode_id"]})
        assert cancelled.json() == {"episode_id": first["episode_id"], "cancelled": True}
        after = step(client, first["episode_id"], "1")
        assert after.status_code == 404 and after.json()["detail"].endswith("is no longer running: cancelled")
        start(client, 2)


def test_environment_failures_are_500_and_the_server_keeps_serving(scripted: type[Scripted]) -> None:
    with served(scripted) as client:
        failed = client.post("/episode/start", json={"sample_id": "boom"})
        assert failed.status_code == 500
        assert failed.json() == {"detail": "environment failure: RuntimeError: reset exploded"}
        bad_config = client.post("/episode/start", json={"sample_id": "a", "config": {"mode": "bad"}})
        assert bad_config.status_code == 400 and bad_config.json()["detail"] == "config mode='bad' is not accepted"
        assert client.get("/health").json()["active_episodes"] == 0
        assert scripted.closed == ["boom", "a"]

        episode = start(client, "a")["episode_id"]
        boom = step(client, episode, "boom")
        assert boom.status_code == 500 and boom.json()["detail"] == "environment failure: RuntimeError: step exploded"
        gone = step(client, episode, "x")
        assert gone.status_code == 404 and "failed: the environment raised" in gone.json()["detail"]

        episode = start(client, "b")["episode_id"]
        junk = step(client, episode, "junk")
        assert junk.status_code == 500 and "expected Step(observation: str | None" in junk.json()["detail"]
        assert scripted.closed == ["boom", "a", "a", "b"]
        assert client.get("/health").json() == {"status": "healthy", "active_episodes": 0, "task_name": "Scripted"}


def test_each_environment_is_closed_once_however_the_episode_ends(scripted: type[Scripted]) -> None:
    with served(scripted) as client:
        won = start(client, "a")["episode_id"]
        assert step(client, won, "win").json()["observation"] is None
        assert client.post("/episode/cancel", json={"episode_id": won}).json()["cancelled"] is False
        start(client, "b")  # left running: closed when the server shuts down
    assert sorted(scripted.closed) == ["a", "b"]


def test_a_cancel_during_a_step_closes_after_the_step(scripted: type[Scripted]) -> None:
    with served(scripted) as client:
        episode = start(client, "a")["episode_id"]
        slow = threading.Thread(target=step, args=(client, episode, "wait"))
        slow.start()
        assert scripted.entered.wait(10), "the step never reached the environment"
        cancel = threading.Thread(
            target=client.post, args=("/episode/cancel",), kwargs={"json": {"episode_id": episode}}
        )
        cancel.start()
        wait_until(lambda: client.get("/health").json()["active_episodes"] == 0, what="the cancel to take effect")
        assert step(client, episode, "x").status_code == 404
        assert scripted.closed == []  # the step in flight still holds the environment
        scripted.release.set()
        slow.join(10)
        cancel.join(10)
        assert scripted.closed == ["a"]


def test_idle_episodes_expire(scripted: type[Scripted]) -> None:
    with served(scripted, idle_timeout=0.3) as client:
        episode = start(client, "a")["episode_id"]
        wait_until(lambda: client.get("/health").json()["active_episodes"] == 0, what="the episode to expire")
        expired = step(client, episode, "x")
        assert expired.status_code == 404
        assert (
            expired.json()["detail"] == f"episode {episode!r} is no longer running: expired after 0.3 s without a call"
        )
        wait_until(lambda: scripted.closed == ["a"], what="the expired environment to be closed")  # in a thread


def test_cli_prints_the_banner_serves_and_exits_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.agents.task_server", "guess-number", "--port", "0", "--max-episodes", "4"],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "TQ_API_KEY"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline().rstrip("\n") for _ in range(9)]
        assert lines[0] == "=" * 70 and lines[1] == "Starting Task Server: guess-number" and lines[8] == "=" * 70
        url = re.fullmatch(r"Server URL: (http://127\.0\.0\.1:\d+)", lines[3]).group(1)  # type: ignore[union-attr]
        assert lines[4:8] == [
            f"API Base:   {url}/api",
            f"Health:     {url}/api/health",
            f"Task Info:  {url}/api/task/info",
            "Auth:       none (no TQ_API_KEY): every request is accepted",
        ]
        health = wait_until(lambda: _get(f"{url}/api/health"), what="the CLI server to answer")
        assert health == {"status": "healthy", "active_episodes": 0, "task_name": "guess-number"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert "Application shutdown complete" in process.stderr.read()  # type: ignore[union-attr]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-env", "--port", "0"], "no environment named 'no-such-env'; registered: ["),
        (["guess-number", "--port", "0", "--max-episodes", "0"], "max_episodes=0 must be >= 1"),
        (["guess-number", "--port", "{taken}"], "cannot listen on 127.0.0.1:{taken}: Address already in use"),
    ],
)
def test_cli_refuses_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        with pytest.raises(SystemExit) as exit_:
            main([arg.format(taken=port) for arg in argv])
    assert exit_.value.code == 2
    assert message.format(taken=port) in capsys.readouterr().err


def _get(url: str) -> Any:
    try:
        return httpx.get(url, timeout=2).json()
    except httpx.TransportError:
        return None


def test_the_environment_in_docs_agents_md_serves() -> None:
    page = (REPO / "docs" / "agents.md").read_text()
    source = re.search(r"```python\n(# mytasks/echo.py\n.*?)```", page, re.DOTALL).group(1)  # type: ignore[union-attr]
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/agents.md", "exec"), namespace)
    with served(namespace["EchoEnvironment"]) as client:
        assert client.get("/task/info").json()["name"] == "echo"
        refused = client.post("/episode/start", json={"sample_id": "1", "config": {"shout": True}})
        assert refused.status_code == 400 and refused.json()["detail"] == "config shout is not supported"
        episode = start(client, "1")
        assert episode["observation"]["content"] == "Say pear."
        assert step(client, episode["episode_id"], "apple").json()["observation"]["content"] == "No. Say pear."
        last = step(client, episode["episode_id"], "pear").json()
        assert (last["reward"], last["done"], last["info"]["success"], last["info"]["num_turns"]) == (
            1.0,
            True,
            True,
            2,
        )


def test_environments_are_found_by_name_or_module_and_class() -> None:
    assert environment_class("tests.unit.workers.agents.test_task_server:Scripted").description == "scripted"
    assert {"os-interaction", "calculator", "guess-number"} <= set(available_environments())
    with pytest.raises(UnknownEnvironment, match=r"no environment named 'nope'; registered: \[.*'calculator'"):
        environment_class("nope")
    with pytest.raises(UnknownEnvironment, match=r"cannot import environment 'no.such.module:X'"):
        environment_class("no.such.module:X")
    with pytest.raises(
        UnknownEnvironment, match=r"'tests.unit.workers.agents.test_task_server:served' is .*, not an Environment"
    ):
        environment_class("tests.unit.workers.agents.test_task_server:served")
    with pytest.raises(ValueError, match=r"environment name 'calculator' is already registered by workers.agents"):
        register_environment("calculator")(Scripted)


def test_a_step_re_sent_with_its_request_id_is_answered_again_not_applied_twice() -> None:
    # game-05 hides 7; a client whose connection broke after the
    # server applied its step re-sends it with the same request_id
    def send(episode_id: str, content: str, request_id: str) -> httpx.Response:
        action = {"type": "text", "content": content}
        return client.post("/episode/step", json={"episode_id": episode_id, "action": action, "request_id": request_id})

    with served(GuessNumberEnvironment) as client:
        episode = start(client, "game-05")["episode_id"]
        first = send(episode, "3", "a")
        again = send(episode, "3", "a")
        assert first.status_code == again.status_code == 200 and again.json() == first.json()
        assert first.json()["info"]["turn"] == 1 and first.json()["observation"]["content"] == "higher"
        assert send(episode, "3", "b").json()["info"]["turn"] == 2  # a new request_id is a new step, same action or not
        won = send(episode, "7", "c")
        assert won.json()["done"] and won.json()["reward"] == 1.0
        replay = send(episode, "7", "c")  # the winning step's reply was lost: the retry gets it, not a 400
        assert replay.status_code == 200 and replay.json() == won.json()
        late = send(episode, "7", "d")
        assert late.status_code == 400 and late.json()["detail"] == f"episode '{episode}' is already done"
        old = send(episode, "3", "a")  # only the last step is remembered: an older id is a new step, refused here
        assert old.status_code == 400
        bad = client.post("/episode/step", json={"episode_id": episode, "action": {"content": "1"}, "request_id": ""})
        assert bad.status_code == 400 and "request_id" in bad.text


def test_a_start_re_sent_with_its_request_id_is_answered_again_not_started_twice(scripted: type[Scripted]) -> None:
    # a client whose connection broke after the server started its episode re-sends the start with the same
    # request_id: it gets that episode again, even at --max-episodes, and no second environment is made
    def send(sample_id: str, request_id: str) -> httpx.Response:
        return client.post("/episode/start", json={"sample_id": sample_id, "request_id": request_id})

    with served(scripted, max_episodes=1) as client:
        first = send("a", "r1")
        again = send("a", "r1")
        assert first.status_code == again.status_code == 200 and again.json() == first.json()
        assert client.get("/health").json()["active_episodes"] == 1
        other = send("b", "r2")  # a new request_id is a new start: refused at --max-episodes=1
        assert other.status_code == 503
        bad = client.post("/episode/start", json={"sample_id": "a", "request_id": ""})
        assert bad.status_code == 400 and "request_id" in bad.text
    assert scripted.closed == ["a"]  # one environment, closed once


def test_a_start_re_sent_while_the_first_is_still_resetting_waits_for_it(scripted: type[Scripted]) -> None:
    with served(scripted) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        body = {"sample_id": "a", "config": {"mode": "wait"}, "request_id": "r1"}
        first = pool.submit(client.post, "/episode/start", json=body)
        assert scripted.entered.wait(10)
        second = pool.submit(client.post, "/episode/start", json=body)
        scripted.release.set()  # whether the re-sent start arrived before or after this, it gets the first's episode
        replies = [first.result(10), second.result(10)]
        assert [r.status_code for r in replies] == [200, 200] and replies[0].json() == replies[1].json()
        assert client.get("/health").json()["active_episodes"] == 1


def test_the_default_max_episodes_fits_the_free_memory() -> None:
    budget = OsInteractionEnvironment.episode_memory_bytes
    assert budget == 2**30
    assert default_max_episodes(OsInteractionEnvironment, available=5 * budget + 1) == 5
    assert default_max_episodes(OsInteractionEnvironment, available=budget // 2) == 1  # never 0
    assert default_max_episodes(OsInteractionEnvironment) >= 1  # type: ignore[operator]  # this machine's figure
    assert default_max_episodes(GuessNumberEnvironment) is None  # holds little: unbounded


def test_with_a_key_every_route_but_health_refuses_a_request_without_it() -> None:
    app = create_app(GuessNumberEnvironment, api_key="task-key")
    with serve_in_background(app) as url:
        for method, path, body in [
            ("GET", "/api/task/info", None),
            ("GET", "/api/task/samples", None),
            ("POST", "/api/episode/start", {"sample_id": "game-00"}),
            ("POST", "/api/episode/step", {"episode_id": "x", "action": {"type": "text", "content": "5"}}),
            ("POST", "/api/episode/cancel", {"episode_id": "x"}),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "task-key"}):
                reply = httpx.request(method, url + path, json=body, headers=headers)
                assert reply.status_code == 401, (path, headers, reply.text)
                assert reply.json()["detail"].startswith("missing or wrong API key")
        assert httpx.get(f"{url}/api/health").json()["status"] == "healthy"  # open: liveness probes
        with httpx.Client(base_url=f"{url}/api", headers={"Authorization": "Bearer task-key"}) as client:
            episode = start(client)
            assert step(client, episode["episode_id"], "5").status_code == 200


def test_the_cli_takes_its_key_from_the_environment_and_says_so() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.agents.task_server", "guess-number", "--port", "0"],
        cwd=REPO,
        env={**os.environ, "TQ_API_KEY": "cli-key"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline().rstrip("\n") for _ in range(9)]
        assert lines[7] == "Auth:       bearer key (TQ_API_KEY) on every route but /api/health"
        assert not any("cli-key" in line for line in lines)
        url = lines[3].split(": ", 1)[1]
        wait_until(lambda: _get(f"{url}/api/health"), what="the CLI server to answer")
        assert httpx.get(f"{url}/api/task/info").status_code == 401
        assert httpx.get(f"{url}/api/task/info", headers={"Authorization": "Bearer cli-key"}).status_code == 200
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
