"""A Ray GRPO run whose inference servers share their devices with training (``rollout.inference_colocate``, issue
27 §1): two stand-in SGLang servers (tests/fake_engine_server.py, answering each generation with two tokens after
0.2 s), one per rollout worker. Each step the run waits for its generation, holds the generations of the steps launched
ahead (async mode), releases the servers, trains, resumes them and loads the new weights before any generation goes
on; every row of the run is trained."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import pytest

from orchestration import grpo_run
from orchestration.config import load_config
from orchestration.grpo_run import GRPORun
from orchestration.inference import inference_manager
from tests.unit.orchestration.test_run_inference import CONFIG
from tests.unit.workers.engines.test_engine_server import FAKE
from workers.api_key import KEY_PLACEHOLDER
from workers.engines.manager import InferenceManager

STEPS, PROMPTS, N = 3, 2, 2


def stand_in(model_path: str, port: int, host: str = "127.0.0.1", *, extra: list[str] | None = None) -> list[str]:
    """``sglang_server_command``'s signature, running the stand-in server: two tokens per generation, 0.2 s each (a
    step's generations overlap the drain of the step ahead's)."""
    return [sys.executable, FAKE, "--host", host, "--port", str(port), "--api-key", KEY_PLACEHOLDER,
            "--model-path", model_path, "--generate-tokens", "--generate-delay", "0.2", *(extra or [])]  # fmt: skip


def served(url: str) -> dict:
    return httpx.get(f"{url}/argv", trust_env=False, timeout=10).json()


@pytest.mark.parametrize(
    "overrides",
    [
        # the sync loop's release and resume are the async one's without the step ahead: slow tier (make test's budget)
        pytest.param({"mode": "sync", "weight_sync": "memory"}, marks=pytest.mark.slow),
        # the step ahead generates while a step trains: its next generations are held, the one in flight finished
        # slow tier too (make test's 10-minute budget); the default tier releases and resumes colocated servers in
        # test_agentrl_demo_servers.py
        pytest.param({"mode": "async", "max_staleness": 1, "weight_sync": "shm"}, marks=pytest.mark.slow),
    ],
    ids=["sync-memory", "async-shm"],
)
def test_colocated_servers_are_released_for_each_training_step_and_resumed_with_the_new_weights(
    tmp_path, monkeypatch, ray_session, overrides
):
    events: list[str] = []
    release, resume, train, publish = (
        InferenceManager.release_memory, InferenceManager.resume_memory, GRPORun.train, GRPORun.publish
    )  # fmt: skip
    managers: list[InferenceManager] = []

    def manager(*args: Any, **kwargs: Any) -> InferenceManager:
        managers.append(inference_manager(*args, server_command=stand_in, health_interval=0.2, **kwargs))
        return managers[-1]

    def releasing(self: InferenceManager) -> list[str]:
        events.append("release")
        return release(self)

    def resuming(self: InferenceManager) -> list[str]:
        events.append("resume")
        return resume(self)

    def training(self: GRPORun, step: int) -> dict[str, float]:
        events.append(f"train {step}")
        return train(self, step)

    def publishing(self: GRPORun, version: int) -> float:
        events.append(f"sync {version}")
        return publish(self, version)

    monkeypatch.setattr(grpo_run, "inference_manager", manager)
    monkeypatch.setattr(InferenceManager, "release_memory", releasing)
    monkeypatch.setattr(InferenceManager, "resume_memory", resuming)
    monkeypatch.setattr(GRPORun, "train", training)
    monkeypatch.setattr(GRPORun, "publish", publishing)
    config = load_config(
        CONFIG,
        {
            "output_dir": str(tmp_path), "steps": STEPS, "prompts_per_step": PROMPTS, "n_samples": N,
            "rollout.engine": "sglang", "rollout.num_workers": 2, "rollout.groups_per_request": 1,
            "rollout.reward_groups_per_request": 1, "rollout.inference_colocate": True, "sft.enabled": False,
            "train.world_size": 1, "task.num_train_prompts": 16, "task.num_eval_prompts": 4, **overrides,
        },
    )  # fmt: skip
    with GRPORun(config) as run:
        rows = run.run()
        urls = run.inference.urls if run.inference is not None else []
        servers = {url: served(url) for url in urls}

    # the run's rows all trained
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["rows"] for r in rows] == [PROMPTS * N] * STEPS
    # the driver's cycle: the servers released inside each step's train, resumed before the step's weights go out
    # (with the weight channel the trainer wrote them already: the engines load them once the gate opens)
    expected = ["sync 0"]  # begin(): the first weights
    for step in range(STEPS):
        expected += [f"train {step}", "release", "resume"]
        if config.weight_sync != "shm":
            expected.append(f"sync {step + 1}")
    assert events == expected
    assert len(servers) == 2
    for url, seen in servers.items():
        assert seen["in_flight_at_release"] == [0] * STEPS, url  # no generation in flight at a release
        assert not [v for v in seen["generated"] if v.endswith("released")], url  # none while released
        assert seen["generated"], f"{url} generated nothing"
        # after each resume the new weights are loaded before the server's next generation
        after = seen["events"]
        for i, event in enumerate(after):
            if event == "release":
                assert after[i + 1] == "resume", after
            if event == "resume":
                following = [e for e in after[i + 1 :] if e.startswith(("load", "generate"))]
                assert not following or following[0].startswith("load"), after
        assert after.count("release") == STEPS
