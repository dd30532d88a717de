"""The status page in a real headless Chromium (Debian's ``chromium``), while a queue runs: the numbers it shows are
the API's, its script and chart library load from the controller (no CDN), and it renders the RL curves.

Set ``TRANSFER_QUEUE_DOCS_SCREENSHOT=docs/images/status_page.png`` to refresh the screenshot docs/operations.md shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from tensordict import TensorDict

from tests.conftest import requirement

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason=requirement("Debian's chromium", "apt-get install -y chromium")
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]


class Elements(HTMLParser):
    """Every element's attributes and text, from Chromium's --dump-dom."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict[str, Any]] = []
        self._open: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {"tag": tag, **{k: v for k, v in attrs}, "text": ""}
        self.elements.append(element)
        if tag not in ("br", "img", "meta", "link", "input"):
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element["text"] += data

    def find(self, **attrs: str) -> list[dict[str, Any]]:
        return [e for e in self.elements if all(e.get(k) == v for k, v in attrs.items())]


def chromium(url: str, tmp: Path, *extra: str) -> str:
    assert CHROMIUM is not None
    command = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=5000", *extra, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def grpo_rows(n: int) -> TensorDict:
    return TensorDict(
        {"prompt_ids": torch.arange(n * 16).reshape(n, 16), "responses": torch.ones(n, 32, dtype=torch.int64)},
        batch_size=[n],
    )


def test_status_page_shows_the_api_numbers_in_chromium(grpo_queue: Any, tmp_path: Path, wait_until: Any) -> None:
    client = grpo_queue.client
    first, second = grpo_queue.step(), grpo_queue.step()
    client.put(grpo_rows(16), global_step=first)  # a full step: 4 groups of 4
    client.put(grpo_rows(8), global_step=second)  # half a step
    client.get_meta(["prompt_ids"], 8, global_step=first, task_name="rollout", get_n_samples=True)
    client.get_meta(["prompt_ids", "responses"], 4, global_step=first, task_name="train", get_n_samples=True)
    waiting: list[Any] = []
    reader = grpo_queue.new_client("waiting-reader")
    # a trainer waiting for rows nobody produced yet: the page shows it while it waits
    thread = threading.Thread(
        target=lambda: waiting.append(
            reader.get_meta(["rewards"], 4, global_step=second, task_name="train", timeout=30)
        ),
        daemon=True,
    )
    thread.start()
    for step in range(40):  # an RL run posting its per-step metrics (the page draws reward and loss)
        row = {"kind": "grpo", "step": step, "reward": 0.2 + 0.01 * step, "loss": 0.5 - 0.005 * step}
        grpo_queue.controller.record_run_metrics.remote(row)
    wait_until(lambda: client.status()["waiting_get_meta"] == 1, what="the trainer's get_meta waiting")
    status = client.status(run_history=True)
    url = status["endpoints"]["controller"] + "/status"

    page = Elements()
    page.feed(chromium(url, tmp_path, "--dump-dom"))
    assert page.find(id="updated")[0].get("data-time"), "the page never loaded /status.json"
    api = client.status()
    for step in (first, second):
        part = next(p for p in api["partitions"] if p["partition_id"] == step)
        (rows,) = page.find(**{"data-partition": str(step), "data-rows": str(part["rows"])})
        assert rows["text"].startswith(f"{part['rows']}/16")
        for task, counts in part["tasks"].items():
            (line,) = page.find(**{"data-partition": str(step), "data-task": task})
            assert int(line["data-acknowledged"]) == counts["acknowledged"]
            assert int(line["data-ready"]) == counts["ready"]
            assert f"{task}: {counts['acknowledged']}/{part['rows']} acknowledged" in line["text"]
    for task, counts in api["tasks"].items():
        for state, value in counts.items():
            (cell,) = page.find(**{"data-task": task, "data-state": state})
            assert cell["text"] == str(value)
    assert page.find(id="card-rows-committed")[0]["text"] == str(api["rows_committed"])
    assert page.find(id="card-waiting-get-meta")[0]["text"] == str(api["waiting_get_meta"])
    for unit in api["storage"]["units"]:
        assert page.find(**{"data-unit-health": str(unit["unit"])})[0]["text"] == "up"
        assert page.find(**{"data-unit": str(unit["unit"])})[0]["data-bytes"] == str(unit["bytes"])
    (chart,) = page.find(id="chart-reward")
    assert int(chart["data-points"]) >= 40 and page.find(tag="canvas"), "uPlot did not draw the reward curve"

    shot = tmp_path / "status_page.png"
    chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1300,1060")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("TRANSFER_QUEUE_DOCS_SCREENSHOT"):
        shutil.copy(shot, os.environ["TRANSFER_QUEUE_DOCS_SCREENSHOT"])
    # the rewards arrive: the waiting trainer is served
    scored = client.get_meta(["prompt_ids"], 8, global_step=second, task_name="reward")
    client.put({"rewards": torch.ones(8, 1)}, metadata=scored)
    thread.join(timeout=30)
    assert len(waiting) == 1 and len(waiting[0]) == 4


def test_status_page_is_read_only_and_local(grpo_queue: Any) -> None:
    import urllib.error
    import urllib.request

    endpoints = ray.get(grpo_queue.controller.http_endpoints.remote())
    assert endpoints["controller"].startswith("http://127.0.0.1:")
    with pytest.raises(urllib.error.HTTPError, match="501"):
        urllib.request.urlopen(urllib.request.Request(endpoints["controller"] + "/status.json", data=b"x"))
    license_text = urllib.request.urlopen(endpoints["controller"] + "/static/uPlot.LICENSE").read()
    assert b"MIT License" in license_text
