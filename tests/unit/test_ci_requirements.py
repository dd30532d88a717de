"""Skips for what CI installs (tests/conftest.py's ``requirement``): a skip elsewhere, a failure under ``CI=true``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REQUIREMENT, requirement

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = """
import pytest

from tests.conftest import requirement


@pytest.mark.skipif(True, reason=requirement("a tool", "apt-get install -y tool"))
def test_mark():
    pass


def test_call():
    pytest.skip(requirement("a server", "apt-get install -y server"))


@pytest.fixture
def server():
    pytest.skip(requirement("a server", "apt-get install -y server"))


def test_fixture(server):
    pass


def test_import():
    pytest.importorskip("no_such_module_for_this_test", reason=requirement("a package", "pip install package"))


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_optional():
    pass


@pytest.mark.xfail(reason=requirement("a fix", "not yet"), strict=True)
def test_expected_failure():
    raise AssertionError
"""


def run_examples(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "test_examples.py").write_text(textwrap.dedent(EXAMPLES))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-rA"]
    done = subprocess.run([*command, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_requirement_reason_says_what_to_install():
    assert requirement("bubblewrap", "apt-get install -y bubblewrap") == (
        f"{REQUIREMENT}bubblewrap (apt-get install -y bubblewrap)"
    )


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_missing_requirement_skips(tmp_path: Path, ci: str | None) -> None:
    out = run_examples(tmp_path, ci)
    assert "5 skipped, 1 xfailed" in out, out
    assert "missing requirement: a tool (apt-get install -y tool)" in out


def test_under_ci_a_missing_requirement_fails_and_other_skips_stay_skips(tmp_path: Path) -> None:
    out = run_examples(tmp_path, "true")
    # the call and importorskip fail, the mark and the fixture (both in setup) are errors; the CUDA skip and the
    # xfail stay as they are
    assert "2 failed, 1 skipped, 1 xfailed, 2 errors" in out, out
    assert "CI=true and this test would skip: missing requirement: a tool (apt-get install -y tool)" in out
    assert "FAILED" in out and "test_examples.py::test_import - CI=true" in out
    assert "ERROR" in out and "test_examples.py::test_fixture - CI=true" in out
    assert "SKIPPED [1]" in out and "needs a CUDA device" in out
