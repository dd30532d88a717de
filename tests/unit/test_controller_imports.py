"""Layering rules of ARCHITECTURE.md that the import graph can check."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "transfer_queue"


def imported_names(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_controller_does_not_create_storage_units_itself() -> None:
    # Creating StorageUnit actors belongs to runtime.py (runtime.start_storage_units), not to the control plane.
    names = imported_names("controller.py")
    assert not {n for n in names if n.startswith("transfer_queue.storage")}, names
