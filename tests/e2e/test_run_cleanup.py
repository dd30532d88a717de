"""A demo run, however it dies, leaves none of its files in ``/dev/shm`` or the temporary directory (issue 25, §3):
stopped by SIGTERM (a scheduler's ``kill``) or SIGINT (Ctrl-C) mid-run, failing with an exception during start-up
once its weight channel exists, or killed outright (SIGKILL of the whole job: its files stay until the next run on
the host sweeps them).

Each run gets a private temporary directory (``TMPDIR``: the driver's and every Ray process's); what our code makes
there (everything but Ray's own ``ray/``) and in ``/dev/shm`` (``tq-weights-<pid>-...``, ``tq-engine-weights-...``)
is compared before and after. The unit tier covers the pieces without Ray: tests/unit/rl_contracts/test_scratch.py,
tests/unit/orchestration/test_run_cleanup.py, tests/unit/orchestration/test_stopping.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl_contracts.scratch import owner_alive, shm_root
from tests.e2e.test_demo import SHORT

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a demo start-up (~8 processes) per way of dying
SCRATCH = re.compile(r"^tq-(?:engine-)?weights-(\d+)-")
# a short run that never ends by itself: no SFT warm-up, GRPO steps until it is stopped
ENDLESS = [*SHORT, "sft.enabled=false", "steps=100000", "checkpoint_every=0"]
# the demo with a start-up that fails after the queue, the actors and the weight channel are up
FAILING_START = """
import sys
import orchestration.grpo_run as grpo_run
def fail(*args, **kwargs):
    raise RuntimeError("start-up failed on purpose")
grpo_run.PromptSource = fail
from recipe.demo import main
sys.exit(main(sys.argv[1:]))
"""


def shm_scratch() -> set[str]:
    root = shm_root() or tempfile.gettempdir()
    return {name for name in os.listdir(root) if SCRATCH.match(name)}


def dead_scratch(names: set[str]) -> list[str]:
    """Those of ``names`` (in /dev/shm) whose owner is dead: left behind."""
    root = shm_root() or tempfile.gettempdir()
    left = []
    for name in names:
        match = SCRATCH.match(name)
        assert match is not None
        path = os.path.join(root, name)
        if os.path.exists(path) and not owner_alive(path, int(match.group(1))):
            left.append(name)
    return sorted(left)


def our_tmp_files(tmpdir: Path) -> list[str]:
    """What our code left in the run's temporary directory: every file outside Ray's ``ray/`` (the per-user socket
    root ``transfer_queue-<uid>`` may stay, empty)."""
    return sorted(
        str(path.relative_to(tmpdir))
        for path in tmpdir.rglob("*")
        if path.relative_to(tmpdir).parts[0] != "ray" and not path.is_dir()
    )


@pytest.fixture
def tmpdir_of_run() -> Iterator[Path]:
    """A short private TMPDIR (Unix socket paths must stay under 108 characters)."""
    path = Path(tempfile.mkdtemp(prefix="tq-e2e-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(out: Path, tmpdir: Path, *args: str) -> subprocess.Popen[str]:
    """The run, its output in files beside ``out`` (a pipe nobody reads until the end would fill and block it)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TMPDIR": str(tmpdir)}
    env.pop("RAY_ADDRESS", None)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = str(len(list(logs.iterdir())) // 2)
    with open(logs / f"{name}.out", "w") as stdout, open(logs / f"{name}.err", "w") as stderr:
        run = subprocess.Popen(
            [sys.executable, *args, f"output_dir={out}", *ENDLESS],
            cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job's SIGINT is ignored
        )  # fmt: skip
    STDERR[run.pid] = logs / f"{name}.err"
    return run


STDERR: dict[int, Path] = {}  # a run's pid -> the file its stderr goes to


def stderr_of(run: subprocess.Popen[str]) -> str:
    return STDERR[run.pid].read_text()


def finish(run: subprocess.Popen[str], timeout: float) -> str:
    """Wait for ``run`` to end; its stderr."""
    run.wait(timeout)
    return stderr_of(run)


def wait_for_a_step(run: subprocess.Popen[str], out: Path, wait_until) -> None:
    """Until the run has trained a step (its weight channel holds published versions) or died."""
    metrics = out / "metrics.jsonl"
    wait_until(
        lambda: run.poll() is not None or (metrics.exists() and '"kind": "grpo"' in metrics.read_text()),
        600,
        what="a GRPO step",
    )
    assert run.poll() is None, stderr_of(run)[-6000:]
    channel = [n for n in shm_scratch() if n.startswith(f"tq-weights-{run.pid}-")]
    assert len(channel) == 1 and any((Path(shm_root() or tempfile.gettempdir()) / channel[0]).glob("*.weights"))


# SIGINT takes the same stop as SIGTERM (tests/unit/orchestration/test_stopping.py; the demo's Ctrl-C test in
# tests/e2e/test_demo.py), and a start-up error is the second run of the SIGKILL test below: each run costs a demo
# start-up, so the slow tier runs those two here only when asked (TQ_ALL_WAYS_TO_DIE=1)
WAYS = [("sigterm", 143)] + ([("sigint", 130), ("start-up-error", 1)] if os.environ.get("TQ_ALL_WAYS_TO_DIE") else [])


@pytest.mark.parametrize(("how", "returncode"), WAYS, ids=lambda x: str(x))
def test_a_run_that_dies_leaves_no_files(tmp_path, tmpdir_of_run, wait_until, how, returncode):
    out = tmp_path / "demo"
    before = shm_scratch()
    if how == "start-up-error":
        run = start(out, tmpdir_of_run, "-c", FAILING_START)
    else:
        run = start(out, tmpdir_of_run, str(ROOT / "recipe" / "demo.py"))
        wait_for_a_step(run, out, wait_until)
        if how == "sigterm":
            os.kill(run.pid, signal.SIGTERM)  # the driver only, as `kill PID` or a job scheduler
        else:
            os.killpg(run.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground process group
    err = finish(run, 300)
    assert run.returncode == returncode, err[-6000:]
    if how == "start-up-error":
        assert "RuntimeError: start-up failed on purpose" in err, err[-6000:]
    else:
        assert re.search(r"^stopped at step \d+; ", err, re.M), err[-3000:]
    assert not [n for n in shm_scratch() if n.startswith(f"tq-weights-{run.pid}-")]
    assert dead_scratch(shm_scratch() - before) == []
    assert our_tmp_files(tmpdir_of_run) == []


def test_a_killed_runs_files_are_swept_by_the_next_run(tmp_path, tmpdir_of_run, wait_until):
    out = tmp_path / "demo"
    before = shm_scratch()
    killed = start(out, tmpdir_of_run, str(ROOT / "recipe" / "demo.py"))
    wait_for_a_step(killed, out, wait_until)
    os.killpg(killed.pid, signal.SIGKILL)  # the whole job, as an OOM kill or a lost node: nothing runs after
    finish(killed, 120)
    assert [n for n in shm_scratch() if n.startswith(f"tq-weights-{killed.pid}-")]  # left behind, for now
    assert our_tmp_files(tmpdir_of_run)  # the queue's socket directories too

    again = start(out, tmpdir_of_run, "-c", FAILING_START, "--new")  # the next run on the host, here a short one
    err = finish(again, 300)
    assert again.returncode == 1 and "start-up failed on purpose" in err, err[-6000:]
    assert dead_scratch(shm_scratch() - before) == []
    assert our_tmp_files(tmpdir_of_run) == []
