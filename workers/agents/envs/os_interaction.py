"""os-interaction: AgentBench-style shell tasks in a bubblewrap sandbox, with answer checking.

Each sample builds a small directory tree (logs, CSV files, notes) from its own seed, asks a question about it or asks
for a change to it, and checks the agent's ``answer(...)`` against the value computed from the files, or, for a
change, runs a check command in the sandbox after ``finish``. The agent acts as in AgentBench's OS task::

    Think: count the logs.
    Act: bash
    ```bash
    find logs -name '*.log' | wc -l
    ```

and is shown ``The output of the OS:`` and what the command printed. Every command runs in the episode's
:class:`~workers.agents.sandbox.Sandbox` (no network, its own namespaces, CPU / wall / memory / process limits).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.agents.environment import Step, register_environment
from workers.agents.envs.sandboxed import SandboxedEnvironment
from workers.agents.sandbox import CommandResult, Sandbox

INSTRUCTIONS = """You are an assistant that will act like a person. I will play the role of a Linux (Ubuntu) operating \
system. Your goal is to implement the operations required by me or answer the question proposed by me. For each of \
your turns, you should first think about what you should do, and then take exactly one of the three actions: "bash", \
"finish" or "answer".

1. If you think you should execute some bash code, take bash action, and you should print like this:
Think: put your thought here.
Act: bash
```bash
# put your bash code here
```

2. If you think you have finished the task, take finish action, and you should print like this:
Think: put your thought here.
Act: finish

3. If you think you have got the answer to the question, take answer action, and you should print like this:
Think: put your thought here.
Act: answer(Your answer to the question should be put in this pair of parentheses)

If the output is too long, I will truncate it. Your working directory is /home/agent.
Now, my problem is:

"""
_BASH = re.compile(r"```(?:bash|sh)?\s*\n(.*?)```", re.DOTALL)
#: on one line, up to its last ")": an answer may hold parentheses, and text may follow on later lines
_ANSWER = re.compile(r"Act:\s*answer\((.*)\)")
_FINISH = re.compile(r"Act:\s*finish\b")
#: output shown to the agent per command (AgentBench truncates similarly)
_SHOWN_CHARS = 800


@dataclass(frozen=True)
class OsTask:
    """One sample: the files to create, the question, and how to check the outcome."""

    question: str
    files: dict[str, str]
    #: the expected answer for ``answer(...)`` tasks; None for tasks checked by ``check`` after ``finish``
    answer: str | None = None
    #: a bash command that exits 0 when a ``finish`` task was done
    check: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(n)]


def _count_logs(rng: random.Random) -> OsTask:
    files = {}
    for i in range(rng.randint(8, 20)):
        folder = rng.choice(["logs", "logs/app", "logs/app/old", "logs/db"])
        files[f"{folder}/f{i:02d}.{rng.choice(['log', 'log', 'txt', 'gz'])}"] = "entry\n" * rng.randint(1, 5)
    count = sum(path.endswith(".log") for path in files)
    return OsTask(
        "How many files with the extension .log are there in logs/, including its subdirectories?", files, str(count)
    )


def _find_line(rng: random.Random) -> OsTask:
    lines = [" ".join(_words(rng, rng.randint(3, 7))) for _ in range(rng.randint(30, 80))]
    key = f"token{rng.randint(1000, 9999)}"
    where = rng.randrange(len(lines))
    lines[where] += f" {key}"
    question = f"Which line number of notes.txt contains the word {key}? Answer with the line number only."
    return OsTask(question, {"notes.txt": "\n".join(lines) + "\n"}, str(where + 1))


def _sum_column(rng: random.Random) -> OsTask:
    rows = [(w, rng.randint(1, 500)) for w in _words(rng, rng.randint(10, 40))]
    body = "name,amount\n" + "".join(f"{name},{amount}\n" for name, amount in rows)
    return OsTask("What is the sum of the amount column of data.csv?", {"data.csv": body}, str(sum(a for _, a in rows)))


def _largest_file(rng: random.Random) -> OsTask:
    names = sorted(set(_words(rng, 8)))
    sizes = rng.sample(range(100, 5000), len(names))
    files = {f"docs/{n}.md": "x" * s for n, s in zip(names, sizes, strict=True)}
    largest = names[sizes.index(max(sizes))]
    return OsTask(
        "Which file in docs/ is the largest? Answer with its file name (e.g. name.md).", files, f"{largest}.md"
    )


def _distinct_users(rng: random.Random) -> OsTask:
    users = _words(rng, rng.randint(3, 9))
    lines = [
        f"2026-01-{rng.randint(1, 28):02d} user={rng.choice(users)} action={rng.choice(['get', 'put'])}"
        for _ in range(rng.randint(40, 120))
    ]
    count = len({line.split()[1] for line in lines})
    return OsTask("How many distinct users appear in access.log?", {"access.log": "\n".join(lines) + "\n"}, str(count))


def _write_count(rng: random.Random) -> OsTask:
    lines = rng.randint(5, 60)
    question = (
        "Create a file named report.txt in your working directory containing only the number of lines of "
        "input.txt, then finish."
    )
    return OsTask(
        question, {"input.txt": "row\n" * lines}, check=f'test "$(tr -d "[:space:]" < report.txt)" = "{lines}"'
    )


#: kind -> generator; sample ``{kind}-{i:03d}`` is ``generator(random.Random(f"{kind}-{i}"))``
TASKS: dict[str, Callable[[random.Random], OsTask]] = {
    "count-logs": _count_logs,
    "find-line": _find_line,
    "sum-column": _sum_column,
    "largest-file": _largest_file,
    "distinct-users": _distinct_users,
    "write-count": _write_count,
}


def build_task(sample_id: str) -> OsTask:
    """The task of ``sample_id`` (``"{kind}-{index:03d}"``), the same every time."""
    kind, _, index = sample_id.rpartition("-")
    return TASKS[kind](random.Random(f"{kind}-{int(index)}"))


def normalise(answer: str) -> str:
    """An answer as compared: stripped of whitespace, quotes and a trailing period, case-folded."""
    return answer.strip().strip("\"'`").strip().rstrip(".").casefold()


@register_environment("os-interaction")
class OsInteractionEnvironment(SandboxedEnvironment):
    """Shell tasks with answer checking; every command runs in a fresh bubblewrap container on the episode's files.

    Args:
        limits: the sandbox's per-command limits (default :class:`SandboxLimits`).
    """

    description = (
        "AgentBench-style Linux tasks (count files, find a line, sum a column, change files) on a throwaway "
        "directory tree. Act with 'Act: bash' and a ```bash``` block, 'Act: answer(...)' or 'Act: finish'. "
        "Reward 1.0 for a correct answer or a change that passes its check, else 0.0."
    )
    max_turns = 8
    task_kinds = TASKS

    def reset(self, sample_id: str, config: dict[str, Any]) -> str:
        self.task = build_task(self.resolve_sample_id(sample_id))
        self.sandbox = Sandbox(self.limits, files=self.task.files)
        return INSTRUCTIONS + self.task.question

    def step(self, action: str) -> Step:
        assert self.sandbox is not None, "step before reset"
        if (answer := _ANSWER.search(action)) is not None:
            return self._finish(answer.group(1), None)
        if (code := _BASH.search(action)) is not None:
            result = self.sandbox.run(code.group(1))
            if result.quota_exceeded:
                return Step(_shown(result), 0.0, True, {"success": False, "error": "disk quota exceeded"})
            info = {"exit_code": result.exit_code, "timed_out": result.timed_out}
            return Step(
                _shown(result), 0.0, False, info | ({"memory_exceeded": True} if result.memory_exceeded else {})
            )
        if _FINISH.search(action) is not None:
            if self.task.check is None:
                return self._finish(None, None)
            return self._finish(None, self.sandbox.run(self.task.check))
        return Step(
            "Invalid action: use 'Act: bash' with a ```bash``` block, 'Act: answer(...)' or 'Act: finish'.",
            0.0,
            False,
            {"invalid_action": True},
        )

    def _finish(self, answer: str | None, check: CommandResult | None) -> Step:
        if self.task.answer is not None:
            success = answer is not None and normalise(answer) == normalise(self.task.answer)
        else:
            success = check is not None and check.exit_code == 0 and not check.timed_out
        return Step(None, float(success), True, {"success": success})


def _shown(result: CommandResult) -> str:
    text = result.output
    if len(text) > _SHOWN_CHARS or result.truncated:
        text = text[:_SHOWN_CHARS] + "\n[truncated because the output is too long]"
    if result.timed_out:
        text += "\n[the command was killed: it ran past its time limit]"
    if result.quota_exceeded:
        text += "\n[the working directory is full: it reached its disk quota]"
    if result.memory_exceeded:
        text += "\n[a process was killed: the episode's processes together reached their memory budget]"
    return "The output of the OS:\n" + text if text.strip() else "The output of the OS is empty."
