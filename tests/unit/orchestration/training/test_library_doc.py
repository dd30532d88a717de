"""docs/library.md's custom loop, run as written (its page's Python blocks, as tests/doc_snippets.py runs every
page's): it must learn its task."""

from __future__ import annotations

from pathlib import Path

from tests.doc_snippets import run_page


def test_the_custom_loop_of_the_docs_learns(tmp_path: Path) -> None:
    namespace, out = run_page("docs/library.md", tmp_path)

    assert "step 20: reward" in out
    assert namespace["accuracy"] > 0.9, out  # greedy: token 7 for every prompt
