"""The Python blocks of README.md and docs/*.md, and how a page's blocks are run (CONTRIBUTING.md §4, "Every doc snippet
runs").

Every ```` ```python ```` block of a page runs as written, the page's blocks in order in one namespace (a later block
may use what an earlier one defined), in a fresh temporary working directory (relative paths land there). A block
whose fence line directly follows a line ``<!-- fragment: why -->`` is a fragment: it is not run (it needs a GPU, a
cluster, a remote server, or is a piece of a loop the reader writes), and the marker says why. A block that raises
fails its test naming the page and the line of its fence, and tracebacks point at the page's own lines.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: pages whose blocks need Ray: run by tests/integration/test_doc_snippets.py, in the shared Ray session
RAY_PAGES = ("README.md", "docs/api.md", "docs/quickstart.md")
#: pages run by a test of their own, which also checks what their blocks do
OWN_TESTS = {"docs/library.md": "tests/unit/orchestration/training/test_library_doc.py"}

FENCE = re.compile(r"^[ \t]*```python\s*$")
#: a fence that looks like Python's but is not ```python (```py, ```python3, ```python fragment): refused, not skipped
NEAR_FENCE = re.compile(r"^[ \t]*```py")
FRAGMENT = re.compile(r"^\s*<!--\s*fragment:\s*(?P<why>\S.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One ```` ```python ```` block: its page (relative to the repository), the line of its fence, its code."""

    page: str
    line: int
    code: str
    fragment: str | None  # why it is not run; None: it runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    """README.md and docs/*.md, relative to the repository root."""
    return ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def blocks(page: str, root: Path = ROOT) -> list[Block]:
    """The Python blocks of ``page`` (a path relative to ``root``), in order."""
    lines = (root / page).read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        if FENCE.match(lines[index]) is None:
            if NEAR_FENCE.match(lines[index]):
                raise AssertionError(
                    f"{page}:{index + 1}: {lines[index].strip()!r} is not run; write ```python "
                    "(and <!-- fragment: why --> on the line before for a block that cannot run)"
                )
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{index + 1}: a ```python block that is never closed")
        marker = FRAGMENT.match(lines[index - 1]) if index > 0 else None
        code = textwrap.dedent("\n".join(lines[index + 1 : end]))
        found.append(Block(page, index + 1, code, marker.group("why") if marker else None))
        index = end + 1
    return found


def run_block(block: Block, namespace: dict[str, Any]) -> None:
    """Run ``block`` in ``namespace``; a failure names the page and the line of the block's fence."""
    # padded with empty lines, so that a traceback's line numbers are the page's own
    source = "\n" * block.line + block.code
    try:
        exec(compile(source, block.page, "exec"), namespace)
    except Exception as error:
        raise AssertionError(
            f"{block.where}: the python block starting at this line raised {type(error).__name__}: {error}\n"
            + "".join(traceback.format_exception(error))
        ) from error


def run_page(
    page: str, workdir: Path, *, root: Path = ROOT, namespace: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """Run the blocks of ``page`` that are not fragments, in order, in one namespace (``namespace``, filled as they
    run, or a new one), with ``workdir`` as the working directory; return the namespace and what they printed."""
    namespace = {"__name__": "doc_snippet"} if namespace is None else namespace
    out = io.StringIO()
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out):
            for block in blocks(page, root):
                if block.fragment is None:
                    run_block(block, namespace)
    finally:
        os.chdir(previous)
    return namespace, out.getvalue()
