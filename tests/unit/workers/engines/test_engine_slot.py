"""EngineSlot: an engine restart and a weight update that race end with the new engine on the newest weights."""

from __future__ import annotations

import threading

import pytest

from workers.rollout import EngineSlot


class Dead(Exception):
    pass


class FakeEngine:
    def __init__(self, name: int):
        self.name, self.version, self.dead = name, 0, False

    def load(self, update) -> int:
        if self.dead:
            raise Dead(f"engine {self.name} is dead")
        self.version = update[0]
        return self.version


def make_slot(block_restart: threading.Event | None = None, started: threading.Event | None = None):
    engines: list[FakeEngine] = []

    def start(restarts: int) -> FakeEngine:
        if restarts and block_restart is not None:
            started.set()
            assert block_restart.wait(5)
        engines.append(FakeEngine(restarts))
        return engines[-1]

    return EngineSlot(start, lambda engine, update: engine.load(update), (Dead,)), engines


def test_an_update_during_a_restart_reaches_the_new_engine():
    release, started = threading.Event(), threading.Event()
    slot, engines = make_slot(release, started)
    slot.update_weights(1)
    engines[0].dead = True
    restart = threading.Thread(target=slot.restart, args=(engines[0],))
    restart.start()
    assert started.wait(5)  # the new engine is being built with version 1 ...
    update = threading.Thread(target=slot.update_weights, args=(2,))
    update.start()  # ... when version 2 is published
    release.set()
    restart.join(5)
    update.join(5)
    assert slot.engine is engines[1] and slot.engine.version == 2
    assert slot.latest == (2, None, None) and slot.restarts == 1


def test_an_update_to_a_dead_engine_starts_one_with_that_version():
    slot, engines = make_slot()
    engines[0].dead = True
    assert slot.update_weights(3, path="/w/v3") == 3
    assert slot.engine is engines[1] and engines[1].version == 3 and slot.restarts == 1
    # the generation thread then finds its engine already replaced: no second restart
    assert slot.restart(engines[0]) is False and slot.restarts == 1


def test_a_failure_that_is_not_an_engine_death_propagates():
    slot, _ = make_slot()
    with pytest.raises(TypeError):
        EngineSlot(
            lambda r: None, lambda e, u: (_ for _ in ()).throw(TypeError("bad weights")), (Dead,)
        ).update_weights(1)
    assert slot.restarts == 0
