"""Every Python block of README.md and docs/*.md runs as written (tests/doc_snippets.py says how): here the pages
that need no Ray; tests/integration/test_doc_snippets.py runs the others."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.doc_snippets import OWN_TESTS, RAY_PAGES, blocks, pages, run_page

PAGES = [p for p in pages() if p not in RAY_PAGES and p not in OWN_TESTS and any(not b.fragment for b in blocks(p))]


@pytest.mark.parametrize("page", PAGES)
def test_the_python_blocks_of_the_page_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = f"{page} started Ray: list it in RAY_PAGES of tests/doc_snippets.py"
    ray = sys.modules.get("ray")
    if ray is not None:  # imported already (in a whole-suite run, the integration tier's session may be up): no init

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(started)

        monkeypatch.setattr(ray, "init", refuse)
    run_page(page, tmp_path)
    if ray is None:
        ray = sys.modules.get("ray")
        assert ray is None or not ray.is_initialized(), started


def test_every_page_is_run_by_exactly_one_test() -> None:
    assert set(RAY_PAGES) <= set(pages()) and set(OWN_TESTS) <= set(pages())
    assert not set(RAY_PAGES) & set(OWN_TESTS)
    for page, test in OWN_TESTS.items():
        assert page in (Path(__file__).resolve().parents[2] / test).read_text(), f"{test} does not run {page}"


def test_a_fragment_is_not_run_and_a_failing_block_names_its_page_and_line(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text(
        "# A page\n\n```python\nx = 1\n```\n\n<!-- fragment: needs a cluster -->\n```python\nraise SystemExit\n```\n\n"
        "Text.\n\n   ```python\n   y = x + 1\n   print(y)\n   ```\n\n```python\ny / 0\n```\n"
    )
    found = blocks("page.md", tmp_path)
    assert [(b.line, b.fragment) for b in found] == [(3, None), (8, "needs a cluster"), (14, None), (19, None)]

    failing = r"^page\.md:19: the python block starting at this line raised ZeroDivisionError: division by zero"
    with pytest.raises(AssertionError, match=failing) as failed:
        run_page("page.md", tmp_path, root=tmp_path)
    assert 'File "page.md", line 20' in str(failed.value)  # the traceback points at the page's own line


def test_a_python_fence_spelled_otherwise_is_refused_not_skipped(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text("# A page\n\n```py\nraise SystemExit\n```\n")

    with pytest.raises(AssertionError, match=r"^page\.md:3: '```py' is not run; write ```python"):
        blocks("page.md", tmp_path)
