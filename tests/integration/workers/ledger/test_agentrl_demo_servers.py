"""recipe/agentrl_demo.py with ``inference_engine=vllm`` (issue 27 §1): the ledger flow samples from the servers of an
``InferenceManager``, one per DP group, here two stand-in servers (tests/fake_engine_server.py, answering vLLM's
``return_token_ids`` as vLLM does and loading weights through SGLang's route, as the manager's tests substitute the
server command): both registered in the ledger, both serving the samplers, both loaded with each step's weights, and
none left after the run, whether it ends normally or with an error; colocated, each step releases them once its rows
are read and resumes them before the new weights are loaded."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

import orchestration.ledger_run as ledger_run
import recipe.agentrl_demo as demo
from orchestration.config import config_from_cli
from tests.integration.workers.ledger.test_agentrl_demo import SMALL, save_model
from tests.unit.workers.engines.test_engine_server import FAKE, REPO, group_members, wait_for
from workers.api_key import KEY_PLACEHOLDER
from workers.engines.manager import InferenceManager
from workers.engines.sglang import SGLangEngine
from workers.ledger import Ledger


def stand_in(model_path: str, port: int, host: str = "127.0.0.1", *, extra: list[str] | None = None) -> list[str]:
    """``vllm_server_command``'s signature, running the stand-in server: prompt ids within the tiny model's
    vocabulary, each chat taking 0.3 s so that the samplers' concurrent requests overlap and spread over both."""
    return [sys.executable, FAKE, "--host", host, "--port", str(port), "--api-key", KEY_PLACEHOLDER,
            "--model-path", model_path, "--vocab-size", "64", "--chat-delay", "0.3", *(extra or [])]  # fmt: skip


def served(server: Any) -> dict:
    return httpx.get(f"{server.url}/argv", trust_env=False, timeout=10).json()


def server_run(tmp_path: Path, monkeypatch, *args: str, steps: int = 2) -> tuple[list[InferenceManager], dict, int]:
    """The demo for ``steps`` steps on two stand-in vllm servers (a tiny local model, 2 prompts x 2 answers a step):
    the managers it started; what each server had served and loaded after each step's weights were synced (by server
    name); the demo's exit code."""
    managers: list[InferenceManager] = []
    after_sync: dict[str, list[dict]] = {}
    start, sync = InferenceManager.start, ledger_run.sync_servers

    def remember(self: InferenceManager) -> list[str]:
        managers.append(self)
        return start(self)

    def spy(servers: InferenceManager, state_dict: dict, version: int) -> None:
        sync(servers, state_dict, version)
        for server in servers.servers:
            after_sync.setdefault(server.name, []).append(served(server))

    monkeypatch.setattr(InferenceManager, "start", remember)
    monkeypatch.setattr(ledger_run, "sync_servers", spy)
    model = save_model(tmp_path / "model")
    cli = [
        f"output_dir={tmp_path / 'run'}", f"steps={steps}", *SMALL[:4], "prompts_per_step=2", "num_generations=2",
        f"model_name_or_path={model}", "inference_engine=vllm", "inference_dp_size=2", *args,
    ]  # fmt: skip
    config = config_from_cli("", demo.DEFAULT_CONFIG, cli, cls=demo.AgentRLDemoConfig)
    kwargs = {"server_command": stand_in, "engine_factory": SGLangEngine, "health_interval": 0.2}
    code = demo.train(config, inference_kwargs=kwargs)
    return managers, after_sync, code


def services(tmp_path: Path) -> dict[str, tuple[str, str, int]]:
    ledger = Ledger(f"sqlite:///{tmp_path}/run/ledger.db")
    try:
        return {s.name: (s.kind, s.status, s.policy_version) for s in ledger.services(model="adder")}
    finally:
        ledger.close()


def test_two_vllm_servers_are_registered_serve_the_samplers_get_each_steps_weights_and_are_stopped(
    tmp_path, monkeypatch, ray_session
):
    managers, after_sync, code = server_run(tmp_path, monkeypatch)

    assert code == 0 and len(managers) == 1
    [manager] = managers
    assert len(manager.servers) == 2 and manager.engine_kind == "vllm"
    model_dir = str(tmp_path / "run" / "inference_model")
    for server in manager.servers:
        first, second = after_sync[server.name]
        # each step's weights, as the version after that step, into both (one directory each step, shared)
        assert [version for _, version in first["loads"]] == ["1"]
        assert [version for _, version in second["loads"]] == ["1", "2"]
        assert first["chats"], f"{server.name} served no sample"  # both served the samplers
        assert first["argv"][first["argv"].index("--model-path") + 1] == model_dir  # the saved policy first
        assert first["argv"][-2:] == ["--tensor-parallel-size", "1"]  # sized by the inf_* knobs
    assert after_sync["adder-0"][0]["loads"][0][0] == after_sync["adder-1"][0]["loads"][0][0]
    # registered as the engine's services, marked down once stopped, and no process left
    assert services(tmp_path) == {"adder-0": ("vllm", "down", 2), "adder-1": ("vllm", "down", 2)}
    for server in manager.servers:
        assert wait_for(lambda pid=server.process.pid: group_members(pid) == []), group_members(server.process.pid)
    ledger = Ledger(f"sqlite:///{tmp_path}/run/ledger.db")
    try:
        trained = [r for r in ledger.records("train") if r.trained_count]
        assert len(trained) == 8 and {r.last_trained_step for r in trained} == {0, 1}
    finally:
        ledger.close()


def test_a_run_that_fails_stops_its_servers(tmp_path, monkeypatch, ray_session):
    import orchestration.ledger_grpo as ledger_grpo

    def fail(self, step, data, wait_s):
        raise RuntimeError("the training step failed")

    monkeypatch.setattr(ledger_grpo.LedgerGRPOTrainer, "_train", fail)
    managers: list[InferenceManager] = []
    start = InferenceManager.start
    monkeypatch.setattr(InferenceManager, "start", lambda self: (managers.append(self), start(self))[1])
    with pytest.raises(RuntimeError, match=r"^the training step failed$"):
        server_run(tmp_path, monkeypatch)
    [manager] = managers
    assert {status for _, status, _ in services(tmp_path).values()} == {"down"}
    for server in manager.servers:
        assert wait_for(lambda pid=server.process.pid: group_members(pid) == []), group_members(server.process.pid)


def test_colocated_servers_are_released_for_each_steps_training_and_resumed_before_its_weights(
    tmp_path, monkeypatch, ray_session
):
    import orchestration.ledger_grpo as ledger_grpo

    events: list[Any] = []
    release, resume, sync = InferenceManager.release_memory, InferenceManager.resume_memory, ledger_run.sync_servers
    train = ledger_grpo.LedgerGRPOTrainer._train
    clients: list[Any] = []  # the samplers' InferenceClient: no request of it may be in flight at a release
    in_flight_at_release: list[int] = []

    class Recorded(ledger_run.InferenceClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            clients.append(self)

    monkeypatch.setattr(ledger_run, "InferenceClient", Recorded)

    def releasing(self):
        events.append("release")
        in_flight_at_release.append(sum(sum(c.inflight.values()) for c in clients))
        return release(self)

    def resuming(self):
        events.append("resume")
        return resume(self)

    def training(self, step, data, wait_s):
        events.append(f"train {step}")
        return train(self, step, data, wait_s)

    def syncing(servers, state_dict, version):
        events.append(f"sync {version}")
        sync(servers, state_dict, version)

    monkeypatch.setattr(InferenceManager, "release_memory", releasing)
    monkeypatch.setattr(InferenceManager, "resume_memory", resuming)
    monkeypatch.setattr(ledger_grpo.LedgerGRPOTrainer, "_train", training)
    monkeypatch.setattr(ledger_run, "sync_servers", syncing)
    _, after_sync, code = server_run(tmp_path, monkeypatch, "inference_colocate=true")
    assert code == 0
    assert events == ["release", "train 0", "resume", "sync 1", "release", "train 1", "resume", "sync 2"]
    assert in_flight_at_release == [0, 0]  # drained first: the samplers' requests waited for the servers to resume
    assert [[v for _, v in s[-1]["loads"]] for s in after_sync.values()] == [["1", "2"]] * 2


def test_without_colocate_the_servers_are_never_released(tmp_path, monkeypatch, ray_session):
    calls: list[str] = []
    monkeypatch.setattr(InferenceManager, "release_memory", lambda self: calls.append("release"))
    monkeypatch.setattr(InferenceManager, "resume_memory", lambda self: calls.append("resume"))
    assert server_run(tmp_path, monkeypatch, steps=1)[2] == 0
    assert calls == []


OWNER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    import recipe.agentrl_demo as demo
    from orchestration.config import config_from_cli
    from tests.integration.workers.ledger.test_agentrl_demo_servers import stand_in
    from workers.engines.manager import InferenceManager
    from workers.engines.sglang import SGLangEngine

    start = InferenceManager.start

    def started(self):
        urls = start(self)
        print("servers", *[server.process.pid for server in self.servers], flush=True)
        return urls

    InferenceManager.start = started
    config = config_from_cli("", demo.DEFAULT_CONFIG, {cli!r}, cls=demo.AgentRLDemoConfig)
    demo.train(config, inference_kwargs={{"server_command": stand_in, "engine_factory": SGLangEngine,
                                          "health_interval": 0.2}})
    """
)


# a demo run on two stand-in servers signalled mid-training (~1 min on a loaded 2-core machine): slow tier (make test's
# 10-minute budget); SIGINT's path is SIGTERM's and the KeyboardInterrupt's unwinding
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_no_server_survives_a_signal_to_the_demo(tmp_path, signum):
    """SIGTERM: the manager's handler stops the servers (marking them down), then the signal does what it did before;
    SIGINT: the same, then the KeyboardInterrupt unwinds the run (which stops them again)."""
    out = tmp_path / "run"
    model = save_model(tmp_path / "model")
    cli = [f"output_dir={out}", "steps=1000", *SMALL[:4], "prompts_per_step=2", "num_generations=2",
           f"model_name_or_path={model}", "inference_engine=vllm", "inference_dp_size=2"]  # fmt: skip
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(repo=str(REPO), cli=cli)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env, start_new_session=True,
    )  # fmt: skip
    pgids: list[int] = []
    try:
        assert owner.stdout is not None
        for line in owner.stdout:
            if line.startswith("servers "):
                pgids = [int(pid) for pid in line.split()[1:]]
                break
        assert len(pgids) == 2 and all(group_members(pgid) for pgid in pgids)
        # the run is training: a step's metrics row is written
        metrics = out / "metrics.jsonl"
        assert wait_for(lambda: metrics.exists() and bool(metrics.read_text().strip()), timeout=120)
        owner.send_signal(signum)
        owner.wait(120)
        for pgid in pgids:
            assert wait_for(lambda pgid=pgid: group_members(pgid) == []), f"left behind: {group_members(pgid)}"
        assert {status for _, status, _ in services(tmp_path).values()} == {"down"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)  # what is left of the run (its Ray)
        owner.wait(30)
        for pgid in pgids:
            for pid in group_members(pgid):
                os.kill(pid, signal.SIGKILL)
