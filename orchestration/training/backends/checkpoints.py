"""The checkpoint directories the backends write: ``checkpoint_dir/step_{N}/`` with a ``metadata.json`` (step,
metrics, time, config), each committed by a rename so an unfinished save is never taken for a checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from orchestration.training.types import LibraryError

METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    """``checkpoint_dir/step_{step}`` (no zero padding: ``latest_checkpoint`` orders by the number)."""
    return Path(checkpoint_dir) / f"step_{step}"


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The complete ``step_N`` directory (with ``metadata.json``) with the highest ``N``, or None.

    Numeric order: ``step_10`` comes after ``step_9``. Unfinished saves (``.step_N.tmp``) are never taken.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _STEP_DIR.match(path.name)) and (path / METADATA).is_file()
    ]
    return max(found, key=lambda item: item[0])[1] if found else None


def metadata_record(step: int, metrics: Mapping[str, Any], config: Mapping[str, Any], **extra: Any) -> str:
    """The ``metadata.json`` text: step, metrics, time, config (values JSON cannot hold are written as floats or
    strings)."""
    record = {"step": step, "metrics": dict(metrics), "time": time.time(), "config": dict(config), **extra}
    return json.dumps(record, indent=2, default=_jsonable) + "\n"


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``metadata.json`` of checkpoint ``path``.

    Raises:
        LibraryError: if ``path`` has none (not a checkpoint, or an unfinished one).
    """
    file = Path(path) / METADATA
    if not file.is_file():
        raise LibraryError(f"{path} is not a checkpoint written by save_checkpoint (no {METADATA})")
    record: dict[str, Any] = json.loads(file.read_text())
    return record


def commit_dir(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` to ``path``; an existing ``path`` is moved aside first and deleted only after."""
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)
