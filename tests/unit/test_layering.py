"""The layers of the RL stack import only downwards (CONTRIBUTING.md, "1. The layers").

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
import sys
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


# ---- inside transfer_queue: its planes (docs/architecture.md "The plan of the folders"; CONTRIBUTING.md) -------------
# state/ is the bookkeeping: plain Python/numpy, no Ray, no sockets, no wire format. wire/ is the wire (messages,
# frames, sockets) and knows no bookkeeping. ops/ reads both (metrics, status). Above them: client/, controller/,
# storage/, then runtime.py and the public face. Only the controller's request table (controller/requests.py)
# translates between the wire and the state.
PLANES = {
    "state": {"wire", "ops", "client", "controller", "storage", "runtime", "dataloader", "interface", "interop"},
    "wire": {"state", "ops", "client", "controller", "storage", "runtime", "dataloader", "interface", "interop"},
    "ops": {"client", "controller", "storage", "runtime", "dataloader", "interface", "interop"},
    "client": {"controller", "storage", "runtime", "state", "ops", "dataloader", "interface"},
    "controller": {"client", "runtime", "storage.unit", "dataloader", "interface"},
    "storage": {"client", "controller", "runtime", "state", "dataloader", "interface"},
    "samplers": {"state", "wire", "ops", "client", "controller", "storage", "runtime"},
}
SOCKETS_AND_RAY = {"ray", "zmq"}


def imported_modules(source: str) -> set[str]:
    """Dotted names of the modules ``source`` imports (``from transfer_queue.wire import protocol`` counts as
    ``transfer_queue.wire.protocol``)."""
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


def plane_violations(plane: str) -> list[str]:
    """``"path imports module"`` for every import by a file of ``transfer_queue/<plane>`` of a part it must not use."""
    out = []
    for path in sorted((ROOT / "transfer_queue" / plane).rglob("*.py")):
        for name in sorted(imported_modules(path.read_text(encoding="utf-8"))):
            part = name.removeprefix("transfer_queue.")
            if name.startswith("transfer_queue.") and any(part == f or part.startswith(f + ".") for f in PLANES[plane]):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def test_the_module_scanner_sees_the_wire_format_however_it_is_imported():
    source = "from transfer_queue.wire import protocol as p\ndef f():\n    from transfer_queue.wire.protocol import X\n"
    assert {"transfer_queue.wire.protocol", "transfer_queue.wire.protocol.X"} <= imported_modules(source)
    assert "transfer_queue.wire.protocol" in reached_modules(ROOT / "transfer_queue" / "controller" / "requests.py")


@pytest.mark.parametrize("plane", sorted(PLANES))
def test_each_plane_of_the_queue_imports_only_what_is_below_it(plane):
    assert (ROOT / "transfer_queue" / plane).is_dir(), f"transfer_queue/{plane}/ is missing"
    assert plane_violations(plane) == []


def test_the_plane_scanner_catches_an_upward_import(tmp_path, monkeypatch):
    (tmp_path / "transfer_queue" / "state").mkdir(parents=True)
    (tmp_path / "transfer_queue" / "state" / "bad.py").write_text(
        "def f():\n    from transfer_queue.ops import metrics\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert plane_violations("state") == [
        "transfer_queue/state/bad.py imports transfer_queue.ops",
        "transfer_queue/state/bad.py imports transfer_queue.ops.metrics",
    ]


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "transfer_queue" / "state").glob("*.py")))
def test_the_bookkeeping_reaches_no_wire_format_sockets_or_ray(module):
    reached = reached_modules(ROOT / "transfer_queue" / "state" / module)
    bad = sorted(
        n
        for n in reached
        if n.split(".")[0] in SOCKETS_AND_RAY
        or (
            not n.startswith(
                (
                    "transfer_queue.state",
                    "transfer_queue.metadata",
                    "transfer_queue.errors",
                    "transfer_queue.config",
                    "transfer_queue.samplers",
                )
            )
            and n.startswith("transfer_queue.")
        )
    )
    assert bad == [], f"transfer_queue/state/{module} reaches {bad}"


def runtime_source(source: str) -> str:
    """``source`` without its ``if TYPE_CHECKING:`` blocks (imports for annotations only never run)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.If, ast.FunctionDef, ast.ClassDef, ast.Try, ast.With)):
            body = getattr(node, "body", [])
            node.body = [  # type: ignore[attr-defined]
                n for n in body if not (isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING"))
            ] or [ast.Pass()]
    return ast.unparse(tree)


def import_graph() -> dict[str, set[str]]:
    """transfer_queue module -> the transfer_queue modules it imports when it runs (at any level, even inside
    functions; not under ``TYPE_CHECKING``)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "transfer_queue").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        targets = set()
        for imported in imported_modules(runtime_source(path.read_text(encoding="utf-8"))):
            target = module_path(imported)
            if target is not None:
                trel = target.relative_to(ROOT).with_suffix("")
                targets.add(".".join(trel.parts[:-1] if trel.name == "__init__" else trel.parts))
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import loops of ``graph``, each as a path that starts and ends at the same module (package ``__init__`` files
    that re-export their own modules are not loops: a package importing its child is skipped)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"pkg": {"pkg.child"}, "pkg.child": {"other"}, "other": set()}) == []
    lazy = "if TYPE_CHECKING:\n    import a\ndef f():\n    import b\n"
    assert imported_modules(runtime_source(lazy)) == {"b"}


def test_the_queue_has_no_import_loop():
    assert cycles(import_graph()) == []
