"""``actor_class``: a ``@ray.remote`` class as the type checker should see it.

mypy does not apply class decorators (python/mypy#3135): it sees a ``@ray.remote`` class as the plain class, which
has no ``.remote`` or ``.options``. ``actor_class(RolloutWorker).remote(...)`` names, in one place, what the decorator
made of the class at run time. The handles it returns stay untyped (``Any``), as Ray's own handles are.
"""

from __future__ import annotations

from typing import Any, Protocol, cast


class RemoteClass(Protocol):
    """What ``@ray.remote`` makes of a class: ``.remote(...)`` starts an actor, ``.options(...)`` configures one."""

    def remote(self, *args: Any, **kwargs: Any) -> Any: ...

    def options(self, **options: Any) -> RemoteClass: ...


def actor_class(cls: type) -> RemoteClass:
    """``cls`` (a ``@ray.remote`` class) typed as the actor class it is at run time; no copy, no check."""
    return cast(RemoteClass, cls)
