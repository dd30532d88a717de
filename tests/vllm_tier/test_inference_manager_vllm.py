"""The vLLM tier of ``InferenceManager`` (``make test-vllm``): two real vLLM OpenAI servers on CPU (the tiny Llama of
``test_vllm_engine``, with a chat template), started from the command lines the manager builds and registered in a
SQLite ledger; each answers a chat completion at its registered URL; a weight sync reaches both; one SIGKILLed is
restarted, reloaded and registered again; ``stop()`` leaves no process of theirs. The tests share the module's
manager and run in file order (the last one stops it).
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.unit.workers.engines.test_engine_server import group_members, wait_for
from tests.vllm_tier.test_vllm_engine import (
    PROMPTS,
    differences,
    save_with_tokenizer,
    tiny_model,
    trainer_logprobs,
)
from workers.engines import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the word-level tokenizer's words joined by spaces: "t5 t6" is the ids [5, 6]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
# each server reserves this fraction of the host's memory (vLLM's CPU reading of --gpu-memory-utilization): 1.7 GiB of
# the 21.7 GiB here, ~0.65 GiB of it the tiny model's worker, the rest its KV cache
MEM_RATIO = 0.08


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    path = save_with_tokenizer(tiny_model(), str(tmp_path_factory.mktemp("vllm-manager") / "model"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE  # vLLM's chat completions need one
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    from workers.ledger import Ledger

    return Ledger(f"sqlite:///{tmp_path_factory.mktemp('vllm-ledger')}/ledger.db")


@pytest.fixture(scope="module")
def manager(model_dir, ledger, tmp_path_factory):
    from workers.engines import InferenceManager

    services = InferenceManager(
        "vllm", model_dir, dp_size=2, inf_tp_size=1, inf_mem_ratio=MEM_RATIO, ledger=ledger, env={"PYTHONPATH": REPO},
        extra_args=["--max-model-len", "64"], health_interval=1.0, startup_timeout=900,
        log_dir=str(tmp_path_factory.mktemp("vllm-manager-logs")),
    )  # fmt: skip
    t0 = time.perf_counter()
    services.start()
    print(f"\ntwo vLLM servers started by the InferenceManager, healthy after {time.perf_counter() - t0:.1f} s")
    try:
        yield services
    finally:
        services.stop()


def rows(ledger) -> dict[str, tuple[str | None, str, int]]:
    return {s.name: (s.url, s.status, s.policy_version) for s in ledger.services(model="policy")}


def chat(url: str, key: str | None, **extra) -> dict:
    """One chat completion at ``url`` (a registered ``/v1``), as an OpenAI client sends it."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 4, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)


def test_two_servers_registered_up_and_answering_chat(manager, ledger):
    urls = manager.urls
    assert len(set(urls)) == 2
    assert rows(ledger) == {
        "inference-0": (f"{urls[0]}/v1", "up", 0),
        "inference-1": (f"{urls[1]}/v1", "up", 0),
    }
    for service in ledger.services(model="policy"):
        reply = chat(service.url, manager.api_key)
        [choice] = reply["choices"]
        assert reply["model"] == "policy" and choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["message"]["content"], str)
        # vLLM's own key check on /v1: a request without the manager's key is refused
        assert httpx.post(f"{service.url}/chat/completions", json={}, timeout=30, trust_env=False).status_code == 401


def test_the_memory_ratio_sizes_each_servers_memory_on_cpu(manager):
    """``inf_mem_ratio`` reached vLLM's CPU worker: the KV cache is what remains of ``MEM_RATIO`` of the host's
    memory (not ``VLLM_CPU_KVCACHE_SPACE``'s explicit size, which ``make test-vllm`` sets and the manager removed)."""
    assert manager.cpu_memory_ratio
    for server in manager.servers:
        assert server.command("127.0.0.1", 1)[-4:-2] == ["--gpu-memory-utilization", str(MEM_RATIO)]
        log = server.log_path.read_text(errors="replace")
        found = re.search(
            r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node \d+, with ([\d.]+) GiB requested", log
        )
        assert found, f"no KV cache sizing in {server.log_path}"
        kv, total, requested = (float(g) for g in found.groups())
        print(f"{server.name}: {requested} GiB of {total} GiB requested, {kv} GiB of it KV cache")
        assert abs(requested - MEM_RATIO * total) <= 0.02 and 0 < kv < requested
        assert "Explicitly set" not in log


def test_sync_weights_reaches_both_servers(manager, ledger, tmp_path_factory):
    new = tiny_model(seed=9).eval()
    checkpoint = tmp_path_factory.mktemp("vllm-step-1") / "ckpt"
    new.save_pretrained(checkpoint)
    replies = manager.sync_weights(str(checkpoint), version=1)
    print("weight sync into both servers: " + ", ".join(f"{r['seconds']:.3f} s" for r in replies))
    assert [(r["success"], r["version"]) for r in replies] == [(True, 1), (True, 1)], replies
    assert wait_for(lambda: {v[1:] for v in rows(ledger).values()} == {("up", 1)})
    for engine in manager.engines:  # the server holds the new weights: its log-probs are the new model's
        assert float(differences(new, engine.generate(PROMPTS, 2, SEEDED), 1.0).max()) < 1e-3


def test_a_samplers_inference_client_chats_with_a_managed_service(manager, ledger, tmp_path):
    """``InferenceClient.chat`` (what a sampler calls) against the least-loaded registered vLLM server: the token
    ids of the prompt and of each choice (vLLM's ``return_token_ids``), each choice's log-probs (those of the synced
    weights, as the trainer computes them) and the service's registered policy version."""
    import asyncio

    from workers.ledger import InferenceClient, SamplingConfig

    cfg = SamplingConfig(output_dir=str(tmp_path), num_generations=2, max_new_tokens=6, temperature=1.0)
    client = InferenceClient(ledger, cfg, api_key=manager.api_key)

    async def once():
        try:
            return await client.chat([{"role": "user", "content": "t5 t6 t7"}], seed=1)
        finally:
            await client.aclose()

    completion = asyncio.run(once())
    assert completion.prompt_token_ids == [5, 6, 7] and completion.policy_version == 1
    new = tiny_model(seed=9).eval()
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert 1 <= len(choice.token_ids) == len(choice.token_logprobs) <= 6
        ref = trainer_logprobs(new, completion.prompt_token_ids, choice.token_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(choice.token_logprobs, ref, strict=True)) < 1e-3
        assert isinstance(choice.message.content, str)


def test_a_sigkilled_server_is_restarted_reloaded_and_registered_again(manager, ledger):
    new = tiny_model(seed=9).eval()
    crashed = manager.servers[1]
    old_url, first_pid = crashed.url, crashed.process.pid
    os.kill(first_pid, signal.SIGKILL)
    t0 = time.perf_counter()
    assert wait_for(lambda: crashed.record.restarts == 1 and rows(ledger)["inference-1"][1:] == ("up", 1), 900)
    print(f"SIGKILLed vLLM server restarted, reloaded and up again after {time.perf_counter() - t0:.1f} s")
    assert crashed.process.pid != first_pid and crashed.url == old_url  # on its port again: the same URL
    assert group_members(first_pid) == []  # its engine core went with it
    assert rows(ledger)["inference-1"][0] == f"{old_url}/v1"
    assert crashed.engine.served_version() == "1" and not crashed.engine.server_restarted()  # GET /weight_info
    assert float(differences(new, crashed.engine.generate(PROMPTS, 2, SEEDED), 1.0).max()) < 1e-3
    assert chat(rows(ledger)["inference-1"][0], manager.api_key)["choices"]
    assert manager.check() == {"inference-0": "healthy", "inference-1": "healthy"}


def test_stop_leaves_no_vllm_process(manager, ledger):
    pgids = [server.process.pid for server in manager.servers]
    assert all(len(group_members(pgid)) >= 2 for pgid in pgids)  # the API server and its engine core, at least
    manager.stop()
    assert all(wait_for(lambda pgid=pgid: group_members(pgid) == []) for pgid in pgids)
    assert {v[1] for v in rows(ledger).values()} == {"down"}
