"""The ledger's rows as pydantic models: ``Task`` (and the user's registered subclasses), ``DispatchedSamplingTask``,
``Record`` / ``DBRecordData`` and ``InferenceService``. These are plain values: the store (``store.py``) reads and
writes them; nothing here talks to a database.

>>> @register_new_model
... class RFTTask(Task):
...     inputs: list[dict]
...     target: str
>>> task = RFTTask(inputs=[{"role": "user", "content": "1+1"}], target="2")
>>> task_from_row(task_type_name(task), task.payload()) == task
True
"""

from __future__ import annotations

import importlib
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from workers.ledger.errors import NotATask, UnregisteredTaskType

TaskStatus = Literal["pending", "running", "done", "failed"]
ClaimStatus = Literal["running", "done", "failed", "expired"]
ServiceStatus = Literal["up", "down"]

# The fields every Task has; a subclass's own fields are its payload.
BASE_TASK_FIELDS = ("id", "split", "epoch", "status", "attempts", "last_error")


class Task(BaseModel):
    """A sampling task: what must be sampled once per epoch of a split. Subclass it for your task type and
    decorate the subclass with :func:`register_new_model`; the subclass's own fields are the payload.

    ``id`` is the task's identity within its split (the scheduler uses the dataset index when it is ``None``);
    ``split``, ``epoch`` and ``status`` are set by the scheduler and the ledger.
    """

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    split: str | None = None
    epoch: int | None = None
    status: TaskStatus = "pending"
    attempts: int = 0
    last_error: str | None = None

    def payload(self) -> dict[str, Any]:
        """The subclass's own fields, JSON-ready (what the ledger stores in the task row's payload column)."""
        return self.model_dump(mode="json", exclude=set(BASE_TASK_FIELDS))


_REGISTRY: dict[str, type[Task]] = {}
TaskT = TypeVar("TaskT", bound=Task)


def register_new_model(cls: type[TaskT]) -> type[TaskT]:
    """Class decorator: make a ``Task`` subclass storable in (and loadable from) the ledger as its own class.

    Types are registered by class name (a script's ``__main__.RFTTask`` and ``mymodule.RFTTask`` are one type when
    their fields agree); two different types with one name are refused."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise NotATask(f"@register_new_model expects a subclass of Task, got {cls!r}")
    existing = _REGISTRY.get(cls.__qualname__)
    if existing is not None and existing is not cls and not _same_fields(existing, cls):
        raise UnregisteredTaskType(
            f"task type {cls.__qualname__} is registered twice with different fields: "
            f"{task_type_name(existing)} {sorted(existing.model_fields)} and "
            f"{task_type_name(cls)} {sorted(cls.model_fields)}"
        )
    _REGISTRY[cls.__qualname__] = cls
    return cls


def _same_fields(a: type[Task], b: type[Task]) -> bool:
    return {k: f.annotation for k, f in a.model_fields.items()} == {k: f.annotation for k, f in b.model_fields.items()}


def task_type_name(task: Task | type[Task]) -> str:
    """The name a task type is stored under: ``module:QualName`` (so another process can import it)."""
    cls = task if isinstance(task, type) else type(task)
    return f"{cls.__module__}:{cls.__qualname__}"


register_new_model(Task)


def registered_task_types() -> list[str]:
    return sorted(task_type_name(cls) for cls in _REGISTRY.values())


def check_registered(task: Any) -> Task:
    """``task`` itself if it is an instance of a registered ``Task`` type; a typed error naming what arrived."""
    if not isinstance(task, Task):
        raise NotATask(f"expected a Task instance (a @register_new_model subclass of Task), got {type(task).__name__}")
    registered = _REGISTRY.get(type(task).__qualname__)
    if registered is None or (registered is not type(task) and not _same_fields(registered, type(task))):
        raise UnregisteredTaskType(
            f"task type {task_type_name(task)} is not registered: decorate it with @register_new_model; "
            f"registered: {registered_task_types()}"
        )
    return task


def task_class(name: str) -> type[Task]:
    """The registered class stored as ``name`` (``module:QualName``); imports the module first if this process has
    no type of that name yet."""
    module, _, qualname = name.rpartition(":")
    if qualname not in _REGISTRY and module and module != "__main__":
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    try:
        return _REGISTRY[qualname]
    except KeyError:
        raise UnregisteredTaskType(
            f"the ledger holds tasks of type {name}, which is not registered in this process: import the module "
            f"that defines it (decorated with @register_new_model); registered: {registered_task_types()}"
        ) from None


def task_from_row(type_name: str, payload: dict[str, Any], **base: Any) -> Task:
    """Rebuild a task of its own registered class from a row's type, payload and base fields."""
    return task_class(type_name).model_validate({**payload, **base})


class DispatchedSamplingTask(BaseModel):
    """A claim: one worker holds one task until ``lease_deadline`` (renewed by heartbeats)."""

    id: int
    task_key: int  # the ledger's row key of the task (one row per (split, epoch, task id))
    task_id: str
    split: str
    epoch: int
    owner: str
    attempt: int
    status: ClaimStatus
    lease_deadline: float
    created_at: float
    updated_at: float
    last_error: str | None = None


class Record(BaseModel):
    """What a finished claim produced for one sample of a task: exactly one per (task, epoch, sample_index)."""

    id: int | None = None
    task_key: int
    task_id: str
    split: str
    epoch: int
    sample_index: int = 0
    claim_id: int | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    score: float | None = None
    policy_version: int = 0
    partition_id: str | None = None
    global_indexes: list[int] = Field(default_factory=list)
    group_id: str | None = None
    blobs: dict[str, str] = Field(default_factory=dict)  # name -> blob-store key of large objects
    trained_count: int = 0
    last_trained_step: int | None = None
    created_at: float = 0.0


class DBRecordData(BaseModel):
    """The training view of a record: which queue rows hold its tensors, its score and how often it was trained."""

    record_id: int
    task_id: str
    split: str
    epoch: int
    sample_index: int
    group_id: str | None
    score: float | None
    policy_version: int
    partition_id: str | None
    global_indexes: list[int]
    trained_count: int
    last_trained_step: int | None


class InferenceService(BaseModel):
    """A registered inference endpoint. ``kind`` is ``"openai"`` (``url`` serves ``/v1/chat/completions``, e.g.
    ``workers/agents/openai_api.py``, or a bare vLLM server), ``"vllm"`` / ``"sglang"`` (a bare vLLM / SGLang server's
    OpenAI-compatible ``url``, an ``InferenceManager``'s: the kind decides how token ids are asked for and read,
    workers/ledger/services.py) or ``"callable"`` (an in-process coroutine registered under ``actor``)."""

    name: str
    kind: Literal["openai", "vllm", "sglang", "callable"] = "openai"
    url: str | None = None
    actor: str | None = None
    model: str = "policy"
    policy_version: int = 0
    status: ServiceStatus = "up"
    load: float = 0.0
    last_heartbeat: float = 0.0
