"""docs/library.md's custom loop, run as written: it must learn its task."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_the_custom_loop_of_the_docs_learns() -> None:
    text = (ROOT / "docs" / "library.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    loop = next(block for block in blocks if "async def main" in block)
    out = io.StringIO()
    scope: dict = {"__name__": "library_doc"}

    with contextlib.redirect_stdout(out):
        exec(compile(loop, "docs/library.md", "exec"), scope)

    assert "step 20: reward" in out.getvalue()
    assert scope["accuracy"] > 0.9, out.getvalue()  # greedy: token 7 for every prompt
