"""Shared pieces of the tiers: one local Ray session, queues reused across tests, ``wait_until``, and
:func:`requirement`, the reason of every skip that CI must not take.

Everything here is opt-in: tests that use no fixture below (the unit tier) never import Ray. Starting a queue costs
seconds on these machines, so queues are started once per configuration and shared; each test gets a
:class:`Queue` view that hands out fresh global steps and partition ids and clears them when the test ends, so
tests never see each other's rows.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

# Before anything imports Ray: bind Ray to 127.0.0.1, so no test sends traffic outside loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

# A test run started with SIGINT ignored (a background job of a non-interactive shell, `(make test &)`, inherits
# SIG_IGN, and so does every process it starts) would make the Ctrl-C tests see no Ctrl-C: Python's own handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

T = TypeVar("T")

#: The prefix of a skip reason that names something CI installs (see :func:`requirement`).
REQUIREMENT = "missing requirement: "


def in_ci() -> bool:
    """True under ``CI=true`` (what GitHub Actions, GitLab and ``.ci/run``'s callers set)."""
    return os.environ.get("CI", "").lower() in ("true", "1")


def requirement(what: str, install: str) -> str:
    """The skip reason for a test that needs something CI installs (bubblewrap, PostgreSQL, Chromium, root...).

    Use it for every such skip: ``pytest.mark.skipif(..., reason=requirement(...))``,
    ``pytest.skip(requirement(...))`` or ``pytest.importorskip(name, reason=requirement(...))`` in a test or fixture
    (not at import time). Elsewhere the test skips, saying what to install; under ``CI=true`` it fails instead
    (:func:`pytest_runtest_makereport`), so that a missing install step cannot turn tests into silent skips while CI
    stays green. Skips CI does not promise (a CUDA device, an IPv6 loopback, optional packages) keep a plain reason.

    >>> requirement("bubblewrap", "apt-get install -y bubblewrap")
    'missing requirement: bubblewrap (apt-get install -y bubblewrap)'
    """
    return f"{REQUIREMENT}{what} ({install})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under ``CI=true``, a skip whose reason :func:`requirement` wrote is a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and isinstance(report.longrepr, tuple) and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2].removeprefix("Skipped: ")
        if reason.startswith(REQUIREMENT):
            report.outcome = "failed"
            report.longrepr = f"CI=true and this test would skip: {reason}; .ci/run must install it"


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """:func:`wait_until`, for test modules (they cannot import this conftest by name reliably)."""
    return wait_until


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray session for the whole run, started on first use."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@dataclass
class StartedQueue:
    """A hand-built controller (and the storage units it started), shared by every test with its configuration."""

    controller: Any
    info: Any
    config: dict[str, Any]
    steps: Iterator[int] = field(default_factory=itertools.count)


class Queue:
    """One test's view of a shared queue: clients, fresh steps and partition ids, all cleaned up afterwards."""

    def __init__(self, started: StartedQueue, name: str):
        self._started = started
        self._name = name
        self._clients: list[Any] = []
        self._steps: list[int] = []
        self._partitions: list[str] = []
        self.client = self.new_client("main")
        self._watcher: Any = None

    @property
    def watcher(self) -> Any:
        """A client with 60 s timeouts for the status polls of a test whose queue gives up within seconds: those
        polls are not what it tests, and a loaded machine can delay the controller's answer past 2 s."""
        if self._watcher is None:
            self._watcher = self.new_client("watcher", timeout=60.0)
        return self._watcher

    @property
    def controller(self) -> Any:
        return self._started.controller

    @property
    def info(self) -> Any:
        return self._started.info

    @property
    def config(self) -> dict[str, Any]:
        return self._started.config

    def new_client(self, client_id: str = "extra", *, timeout: float | None = None) -> Any:
        """A client of this queue; ``timeout`` replaces the queue's default_timeout for its calls."""
        import msgspec

        from transfer_queue import TransferQueueClient

        info = self.info
        if timeout is not None:
            info = msgspec.structs.replace(info, config={**info.config, "default_timeout": timeout})
        client = TransferQueueClient(client_id=f"{self._name}-{client_id}", controller_info=info)
        self._clients.append(client)
        return client

    def step(self) -> int:
        """A global step no test has used on this queue (steps are never reused once cleared)."""
        step = next(self._started.steps)
        self._steps.append(step)
        return step

    def partition(self, prefix: str = "p") -> str:
        """A string partition id no test has used."""
        name = f"{self._name}-{prefix}-{uuid.uuid4().hex[:8]}"
        self._partitions.append(name)
        return name

    def storage_bytes(self) -> int:
        import ray

        return sum(s["bytes"] for s in ray.get(self.controller.storage_stats.remote()))

    def close(self) -> None:
        cleaner = self.new_client("cleanup")
        for step in self._steps:
            cleaner.clear(global_step=step)
        for partition in self._partitions:
            cleaner.clear(partition_id=partition)
        for client in self._clients:
            client.close()


def stop_controller(controller: Any) -> None:
    """Stop a hand-built controller and the storage units it started."""
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=30)
    except Exception:  # already dead: killed below anyway
        pass
    ray.kill(controller)


class QueuePool:
    """Queues by configuration, started on first use and stopped when the session ends."""

    def __init__(self) -> None:
        self._queues: dict[tuple, StartedQueue] = {}

    def get(self, **config: Any) -> StartedQueue:
        import ray

        from transfer_queue import TransferQueueController

        key = tuple(sorted((k, repr(v)) for k, v in config.items()))
        started = self._queues.get(key)
        if started is None:
            controller = TransferQueueController.remote(**config)
            started = StartedQueue(controller, ray.get(controller.get_info.remote()), config)
            self._queues[key] = started
        return started

    def close(self) -> None:
        import ray

        controllers = [started.controller for started in self._queues.values()]
        stopping = [controller.shutdown.remote() for controller in controllers]  # all at once, then waited for
        for controller, ref in zip(controllers, stopping, strict=True):
            try:
                ray.get(ref, timeout=30)
            except Exception:  # already dead: killed below anyway
                pass
            ray.kill(controller)
        self._queues.clear()


# The configurations tests share: plain rows over two storage units, and GRPO groups of 4. Every storage unit is a
# process that imports torch (seconds here), so the queues that need no second unit get one.
DEFAULT_QUEUE = {"global_batch_size": 16, "num_global_batch": 4, "num_n_samples": 1, "default_timeout": 15.0}
GRPO_QUEUE = {
    "global_batch_size": 4,
    "num_global_batch": 4,
    "num_n_samples": 4,
    "default_timeout": 15.0,
    "num_storage_units": 1,
}
# Small limits for fault and backpressure tests: operations give up within seconds, abandoned puts are aborted
# quickly, two steps are live at most, and the storage holds 1 MiB.
FAST_QUEUE = {
    "global_batch_size": 8,
    "num_global_batch": 2,
    "num_n_samples": 1,
    "default_timeout": 2.0,
    "put_grace": 1.0,
    "num_storage_units": 1,
    "storage_unit_bytes": 1 << 20,
}


@pytest.fixture(scope="session")
def queue_pool(ray_session: Any) -> Iterator[QueuePool]:
    pool = QueuePool()
    yield pool
    pool.close()


@pytest.fixture
def make_view(queue_pool: QueuePool, request: pytest.FixtureRequest) -> Iterator[Callable[..., Queue]]:
    """``make_view(**config)``: this test's view of the shared queue with that configuration."""
    views: list[Queue] = []

    def make(**config: Any) -> Queue:
        view = Queue(queue_pool.get(**config), request.node.name[:40])
        views.append(view)
        return view

    yield make
    for view in views:
        view.close()


@pytest.fixture
def queue(make_view: Callable[..., Queue]) -> Queue:
    """The shared plain queue: steps of 16 rows, groups of 1, four steps live."""
    return make_view(**DEFAULT_QUEUE)


@pytest.fixture
def grpo_queue(make_view: Callable[..., Queue]) -> Queue:
    """The shared GRPO queue: steps of 4 prompts x 4 responses, four steps live."""
    return make_view(**GRPO_QUEUE)


@pytest.fixture
def fast_queue(make_view: Callable[..., Queue]) -> Queue:
    """The shared queue with 2 s timeouts and a 1 s put grace."""
    return make_view(**FAST_QUEUE)
