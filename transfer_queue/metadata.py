"""What a batch is, without its tensors: :class:`FieldSchema` and :class:`BatchMeta`.

A ``BatchMeta`` names rows of one partition (their global indexes and GRPO group ids), the fields it covers with
their schema, and where each (row, field) payload lives in the storage units (a block id and an offset in that
block). ``get_meta`` returns one; ``get_data`` turns it into a TensorDict; ``put(..., metadata=meta)`` writes new
fields into its rows. Operations here are pure and O(rows in the batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

from transfer_queue.errors import InvalidRequest, UnknownField

FieldKind = Literal["dense", "jagged", "object"]
_PER_ROW = ("keys", "custom_meta")  # entries of ``extra`` that hold one value per row
PartitionKey = int | str


class FieldSchema(msgspec.Struct, frozen=True, array_like=True):
    """How one field is stored.

    ``kind`` is ``dense`` (a ``[rows, *shape]`` tensor), ``jagged`` (rows of different length along their first
    dimension: values ``[total, *shape]`` + offsets; comes back as a nested tensor) or ``object`` (str, bytes or
    msgpack-encodable values; comes back as non-tensor data). ``dtype`` is a torch dtype name such as ``float32``
    (``object`` for object fields); ``shape`` is the per-row shape (dense) or the trailing shape after the
    ragged dimension (jagged).
    """

    kind: FieldKind
    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Runs on decode too, where msgspec turns the error into a ValidationError (MalformedMessage).
        if self.kind not in ("dense", "jagged", "object"):
            raise InvalidRequest(f"a field's kind is dense, jagged or object, got {self.kind!r}")
        if any(d < 0 for d in self.shape):
            raise InvalidRequest(f"a field's shape has no negative dimension, got {list(self.shape)}")

    def describe(self) -> str:
        if self.kind == "object":
            shape = list(self.shape) if self.shape else ""
            return "object" if self.dtype == "object" else f"object {self.dtype}{shape}"
        dims = ", ".join(str(d) for d in self.shape)
        row = f"[*, {dims}]" if self.kind == "jagged" and dims else ("[*]" if self.kind == "jagged" else f"[{dims}]")
        return f"{self.kind} {self.dtype}{row}"


def as_names(names: str | Iterable[Any]) -> list[str]:
    """Field names or keys as a list of str: a bare ``str`` is ONE name (never iterated character by character)."""
    if isinstance(names, str):
        return [names]
    return [str(n) for n in names]


def _int64(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))


@dataclass(eq=False)
class BatchMeta:
    """Rows of one partition and where their fields live; everything ``get_data`` needs, and nothing more.

    Attributes:
        partition_id: the partition: an ``int`` global step or a ``str`` partition id.
        partition_uid: identity of this incarnation of the partition; a clear makes metas of it stale.
        global_indexes: ``int64 [B]`` row identities (for a step: ``step * rows_per_step + row``).
        group_ids: ``int64 [B]`` GRPO group of each row (scoped to the partition).
        fields: field name -> schema, in column order of ``blocks`` / ``offsets``.
        blocks, offsets: ``[B, F]`` storage location of each (row, field); block ids encode the storage unit.
        task_name: the task that consumed these rows (``None`` for a put's meta).
        extra: small per-batch facts (``dp_rank``, ``dp_group_id``, ``keys`` for kv partitions, ...).

    >>> meta = BatchMeta.empty("train")
    >>> len(meta)
    0
    """

    partition_id: PartitionKey
    partition_uid: int
    global_indexes: np.ndarray
    group_ids: np.ndarray
    fields: dict[str, FieldSchema]
    blocks: np.ndarray
    offsets: np.ndarray
    task_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.global_indexes = _int64(self.global_indexes)
        self.group_ids = _int64(self.group_ids)
        rows, cols = len(self.global_indexes), len(self.fields)
        if len(self.group_ids) != rows:
            raise InvalidRequest(f"BatchMeta needs one group id per row: {rows} rows, got {len(self.group_ids)}")
        for name in ("blocks", "offsets"):
            cells = np.asarray(getattr(self, name), dtype=np.int64)
            if cells.size != rows * cols:
                raise InvalidRequest(f"BatchMeta needs {rows} x {cols} {name} (rows x fields), got {cells.size}")
            setattr(self, name, cells.reshape(rows, cols))

    @classmethod
    def of_arrays(
        cls,
        partition_id: PartitionKey,
        partition_uid: int,
        global_indexes: np.ndarray,
        group_ids: np.ndarray,
        fields: dict[str, FieldSchema],
        blocks: np.ndarray,
        offsets: np.ndarray,
        task_name: str | None,
        extra: dict[str, Any],
    ) -> BatchMeta:
        """A meta of arrays the controller's bookkeeping built (1-D int64 indexes and groups, ``[B, F]`` int64 blocks
        and offsets), taken as they are: no checks, no copies (a get_meta's hot path)."""
        meta = cls.__new__(cls)
        meta.__dict__.update(
            partition_id=partition_id,
            partition_uid=partition_uid,
            global_indexes=global_indexes,
            group_ids=group_ids,
            fields=fields,
            blocks=blocks,
            offsets=offsets,
            task_name=task_name,
            extra=extra,
        )
        return meta

    @classmethod
    def empty(cls, partition_id: PartitionKey, partition_uid: int = -1, task_name: str | None = None) -> BatchMeta:
        none = np.zeros(0, dtype=np.int64)
        return cls(partition_id, partition_uid, none, none, {}, np.zeros((0, 0)), np.zeros((0, 0)), task_name)

    # ---- shape of the batch -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.global_indexes)

    @property
    def size(self) -> int:
        return len(self)

    @property
    def global_step(self) -> int | None:
        """The global step of the partition, or ``None`` for a string partition."""
        return self.partition_id if isinstance(self.partition_id, int) else None

    @property
    def field_names(self) -> list[str]:
        return list(self.fields)

    @property
    def keys(self) -> list[str] | None:
        """The kv keys of the rows, for metas of a partition used by key."""
        return self.extra.get("keys")

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        """Each row's custom meta (``set_custom_meta``, kv tags) as it was when the meta was made; ``{}`` where
        none is set. ``client.get_custom_meta(meta)`` reads the current values."""
        return self.extra.get("custom_meta") or [{} for _ in range(len(self))]

    def update_custom_meta(self, values: Sequence[dict[str, Any] | None]) -> None:
        """Set this meta's ``custom_meta`` locally (one dict per row); ``client.set_custom_meta(meta)`` stores it."""
        values = list(values)
        if len(values) != len(self):
            raise InvalidRequest(f"update_custom_meta: the meta has {len(self)} rows, got {len(values)} values")
        self.extra["custom_meta"] = [dict(v) if v else {} for v in values]

    def _per_row_extra(self, positions: list[int]) -> dict[str, Any]:
        extra = dict(self.extra)
        for name in _PER_ROW:
            if extra.get(name) is not None:
                extra[name] = [extra[name][i] for i in positions]
        return extra

    def __repr__(self) -> str:
        shown = self.global_indexes[:8].tolist()
        more = "..." if len(self) > 8 else ""
        return (
            f"BatchMeta(partition_id={self.partition_id!r}, size={len(self)}, fields={self.field_names}, "
            f"global_indexes={shown}{more}, task_name={self.task_name!r})"
        )

    # ---- selection --------------------------------------------------------------------------------------
    def select_samples(self, positions: Sequence[int] | np.ndarray) -> BatchMeta:
        """The rows at ``positions`` (positions in this batch, not global indexes), in that order."""
        pos = _int64(positions)
        if len(pos) and (pos.min() < -len(self) or pos.max() >= len(self)):
            raise InvalidRequest(f"select_samples: positions must lie in [0, {len(self)}), got {pos.tolist()}")
        extra = self._per_row_extra(pos.tolist())
        return BatchMeta(
            self.partition_id,
            self.partition_uid,
            self.global_indexes[pos],
            self.group_ids[pos],
            dict(self.fields),
            self.blocks[pos],
            self.offsets[pos],
            self.task_name,
            extra,
        )

    def select_fields(self, names: Iterable[str]) -> BatchMeta:
        """The same rows with only the fields ``names`` (a str is one field)."""
        names = list(dict.fromkeys(as_names(names)))
        missing = [n for n in names if n not in self.fields]
        if missing:
            raise UnknownField(f"fields {missing} are not in this batch; it has {self.field_names}")
        cols = [self.field_names.index(n) for n in names]
        return BatchMeta(
            self.partition_id,
            self.partition_uid,
            self.global_indexes,
            self.group_ids,
            {n: self.fields[n] for n in names},
            self.blocks[:, cols],
            self.offsets[:, cols],
            self.task_name,
            dict(self.extra),
        )

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into ``chunks`` consecutive pieces of near-equal size, like ``torch.chunk``: the last may be
        shorter, fewer pieces come back when the rows do not fill ``chunks`` of them, and an empty batch gives
        ``chunks`` empty pieces."""
        if chunks < 1:
            raise InvalidRequest(f"chunk: chunks must be >= 1, got {chunks}")
        if not len(self):  # torch.chunk of an empty tensor: `chunks` empty pieces
            return [self.select_samples([]) for _ in range(chunks)]
        step = -(-len(self) // chunks)
        return [self.select_samples(np.arange(i, min(i + step, len(self)))) for i in range(0, len(self), step)]

    def split_for_ranks(self, k: int) -> list[BatchMeta]:
        """Split into exactly ``k`` consecutive pieces whose sizes differ by at most one (the first ones larger), as
        upstream TransferQueue's ``BatchMeta.chunk`` does for DP ranks: with fewer rows than ``k`` the last pieces
        are empty. (``chunk`` follows ``torch.chunk`` instead: equal pieces, the last shorter, maybe fewer.)

        >>> [len(p) for p in BatchMeta.empty("p").split_for_ranks(3)]
        [0, 0, 0]
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidRequest(f"split_for_ranks: k must be an int >= 1, got {k!r}")
        base, extra = divmod(len(self), k)
        bounds = np.cumsum([0] + [base + (1 if i < extra else 0) for i in range(k)])
        return [self.select_samples(np.arange(bounds[i], bounds[i + 1])) for i in range(k)]

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """Rows of several metas of the same partition, in order. All must cover the same fields."""
        metas = [m for m in metas]
        if not metas:
            raise InvalidRequest("concat needs at least one BatchMeta, got an empty list")
        first = metas[0]
        for m in metas[1:]:
            if m.partition_uid != first.partition_uid:
                raise InvalidRequest(
                    f"concat: all metas must come from one partition; got {first.partition_id!r} "
                    f"(uid {first.partition_uid}) and {m.partition_id!r} (uid {m.partition_uid})"
                )
            if m.fields != first.fields:
                raise InvalidRequest(
                    f"concat: all metas must have the same fields; got {first.field_names} and {m.field_names}"
                )
        # the same fields may come in another column order: align every meta's columns with the first's
        metas = [m if m.field_names == first.field_names else m.select_fields(first.field_names) for m in metas]
        extra = dict(first.extra)
        if first.keys is not None:
            extra["keys"] = [k for m in metas for k in (m.keys or [])]
        if any(m.extra.get("custom_meta") for m in metas):
            extra["custom_meta"] = [c for m in metas for c in m.custom_meta]
        return BatchMeta(
            first.partition_id,
            first.partition_uid,
            np.concatenate([m.global_indexes for m in metas]),
            np.concatenate([m.group_ids for m in metas]),
            dict(first.fields),
            np.concatenate([m.blocks for m in metas]) if len(metas) > 1 else first.blocks,
            np.concatenate([m.offsets for m in metas]) if len(metas) > 1 else first.offsets,
            first.task_name,
            extra,
        )

    def union_fields(self, other: BatchMeta) -> BatchMeta:
        """The same rows with the fields of both metas (``other`` must name the same rows in the same order)."""
        if other.partition_uid != self.partition_uid or not np.array_equal(other.global_indexes, self.global_indexes):
            raise InvalidRequest("union_fields: both metas must name the same rows of the same partition in order")
        new = [n for n in other.fields if n not in self.fields]
        cols = [other.field_names.index(n) for n in new]
        return BatchMeta(
            self.partition_id,
            self.partition_uid,
            self.global_indexes,
            self.group_ids,
            {**self.fields, **{n: other.fields[n] for n in new}},
            np.concatenate([self.blocks, other.blocks[:, cols]], axis=1),
            np.concatenate([self.offsets, other.offsets[:, cols]], axis=1),
            self.task_name,
            {**other.extra, **self.extra},
        )


def describe_partition(key: PartitionKey) -> str:
    """How errors and logs name a partition: ``global_step=3`` or ``partition_id='kv'``."""
    return f"global_step={key}" if isinstance(key, int) else f"partition_id={key!r}"


MAX_CUSTOM_META_BYTES = 4096  # a row's custom meta, msgpack-encoded: small facts, never payload


def merge_schema(stored: FieldSchema, incoming: FieldSchema, promote: bool) -> FieldSchema | None:
    """The schema a field has after a put of ``incoming`` into a partition storing ``stored``; ``None``: a clash.

    With ``promote`` (``QueueConfig.promote_jagged``), a dense or jagged field whose length along its first per-row
    dimension changes becomes jagged (same dtype and trailing shape), as upstream TransferQueue does silently.
    """
    if stored == incoming:
        return stored
    if not promote or "object" in (stored.kind, incoming.kind) or stored.dtype != incoming.dtype:
        return None
    trailing = []
    for schema in (stored, incoming):
        if schema.kind == "dense" and not schema.shape:
            return None  # a scalar per row has no dimension to be jagged along
        trailing.append(schema.shape[1:] if schema.kind == "dense" else schema.shape)
    return FieldSchema("jagged", stored.dtype, trailing[0]) if trailing[0] == trailing[1] else None


def _encode_numpy_scalar(value: Any) -> Any:
    if isinstance(value, np.generic):  # a number restored or computed as a numpy scalar: the number it holds
        return value.item()
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


_custom_meta_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_numpy_scalar)  # sizes what a meta carries


def check_custom_meta(values: list[Any], labels: list[str]) -> None:
    """Raise InvalidRequest unless every value is a dict (or None) of at most MAX_CUSTOM_META_BYTES encoded."""
    for label, value in zip(labels, values, strict=True):
        if value is not None and not isinstance(value, dict):
            raise InvalidRequest(f"the custom meta of {label} must be a dict (or None), got {type(value).__name__}")
        size = len(_custom_meta_encoder.encode(value))
        if size > MAX_CUSTOM_META_BYTES:
            raise InvalidRequest(
                f"the custom meta of {label} is {size} bytes encoded; at most {MAX_CUSTOM_META_BYTES} are allowed "
                "(put larger values into a field)"
            )


class Moved(Protocol):
    """A retired unit's moved copies (``p.UnitMove``, ``state.lost_rows.CopiesMoved``): see :func:`current_holders`."""

    @property
    def unit(self) -> int: ...
    @property
    def to(self) -> dict[int, int]: ...
    @property
    def below(self) -> int: ...


def current_holders(
    blocks: np.ndarray, num_units: int, replica_of: Sequence[int], moves: Sequence[Moved] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """replicas=2: per block id, the two units holding its copies now: the unit it was placed on and its replica's
    unit, except that a copy on a retired unit whose copies were moved (``moves``, in the order the units were
    retired) is on the unit it was moved to once the move went past the block (``below``). A move's target is chosen
    per unit holding the other copy (``to``), so a block is resolved slot by slot, the other slot as it stands.

    >>> from types import SimpleNamespace as M
    >>> [h.tolist() for h in current_holders(np.array([0, 3, 2]), 3, [1, 2, 0], [M(unit=0, to={1: 2, 2: 1}, below=3)])]
    [[2, 0, 2], [1, 1, 1]]
    """
    blocks = np.asarray(blocks, dtype=np.int64)
    first = blocks % num_units
    second = np.asarray(replica_of, dtype=np.int64)[first]
    for move in moves:
        to = np.full(num_units, -1, dtype=np.int64)
        for survivor, target in move.to.items():
            to[survivor] = target
        done = blocks < move.below
        for slot, other in ((first, second), (second, first)):
            moved = done & (slot == move.unit)
            slot[moved] = np.where(to[other[moved]] >= 0, to[other[moved]], slot[moved])
    return first, second
