"""The layers of the RL stack import only downwards (STYLE.md 19: layers meet at contracts).

    transfer_queue  <-  rl_contracts  <-  workers | trainers  <-  orchestration  <-  recipe

Producers (``workers/``) and consumers (``trainers/``) meet only through the queue and weight sync; what both need
(the task contract, prompts, row helpers, the queue clock) lives in ``rl_contracts/``; only ``orchestration/`` knows
them all. Every import statement counts, including those inside functions and under ``TYPE_CHECKING``, and so does
every string that names a module of a forbidden layer (``"workers.tasks.addition:AdditionTask"`` in ``trainers/`` is
an import that happens at run time, through ``import_object`` or ``python -m``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STACK = ["transfer_queue", "rl_contracts", "workers", "trainers", "orchestration", "recipe"]
FORBIDDEN = {
    "transfer_queue": {"rl_contracts", "workers", "trainers", "orchestration", "recipe"},
    "rl_contracts": {"workers", "trainers", "orchestration", "recipe"},
    "workers": {"trainers", "orchestration", "recipe"},
    "trainers": {"workers", "orchestration", "recipe"},
    "orchestration": {"recipe"},
}


def imported_packages(source: str) -> set[str]:
    """Top-level packages named by the absolute import statements of ``source``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# a dotted module path, optionally with ":name": "workers.tasks.addition:AdditionTask", "workers.agents.task_server"
MODULE_PATH = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_][\w.]*)?")


def docstring_nodes(tree: ast.AST) -> set[int]:
    """``id()`` of the docstring constants of ``tree`` (prose, which may name any layer)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def named_packages(source: str) -> set[str]:
    """Top-level packages named by the module paths inside the string literals of ``source`` (docstrings aside)."""
    tree = ast.parse(source)
    skip = docstring_nodes(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            names.update(match.group(1) for match in MODULE_PATH.finditer(node.value))
    return names


def violations(package: str) -> list[str]:
    """``"path imports name"`` for every import in ``package`` of a layer it must not reach, and ``"path names
    name"`` for every string literal naming a module of such a layer."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for name in sorted(imported_packages(source) & FORBIDDEN[package]):
            out.append(f"{path.relative_to(ROOT)} imports {name}")
        for name in sorted(named_packages(source) & FORBIDDEN[package]):
            out.append(f"{path.relative_to(ROOT)} names {name}")
    return out


def test_the_scanner_sees_every_kind_of_import():
    source = (
        "import os, workers.rollout as r\n"
        "from trainers.grpo import GRPOTrainerRank\n"
        "from . import sibling\n"
        "def f():\n    from orchestration import GRPORun\n"
        "if TYPE_CHECKING:\n    import recipe.demo\n"
    )
    assert imported_packages(source) == {"os", "workers", "trainers", "orchestration", "recipe"}


def test_the_scanner_sees_module_paths_in_strings_but_not_in_docstrings():
    source = (
        '"""Trainers; the default task is workers.tasks.addition:AdditionTask (prose)."""\n'
        'name: str = "workers.tasks.addition:AdditionTask"\n'
        'cmd = ["python", "-m", "orchestration.grpo_run"]\n'
        'text = f"see recipe.demo for {x}"\n'
        'def f():\n    """Nothing here: workers.rollout."""\n'
        '    return "train", "rollout", "metrics.jsonl", "workers"\n'
    )
    assert named_packages(source) == {"workers", "orchestration", "recipe", "metrics"}
    assert named_packages(source) & FORBIDDEN["trainers"] == {"workers", "orchestration", "recipe"}


def test_a_string_naming_a_forbidden_layer_is_a_violation(tmp_path, monkeypatch):
    package = tmp_path / "trainers"
    package.mkdir()
    (package / "config.py").write_text('name: str = "workers.tasks.addition:AdditionTask"\n', encoding="utf-8")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert violations("trainers") == ["trainers/config.py names workers"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_layer_imports_only_downwards(package):
    assert (ROOT / package).is_dir(), f"{package}/ is missing"
    assert violations(package) == []


def test_the_run_orchestration_sits_above_workers_and_trainers():
    imported = set()
    for path in (ROOT / "orchestration").rglob("*.py"):
        imported |= imported_packages(path.read_text(encoding="utf-8"))
    assert {"workers", "trainers", "rl_contracts", "transfer_queue"} <= imported
    assert not (ROOT / "trainers" / "rl_loop.py").exists(), "the run's orchestration moved to orchestration/"


# ---- inside transfer_queue: the bookkeeping knows no wire format (ARCHITECTURE §2, STYLE 4) -------------------------
# The controller's bookkeeping is plain Python/numpy: no Ray, no sockets, no wire format. Only the controller's
# request table (request_table.py: RequestTable.handle takes decoded request structs, calls QueueState and answers
# MetaWire / Reservation) and the servers translate between the wire (protocol.py) and these modules.
BOOKKEEPING = [
    "queue_state.py",
    "lost_rows.py",
    "partition.py",
    "partition_table.py",
    "put_ledger.py",
    "delivery.py",
    "dp_rounds.py",
    "waiting.py",
    "kv_state.py",
    "reader.py",
    "selection.py",
]
WIRE_AND_SOCKETS = {
    "transfer_queue.protocol",
    "transfer_queue.transport",
    "transfer_queue.unix_socket",
    "transfer_queue.server",
    "transfer_queue.auth",
    "transfer_queue.controller",
    "transfer_queue.storage",
    "transfer_queue.client",
    "ray",
    "zmq",
}


def imported_modules(source: str) -> set[str]:
    """Dotted names of the modules ``source`` imports (``from transfer_queue import protocol`` counts as
    ``transfer_queue.protocol``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_path(name: str) -> Path | None:
    """The file of a transfer_queue module (or package), None for anything else."""
    if not name.startswith("transfer_queue."):
        return None
    base = ROOT / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def reached_modules(path: Path) -> set[str]:
    """Every module imported by ``path`` and, through transfer_queue modules, by what it imports."""
    seen: set[str] = set()
    todo = [path]
    done: set[Path] = set()
    while todo:
        current = todo.pop()
        if current in done:
            continue
        done.add(current)
        for name in imported_modules(current.read_text(encoding="utf-8")):
            seen.add(name)
            nested = module_path(name)
            if nested is not None:
                todo.append(nested)
    return seen


def test_the_module_scanner_sees_the_wire_format_however_it_is_imported():
    source = "from transfer_queue import protocol as p\ndef f():\n    from transfer_queue.protocol import MetaWire\n"
    assert {"transfer_queue.protocol", "transfer_queue.protocol.MetaWire"} <= imported_modules(source)
    assert "transfer_queue.protocol" in reached_modules(ROOT / "transfer_queue" / "request_table.py")


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_the_bookkeeping_imports_no_wire_format_sockets_or_ray(module):
    reached = reached_modules(ROOT / "transfer_queue" / module)
    bad = sorted(n for n in reached if any(n == w or n.startswith(w + ".") for w in WIRE_AND_SOCKETS))
    assert bad == [], f"transfer_queue/{module} reaches {bad}"
