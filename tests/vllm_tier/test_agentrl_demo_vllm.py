"""The vLLM tier of recipe/agentrl_demo.py's ``inference_engine=vllm`` (``make test-vllm``): the ledger flow on a tiny
local chat model for 2 steps, its samplers asking two real vLLM OpenAI servers on CPU started by the run's
``InferenceManager`` (``inference_dp_size=2``): both registered in the ledger as ``vllm`` services, both picked by the
samplers' ``InferenceClient``, both serving each step's weights (``GET /weight_info``) after the step, and no process
of theirs left once the run ends."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.unit.workers.engines.test_engine_server import group_members, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# each server reserves this fraction of the host's memory (vLLM's CPU reading of --gpu-memory-utilization), as in
# test_inference_manager_vllm
MEM_RATIO = 0.08


def test_the_demo_samples_from_two_vllm_servers_and_loads_each_steps_weights_into_both(tmp_path, monkeypatch):
    import orchestration.ledger_run as ledger_run
    import recipe.agentrl_demo as demo
    from orchestration.config import config_from_cli
    from workers.engines.manager import InferenceManager
    from workers.ledger import InferenceClient, Ledger
    from workers.models import save_tiny_chat_model

    managers: list[InferenceManager] = []
    served: dict[str, list[str | None]] = {}
    picked: set[str] = set()
    start, sync, pick = InferenceManager.start, ledger_run.sync_servers, InferenceClient.pick

    def remember(self: InferenceManager) -> list[str]:
        managers.append(self)
        t0 = time.perf_counter()
        urls = start(self)
        print(f"\ntwo vLLM servers of the demo healthy after {time.perf_counter() - t0:.1f} s")
        return urls

    def spy(servers: InferenceManager, state_dict: dict, version: int) -> None:
        sync(servers, state_dict, version)
        for server in servers.servers:
            served.setdefault(server.name, []).append(server.engine.served_version())

    async def picking(self: InferenceClient) -> Any:
        service = await pick(self)
        picked.add(service.name)
        return service

    monkeypatch.setattr(InferenceManager, "start", remember)
    monkeypatch.setattr(ledger_run, "sync_servers", spy)
    monkeypatch.setattr(InferenceClient, "pick", picking)
    # a character-level tokenizer with a ChatML template; heads of 32 dimensions (vLLM's CPU attention refuses 16:
    # "Unsupported CPU attention configuration: head_dim=16")
    model = save_tiny_chat_model(tmp_path / "model", num_heads=2)
    cli = [
        f"output_dir={tmp_path / 'run'}", "steps=2", "sft_target=0", "num_tasks=32", "lease_s=30",
        "prompts_per_step=4", "num_generations=2", "max_new_tokens=4", f"model_name_or_path={model}",
        "inference_engine=vllm", "inference_dp_size=2", f"inference_mem_ratio={MEM_RATIO}",
    ]  # fmt: skip
    config = config_from_cli("", demo.DEFAULT_CONFIG, cli, cls=demo.AgentRLDemoConfig)
    kwargs = {"env": {"PYTHONPATH": REPO}, "extra_args": ["--max-model-len", "256"], "startup_timeout": 900,
              "health_interval": 1.0}  # fmt: skip

    assert demo.train(config, inference_kwargs=kwargs) == 0

    [manager] = managers
    assert served == {"adder-0": ["1", "2"], "adder-1": ["1", "2"]}  # each step's weights, in both
    assert picked == {"adder-0", "adder-1"}  # both served the samplers
    ledger = Ledger(f"sqlite:///{tmp_path}/run/ledger.db")
    try:
        assert {s.name: (s.kind, s.status) for s in ledger.services(model="adder")} == {
            "adder-0": ("vllm", "down"),
            "adder-1": ("vllm", "down"),
        }
        trained = [r for r in ledger.records("train") if r.trained_count]
        assert len(trained) == 16 and {r.last_trained_step for r in trained} == {0, 1}
    finally:
        ledger.close()
    for server in manager.servers:
        assert wait_for(lambda pid=server.process.pid: group_members(pid) == []), group_members(server.process.pid)
