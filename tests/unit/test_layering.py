"""The layers of the RL stack import only downwards (STYLE.md 19: layers meet at contracts).

    transfer_queue  <-  rl_contracts  <-  workers | trainers  <-  orchestration  <-  recipe

Producers (``workers/``) and consumers (``trainers/``) meet only through the queue and weight sync; what both need
(the task contract, prompts, row helpers, the queue clock) lives in ``rl_contracts/``; only ``orchestration/`` knows
them all. Every import statement counts, including those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
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


def violations(package: str) -> list[str]:
    """``"path imports name"`` for every import in ``package`` of a layer it must not reach."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_packages(path.read_text(encoding="utf-8")) & FORBIDDEN[package]):
            out.append(f"{path.relative_to(ROOT)} imports {name}")
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
