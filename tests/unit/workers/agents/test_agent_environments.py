"""The environments that ship, driven over the task-server protocol: os-interaction (sandboxed shell tasks, escape
attempts while the server keeps serving, no orphans when the server is killed), calculator and guess-number."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import requirement, wait_until
from tests.unit.workers.agents.test_sandbox import running, sleeping
from tests.unit.workers.agents.test_task_server import served, start, step
from workers.agents.envs.calculator import CalculatorEnvironment, CalculatorError, evaluate, problem
from workers.agents.envs.guess_number import GuessNumberEnvironment
from workers.agents.envs.os_interaction import TASKS, OsInteractionEnvironment, build_task
from workers.agents.sandbox import Sandbox, SandboxLimits, sandbox_unavailable_reason

REPO = Path(__file__).resolve().parents[4]
needs_sandbox = pytest.mark.skipif(
    sandbox_unavailable_reason() is not None,
    reason=requirement(
        f"a working bubblewrap sandbox: {sandbox_unavailable_reason()}", "apt-get install -y bubblewrap"
    ),
)
FAST = {"limits": SandboxLimits(wall_seconds=1.0, cpu_seconds=1, max_processes=16)}

#: a reference solution per task kind: a command whose last output line is the answer (or that makes the change)
SOLUTIONS = {
    "count-logs": "find logs -name '*.log' | wc -l",
    "find-line": "grep -n \"$(grep -o 'token[0-9]*' question)\" notes.txt | cut -d: -f1",
    "sum-column": "awk -F, 'NR > 1 {s += $2} END {print s}' data.csv",
    "largest-file": "ls -S docs | head -1",
    "distinct-users": "awk '{print $2}' access.log | sort -u | wc -l",
    "write-count": "wc -l < input.txt > report.txt",
}


def bash(code: str) -> str:
    return f"Think: run it.\nAct: bash\n```bash\n{code}\n```"


@pytest.fixture(scope="module")
def os_server() -> Iterator[httpx.Client]:
    with served(OsInteractionEnvironment, environment_kwargs=FAST) as client:
        yield client


@needs_sandbox
@pytest.mark.parametrize("kind", sorted(TASKS))
def test_os_tasks_are_solved_by_their_reference_command_and_failed_by_a_wrong_answer(
    os_server: httpx.Client, kind: str
) -> None:
    client = os_server
    first = start(client, f"{kind}-004")
    assert first["observation"]["content"].startswith("You are an assistant that will act like a person.")
    question = build_task(f"{kind}-004").question
    assert first["observation"]["content"].endswith(question)
    episode = first["episode_id"]
    setup = f"echo '{question}' > question; " if kind == "find-line" else ""
    shown = step(client, episode, bash(setup + SOLUTIONS[kind])).json()
    assert shown["done"] is False and shown["info"]["exit_code"] == 0
    if kind == "write-count":
        final = step(client, episode, "Think: done.\nAct: finish").json()
    else:
        answer = shown["observation"]["content"].strip().splitlines()[-1]
        final = step(client, episode, f"Think: got it.\nAct: answer({answer})").json()
    assert (final["reward"], final["info"]["success"], final["info"]["num_turns"]) == (1.0, True, 2)

    wrong = start(client, f"{kind}-004")["episode_id"]
    action = "Act: finish" if kind == "write-count" else "Act: answer(definitely wrong)"
    assert step(client, wrong, action).json()["info"] == {"success": False, "turn": 1, "num_turns": 1}


@needs_sandbox
@pytest.mark.parametrize(
    ("action", "success"),
    [
        ("Think: counted.\nAct: answer( 7 )\nThat is all (I hope).", True),
        ("Act: answer('7.')", True),
        ("Act: answer(7 files)", False),
        ("Act: finish", False),  # a question wants an answer
        ("I think it is 7", None),  # no action: told how to act, the episode goes on
    ],
)
def test_os_answers_are_parsed_and_normalised(action: str, success: bool | None) -> None:
    env = OsInteractionEnvironment(FAST["limits"])
    try:
        env.reset("count-logs-000", {})
        assert env.task.answer == "7"
        reply = env.step(action)
        if success is None:
            assert not reply.done and reply.info == {"invalid_action": True}
            assert reply.observation.startswith("Invalid action: use 'Act: bash'")  # type: ignore[union-attr]
        else:
            assert reply.done and reply.info == {"success": success} and reply.reward == float(success)
    finally:
        env.close()


@needs_sandbox
def test_escapes_are_contained_and_the_server_keeps_serving(tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("host\n")
    limits = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, max_processes=16)  # 2 s: room to ask /health meanwhile
    with served(OsInteractionEnvironment, environment_kwargs={"limits": limits}) as client:
        episode = start(client, "count-logs-000")["episode_id"]
        replies: list[dict[str, Any]] = []
        sleeper = threading.Thread(target=lambda: replies.append(step(client, episode, bash("sleep 86420")).json()))
        sleeper.start()
        wait_until(lambda: sleeping("86420") == 1, what="the sandboxed sleep to start")
        assert client.get("/health").json()["active_episodes"] == 1
        assert not replies and sleeping("86420") == 1  # served while the command runs
        sleeper.join(10)
        assert replies[0]["observation"]["content"].endswith("[the command was killed: it ran past its time limit]")
        assert replies[0]["info"]["timed_out"] is True and replies[0]["done"] is False

        other = start(client, "sum-column-000")["episode_id"]
        bomb = step(client, other, bash("bomb() { bomb | bomb & }; bomb")).json()
        assert bomb["done"] is False
        escape = step(client, other, bash(f"echo pwned > {sentinel}; echo > /dev/tcp/127.0.0.1/1 && echo NET")).json()
        assert "NET" not in escape["observation"]["content"]
        solved = step(client, other, bash(SOLUTIONS["sum-column"])).json()
        answer = solved["observation"]["content"].splitlines()[-1]
        assert step(client, other, f"Act: answer({answer})").json()["reward"] == 1.0
    assert sentinel.read_text() == "host\n"
    wait_until(lambda: running("sleep 86420") == [] and running("bomb()") == [], what="no sandboxed process left")


#: a small episode: 32 MiB of memory for all its processes, 4 MiB for each of its filesystems
SMALL = SandboxLimits(
    episode_memory_bytes=32 * 2**20,
    disk_bytes=4 * 2**20,
    tmp_bytes=4 * 2**20,
    shm_bytes=4 * 2**20,
    wall_seconds=20,
    max_processes=16,
)


@needs_sandbox
def test_resource_and_privilege_escapes_are_bounded_and_the_server_keeps_serving(tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("host\n")
    allocators = "python3 -c 'import time; x = b\"a\" * (16 << 20); time.sleep(3)'"
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        served(OsInteractionEnvironment, environment_kwargs={"limits": SMALL}) as client,
    ):
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        episode = start(client, "count-logs-000")["episode_id"]
        fill = "for i in $(seq 20); do head -c 3000000 /dev/zero > /dev/shm/f$i; done 2> /dev/null; du -sb /dev/shm"
        shm = step(client, episode, bash(fill)).json()["observation"]["content"]
        assert 0 < int(shm.split()[-2]) <= SMALL.shm_bytes  # not 60 MB
        memory = step(client, episode, bash(f"for i in $(seq 8); do {allocators} & done; wait")).json()
        assert memory["info"]["memory_exceeded"] is True and memory["done"] is False
        assert memory["observation"]["content"].endswith("together reached their memory budget]")
        escape = f"unshare -U true; mount -t tmpfs x /tmp; echo > /dev/tcp/127.0.0.1/{port}"
        nested = step(client, episode, bash(escape)).json()["observation"]["content"]
        assert "unshare failed: Operation not permitted" in nested and "must be superuser" in nested
        assert "Connection refused" in nested
        assert client.get("/health").json()["active_episodes"] == 1

        writers = "for i in $(seq 30); do head -c 3000000 /dev/zero > f$i & done; wait"
        disk = step(client, episode, bash(f"{writers}; echo pwned > {sentinel}")).json()
        assert disk["done"] is True and disk["info"]["error"] == "disk quota exceeded" and not disk["info"]["success"]
        with pytest.raises(TimeoutError):
            listener.accept()

        other = start(client, "sum-column-000")["episode_id"]
        solved = step(client, other, bash(SOLUTIONS["sum-column"])).json()
        answer = solved["observation"]["content"].splitlines()[-1]
        assert step(client, other, f"Act: answer({answer})").json()["reward"] == 1.0
    assert sentinel.read_text() == "host\n"
    wait_until(lambda: running("time.sleep(3)") == [], what="no sandboxed process left")


@needs_sandbox
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_sandboxed_process_outlives_its_server(stop: signal.Signals, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL: the sandbox dies with its parent. SIGTERM: after --shutdown-timeout every sandbox is closed."""
    # the sandbox's own uid must be able to pass through its parents to reach it (pytest's tmp_path is 0700)
    tmp_path = Path(tempfile.mkdtemp(prefix="tq-sandbox-test-"))
    tmp_path.chmod(0o711)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.agents.task_server",
            "os-interaction",
            "--port",
            "0",
            "--shutdown-timeout",
            "0.2",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert server.stdout is not None
        url = next(m.group(1) for line in server.stdout if (m := re.match(r"API Base:\s+(\S+)", line)))
        wait_until(lambda: _healthy(url), timeout=30, what="the CLI server to answer")
        episode = httpx.post(f"{url}/episode/start", json={"sample_id": 0}).json()["episode_id"]
        body = {"episode_id": episode, "action": {"type": "text", "content": bash("sleep 97531 & sleep 97531")}}
        threading.Thread(target=lambda: _post_quietly(f"{url}/episode/step", body), daemon=True).start()
        wait_until(lambda: sleeping("97531") == 2, what="the sandboxed sleeps to start")
        server.send_signal(stop)
        assert server.wait(10) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
        wait_until(lambda: running("sleep 97531") == [], timeout=10, what="the sandbox to die with its server")
        if stop == signal.SIGTERM:
            assert list(tmp_path.iterdir()) == []  # every episode's directory tree removed
        else:  # what the killed server left (its tree, a tmpfs home and cgroup as root) goes at the next sandbox here
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
            with Sandbox(FAST["limits"]) as sandbox:
                assert [path.name for path in tmp_path.iterdir()] == [sandbox.root.name]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for pipe in (server.stdout, server.stderr):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(tmp_path, ignore_errors=True)


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _post_quietly(url: str, body: dict[str, Any]) -> None:
    try:
        httpx.post(url, json=body, timeout=30)
    except httpx.TransportError:
        pass


@pytest.mark.parametrize(
    ("expression", "value"),
    [("37 * 48 - 125", 1651), ("(2 + 3) ** 2 / 4", 6.25), ("-7 // 2 % 5", 1), ("1e3 + 1", 1001.0)],
)
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('id')", r"unsupported expression \"__import__\('os'\).system\('id'\)\""),
        ("2 ** 1000", "exponent 1000 is too large"),
        ("10 ** 20", r"the value of '10 \*\* 20' is out of range"),
        ("1 / 0", "division by zero"),
        ("3 +", r"cannot parse '3 \+'"),
        ("'a' * 3", "unsupported expression"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_a_calculator_episode_with_tool_calls() -> None:
    question, answer = problem(3)
    with served(CalculatorEnvironment) as client:
        assert client.get("/task/info").json()["num_samples"] == 200
        first = start(client, "calc-003")
        assert first["observation"]["content"].startswith(question)
        episode = first["episode_id"]
        expression = question.removeprefix("What is ").removesuffix("?")
        tool = step(client, episode, f"Let me compute. calculator({expression})").json()
        assert tool["observation"]["content"] == f"calculator result: {answer}"
        call = '{"name": "calculator", "arguments": "{\\"expression\\": \\"1/0\\"}"}'
        assert step(client, episode, call).json()["observation"]["content"] == "calculator error: division by zero"
        final = step(client, episode, f"answer({answer:,})").json()
        assert final["done"] and final["reward"] == 1.0
        assert final["info"] == {"success": True, "tool_calls": 2, "turn": 3, "num_turns": 3}
        wrong = start(client, "calc-003")["episode_id"]
        assert step(client, wrong, f"answer({answer + 1})").json()["info"]["success"] is False


def test_guess_number_uses_a_tiny_vocabulary_and_every_target_is_reachable() -> None:
    seen = set()
    for sample_id in GuessNumberEnvironment.sample_ids():
        env = GuessNumberEnvironment()
        seen.add(env.reset(sample_id, {}))
        replies = [env.step(str(guess)) for guess in range(1, 17)]
        assert [r.observation for r in replies].count("correct") == 1
        seen |= {r.observation for r in replies}
        assert env.step("seventeen").observation == "invalid" and env.step("17").observation == "invalid"
    firsts = {f"game {k} guess a number from 1 to 16" for k in range(1, 17)}
    assert seen == firsts | {"higher", "lower", "correct"}  # the first observation names the game, never its number
