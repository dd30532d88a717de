"""dbbench-dev: AgentBench-style database tasks (DB-bench) on SQLite in a bubblewrap sandbox, with answer checking.

Each sample builds one table from its own seed and asks a question about it (how many, which, the total, the list)
or asks for a change to it (update, insert, delete). The agent acts as in AgentBench's DB task, one SQL statement a
turn::

    Action: Operation
    ```sql
    SELECT COUNT(*) FROM players WHERE team = 'kalo';
    ```

and is shown what SQLite returned (the rows, or how many rows a change touched, or the error). It ends with::

    Action: Answer
    Final Answer: ["7"]

A question's answer is checked against the rows of its reference query (order and number formatting aside); a change
is checked by comparing the whole table after the episode with the table the reference statement leaves. Both
references run on the host, on an in-memory SQLite database built from the same script, so the expected value is
SQLite's own. Every statement runs in the episode's :class:`~workers.agents.sandbox.Sandbox` (no network, its own
namespaces, CPU / wall / memory / process limits), through the sandbox's ``python3`` and its ``sqlite3`` module.
"""

from __future__ import annotations

import ast
import json
import random
import re
import secrets
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.agents.environment import Step, register_environment
from workers.agents.envs.sandboxed import SandboxedEnvironment
from workers.agents.sandbox import CommandResult, Sandbox

INSTRUCTIONS = """I will ask you a question, then you should help me operate a SQLite database with SQL to answer \
the question. You have to explain the problem and your solution to me and write down your thoughts. After thinking \
and explaining thoroughly, every round you can choose to operate or to answer.

To operate, write one SQL statement in a code block, like this:
Action: Operation
```sql
SELECT * FROM table WHERE condition;
```
You MUST put SQL in markdown format without any other comments, one statement per operation. Every time you can \
only execute one SQL statement. I will only execute the statement in the first SQL code block. I will give you its \
output (the rows, or the number of rows it changed, or the error).

When you have the answer, or when you have made the change I asked for, write:
Action: Answer
Final Answer: ["ANSWER1", "ANSWER2", ...]
DO NOT write this pattern unless you are sure about your answer. The answer is a list of the values the question \
asks for; for a change to the table, answer with an empty list after making it: Final Answer: []

Now, here is the task.

"""
_SQL = re.compile(r"```(?:sql|sqlite)?\s*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_OPERATION = re.compile(r"Action:\s*Operation", re.IGNORECASE)
_ANSWER = re.compile(r"Final Answer:\s*(.*)", re.DOTALL | re.IGNORECASE)
#: output shown to the agent per statement (AgentBench truncates similarly)
_SHOWN_CHARS = 800
#: the script each statement goes through, inside the sandbox: one statement, autocommit, rows as a Python list
_RUNNER = """import json, sqlite3, sys
db = sqlite3.connect("db.sqlite", isolation_level=None)
if sys.argv[1] == "init":
    db.executescript(open(".dbbench/init.sql").read())
elif sys.argv[1] == "dump":
    print(json.dumps(sorted(db.execute("SELECT * FROM " + sys.argv[2]).fetchall(), key=repr)))
else:
    try:
        cursor = db.execute(sys.stdin.read())
    except (sqlite3.Error, sqlite3.Warning) as exc:
        print(f"Error: {exc}")
        sys.exit(1)
    if cursor.description is None:
        print(f"Query OK, {max(cursor.rowcount, 0)} rows affected")
    else:
        print(cursor.fetchall())
"""

TEAMS = ["kalo", "mine", "rusa", "tovi", "depo"]
CITIES = ["Lund", "Oslo", "Riga", "Bern", "Kiev", "Lima"]


@dataclass(frozen=True)
class DbTask:
    """One sample: the table's script, the question, and the reference statement that answers it or makes the
    change (``change``: compare the table afterwards instead of the answer)."""

    table: str
    columns: str
    init_sql: str
    question: str
    reference: str
    change: bool = False

    def prompt(self) -> str:
        return f"{self.question}\nThe table is named {self.table}; its columns: {self.columns}."


def _players(rng: random.Random) -> tuple[str, str, list[tuple[Any, ...]]]:
    names = sorted({"".join(rng.choice("aeiou" if i % 2 else "bdklmnprstv") for i in range(6)) for _ in range(30)})
    rows = [
        (i + 1, name, rng.choice(TEAMS), rng.randint(0, 99), rng.randint(2015, 2026))
        for i, name in enumerate(rng.sample(names, rng.randint(8, 20)))
    ]
    return "players", "id INTEGER PRIMARY KEY, name TEXT, team TEXT, score INTEGER, year INTEGER", rows


def _sales(rng: random.Random) -> tuple[str, str, list[tuple[Any, ...]]]:
    rows = [
        (
            i + 1,
            rng.choice(CITIES),
            rng.choice(["tea", "rice", "salt", "wool"]),
            rng.randint(1, 40),
            rng.randint(5, 500),
        )
        for i in range(rng.randint(10, 25))
    ]
    return "sales", "id INTEGER PRIMARY KEY, city TEXT, product TEXT, quantity INTEGER, amount INTEGER", rows


def _script(table: str, columns: str, rows: list[tuple[Any, ...]]) -> str:
    values = ",\n".join("(" + ", ".join(_literal(v) for v in row) + ")" for row in rows)
    return f"CREATE TABLE {table} ({columns});\nINSERT INTO {table} VALUES\n{values};\n"


def _literal(value: Any) -> str:
    return "'" + value.replace("'", "''") + "'" if isinstance(value, str) else str(value)


def _count_team(rng: random.Random) -> DbTask:
    table, columns, rows = _players(rng)
    team = rng.choice([r[2] for r in rows])
    return DbTask(
        table, columns, _script(table, columns, rows),
        f"How many players of the team '{team}' are there?",
        f"SELECT COUNT(*) FROM {table} WHERE team = '{team}'",
    )  # fmt: skip


def _top_scorer(rng: random.Random) -> DbTask:
    table, columns, rows = _players(rng)
    top = max(r[3] for r in rows)
    first = next(r for r in rows if r[3] == top)  # one player holds the top score: the answer is one name
    rows = [r if r[3] != top or r is first else (*r[:3], top - 1, r[4]) for r in rows]
    return DbTask(
        table, columns, _script(table, columns, rows),
        "Which player has the highest score? Answer with the name.",
        f"SELECT name FROM {table} ORDER BY score DESC LIMIT 1",
    )  # fmt: skip


def _city_total(rng: random.Random) -> DbTask:
    table, columns, rows = _sales(rng)
    city = rng.choice([r[1] for r in rows])
    return DbTask(
        table, columns, _script(table, columns, rows),
        f"What is the total amount of the sales in {city}?",
        f"SELECT SUM(amount) FROM {table} WHERE city = '{city}'",
    )  # fmt: skip


def _players_since(rng: random.Random) -> DbTask:
    table, columns, rows = _players(rng)
    year = rng.choice(sorted({r[4] for r in rows}))
    return DbTask(
        table, columns, _script(table, columns, rows),
        f"List the names of the players whose year is {year} or later.",
        f"SELECT name FROM {table} WHERE year >= {year}",
    )  # fmt: skip


def _update_score(rng: random.Random) -> DbTask:
    table, columns, rows = _players(rng)
    name, score = rng.choice(rows)[1], rng.randint(100, 200)
    return DbTask(
        table, columns, _script(table, columns, rows),
        f"Set the score of the player named '{name}' to {score}.",
        f"UPDATE {table} SET score = {score} WHERE name = '{name}'", change=True,
    )  # fmt: skip


def _insert_sale(rng: random.Random) -> DbTask:
    table, columns, rows = _sales(rng)
    city, quantity, amount = rng.choice(CITIES), rng.randint(1, 40), rng.randint(5, 500)
    new_id = len(rows) + 1
    return DbTask(
        table, columns, _script(table, columns, rows),
        f"Record a new sale with id {new_id}: {quantity} of wool in {city} for an amount of {amount}.",
        f"INSERT INTO {table} VALUES ({new_id}, '{city}', 'wool', {quantity}, {amount})", change=True,
    )  # fmt: skip


def _delete_small(rng: random.Random) -> DbTask:
    table, columns, rows = _sales(rng)
    below = rng.choice(sorted({r[4] for r in rows})[1:])  # above the smallest: at least one row goes
    return DbTask(
        table, columns, _script(table, columns, rows),
        f"Delete every sale whose amount is less than {below}.",
        f"DELETE FROM {table} WHERE amount < {below}", change=True,
    )  # fmt: skip


#: kind -> generator; sample ``{kind}-{i:03d}`` is ``generator(random.Random(f"dbbench-{kind}-{i}"))``
TASKS: dict[str, Callable[[random.Random], DbTask]] = {
    "count-team": _count_team,
    "top-scorer": _top_scorer,
    "city-total": _city_total,
    "players-since": _players_since,
    "update-score": _update_score,
    "insert-sale": _insert_sale,
    "delete-small": _delete_small,
}


def build_task(sample_id: str) -> DbTask:
    """The task of ``sample_id`` (``"{kind}-{index:03d}"``), the same every time."""
    kind, _, index = sample_id.rpartition("-")
    return TASKS[kind](random.Random(f"dbbench-{kind}-{int(index)}"))


def expected(task: DbTask) -> list[Any]:
    """What the reference leaves, computed on the host by SQLite itself: a question's rows, or for a change the
    whole table afterwards (sorted as the sandbox's dump sorts it)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(task.init_sql)
        rows = db.execute(task.reference).fetchall()
        if task.change:
            rows = sorted(db.execute(f"SELECT * FROM {task.table}").fetchall(), key=repr)
        return [list(row) for row in rows]
    finally:
        db.close()


def normalise(value: Any) -> str:
    """One answer value as compared: a number in one spelling (``7``, ``"7"``, ``7.0``), text stripped of quotes and
    whitespace and case-folded."""
    text = str(value).strip().strip("\"'`").strip()
    try:
        number = float(text)
    except ValueError:
        return text.casefold()
    return repr(round(number, 6)) if number != int(number) else str(int(number))


def parse_answer(text: str) -> list[Any] | None:
    """The list after ``Final Answer:`` (a JSON or Python list; one bare value is a list of one); None when it is
    not a list of values."""
    body = text.strip().splitlines()[0].strip() if text.strip() else ""
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError):
        return [body] if body and not body.startswith("[") else None
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


@register_environment("dbbench-dev")
class DbBenchEnvironment(SandboxedEnvironment):
    """SQL tasks with answer checking on a SQLite table, each statement run in a bubblewrap sandbox.

    Args:
        limits: the sandbox's per-command limits (default :class:`SandboxLimits`).
    """

    description = (
        "AgentBench DB-bench-style SQL tasks (count, find, sum, list, update, insert, delete) on a throwaway SQLite "
        "table. Act with 'Action: Operation' and a ```sql``` block (one statement), or 'Action: Answer' and "
        "'Final Answer: [...]'. Reward 1.0 for the right values or the right table afterwards, else 0.0."
    )
    max_turns = 8
    task_kinds = TASKS

    def reset(self, sample_id: str, config: dict[str, Any]) -> str:
        self.task = build_task(self.resolve_sample_id(sample_id))
        files = {".dbbench/run.py": _RUNNER, ".dbbench/init.sql": self.task.init_sql}
        self.sandbox = Sandbox(self.limits, files=files)
        made = self.sandbox.run("python3 .dbbench/run.py init")
        if made.exit_code != 0:
            raise RuntimeError(f"dbbench-dev could not build the table of {sample_id}: {made.output[-500:]}")
        return INSTRUCTIONS + self.task.prompt()

    def step(self, action: str) -> Step:
        assert self.sandbox is not None, "step before reset"
        if (answer := _ANSWER.search(action)) is not None and not _OPERATION.search(action[: answer.start()]):
            return self._finish(parse_answer(answer.group(1)))
        if (sql := _SQL.search(action)) is not None:
            result = self.run_sql(sql.group(1))
            info: dict[str, Any] = {"exit_code": result.exit_code, "timed_out": result.timed_out}
            if result.quota_exceeded:
                return Step(_shown(result), 0.0, True, {"success": False, "error": "disk quota exceeded"})
            return Step(_shown(result), 0.0, False, info)
        return Step(
            "Invalid action: use 'Action: Operation' with one ```sql``` block, or 'Action: Answer' with "
            "'Final Answer: [...]'.",
            0.0,
            False,
            {"invalid_action": True},
        )

    def run_sql(self, sql: str) -> CommandResult:
        """Run one statement in the sandbox (fed on stdin behind a delimiter no statement can hold)."""
        assert self.sandbox is not None, "run_sql before reset"
        end = f"SQL_{secrets.token_hex(8)}"
        return self.sandbox.run(f"python3 .dbbench/run.py query <<'{end}'\n{sql.strip()}\n{end}\n")

    def _finish(self, answer: list[Any] | None) -> Step:
        assert self.sandbox is not None
        want = expected(self.task)
        if self.task.change:
            dumped = self.sandbox.run(f"python3 .dbbench/run.py dump {self.task.table}")
            try:
                table = json.loads(dumped.output) if dumped.exit_code == 0 else None
            except json.JSONDecodeError:
                table = None
            success = table == want
        else:
            got = sorted(normalise(v) for v in answer) if answer is not None else None
            success = got == sorted(normalise(v) for row in want for v in row)
        return Step(None, float(success), True, {"success": success})


def _shown(result: CommandResult) -> str:
    text = result.output.strip()
    if len(text) > _SHOWN_CHARS or result.truncated:
        text = text[:_SHOWN_CHARS] + "\n[truncated because the output is too long]"
    if result.timed_out:
        text += "\n[the statement was stopped: it ran past its time limit]"
    if result.memory_exceeded:
        text += "\n[the statement was stopped: it reached its memory budget]"
    return text or "The statement returned nothing."
