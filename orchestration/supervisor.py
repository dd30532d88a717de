"""Supervisor: the run goes on when a rollout or reward worker dies (its process killed, ``ray.kill``).

The workers are Ray actors started with ``max_restarts`` (``rollout.max_worker_restarts``): Ray starts a dead one again
(the same constructor arguments: a new queue client, a new engine). What it does not do is finish the work the dead
one had; the supervisor does, with the queue's at-least-once delivery:

- the rows the dead worker held come back to ready ``disconnect_grace`` (5 s) after its connections closed: the
  rollout and reward tasks acknowledge after the worker's put (``rl_contracts.lost_rows.WORKER_TASK_OPTIONS``), and
  a second put of rows whose first worker died between its put and its ack is refused, never written twice;
- each step call the dead worker had (``generate_step`` / ``score_step``; they fail with a ``RayActorError``) is made
  again on the restarted actor (only when its process is new: a call that failed with ``ActorUnavailableError``, the
  worker unreachable for a while but alive, may still run on it and is not made twice), in its redo concurrency
  group (a call for a later step may be waiting in the step group for weights this step's training publishes),
  which runs several calls at once (a redo of step s + 1 may be waiting there for rows of its own, and Ray may
  report the failures of one death in any order);
- the calls are made again once those rows are back (``disconnect_grace`` after the death was seen, plus a second):
  a call made sooner would find them leased to the dead worker, end the step for itself, and leave them to nobody;
- a restarted rollout worker is sent the weights last published (``weight_sync`` memory or disk; with the shm channel
  its engine pulls them itself), so it never samples from older weights than the others.

The driver's wait for the trainer (``LostPrompts.wait``) calls :meth:`Supervisor.check` once a second. Restarts are
counted by the worker's process id (``pid()``: a restarted worker has a new one) and land in the step's metrics row
(``restarts_rollout``, ``restarts_reward``); a worker killed while it had no call in flight fails no call, so every
``PID_LOOK_S`` the supervisor also asks each worker its process id. A worker whose restarts are spent ends the run
with :class:`WorkerLost`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

logger = logging.getLogger(__name__)
#: after the grace, the seconds the supervisor waits on top before it makes a dead worker's calls again
GRACE_MARGIN_S = 1.0
#: the longest the supervisor waits for Ray to bring a dead worker back (its constructor runs again)
RESTART_WAIT_S = 300.0
#: seconds between two looks at every worker's process id (and the longest one waits for a worker's answer): a worker
#: killed while it had no call in flight fails no call, so its restart is seen only so (and the weights last
#: published are sent to it then)
PID_LOOK_S = 5.0

KINDS = ("rollout", "reward")  # the workers supervised, in the order of a pending step's (rollout, reward) refs


class WorkerLost(RuntimeError):
    """A rollout or reward worker died and Ray did not restart it (its ``rollout.max_worker_restarts`` are spent)."""


@dataclass(frozen=True)
class Call:
    """One step call of a worker: made again on the restarted worker when this one fails with the worker's death."""

    kind: str  # "rollout" or "reward"
    index: int  # the worker's index in the run's list of that kind
    step: int
    pid: int | None = None  # the worker's process when the call was made: made again only on a new one


class Supervisor:
    """Restarts' bookkeeping and the step calls of the run's workers.

    Args:
        workers: ``{"rollout": [...], "reward": [...]}``, the run's actor handles (each with ``pid()``).
        call: ``call(kind, index, step) -> ObjectRef``: the worker's step call made again (in its redo group).
        on_restart: ``on_restart(kind, index)``: after a restart was seen (e.g. send the weights last published).
        client: the driver's queue client (its ``config.disconnect_grace``: when a dead worker's rows are back).
        budget: ``rollout.max_worker_restarts``, for :class:`WorkerLost`'s message.
    """

    def __init__(
        self,
        workers: dict[str, list[Any]],
        call: Callable[[str, int, int], Any],
        on_restart: Callable[[str, int], None],
        client: Any,
        budget: int,
    ):
        self.workers = workers
        self.call_again = call
        self.on_restart = on_restart
        self.client = client
        self.budget = budget
        self.pids = {kind: ray.get([w.pid.remote() for w in handles]) for kind, handles in workers.items()}
        self.calls: dict[Any, Call] = {}  # the step calls made, by their ref
        self.ok: set[Any] = set()  # refs that ended well (not looked at again)
        self.lived: set[Any] = set()  # refs that failed while their worker lived on (not made again, not looked at)
        self.restarts = dict.fromkeys(KINDS, 0)  # since the run started
        self._reported = dict.fromkeys(KINDS, 0)  # what take_restarts() handed out
        self.grace_s = float(getattr(getattr(client, "config", None), "disconnect_grace", 5.0))
        self.back_at = 0.0  # monotonic time the rows of the last death seen are back (its grace ended)
        self._next_look = time.monotonic() + PID_LOOK_S  # the next look at every worker's pid (idle deaths)
        self.calls_made_again = 0

    def track(self, kind: str, index: int, step: int, ref: Any) -> Any:
        """Remember the step call ``ref`` (``kind`` worker ``index``, ``step``); returns it."""
        self.calls[ref] = Call(kind, index, step, self.pids[kind][index])
        return ref

    def check(self, pending: dict[int, tuple[list[Any], list[Any]]]) -> None:
        """The ended calls of the ``pending`` steps: the calls that failed with their worker's death are made again on
        the restarted worker (their refs replaced in ``pending``), in step order, in the workers' redo group (it runs
        several at once: ``rl_contracts.stages.REDO_CONCURRENCY``); any other failure is raised (it fails the run,
        as before)."""
        failed = self._failed(pending)
        for kind, index, exc in {(c.kind, c.index): (c.kind, c.index, e) for _, _, _, c, e in failed}.values():
            self.restarted(kind, index, exc)
        for step, refs, position, call, exc in sorted(failed, key=lambda f: (f[0], KINDS.index(f[3].kind))):
            if call.pid is not None and self.pids[call.kind][call.index] == call.pid:
                # the same process answers: it was unreachable for a while (ActorUnavailableError), not dead; the call
                # may still run on it (its rows are its own), so it is not made twice; gather() leaves it out
                logger.warning("step %d: %s worker %d's call failed (%s) but the worker lived on; not made again",
                               step, call.kind, call.index, type(exc).__name__)  # fmt: skip
                self.lived.add(refs[position])
                continue
            logger.warning("step %d: %s worker %d's call failed with its death; making it again", step, call.kind,
                           call.index)  # fmt: skip
            self.calls.pop(refs[position], None)
            refs[position] = self.call(call.kind, call.index, step)
        if time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + PID_LOOK_S
            self._look_at_pids()

    def _look_at_pids(self) -> None:
        """A worker Ray restarted while it had no call in flight (killed between two steps) failed no call: its new
        process id says so. Its restart is counted and ``on_restart`` called (a rollout worker gets the weights
        last published: a new process starts from the task's initial ones)."""
        for kind, handles in self.workers.items():
            for index, worker in enumerate(handles):
                try:
                    pid = ray.get(worker.pid.remote(), timeout=PID_LOOK_S)
                except (ActorUnavailableError, GetTimeoutError):  # being restarted, or busy: seen at the next look
                    continue
                except RayActorError as exc:  # dead and not restarted: WorkerLost
                    self.restarted(kind, index, exc)
                    continue
                if pid != self.pids[kind][index]:
                    self.restarted(kind, index)

    def _failed(
        self, pending: dict[int, tuple[list[Any], list[Any]]]
    ) -> list[tuple[int, list[Any], int, Call, BaseException]]:
        """``(step, refs, position, call, error)`` of each ended call of ``pending`` that failed with its worker's
        death; other failures are raised, calls that ended well noted."""
        failed: list[tuple[int, list[Any], int, Call, BaseException]] = []
        for step in sorted(pending):
            for refs in pending[step]:
                for position, ref in enumerate(refs):
                    if ref in self.ok or ref in self.lived or not _done(ref):
                        continue
                    try:
                        ray.get(ref)
                        self.ok.add(ref)
                    except RayActorError as exc:
                        call = self.calls.get(ref)
                        if call is None:  # a call the supervisor does not know: nothing to make again
                            raise
                        failed.append((step, refs, position, call, exc))
        return failed

    def gather(self, step: int, refs: list[Any]) -> list[dict[str, Any]]:
        """The results of a trained step's calls of one kind; a call that failed with its worker's death is left out
        (the step's rows are trained: what it held was done by others), its restart noted."""
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except RayActorError as exc:
                call = self.calls.get(ref)
                if call is None:
                    raise
                self.restarted(call.kind, call.index, exc)
        for ref in refs:
            self.calls.pop(ref, None)
            self.ok.discard(ref)
            self.lived.discard(ref)
        return out

    def call(self, kind: str, index: int, step: int) -> Any:
        """Make worker ``index`` of ``kind``'s call of ``step`` again, once the rows of the last death are back."""
        time.sleep(max(0.0, self.back_at - time.monotonic()))
        self.calls_made_again += 1
        return self.track(kind, index, step, self.call_again(kind, index, step))

    def restarted(self, kind: str, index: int, cause: BaseException | None = None) -> None:
        """Wait for worker ``index`` of ``kind`` to be up again (Ray restarts it); count the restart if its process
        is new, and call ``on_restart``.

        Raises:
            WorkerLost: Ray did not restart it (its restarts are spent).
        """
        seen = time.monotonic()  # the death happened before: its rows are back a grace after this at the latest
        deadline = seen + RESTART_WAIT_S
        while True:
            try:
                pid = ray.get(self.workers[kind][index].pid.remote())
                break
            except ActorUnavailableError:  # being restarted
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            except RayActorError as exc:
                raise WorkerLost(
                    f"{kind} worker {index} died and was not restarted: expected one of its "
                    f"rollout.max_worker_restarts={self.budget} restarts, got {type(exc).__name__} ({cause})"
                ) from exc
        if pid == self.pids[kind][index]:
            return  # this death was seen already (its other calls)
        self.back_at = max(self.back_at, seen + self.grace_s + GRACE_MARGIN_S)
        self.pids[kind][index] = pid
        self.restarts[kind] += 1
        logger.warning(
            "%s worker %d died (%s); Ray restarted it (pid %d), restart %d of the run's %s workers",
            kind, index, type(cause).__name__ if cause else "?", pid, self.restarts[kind], kind,
        )  # fmt: skip
        self.on_restart(kind, index)

    def take_restarts(self) -> dict[str, int]:
        """``{"restarts_rollout": n, "restarts_reward": m}``: the restarts seen since the last call (a step's row)."""
        out = {f"restarts_{kind}": self.restarts[kind] - self._reported[kind] for kind in KINDS}
        self._reported = dict(self.restarts)
        return out


def when_up(call: Callable[[], Any], wait_s: float = RESTART_WAIT_S) -> Any:
    """``call()`` (a ``ray.get`` of an actor's method), asked again while its actor is being restarted (a worker
    killed again right after its restart, the controller replaying its journal), for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _done(ref: Any) -> bool:
    done, _ = ray.wait([ref], timeout=0)
    return bool(done)
