"""Every command-line entry point's --help shows its whole description, not a first line cut mid-sentence."""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from collections.abc import Callable
from unittest import mock

import pytest


def run_main(module: str) -> Callable[[], object]:
    main = importlib.import_module(module).main
    return lambda: main(["--help"])


def run_parse_args(module: str) -> Callable[[], object]:
    parse_args = importlib.import_module(module).parse_args

    def run() -> object:
        with mock.patch.object(sys, "argv", ["prog", "--help"]):
            return parse_args()

    return run


ENTRY_POINTS = {
    "recipe.agent_demo": run_main,
    "recipe.agentrl_demo": run_main,
    "recipe.demo": run_main,
    "recipe.sft": run_main,
    "recipe.smollm2.run": run_main,
    "recipe.experiments.addition_single_process": run_parse_args,
    "workers.ledger.__main__": run_main,
}


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_help_shows_the_whole_first_paragraph_of_the_description(module: str) -> None:
    call = ENTRY_POINTS[module](module)
    doc = sys.modules[module].__doc__ or ""
    first_paragraph = " ".join(doc.split("\n\n")[0].split())
    out = io.StringIO()

    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        call()

    assert exited.value.code == 0
    assert first_paragraph in " ".join(out.getvalue().split()), out.getvalue()
