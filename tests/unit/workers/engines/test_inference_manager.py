"""InferenceManager: the guide's inf_* knobs on each engine's command line and the refusals of what an engine cannot
honour; two stand-in servers (tests/fake_engine_server.py) started, registered in a SQLite ledger, synced, one
SIGKILLed and seen restarted at the same URL, reloaded and registered again; released and resumed; and no server
left behind when the owning process is SIGTERMed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.unit.workers.engines.test_engine_server import FAKE, REPO, group_members, wait_for
from workers.api_key import KEY_PLACEHOLDER
from workers.engines import InferenceManager
from workers.engines.errors import EngineError, EngineRequestError, InvalidInferenceSizing
from workers.engines.manager import sizing_args
from workers.engines.sglang import SGLangEngine
from workers.ledger import Ledger, SamplingConfig


def fake_command(model_path: str, port: int, host: str = "127.0.0.1", *, extra: list[str] | None = None) -> list[str]:
    """``sglang_server_command``'s signature, running the stand-in server (it keeps the flags it does not know)."""
    return [sys.executable, FAKE, "--host", host, "--port", str(port), "--api-key", KEY_PLACEHOLDER,
            "--model-path", model_path, *(extra or [])]  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "tp", "ep", "ratio", "argv"),
    [
        ("vllm", 1, 1, None, ["--tensor-parallel-size", "1"]),
        (
            "vllm",
            4,
            4,
            0.6,
            ["--tensor-parallel-size", "4", "--enable-expert-parallel", "--gpu-memory-utilization", "0.6"],
        ),
        ("vllm", 2, 1, 1, ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "1.0"]),
        ("sglang", 1, 1, None, ["--tp-size", "1", "--ep-size", "1"]),
        ("sglang", 8, 4, 0.85, ["--tp-size", "8", "--ep-size", "4", "--mem-fraction-static", "0.85"]),
    ],
)
def test_each_knob_maps_onto_the_engines_own_flag(engine, tp, ep, ratio, argv):
    assert sizing_args(engine, tp_size=tp, ep_size=ep, mem_ratio=ratio) == argv


def test_the_servers_command_lines_and_devices():
    vllm = InferenceManager(
        "vllm", "/models/p", dp_size=2, inf_tp_size=2, inf_mem_ratio=0.5, gpus=[0, 1, 2, 3], extra_args=["--x", "1"]
    )
    argv = vllm.servers[1].command("127.0.0.1", 8001)
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/p"]
    assert argv[-6:] == ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5", "--x", "1"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in vllm.servers] == ["0,1", "2,3"]
    assert vllm.servers[0].env["VLLM_SERVER_DEV_MODE"] == "1" and vllm.servers[0].health_path == "/health"
    assert [s.name for s in vllm.servers] == ["inference-0", "inference-1"]

    sglang = InferenceManager("sglang", "/models/p", inf_tp_size=4, inf_ep_size=2, inf_mem_ratio=0.7)
    argv = sglang.servers[0].command("127.0.0.1", 30000)
    assert argv[1:5] == ["-m", "sglang.launch_server", "--model-path", "/models/p"]
    assert argv[-6:] == ["--tp-size", "4", "--ep-size", "2", "--mem-fraction-static", "0.7"]
    assert sglang.servers[0].health_path == "/health_generate" and "CUDA_VISIBLE_DEVICES" not in sglang.servers[0].env
    # one key for all the servers, for the samplers' InferenceClient
    assert sglang.api_key and sglang.servers[0].api_key == sglang.api_key


def test_vllm_servers_answer_to_the_managers_model_name_and_their_engines_ask_for_it():
    """The ledger flow's services carry the manager's ``model`` (its ``SamplingConfig.model``) and the samplers ask
    for it; vLLM answers 404 to a name other than its ``--served-model-name`` (the vLLM tier's ledger run did)."""
    for model in ("adder", "policy"):  # policy: the default, the Ray GRPO run's
        manager = InferenceManager("vllm", "/models/p", **({"model": model} if model != "policy" else {}))
        argv = manager.servers[0].command("127.0.0.1", 8000)
        assert argv[argv.index("--served-model-name") + 1] == model
        assert manager.servers[0].engine_factory("http://127.0.0.1:8000").served_model == model


def test_sglang_servers_answer_to_the_managers_model_name():
    """As the vLLM servers (above): an SGLang server started without ``--served-model-name`` answers to and reports
    its model path, not the ledger services' model the samplers ask for."""
    for model in ("adder", "policy"):
        manager = InferenceManager("sglang", "/models/p", **({"model": model} if model != "policy" else {}))
        argv = manager.servers[0].command("127.0.0.1", 30000)
        assert argv[argv.index("--served-model-name") + 1] == model
        assert argv[argv.index("--model-path") + 1] == "/models/p"


@pytest.mark.parametrize(
    ("engine", "kwargs", "message"),
    [
        (
            "vllm",
            {"inf_tp_size": 4, "inf_ep_size": 2},
            r"^vllm: inf_ep_size=2 with inf_tp_size=4: vLLM's --enable-expert-parallel spreads the experts over the "
            r"whole tensor-parallel group of a server \(expert parallel size = --tensor-parallel-size\), so it "
            r"supports inf_ep_size 1 \(no expert parallelism\) or 4$",
        ),
        (
            "sglang",
            {"inf_tp_size": 4, "inf_ep_size": 3},
            r"^sglang: inf_ep_size=3 with inf_tp_size=4: SGLang's --ep-size splits the --tp-size ranks of a server "
            r"into expert groups, so it supports an inf_ep_size that divides inf_tp_size=4$",
        ),
        ("vllm", {"inf_tp_size": 0}, r"^vllm: inf_tp_size expected an int >= 1, got 0$"),
        ("sglang", {"inf_ep_size": 1.5}, r"^sglang: inf_ep_size expected an int >= 1, got 1.5$"),
        (
            "vllm",
            {"inf_mem_ratio": 1.2},
            r"^vllm: inf_mem_ratio expected a float in \(0, 1\] \(the fraction of each device's memory the server "
            r"takes\), got 1.2$",
        ),
        ("sglang", {"inf_mem_ratio": 0}, r"^sglang: inf_mem_ratio expected a float in \(0, 1\] .*got 0$"),
        ("sglang", {"dp_size": 0}, r"^sglang: dp_size expected an int >= 1 \(one server each\), got 0$"),
        (
            "vllm",
            {"dp_size": 2, "inf_tp_size": 2, "gpus": [0, 1, 2]},
            r"^vllm: 2 servers of inf_tp_size=2 devices need 4 gpus, got 3: \[0, 1, 2\]$",
        ),
        (
            "hf",
            {},
            r"^engine 'hf': expected one of vllm, sglang, the engines an InferenceManager starts servers of "
            r"\(HFEngine runs in the process that samples, so it has no server to start\)$",
        ),
        ("sglang", {"sleep_mode": True}, r"^sglang: sleep_mode is vLLM's \(--enable-sleep-mode\)"),
    ],
)
def test_what_an_engine_cannot_honour_is_refused_at_construction(engine, kwargs, message):
    with pytest.raises(InvalidInferenceSizing, match=message) as refused:
        InferenceManager(engine, "/models/p", **kwargs)
    assert isinstance(refused.value, EngineError) and isinstance(refused.value, ValueError)


def test_a_sampling_config_sizes_the_manager():
    cfg = SamplingConfig(inf_tp_size=2, inf_ep_size=2, inf_mem_ratio=0.6, model="tiny")
    manager = InferenceManager.from_config(cfg, "vllm", "/models/p", dp_size=3)
    assert len(manager.servers) == 3 and manager.model == "tiny"
    assert manager.sizing == ["--tensor-parallel-size", "2", "--enable-expert-parallel", "--gpu-memory-utilization",
                              "0.6"]  # fmt: skip


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)


def test_on_vllms_cpu_build_the_memory_ratio_governs_and_the_kv_cache_size_is_removed(tmp_path, monkeypatch):
    """vLLM's CPU backend reads --gpu-memory-utilization as the fraction of the host's memory a server reserves,
    unless VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) overrides it: the manager removes that variable, even one the
    run's own environment sets."""
    monkeypatch.setattr("workers.engines.vllm_server.vllm_on_cpu", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    manager = InferenceManager(
        "vllm", "/models/tiny", dp_size=2, inf_mem_ratio=0.25, server_command=fake_command, engine_factory=SGLangEngine,
        health_interval=0, log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    assert manager.cpu_memory_ratio and manager.servers[0].env["VLLM_CPU_KVCACHE_SPACE"] is None
    with manager:
        for server in manager.servers:
            assert served(server)["argv"][-4:] == ["--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.25"]
            started_with = environ(server.process.pid)
            assert "VLLM_CPU_KVCACHE_SPACE" not in started_with and started_with["VLLM_SERVER_DEV_MODE"] == "1"

    no_ratio = InferenceManager("vllm", "/models/tiny", dp_size=2)  # the 1 GiB KV cache of vllm_server_env stays
    assert not no_ratio.cpu_memory_ratio and no_ratio.servers[0].env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.setattr("workers.engines.vllm_server.vllm_on_cpu", lambda: False)  # a GPU build: each its devices
    on_gpus = InferenceManager("vllm", "/models/tiny", dp_size=3, inf_mem_ratio=0.5)
    assert not on_gpus.cpu_memory_ratio and on_gpus.servers[0].env["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dp_size": 3, "inf_mem_ratio": 0.5},
            r"^vllm on CPU: inf_mem_ratio=0.5 is the fraction of this host's memory each server reserves \(vLLM's CPU "
            r"backend reads --gpu-memory-utilization so\) and the 3 servers share this host: dp_size x inf_mem_ratio = "
            r"1.5, expected at most 1$",
        ),
        (
            {"inf_mem_ratio": 0.5, "env": {"VLLM_CPU_KVCACHE_SPACE": "4"}},
            r"^vllm on CPU: inf_mem_ratio=0.5 with VLLM_CPU_KVCACHE_SPACE=4 in env: the KV cache size in GiB overrides "
            r"the memory fraction on vLLM's CPU backend; expected one of them$",
        ),
    ],
)
def test_on_vllms_cpu_build_a_memory_ratio_it_cannot_honour_is_refused(monkeypatch, kwargs, message):
    monkeypatch.setattr("workers.engines.vllm_server.vllm_on_cpu", lambda: True)
    with pytest.raises(InvalidInferenceSizing, match=message):
        InferenceManager("vllm", "/models/tiny", **kwargs)


def served(server) -> dict:
    """What the stand-in server says it was started with and loaded."""
    return httpx.get(f"{server.url}/argv", trust_env=False, timeout=10).json()


def rows(ledger: Ledger) -> dict[str, tuple[str | None, str, int]]:
    return {s.name: (s.url, s.status, s.policy_version) for s in ledger.services(model="tiny")}


def test_two_services_registered_synced_restarted_and_stopped(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    manager = InferenceManager(
        "sglang", "/models/tiny", dp_size=2, inf_tp_size=2, inf_mem_ratio=0.5, ledger=ledger, model="tiny",
        server_command=fake_command, health_interval=0.1, log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    with manager:
        urls = manager.urls
        assert len(set(urls)) == 2 and all(url.startswith("http://127.0.0.1:") for url in urls)
        # (waited for: a health check every 0.1 s that a loaded machine answers late marks a server down a while)
        assert wait_for(
            lambda: (
                rows(ledger) == {"inference-0": (f"{urls[0]}/v1", "up", 0), "inference-1": (f"{urls[1]}/v1", "up", 0)}
            )
        ), rows(ledger)
        assert [s.url for s in manager.services] == [f"{url}/v1" for url in urls]
        for server in manager.servers:  # the sizing reached the real process's command line
            assert served(server)["argv"][-6:] == ["--tp-size", "2", "--ep-size", "1", "--mem-fraction-static", "0.5"]

        checkpoint = str(tmp_path / "step-1")
        replies = manager.sync_weights(checkpoint)
        assert [(r["success"], r["version"]) for r in replies] == [(True, 1), (True, 1)]
        assert [served(server)["loads"] for server in manager.servers] == [[[checkpoint, "1"]]] * 2
        assert wait_for(lambda: {v[2] for v in rows(ledger).values()} == {1})

        crashed = manager.servers[1]
        first_pid, first_url = crashed.process.pid, crashed.url
        os.kill(first_pid, signal.SIGKILL)
        # the new process first: restart() counts the restart before it marks the row down, so a look in between
        # still sees the row as it was before the crash ("up", 1)
        assert wait_for(
            lambda: (
                crashed.record.restarts == 1
                and crashed.process.pid != first_pid
                and rows(ledger)["inference-1"][1:] == ("up", 1)
            )
        )
        assert crashed.process.pid != first_pid
        # at the same URL: rollout worker i's engine client, built once with it, still reaches its server
        assert crashed.url == first_url and manager.urls == urls
        assert rows(ledger)["inference-1"][0] == f"{first_url}/v1"
        assert served(crashed)["loads"] == [[checkpoint, "1"]]  # the newest weights before it is up again
        assert wait_for(lambda: manager.check() == {"inference-0": "healthy", "inference-1": "healthy"})
        pgids = [server.process.pid for server in manager.servers]
    assert {v[1] for v in rows(ledger).values()} == {"down"}
    assert all(wait_for(lambda pgid=pgid: group_members(pgid) == []) for pgid in pgids)


class StopToRelease(SGLangEngine):
    """A client whose server cannot free its memory itself (vLLM without sleep mode): EngineServer stops it."""

    supports_release_memory = False


@pytest.mark.parametrize(("factory", "how"), [(None, "engine"), (StopToRelease, "stop")])
def test_release_and_resume_take_the_services_down_and_up(tmp_path, factory, how):
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    manager = InferenceManager(
        "sglang", "/models/tiny", dp_size=2, ledger=ledger, model="tiny", server_command=fake_command,
        engine_factory=factory, health_interval=0, log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    with manager:
        checkpoint = str(tmp_path / "step-1")
        manager.sync_weights(checkpoint, version=1)
        before = manager.urls
        assert manager.release_memory() == [how, how]  # SGLang's release_memory_occupation, or the server stopped
        assert {v[1] for v in rows(ledger).values()} == {"down"}
        assert manager.resume_memory() == manager.urls
        assert {name: v[1:] for name, v in rows(ledger).items()} == {"inference-0": ("up", 1), "inference-1": ("up", 1)}
        assert [v[0] for v in rows(ledger).values()] == [f"{url}/v1" for url in manager.urls]
        assert manager.urls == before  # a server stopped and started again keeps its port
        if how == "stop":  # new processes, loaded with the newest weights before they are up
            assert [served(server)["loads"] for server in manager.servers] == [[[checkpoint, "1"]]] * 2


class RefusesWeights(SGLangEngine):
    """A client whose loads fail once ``refuse`` is set (a restarted server that cannot read the checkpoint)."""

    refuse = False

    def update_weights_from_checkpoint(self, checkpoint_path, version=None):
        if RefusesWeights.refuse:
            raise EngineRequestError(f"sglang server at {self.url} did not load the weights of {checkpoint_path}")
        return super().update_weights_from_checkpoint(checkpoint_path, version)


def test_a_restarted_server_that_cannot_get_the_newest_weights_stays_down(tmp_path, monkeypatch):
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    manager = InferenceManager(
        "sglang", "/models/tiny", dp_size=2, ledger=ledger, model="tiny", server_command=fake_command,
        engine_factory=RefusesWeights, health_interval=0.1, log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    with manager:
        manager.sync_weights(str(tmp_path / "step-1"), version=1)
        monkeypatch.setattr(RefusesWeights, "refuse", True)
        crashed = manager.servers[0]
        os.kill(crashed.process.pid, signal.SIGKILL)
        assert wait_for(lambda: "inference-0" in manager.errors)
        assert crashed.record.status == "healthy" and served(crashed)["loads"] == []  # runs the initial weights
        assert {name: v[1] for name, v in rows(ledger).items()} == {"inference-0": "down", "inference-1": "up"}
        with pytest.raises(EngineRequestError, match=r"did not load the weights of .*step-1"):
            manager.check()
        manager.release_memory()
        manager.resume_memory()  # the weights it never got are still missing: it stays down
        assert {name: v[1] for name, v in rows(ledger).items()} == {"inference-0": "down", "inference-1": "up"}

        monkeypatch.setattr(RefusesWeights, "refuse", False)
        assert [r["success"] for r in manager.sync_weights(str(tmp_path / "step-2"))] == [True, True]
        assert {name: v[1:] for name, v in rows(ledger).items()} == {"inference-0": ("up", 2), "inference-1": ("up", 2)}
        assert wait_for(lambda: manager.check() == {"inference-0": "healthy", "inference-1": "healthy"})


def test_a_state_dict_is_written_once_and_kept_for_restarts_until_the_next_sync(tmp_path):
    manager = InferenceManager(
        "sglang", "/models/tiny", dp_size=2, server_command=fake_command, health_interval=0,
        log_dir=str(tmp_path / "logs"),
    )  # fmt: skip
    with manager:
        manager.sync_state_dict({"w": torch.ones(2)}, version=1)
        first = {served(server)["loads"][-1][0] for server in manager.servers}
        assert len(first) == 1 and (Path(next(iter(first))) / "model.safetensors").is_file()  # one directory for all
        manager.sync_state_dict({"w": torch.zeros(2)}, version=2)
        second = {served(server)["loads"][-1][0] for server in manager.servers}
        assert second != first and not Path(next(iter(first))).exists() and Path(next(iter(second))).exists()
    assert not Path(next(iter(second))).exists()


OWNER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from tests.unit.workers.engines.test_inference_manager import fake_command
    from workers.engines import InferenceManager
    from workers.ledger import Ledger
    manager = InferenceManager("sglang", "/models/tiny", dp_size=2, server_command=fake_command, health_interval=0.2,
                               ledger=Ledger({ledger!r}), model="tiny")
    manager.start()
    print(*[server.process.pid for server in manager.servers], flush=True)
    time.sleep(600)
    """
)


def test_no_server_survives_a_sigterm_of_the_owning_process(tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.db"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(repo=REPO, ledger=url)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    pgids: list[int] = []
    try:
        pgids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pgids) == 2 and all(group_members(pgid) for pgid in pgids)
        assert {v[1] for v in rows(Ledger(url)).values()} == {"up"}
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(30) == -signal.SIGTERM
        for pgid in pgids:
            assert wait_for(lambda pgid=pgid: group_members(pgid) == []), f"left behind: {group_members(pgid)}"
        # stopped by EngineServer's SIGTERM handler, which marked them down (the kernel's kill would not have)
        assert {v[1] for v in rows(Ledger(url)).values()} == {"down"}
    finally:
        owner.kill()
        for pgid in pgids:
            for pid in group_members(pgid):
                os.kill(pid, signal.SIGKILL)


def test_a_samplers_chat_with_an_sglang_service_reads_sglangs_token_ids(tmp_path):
    """The services are registered with their engine's kind, so a sampler's InferenceClient asks an SGLang server
    with SGLang's flags and reads its reply's fields (the stand-in answers as SGLang's /v1/chat/completions)."""
    import asyncio

    from workers.ledger import InferenceClient

    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    cfg = SamplingConfig(output_dir=str(tmp_path), model="tiny")
    manager = InferenceManager(
        "sglang", "/models/tiny", ledger=ledger, model="tiny", server_command=fake_command, health_interval=0.1,
        log_dir=str(tmp_path / "logs"),
    )  # fmt: skip

    async def chat() -> Any:
        client = InferenceClient(ledger, cfg, refresh_s=0, api_key=manager.api_key)
        try:
            return await client.chat([{"role": "user", "content": "1+1="}], n=2)
        finally:
            await client.aclose()

    with manager:
        assert wait_for(lambda: [(s.kind, s.status) for s in ledger.services(model="tiny")] == [("sglang", "up")])
        got = asyncio.run(chat())
        assert got.prompt_token_ids == [ord(c) for c in "1+1="]
        assert [(c.token_ids, c.token_logprobs) for c in got.choices] == [([5, 2], [-0.25, -1.5])] * 2
        assert got.policy_version == 0
        manager.sync_weights(str(tmp_path / "step-1"))
        assert asyncio.run(chat()).policy_version == 1  # the synced weights


# --- gpu_plan (issue 27): each server's devices, the manager's gpus split (a pure function: no GPU needed) ---------
@pytest.mark.parametrize(
    ("gpus", "servers", "tp", "plan"),
    [
        ([0, 1, 2, 3], 2, 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3], 4, 1, [[0], [1], [2], [3]]),
        ([6, 7, 2, 3, 0], 2, 2, [[6, 7], [2, 3]]),  # Ray's ids in its order; the fifth is left unused
        (["2", "3"], 1, 2, [["2", "3"]]),
    ],
)
def test_the_gpu_plan_gives_server_r_the_devices_r_tp_to_r_plus_1_tp(gpus, servers, tp, plan):
    from workers.engines.manager import gpu_plan

    assert gpu_plan(gpus, servers, tp) == plan


@pytest.mark.parametrize(
    ("gpus", "servers", "tp", "message"),
    [
        ([0, 1, 2], 2, 2, r"^2 servers of inf_tp_size=2 devices need 4 gpus, got 3: \[0, 1, 2\]$"),
        ([], 1, 1, r"^1 servers of inf_tp_size=1 devices need 1 gpus, got 0: \[\]$"),
        ([0, 1, 1, 2], 2, 2, r"^gpus: expected 4 distinct devices, one server each, got 1 more than once in "),
        ([0, 1], 0, 1, r"^num_servers expected an int >= 1, got 0$"),
        ([0, 1], 1, 0, r"^inf_tp_size expected an int >= 1, got 0$"),
    ],
)
def test_too_few_or_shared_gpus_are_refused_naming_both_numbers(gpus, servers, tp, message):
    from workers.engines.manager import gpu_plan

    with pytest.raises(InvalidInferenceSizing, match=message):
        gpu_plan(gpus, servers, tp)
