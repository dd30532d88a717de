"""Environment: what a task developer writes to put a task behind the task-server protocol.

One episode is one instance: the task server builds a fresh environment per ``POST /api/episode/start``, calls
:meth:`Environment.reset`, then :meth:`Environment.step` once per action, and :meth:`Environment.close` when the
episode ends, is cancelled or expires. Environments know nothing about HTTP or RL; the server enforces the turn limit
and reports ``turn``, ``num_turns`` and ``success``.

A new task is one file::

    from workers.agents.environment import Environment, Step, register_environment

    @register_environment("echo")
    class EchoEnvironment(Environment):
        description = "Repeat the word you are shown."
        max_turns = 1

        @classmethod
        def sample_ids(cls):
            return ["apple", "pear"]

        def reset(self, sample_id, config):
            self.word = self.sample(sample_id)
            return f"Say {self.word}."

        def step(self, action):
            ok = action.strip() == self.word
            return Step(None, float(ok), True, {"success": ok})

and ``python -m workers.agents.task_server echo --port 0`` (built-in names) or ``... mypackage.echo:EchoEnvironment``
serves it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar


class EpisodeError(Exception):
    """Base of the errors an environment raises on purpose (the server maps each to an HTTP status)."""


class UnknownSample(EpisodeError, LookupError):
    """``sample_id`` names no sample of this task (HTTP 404)."""


class InvalidAction(EpisodeError, ValueError):
    """The request itself is wrong: a bad ``config`` or an action the environment cannot take (HTTP 400)."""


class UnknownEnvironment(LookupError):
    """No environment is registered (or importable) under the given name."""


class Step(NamedTuple):
    """What :meth:`Environment.step` returns; unpacks as ``observation, reward, done, info``.

    ``observation`` is ``None`` when the episode is over and there is nothing more to show. ``info`` is JSON-able;
    on the last step it should hold ``success`` (bool).
    """

    observation: str | None
    reward: float
    done: bool
    info: dict[str, Any]


class Environment(ABC):
    """One episode of a task. Subclass it, set the class attributes, implement the three abstract methods.

    ``reset`` and ``step`` may block (run a command, call a tool): the server runs them off its event loop, one call at
    a time per episode.
    """

    #: the name the task is served under (set by :func:`register_environment`)
    name: ClassVar[str] = ""
    #: one paragraph for ``GET /api/task/info``
    description: ClassVar[str] = ""
    #: turn limit; the server ends the episode (``success=False``, ``truncated=True``) when it is reached.
    #: ``config={"max_turns": n}`` at episode start may lower it.
    max_turns: ClassVar[int] = 8
    observation_type: ClassVar[str] = "text"
    action_type: ClassVar[str] = "text"
    #: the most memory one episode may hold (a sandbox's budget), or None for an environment that holds little: the
    #: task server's default ``--max-episodes`` is the memory free at its start divided by this
    episode_memory_bytes: ClassVar[int | None] = None

    @classmethod
    @abstractmethod
    def sample_ids(cls) -> Sequence[str]:
        """The ids of every sample of the task, in a fixed order (``num_samples`` is their count)."""

    @abstractmethod
    def reset(self, sample_id: str, config: dict[str, Any]) -> str:
        """Start the episode on ``sample_id`` and return the first observation.

        Raises:
            UnknownSample: ``sample_id`` is not one of :meth:`sample_ids` (use :meth:`resolve_sample_id`).
            InvalidAction: ``config`` holds something this environment does not accept.
        """

    @abstractmethod
    def step(self, action: str) -> Step:
        """Take one action and return what follows from it."""

    def close(self) -> None:  # noqa: B027  (optional hook: most environments hold nothing)
        """Release what the episode holds (a sandbox, files). Must not raise.

        Called once when the episode ends; called again only at server shutdown if that first call was cut off, so
        it must be idempotent (and may run while a ``step`` is still in its thread: kill, do not wait).
        """

    @classmethod
    def resolve_sample_id(cls, sample_id: str) -> str:
        """``sample_id`` itself if it is a sample id, else the id at that index if it is a decimal index.

        Raises:
            UnknownSample: neither, naming the task's sample count.
        """
        ids = cls.sample_ids()
        if sample_id in ids:
            return sample_id
        if sample_id.isdecimal() and int(sample_id) < len(ids):
            return ids[int(sample_id)]
        first = ", ".join(repr(i) for i in list(ids)[:3])
        raise UnknownSample(
            f"sample_id={sample_id!r} is not a sample of {cls.name or cls.__name__!r}: expected one of its "
            f"{len(ids)} ids ({first}, ...) or an index in [0, {len(ids)})"
        )


E = TypeVar("E", bound=type[Environment])
_REGISTRY: dict[str, type[Environment]] = {}


def register_environment(name: str) -> Callable[[E], E]:
    """Class decorator: serve the class under ``name``. Raises ValueError if another class holds the name."""

    def decorate(cls: E) -> E:
        held = _REGISTRY.get(name)
        if held is not None and held.__qualname__ != cls.__qualname__:
            raise ValueError(f"environment name {name!r} is already registered by {held.__module__}.{held.__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_environments() -> list[str]:
    """Names of the registered environments (the built-in ones included)."""
    importlib.import_module("workers.agents.envs")
    return sorted(_REGISTRY)


def environment_class(name: str) -> type[Environment]:
    """The environment class registered as ``name``, or named ``"package.module:Class"``.

    Raises:
        UnknownEnvironment: naming what is registered.
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise UnknownEnvironment(f"cannot import environment {name!r}: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise UnknownEnvironment(f"{name!r} is {cls!r}, not an Environment subclass")
        if not cls.name:
            cls.name = attr
        return cls
    known = available_environments()
    if name not in _REGISTRY:
        raise UnknownEnvironment(f"no environment named {name!r}; registered: {known} (or pass 'module:Class')")
    return _REGISTRY[name]
