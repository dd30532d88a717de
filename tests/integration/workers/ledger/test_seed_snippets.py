"""The seed's snippets (agentrl-sampling-guide.md) run against our package as written, only the imports changed:
``databases`` / ``rollout.sampler`` / ``rollout.scheduler`` -> ``workers.ledger``. Plus the ``ledger status`` view."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

# --- seed: "Define a custom task type" (import changed)
from workers.ledger import Task, register_new_model


@register_new_model
class RFTTask(Task):
    inputs: list[dict]
    target: str


# --- seed: "Wrap your items as a dataset that returns Task instances"
from torch.utils.data import Dataset  # noqa: E402


class RFTDataset(Dataset):
    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        # Return a Task instance; the scheduler will set split/epoch and write to DB.
        return RFTTask(**self.items[idx])


# --- seed: "Write a custom sampler" (import changed)
from workers.ledger import AsyncSampler  # noqa: E402


class MySampler(AsyncSampler):
    async def run(self):
        messages = [{"role": "user", "content": "Hello, who are you?"}]
        response = await self.create_chat_completions(messages)  # noqa: F841
        # process response and write a record here

    async def evaluate_record(self, record):
        # return a scalar score
        return 0


#
from workers.ledger import InferenceService, Ledger, SamplingConfig  # noqa: E402

ITEMS = [{"inputs": [{"role": "user", "content": f"{i}+{i}"}], "target": str(2 * i)} for i in range(4)]


@pytest.fixture
def cfg(ledger_url, tmp_path, endpoint_url):
    Ledger(ledger_url).register_service(InferenceService(name="tiny-0", url=endpoint_url, model="tiny"))
    return SamplingConfig(output_dir=str(tmp_path), db_connection_string=ledger_url, model="tiny", max_new_tokens=4)


def test_the_seed_s_scheduler_snippet(cfg):
    items = ITEMS
    # --- seed: "Then run it with SamplingScheduler" (import changed) ---
    from workers.ledger import SamplingScheduler

    dataset = RFTDataset(items)
    scheduler = SamplingScheduler(
        config=cfg,
        sampler_class=MySampler,  # your custom sampler
        dataset=dataset,
        split="train",
    )
    scheduler.run()
    # ---
    ledger = Ledger(cfg.ledger_url)
    tasks = ledger.tasks("train")
    assert [type(t) for t in tasks] == [RFTTask] * 4 and [t.status for t in tasks] == ["done"] * 4
    assert [(t.id, t.target, t.inputs) for t in tasks] == [
        (str(i), it["target"], it["inputs"]) for i, it in enumerate(ITEMS)
    ]
    assert scheduler.stats["completed"] == 4


def test_the_seed_s_async_with_snippet(cfg):
    Ledger(cfg.ledger_url).write_epoch("train", 0, [RFTDataset(ITEMS)[0].model_copy(update={"id": "0"})], owner="t")

    async def main():
        # --- seed: "Use it via the async context manager (auto claim/return tasks)" ---
        async with MySampler(cfg) as sampler:
            await sampler.run()
        # ---
        return sampler

    sampler = asyncio.run(main())
    assert isinstance(sampler.task, RFTTask) and sampler.task.target == "0"
    assert [c.status for c in Ledger(cfg.ledger_url).claims("train")] == ["done"]


def test_ledger_status_view(cfg, tmp_path):
    from workers.ledger import SamplingScheduler

    SamplingScheduler(config=cfg, sampler_class=MySampler, dataset=RFTDataset(ITEMS), split="train").run()
    out = subprocess.run(
        [sys.executable, "-m", "workers.ledger", "status", "--db", cfg.ledger_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "  train            0        0        0        4        0        4" in out
    assert "claims  done 4" in out and "records 0 (0 trained)" in out
    assert "tiny-0" in out and " up " in out and "model=tiny" in out
    missing = subprocess.run(
        [sys.executable, "-m", "workers.ledger", "status", "--db", f"sqlite:///{tmp_path}/nothing.db"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no ledger at sqlite:///" in missing.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "workers.ledger", "status", "--db", "mongodb://localhost:27017"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "expected 'sqlite:///PATH' or 'postgresql://" in bad.stderr
