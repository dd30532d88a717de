"""Watching storage units through Ray: a unit whose actor died, or whose node died, is down for good.

The controller follows its connection to each unit too (a dropped connection or missed heartbeats mark it down
until it is back); this watcher adds what only Ray knows. :func:`units_on_dead_nodes` is the logic (no Ray);
:class:`UnitWatcher` is the thread the controller actor runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

logger = logging.getLogger(__name__)
PING_EVERY = 1.0  # seconds between liveness calls to each unit (one outstanding at a time)
NODES_EVERY = 2.0  # seconds between looks at Ray's node table


def units_on_dead_nodes(unit_nodes: Sequence[str], alive_nodes: Collection[str]) -> dict[int, str]:
    """The units whose Ray node is not alive, with why. Units outside Ray (node id "") are never judged here.

    >>> units_on_dead_nodes(["a", "b", ""], {"a"})
    {1: 'its Ray node b died'}
    """
    dead = [(u, node) for u, node in enumerate(unit_nodes) if node and node not in alive_nodes]
    return {u: f"its Ray node {node[:12]} died" for u, node in dead}


class UnitWatcher:
    """Asks Ray about each storage unit: a liveness call that fails because the actor died for good (Ray will not
    restart it), or the unit's node leaving Ray's table of alive nodes, marks the unit down for good through
    ``mark(unit, why, final=True)``. A unit Ray is restarting is down for now; once a liveness call answers with a new
    incarnation (also after its node died, restarted elsewhere), ``restarted(unit)`` is called (it attaches the new
    incarnation; True when done) and the unit is up again.

    Args:
        units: the units' actor handles.
        unit_nodes: each unit's Ray node id ("" if unknown).
        mark: the controller's ``mark_unit``.
        incarnations: each unit's incarnation id now (None: learned from the first liveness call).
        restarted: called from this thread when a unit comes back as a new incarnation.
        restartable: Ray restarts dead units (their node's death is not final).
    """

    def __init__(
        self,
        units: Sequence[Any],
        unit_nodes: Sequence[str],
        mark: Callable[..., None],
        incarnations: Sequence[str | None] | None = None,
        restarted: Callable[[int], bool] | None = None,
        restartable: bool = False,
    ):
        self._units = list(units)
        self._nodes = list(unit_nodes)
        self._mark = mark
        self._incarnations: list[str | None] = (
            list(incarnations) if incarnations is not None else [None] * len(self._units)
        )
        self._restarted = restarted
        self._restartable = restartable
        self._dead: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tq-unit-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        pending: dict[Any, int] = {}
        since_nodes = NODES_EVERY
        while not self._stop.wait(PING_EVERY):
            for u, unit in enumerate(self._units):
                # a dead unit Ray may still restart (elsewhere, after its node died) is watched for its return
                if (u not in self._dead or self._restartable) and u not in pending.values():
                    pending[unit.incarnation.remote()] = u
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                u = pending.pop(ref)
                try:
                    incarnation = ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    continue  # unreachable for now (a partition, or Ray is restarting it): the connection watch says so
                except ray.exceptions.RayActorError as exc:
                    self._down(u, f"its Ray actor died ({type(exc).__name__})")
                    continue
                except Exception:  # a unit that raises is alive
                    continue
                self._follow_incarnation(u, incarnation)
            since_nodes += PING_EVERY
            if since_nodes >= NODES_EVERY:
                since_nodes = 0.0
                try:
                    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                except Exception:  # the GCS is unreachable: nothing to conclude
                    continue
                for u, why in units_on_dead_nodes(self._nodes, alive).items():
                    self._down(u, why)  # for good, unless Ray restarts it elsewhere (a new incarnation)

    def _follow_incarnation(self, unit: int, incarnation: Any) -> None:
        known = self._incarnations[unit]
        if known is None or not isinstance(incarnation, str):
            self._incarnations[unit] = incarnation if isinstance(incarnation, str) else None
            return
        if incarnation == known or self._restarted is None:
            return
        try:
            done = self._restarted(unit)
        except Exception:  # tried again at the next liveness call
            logger.exception("attaching restarted storage unit %d failed; trying again", unit)
            return
        if done:
            self._incarnations[unit] = incarnation
            self._dead.discard(unit)
            self._nodes[unit] = ""  # it may run on another node now; its death is reported by its liveness calls

    def _down(self, unit: int, why: str) -> None:
        if unit not in self._dead:
            self._dead.add(unit)
            logger.warning("storage unit %d: %s", unit, why)
            self._mark(unit, why, final=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
