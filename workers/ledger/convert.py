"""``convert_record_to_data_func``: the hook (AgentRL's name) that turns a ledger ``Record`` into training data, the
same on both paths of a run that learns from the ledger's records: training from the records the ledger holds
(orchestration/ledger_run.py's ``ledger_rows``, ``enable_sampling=false``) and sampling, where each finished group's
records pass through it on their way into the queue (``AsyncSampler`` with a sink, ``sampled_row``).

The hook is called with one ``Record`` (its ``messages``, ``score``, ``policy_version``, ``blobs`` ...) and returns
``RecordData``, a dict ``{"prompt_ids": [int, ...], "response_ids": [int, ...]}``: the tokens of the prompt and of
the answer the policy is trained on (the default, ``orchestration.ledger_run.default_convert_record_to_data``,
renders ``messages[:-1]`` with the run's chat format and tokenises the last message's content). It returns None (or
``[]``) to skip the record: it is not trained, and neither is its GRPO group (a step trains whole groups).

With sampling, a hook that returns the very tokens sampled (the row's ``prompt_ids`` and ``response_ids``) keeps the
sampler's per-token log-probs and policy version; one that returns other tokens puts them into the queue without
log-probs (``response_logprobs`` empty), and the trainer takes the policy's own log-probs of them as the old ones
(``LedgerGRPOTrainer``, as for rows rebuilt from ledger records).

Give it as a callable or, on a command line or in a config, as a dotted name ``"package.module:function"`` (or
``"package.module.function"``):

>>> resolve_convert_record_to_data_func("json:dumps").__name__
'dumps'
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypedDict

from rl_contracts.task import import_object
from workers.ledger.errors import InvalidRecordConverter, InvalidRecordData
from workers.ledger.models import Record


class RecordData(TypedDict):
    """One record's training data: the prompt's and the answer's token ids (the answer non-empty)."""

    prompt_ids: list[int]
    response_ids: list[int]


EXPECTED = (
    "a dict {'prompt_ids': [int, ...], 'response_ids': [int, ...]} (the answer non-empty), or None / [] to skip "
    "the record"
)


def resolve_convert_record_to_data_func(spec: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The hook ``spec`` names: a callable as it is, a dotted ``"module:function"`` / ``"module.function"`` imported,
    None as None (the caller's default).

    Raises:
        InvalidRecordConverter: a name that does not import, or that names something not callable, or a ``spec``
            that is neither a string nor a callable.
    """
    if spec is None or (callable(spec) and not isinstance(spec, str)):
        return spec
    if not isinstance(spec, str):
        raise InvalidRecordConverter(
            f"convert_record_to_data_func: expected a callable or a dotted name 'package.module:function', got a "
            f"{type(spec).__name__} ({spec!r:.100})"
        )
    try:
        fn = import_object(spec)
    except ValueError as exc:
        raise InvalidRecordConverter(
            f"convert_record_to_data_func: expected a dotted name 'package.module:function' of an importable "
            f"function, got {spec!r}: {exc}"
        ) from None
    if not callable(fn):
        raise InvalidRecordConverter(
            f"convert_record_to_data_func: expected {spec!r} to name a function of one Record, got a "
            f"{type(fn).__name__}"
        )
    return fn


def convert_record(fn: Callable[..., Any], record: Record) -> RecordData | None:
    """``fn(record)`` checked: its ``RecordData`` (ids as ints), or None when it skips the record.

    Raises:
        InvalidRecordData: a result of another shape, naming the hook, the record, what was expected and what arrived.
    """
    data = fn(record)
    if data is None or (isinstance(data, list) and not data):
        return None
    name = getattr(fn, "__qualname__", repr(fn))
    where = f"convert_record_to_data_func {name} of record {record.id} (task {record.task_id})"
    if not isinstance(data, dict):
        raise InvalidRecordData(f"{where}: expected {EXPECTED}, got a {type(data).__name__}: {data!r:.200}")
    missing = [key for key in ("prompt_ids", "response_ids") if key not in data]
    if missing:
        raise InvalidRecordData(f"{where}: expected {EXPECTED}, got a dict without {missing}: keys {sorted(data)}")
    checked: dict[str, list[int]] = {}
    for key in ("prompt_ids", "response_ids"):
        ids = data[key]
        if hasattr(ids, "tolist"):  # a tensor or an array of ids
            ids = ids.tolist()
        integers = isinstance(ids, list | tuple) and all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids
        )
        if not integers:
            raise InvalidRecordData(f"{where}: expected {key} a list of ints, got {ids!r:.200}")
        checked[key] = [int(i) for i in ids]
    if not checked["response_ids"]:
        raise InvalidRecordData(f"{where}: expected a non-empty response_ids (the answer trained on), got []")
    return RecordData(prompt_ids=checked["prompt_ids"], response_ids=checked["response_ids"])


def sampled_row(fn: Callable[..., Any], record: Record, row: dict[str, Any]) -> dict[str, Any] | None:
    """The queue row of a sampled ``record`` through the hook ``fn``: ``row`` (the sampler's: ``prompt_ids``,
    ``response_ids``, ``response_logprobs``, ``policy_version``, ...) as it is when ``fn`` returns its very tokens;
    the hook's tokens with ``response_logprobs`` empty (none: the sampler's belong to other tokens) when it returns
    others; None when it skips the record.

    Raises:
        InvalidRecordData: as ``convert_record``.
    """
    data = convert_record(fn, record)
    if data is None:
        return None
    if data["prompt_ids"] == list(row["prompt_ids"]) and data["response_ids"] == list(row["response_ids"]):
        return row
    return {**row, "prompt_ids": data["prompt_ids"], "response_ids": data["response_ids"], "response_logprobs": []}
