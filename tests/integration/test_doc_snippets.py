"""The pages whose Python blocks need Ray (``RAY_PAGES`` of tests/doc_snippets.py) run as written, in the shared
Ray session: a block's ``ray.init()`` joins it. What a page leaves running (the queue ``transfer_queue.init``
started, the actors its namespace holds) is stopped after it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.doc_snippets import RAY_PAGES, run_page


def readme_does_what_it_says(namespace: dict[str, Any]) -> None:
    assert namespace["batch"]["prompt_ids"].shape == (4, 16)
    assert len(namespace["ready"]) == 4  # the rows with a reward are ready for "train"


#: what a page's blocks must have done, beyond running
CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {"README.md": readme_does_what_it_says}


def stop_what_the_page_started(namespace: dict[str, Any]) -> None:
    import ray

    import transfer_queue

    transfer_queue.shutdown()
    for value in namespace.values():
        for handle in value if isinstance(value, list) else [value]:
            if isinstance(handle, ray.actor.ActorHandle):
                ray.kill(handle)


@pytest.mark.slow  # ~30-60 s a page (each starts storage units): the slow tier (.ci/run) keeps make test < 10 min
@pytest.mark.parametrize("page", RAY_PAGES)
def test_the_python_blocks_of_the_page_run(
    page: str, ray_session: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the session is up: a page's ray.init() joins it (Ray refuses a second init)
    monkeypatch.setattr(ray_session, "init", lambda *args, **kwargs: None)
    namespace: dict[str, Any] = {"__name__": "doc_snippet"}
    try:
        run_page(page, tmp_path, namespace=namespace)
        CHECKS.get(page, lambda namespace: None)(namespace)
    finally:
        stop_what_the_page_started(namespace)
