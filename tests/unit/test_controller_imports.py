"""The controller is handed its storage units: it never creates them and never imports the runtime above it
(CONTRIBUTING.md, "1. The layers")."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "transfer_queue"


def imported_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", sorted(p.name for p in (PACKAGE / "controller").glob("*.py")))
def test_the_controller_neither_creates_storage_units_nor_imports_the_runtime(module) -> None:
    # Starting StorageUnit actors belongs to transfer_queue.runtime (start_storage_units, TransferQueueController)
    names = imported_names(PACKAGE / "controller" / module)
    bad = {n for n in names if n.startswith(("transfer_queue.storage.unit", "transfer_queue.runtime"))}
    assert not bad, f"controller/{module} imports {sorted(bad)}"


def test_a_bare_controller_body_refuses_to_start_storage_units() -> None:
    from transfer_queue.controller.actor import ControllerActor
    from transfer_queue.errors import InvalidRequest

    body = ControllerActor.__new__(ControllerActor)
    with pytest.raises(InvalidRequest, match="was given no storage_units and cannot start 2: pass storage_units"):
        body.start_storage_units(2, None, None)
