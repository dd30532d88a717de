"""A JSONL dataset of sample ids, as AReaL's task-server examples ship them: one JSON object a line,
``{"index": 3, "messages": [{"role": "user", "content": "..."}]}``; ``index`` names a sample of the environment (its
position among the environment's samples, or its id as a string), ``messages`` (optional) is what the example shows
of it (the task server builds the episode's first observation itself).

>>> import tempfile, json
>>> path = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
>>> _ = path.write(json.dumps({"index": 1, "messages": []}) + "\\n" + json.dumps({"index": "game-03"}) + "\\n")
>>> path.close()
>>> load_sample_ids(path.name, ["game-00", "game-01", "game-02", "game-03"])
['game-01', 'game-03']
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


class SampleDatasetError(ValueError):
    """A line of a sample-id dataset is not what the format says (the message names the file, the line and why)."""


def load_sample_ids(path: str | Path, environment_ids: Sequence[str]) -> list[str]:
    """The environment sample ids a dataset file names, in its order (repeats kept: they weigh a sample more).

    Raises:
        SampleDatasetError: a line that is not a JSON object with an ``index``, an index the environment does not
            have, or a file with no sample at all.
        FileNotFoundError: no such file.
    """
    known = set(environment_ids)
    ids: list[str] = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SampleDatasetError(f"{where}: expected a JSON object, got invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or "index" not in row:
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise SampleDatasetError(f"{where}: expected an object with an 'index' key, got {got}")
            ids.append(_sample_id(row["index"], environment_ids, known, where))
    if not ids:
        raise SampleDatasetError(f"{path}: expected at least one {{'index': ...}} line, the file has none")
    return ids


def _sample_id(index: object, environment_ids: Sequence[str], known: set[str], where: str) -> str:
    if isinstance(index, bool) or not isinstance(index, (int, str)):
        raise SampleDatasetError(f"{where}: expected 'index' to be an integer or a sample id, got {index!r}")
    if isinstance(index, int):
        if not 0 <= index < len(environment_ids):
            raise SampleDatasetError(
                f"{where}: index {index} is out of range: the environment has {len(environment_ids)} samples "
                f"(0..{len(environment_ids) - 1})"
            )
        return environment_ids[index]
    if index not in known:
        if index.isdecimal():
            return _sample_id(int(index), environment_ids, known, where)
        shown = ", ".join(list(environment_ids)[:3])
        raise SampleDatasetError(f"{where}: the environment has no sample {index!r} (its ids: {shown}, ...)")
    return index
