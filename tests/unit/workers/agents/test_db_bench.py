"""dbbench-dev (AgentBench's DB-bench, served as its example names it): SQL tasks on SQLite in the sandbox, each
kind solved by its reference statement over the task-server protocol and failed by a wrong answer or a change not
made; answers parsed and compared as AgentBench's lists; SQL errors shown, the episode going on."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.unit.workers.agents.test_agent_environments import needs_sandbox
from tests.unit.workers.agents.test_task_server import served, start, step
from workers.agents.environment import environment_class
from workers.agents.envs.db_bench import TASKS, DbBenchEnvironment, build_task, expected, normalise, parse_answer
from workers.agents.sandbox import SandboxLimits

#: each statement starts a Python in the sandbox: room for a loaded machine's slow start
LIMITS = SandboxLimits(wall_seconds=10.0, cpu_seconds=5, max_processes=16)


def operation(sql: str) -> str:
    return f"The statement below does it.\nAction: Operation\n```sql\n{sql};\n```"


def answer(values: list[Any]) -> str:
    return f"I have it.\nAction: Answer\nFinal Answer: {values!r}"


@pytest.fixture(scope="module")
def db_server() -> Iterator[httpx.Client]:
    with served(DbBenchEnvironment, environment_kwargs={"limits": LIMITS}) as client:
        yield client


def test_it_is_served_as_dbbench_dev_with_samples_that_are_the_same_every_time() -> None:
    assert environment_class("dbbench-dev") is DbBenchEnvironment
    ids = DbBenchEnvironment.sample_ids()
    assert len(ids) == 20 * len(TASKS) and ids[0] == "count-team-000"
    assert build_task("city-total-007") == build_task("city-total-007")
    assert build_task("city-total-007") != build_task("city-total-008")


@needs_sandbox
@pytest.mark.parametrize("kind", sorted(TASKS))
def test_db_tasks_are_solved_by_their_reference_statement_and_failed_otherwise(
    db_server: httpx.Client, kind: str
) -> None:
    task = build_task(f"{kind}-004")
    first = start(db_server, f"{kind}-004")
    assert first["observation"]["content"].startswith("I will ask you a question, then you should help me operate")
    assert first["observation"]["content"].endswith(f"The table is named {task.table}; its columns: {task.columns}.")
    episode = first["episode_id"]
    shown = step(db_server, episode, operation(task.reference)).json()
    assert shown["done"] is False and shown["info"]["exit_code"] == 0
    if task.change:
        assert shown["observation"]["content"].startswith("Query OK, ")
        final = step(db_server, episode, answer([])).json()
    else:
        rows = ast.literal_eval(shown["observation"]["content"])
        assert [list(row) for row in rows] == expected(task)
        final = step(db_server, episode, answer([v for row in rows for v in row])).json()
    assert (final["reward"], final["info"]["success"], final["info"]["num_turns"]) == (1.0, True, 2)

    wrong = start(db_server, f"{kind}-004")["episode_id"]  # a question answered wrongly; a change never made
    assert step(db_server, wrong, answer(["definitely wrong"])).json()["info"] == {
        "success": False,
        "turn": 1,
        "num_turns": 1,
    }


@needs_sandbox
def test_sql_errors_and_bad_actions_are_shown_and_the_episode_goes_on() -> None:
    env = DbBenchEnvironment(LIMITS)
    try:
        env.reset("count-team-000", {})
        error = env.step(operation("SELEC COUNT(*) FROM players"))
        assert not error.done and error.info == {"exit_code": 1, "timed_out": False}
        assert error.observation == 'Error: near "SELEC": syntax error'
        two = env.step(operation("SELECT 1; SELECT 2"))
        assert two.observation == "Error: You can only execute one statement at a time."
        quoted = env.step(operation("SELECT 'SQL_' || name FROM players WHERE name = 'x''y'"))
        assert quoted.observation == "[]"  # quotes and the delimiter's prefix reach SQLite unharmed
        invalid = env.step("SELECT COUNT(*) FROM players")
        assert not invalid.done and invalid.info == {"invalid_action": True}
        assert invalid.observation.startswith("Invalid action: use 'Action: Operation'")  # type: ignore[union-attr]
        right = expected(env.task)[0][0]
        final = env.step(f"Thinking.\nAction: Answer\nFinal Answer: [{right}]")
        assert final.done and final.reward == 1.0
    finally:
        env.close()


@needs_sandbox
def test_a_change_is_judged_by_the_table_not_the_answer() -> None:
    env = DbBenchEnvironment(LIMITS)
    try:
        env.reset("update-score-001", {})
        env.step(operation("UPDATE players SET score = 1"))  # a change, but not the one asked for
        assert env.step(answer([])).info == {"success": False}
    finally:
        env.close()


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ('["7"]', ["7"]),
        ("[7, 'kalo']\nthat is all", [7, "kalo"]),
        ("7", [7]),
        ("ladumu", ["ladumu"]),
        ("[]", []),
        ("[unclosed", None),
    ],
)
def test_final_answers_are_read_as_lists(text: str, values: list[Any] | None) -> None:
    assert parse_answer(text) == values


@pytest.mark.parametrize(("value", "same_as"), [(7, "7"), ("7.0", "7"), (" 'Kalo' ", "kalo"), (2.50, "2.5")])
def test_answer_values_compare_in_one_spelling(value: Any, same_as: str) -> None:
    assert normalise(value) == normalise(same_as)
