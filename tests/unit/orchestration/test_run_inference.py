"""A run's inference servers (orchestration/inference.py, issue 27 §1): ``rollout.engine_url`` as one URL for every
rollout worker or a list of one per worker; without it, a ``vllm-server`` / ``sglang`` run starts one server per
rollout worker through an ``InferenceManager`` (``rollout.inf_*`` size them), worker ``i`` uses server ``i``, its engine
client loads the published weights into that server alone, and the servers stop with the run. No Ray and no vLLM: the
servers are the stand-in of tests/fake_engine_server.py."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from orchestration import grpo_run
from orchestration.config import ConfigError, RolloutConfig, load_config, parse_overrides
from orchestration.grpo_run import GRPORun
from orchestration.inference import inference_manager, model_directory, starts_servers, worker_urls
from rl_contracts.weight_channel import WeightChannel
from tests.unit.workers.engines.test_engine_server import group_members, wait_for
from tests.unit.workers.engines.test_inference_manager import fake_command
from workers.engines.base import SamplingParams
from workers.engines.host import EngineActor, EngineSpec

CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"
URLS = ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]


# ---- the config ----------------------------------------------------------------------------------------------------
def test_engine_url_takes_one_url_or_a_list_of_one_per_rollout_worker():
    one = load_config(None, {"rollout.engine": "sglang", "rollout.num_workers": 2, "rollout.engine_url": URLS[0]})
    assert one.rollout.engine_url == URLS[0]
    listed = load_config(None, {"rollout.engine": "vllm-server", "rollout.num_workers": 2, "rollout.engine_url": URLS})
    assert listed.rollout.engine_url == URLS


def test_engine_url_lists_on_the_command_line_and_in_yaml(tmp_path):
    overrides = parse_overrides(
        ["rollout.engine=sglang", "rollout.num_workers=2", f"rollout.engine_url=[{URLS[0]},{URLS[1]}]"]
    )
    assert load_config(None, overrides).rollout.engine_url == URLS
    path = tmp_path / "run.yaml"
    path.write_text(f"rollout:\n  engine: sglang\n  num_workers: 2\n  engine_url:\n    - {URLS[0]}\n    - {URLS[1]}\n")
    assert load_config(path).rollout.engine_url == URLS


@pytest.mark.parametrize(("workers", "urls"), [(3, URLS), (1, URLS), (2, URLS[:1])])
def test_a_list_of_urls_not_one_per_rollout_worker_is_refused_naming_both_numbers(workers, urls):
    with pytest.raises(
        ConfigError,
        match=rf"^invalid config: rollout.engine_url lists {len(urls)} URLs for rollout.num_workers={workers} "
        r"rollout workers: give one URL per worker, or one URL \(a string\) for all of them",
    ):
        load_config(None, {"rollout.engine": "sglang", "rollout.num_workers": workers, "rollout.engine_url": urls})


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize(
    ("key", "value"), [("rollout.inf_tp_size", 2), ("rollout.inf_ep_size", 2), ("rollout.inf_mem_ratio", 0.5)]
)
def test_inference_sizes_with_an_engine_in_the_rollout_worker_are_refused_naming_the_engines_that_honour_them(
    engine, key, value
):
    with pytest.raises(
        ConfigError,
        match=rf"^invalid config: {key}={value} sizes the inference servers the run starts, which only the engines "
        rf"'vllm-server', 'sglang' honour; rollout.engine='{engine}' runs in the rollout worker",
    ):
        load_config(None, {"rollout.engine": engine, key: value})


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"rollout.engine": "hf"}, "rollout.engine='hf' runs in the rollout worker"),
        (
            {"rollout.engine": "sglang", "rollout.engine_url": URLS[0]},
            r"rollout.engine_url names servers started elsewhere \(the run cannot release them\)",
        ),
        (
            {"rollout.engine": "vllm-server", "rollout.generate_fn": "workers.agents.rollout_fns:single_turn_generate"},
            "rollout.generate_fn='workers.agents.rollout_fns:single_turn_generate' runs agent rollout workers: their "
            "requests are not held",
        ),
    ],
)
def test_colocate_without_servers_the_run_starts_and_holds_is_refused_saying_why(overrides, why):
    with pytest.raises(
        ConfigError,
        match=r"^invalid config: rollout.inference_colocate=true releases the memory of the inference servers the "
        r"run starts \(rollout.engine 'vllm-server' or 'sglang' without rollout.engine_url or rollout.generate_fn\); "
        + why
        + r" \(from the override ",
    ):
        load_config(None, {**overrides, "rollout.inference_colocate": True})


def test_colocate_with_servers_the_run_starts_is_taken():
    config = load_config(None, {"rollout.engine": "sglang", "rollout.inference_colocate": True})
    assert config.rollout.inference_colocate is True
    assert load_config(None, {"rollout.engine": "sglang"}).rollout.inference_colocate is False


def test_inference_sizes_with_servers_started_elsewhere_are_refused():
    with pytest.raises(
        ConfigError, match=r"^invalid config: rollout.inf_tp_size=2 sizes .* rollout.engine_url names servers started"
    ):
        load_config(None, {"rollout.engine": "sglang", "rollout.engine_url": URLS[0], "rollout.inf_tp_size": 2})


@pytest.mark.parametrize(
    ("engine", "tp", "ep", "message"),
    [
        ("vllm-server", 4, 2, r"vllm: inf_ep_size=2 with inf_tp_size=4: vLLM's --enable-expert-parallel"),
        ("sglang", 4, 3, r"sglang: inf_ep_size=3 with inf_tp_size=4: SGLang's --ep-size splits"),
    ],
)
def test_inference_sizes_the_engine_cannot_honour_are_refused_at_config_time(engine, tp, ep, message):
    with pytest.raises(ConfigError, match=rf"^invalid config: rollout.inf_\*: {message}"):
        load_config(None, {"rollout.engine": engine, "rollout.inf_tp_size": tp, "rollout.inf_ep_size": ep})


def test_inference_sizes_the_engine_honours_are_taken():
    config = load_config(
        None,
        {"rollout.engine": "sglang", "rollout.inf_tp_size": 8, "rollout.inf_ep_size": 4, "rollout.inf_mem_ratio": 1},
    )
    assert (config.rollout.inf_tp_size, config.rollout.inf_ep_size, config.rollout.inf_mem_ratio) == (8, 4, 1)


# ---- the plan: each rollout worker's server --------------------------------------------------------------------
def test_one_url_serves_every_worker_and_a_list_gives_each_its_own():
    assert worker_urls(RolloutConfig(num_workers=3, engine="sglang", engine_url=URLS[0])) == [URLS[0]] * 3
    assert worker_urls(RolloutConfig(num_workers=2, engine="vllm-server", engine_url=URLS)) == URLS


def test_without_engine_url_a_server_engine_run_starts_its_servers_and_worker_i_uses_server_i():
    rollout = RolloutConfig(num_workers=2, engine="sglang")
    assert starts_servers(rollout)
    assert worker_urls(rollout, ["http://127.0.0.1:1", "http://127.0.0.1:2"]) == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    with pytest.raises(ValueError, match=r"^the run starts one server per rollout worker: expected 2 URLs, got none"):
        worker_urls(rollout)
    with pytest.raises(ValueError, match=r"^the run starts one server per rollout worker: expected 2 URLs, got 1"):
        worker_urls(rollout, ["http://127.0.0.1:1"])


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_an_engine_in_the_rollout_worker_has_no_server(engine):
    rollout = RolloutConfig(num_workers=2, engine=engine)
    assert not starts_servers(rollout)
    assert worker_urls(rollout) == [None, None]
    with pytest.raises(ValueError, match=f"^rollout.engine='{engine}' runs in the rollout worker: no servers"):
        worker_urls(rollout, URLS)


def test_servers_started_elsewhere_are_not_replaced_by_started_ones():
    rollout = RolloutConfig(num_workers=2, engine="sglang", engine_url=URLS)
    assert not starts_servers(rollout)
    with pytest.raises(ValueError, match="names the servers: the run starts none"):
        worker_urls(rollout, URLS)


def test_the_model_directory_is_model_path_or_the_tasks_policy_saved_once(tmp_path):
    assert model_directory(str(tmp_path / "mine"), SimpleNamespace(), tmp_path) == str(tmp_path / "mine")
    from workers.tasks.addition import AdditionTask

    directory = Path(model_directory(None, AdditionTask(), tmp_path / "run"))
    assert directory == tmp_path / "run" / "inference_model"
    assert (directory / "config.json").exists() and (directory / "model.safetensors").exists()
    from transformers import AutoTokenizer

    # the addition task's tokenizer cannot be saved: a stand-in of the policy's vocabulary and special ids, which vLLM's
    # OpenAI server needs to start (found on a vllm-server demo run: "Couldn't instantiate the backend tokenizer")
    tokenizer, task_tokenizer = AutoTokenizer.from_pretrained(directory), AdditionTask().tokenizer
    assert len(tokenizer) == task_tokenizer.vocab_size
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (
        task_tokenizer.eos_token_id,
        task_tokenizer.pad_token_id,
        task_tokenizer.bos_token_id,
    )


# ---- the plan run on stand-in servers ---------------------------------------------------------------------------
def loads(url: str) -> list[list[str]]:
    """The weight loads a stand-in server answered."""
    return httpx.get(f"{url}/argv", trust_env=False, timeout=10).json()["loads"]


def test_each_workers_engine_loads_the_weights_into_its_own_server(tmp_path):
    rollout = RolloutConfig(num_workers=2, engine="sglang", inf_tp_size=2, inf_mem_ratio=0.5)
    manager = inference_manager(rollout, "/models/tiny", tmp_path, server_command=fake_command, health_interval=0.2)
    with manager:
        urls = worker_urls(rollout, manager.urls)
        assert urls == manager.urls and len(set(urls)) == 2
        for url in urls:  # the sizing reached each server's command line
            argv = httpx.get(f"{url}/argv", trust_env=False, timeout=10).json()["argv"]
            assert argv[-6:] == ["--tp-size", "2", "--ep-size", "1", "--mem-fraction-static", "0.5"]
        spec = EngineSpec(kind="sglang", model_path="/models/tiny", api_key=manager.api_key)
        engines = [EngineSpec(**{**spec.__dict__, "url": url}).build() for url in urls]
        engines[1].update_weights(3, path=str(tmp_path / "v3"))  # what worker 1's EngineActor does on a publish
        assert loads(urls[0]) == [] and loads(urls[1]) == [[str(tmp_path / "v3"), "3"]]
        engines[0].update_weights(3, path=str(tmp_path / "v3"))
        assert loads(urls[0]) == [[str(tmp_path / "v3"), "3"]]
        pgids = [server.process.pid for server in manager.servers]
    assert all(wait_for(lambda pgid=pgid: group_members(pgid) == []) for pgid in pgids)


def generated(url: str) -> list[str]:
    """The weight version of each generation a stand-in server answered."""
    return httpx.get(f"{url}/argv", trust_env=False, timeout=10).json()["generated"]


@contextlib.contextmanager
def one_server(tmp_path: Path, command: Any = fake_command, **spec: Any) -> Iterator[tuple[Any, str, Any]]:
    """A run's one SGLang stand-in server (restarted by its monitor) and the worker's EngineActor over it, without
    Ray: ``(manager, url, actor)``."""
    rollout = RolloutConfig(num_workers=1, engine="sglang")
    manager = inference_manager(rollout, "/models/tiny", tmp_path, server_command=command, health_interval=0.1)
    with manager:
        (url,) = worker_urls(rollout, manager.urls)
        actor = EngineActor.__ray_metadata__.modified_class(
            EngineSpec(kind="sglang", model_path="/models/tiny", url=url, api_key=manager.api_key, **spec)
        )
        yield manager, url, actor


def test_a_crashed_server_comes_back_at_its_url_and_gets_the_newest_weights_before_the_workers_next_generation(
    tmp_path,
):
    with one_server(tmp_path) as (manager, url, actor):
        params = SamplingParams(max_new_tokens=1)
        for version in (1, 2):  # two publishes
            actor.update_weights(version, None, str(tmp_path / f"v{version}"))
        assert actor.generate([[1, 2]], 2, params)[0] == 2 and generated(url) == ["2"]

        server = manager.servers[0]
        os.kill(server.process.pid, signal.SIGKILL)
        assert wait_for(lambda: server.record.restarts == 1 and server.record.status == "healthy")
        assert server.url == url and loads(url) == []  # the same URL, the weights of its command line
        version, generations = actor.generate([[1, 2]], 2, params)  # reaches it, and loads v2 again first
        assert version == 2 and len(generations[0]) == 2
        assert loads(url) == [[str(tmp_path / "v2"), "2"]] and generated(url) == ["2"]
        assert actor.restore_server_weights() is False  # the server holds the client's version now


def test_with_a_weight_channel_a_restarted_server_gets_the_channels_newest_weights_again(tmp_path):
    rollout = RolloutConfig(num_workers=1, engine="sglang")
    manager = inference_manager(rollout, "/models/tiny", tmp_path, server_command=fake_command, health_interval=0.1)
    channel = WeightChannel.create(root=str(tmp_path))
    try:
        with manager:
            (url,) = worker_urls(rollout, manager.urls)
            spec = EngineSpec(kind="sglang", model_path="/models/tiny", url=url, api_key=manager.api_key,
                              weights_channel=str(channel.path))  # fmt: skip
            actor = EngineActor.__ray_metadata__.modified_class(spec)
            params = SamplingParams(max_new_tokens=1)
            channel.write(1, {"w": torch.ones(2)})
            assert actor.generate([[1]], 1, params)[0] == 1 and generated(url) == ["1"]
            server = manager.servers[0]
            os.kill(server.process.pid, signal.SIGKILL)
            assert wait_for(lambda: server.record.restarts == 1 and server.record.status == "healthy")
            assert server.url == url and generated(url) == []
            assert actor.generate([[1]], 1, params)[0] == 1
            assert [version for _, version in loads(url)] == ["1"] and generated(url) == ["1"]
    finally:
        channel.close()


def test_a_server_restarted_after_the_warm_ups_version_0_gets_version_0_again(tmp_path):
    # the SFT warm-up publishes its weights as version 0: a server restarted then holds its command line's weights
    with one_server(tmp_path) as (manager, url, actor):
        params = SamplingParams(max_new_tokens=1)
        assert actor.restore_server_weights() is False  # nothing loaded yet: the command line's weights are the ones
        actor.update_weights(0, None, str(tmp_path / "v0"))
        server = manager.servers[0]
        os.kill(server.process.pid, signal.SIGKILL)
        assert wait_for(lambda: server.record.restarts == 1 and server.record.status == "healthy")
        assert actor.generate([[1, 2]], 1, params)[0] == 0
        assert loads(url) == [[str(tmp_path / "v0"), "0"]] and generated(url) == ["0"]


def slow_generations(
    model_path: str, port: int, host: str = "127.0.0.1", *, extra: list[str] | None = None
) -> list[str]:
    """``fake_command`` whose generations take 2 s each (a kill lands while one is in flight)."""
    return fake_command(model_path, port, host, extra=[*(extra or []), "--generate-delay", "2"])


def test_a_generation_in_flight_when_its_server_is_killed_is_made_again_once_the_server_is_back(tmp_path):
    with one_server(tmp_path, slow_generations) as (manager, url, actor):
        actor.update_weights(2, None, str(tmp_path / "v2"))
        server, pid = manager.servers[0], manager.servers[0].process.pid
        in_flight = threading.Event()

        def kill_once_in_flight() -> None:
            while not in_flight.is_set():  # the request reached the server: it counts it before answering
                if httpx.get(f"{url}/argv", trust_env=False, timeout=5).json()["in_flight"]:
                    in_flight.set()
                else:
                    time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_in_flight)
        killer.start()
        version, generations = actor.generate([[1, 2]], 2, SamplingParams(max_new_tokens=1))  # waits, asks again
        killer.join()
        assert in_flight.is_set() and server.record.restarts == 1
        assert version == 2 and len(generations[0]) == 2
        # the new server got version 2 before it generated, and generated the request once
        assert loads(url) == [[str(tmp_path / "v2"), "2"]] and generated(url) == ["2"]


def test_a_run_gives_worker_i_server_i_and_its_key_and_stops_the_servers_when_it_ends(monkeypatch, tmp_path):
    made: list[Any] = []

    def manager(*args: Any, **kwargs: Any) -> Any:
        made.append(inference_manager(*args, server_command=fake_command, health_interval=0.2, **kwargs))
        return made[-1]

    specs: list[EngineSpec] = []

    def start_workers(self: GRPORun, info: Any, spec: EngineSpec) -> Any:
        specs.extend(self.worker_spec(spec, i) for i in range(self.cfg.rollout.num_workers))
        raise RuntimeError("an actor did not start")

    monkeypatch.setattr(grpo_run, "inference_manager", manager)
    monkeypatch.setattr(grpo_run.transfer_queue, "init", lambda **kwargs: SimpleNamespace(controller_info=None))
    monkeypatch.setattr(grpo_run.transfer_queue, "shutdown", lambda: None)
    monkeypatch.setattr(GRPORun, "start_workers", start_workers)
    config = load_config(
        CONFIG,
        {"output_dir": str(tmp_path), "rollout.engine": "sglang", "rollout.num_workers": 2, "weight_sync": "memory"},
    )
    with pytest.raises(RuntimeError, match="an actor did not start"):
        GRPORun(config)
    (started,) = made
    assert [spec.url for spec in specs] == started.urls and len(set(started.urls)) == 2
    assert {spec.api_key for spec in specs} == {started.api_key} and started.api_key
    assert {spec.model_path for spec in specs} == {str((tmp_path / "inference_model").absolute())}
    assert [server.record.status for server in started.servers] == ["stopped", "stopped"]
    pgids = [server.process.pid for server in started.servers]
    assert all(wait_for(lambda pgid=pgid: group_members(pgid) == []) for pgid in pgids)


# ---- placement (issue 27): each server its own GPUs, rollout.gpus or Ray's reserved ones; nothing on CPU ---------
def test_rollout_gpus_place_the_servers_the_run_starts_on_the_command_line_and_in_yaml(tmp_path):
    overrides = parse_overrides(
        ["rollout.engine=sglang", "rollout.num_workers=2", "rollout.inf_tp_size=2", "rollout.gpus=[4,5,6,7]"]
    )
    config = load_config(None, overrides)
    assert config.rollout.gpus == [4, 5, 6, 7]
    manager = inference_manager(config.rollout, "/models/p", tmp_path)
    assert [server.env["CUDA_VISIBLE_DEVICES"] for server in manager.servers] == ["4,5", "6,7"]
    reserved = inference_manager(config.rollout, "/models/p", tmp_path, gpus=["1", "0", "3", "2"])  # Ray's ids
    assert [server.env["CUDA_VISIBLE_DEVICES"] for server in reserved.servers] == ["1,0", "3,2"]
    unplaced = inference_manager(RolloutConfig(num_workers=2, engine="sglang"), "/models/p", tmp_path)
    assert all("CUDA_VISIBLE_DEVICES" not in server.env for server in unplaced.servers)  # CPU: as before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"rollout.engine": "sglang", "rollout.num_workers": 2, "rollout.inf_tp_size": 2, "rollout.gpus": [0, 1, 2]},
            r"^invalid config: rollout.gpus: 2 servers of inf_tp_size=2 devices need 4 gpus, got 3: \[0, 1, 2\] \(one "
            r"server per rollout worker: rollout.num_workers=2\)",
        ),
        (
            {"rollout.engine": "sglang", "rollout.num_workers": 2, "rollout.gpus": [0, 0]},
            r"^invalid config: rollout.gpus: gpus: expected 2 distinct devices, one server each, got 0 more than once",
        ),
        (
            {"rollout.engine": "vllm-server", "rollout.gpus": [-1]},
            r"^invalid config: rollout.gpus: expected device ids >= 0, got \[-1\] in \[-1\]",
        ),
        (
            {"rollout.engine": "hf", "rollout.gpus": [0]},
            r"^invalid config: rollout.gpus=\[0\] places the inference servers the run starts \(rollout.engine "
            r"'vllm-server' or 'sglang' without rollout.engine_url\); rollout.engine='hf' runs in the rollout worker",
        ),
        (
            {"rollout.engine": "sglang", "rollout.engine_url": URLS[0], "rollout.gpus": [0]},
            r"^invalid config: rollout.gpus=\[0\] places .*; rollout.engine_url names servers started elsewhere: drop "
            r"one of them",
        ),
    ],
)
def test_rollout_gpus_the_servers_cannot_take_are_refused_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_without_ray_or_with_rollout_gpus_nothing_is_reserved(monkeypatch):
    import ray

    from orchestration.inference import reserve_server_gpus

    # without Ray, whatever ran before in this process (another test file may have started a session)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert reserve_server_gpus(RolloutConfig(num_workers=2, engine="sglang")) is None
    assert reserve_server_gpus(RolloutConfig(num_workers=2, engine="sglang", gpus=[0, 1])) is None
    assert reserve_server_gpus(RolloutConfig(num_workers=2, engine="hf")) is None


RESERVE = """
import json, ray
from orchestration.config import RolloutConfig
from orchestration.inference import reserve_server_gpus
from workers.engines.errors import InvalidInferenceSizing

ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, logging_level="ERROR")  # Ray's GPU slots, no device
out = {}
# 2 server GPUs and 3 trainer GPUs do not fit apart in 4: they share the devices, nothing is reserved
out["shared"] = reserve_server_gpus(RolloutConfig(num_workers=2, engine="sglang"), trainer_gpus=3) is None
holder, ids = reserve_server_gpus(RolloutConfig(num_workers=2, engine="sglang"), trainer_gpus=2)
out["reserved"] = ids


@ray.remote(num_gpus=2, num_cpus=0)
class TrainerRank:
    def gpu_ids(self):
        return [str(g) for g in ray.get_gpu_ids()]


rank = TrainerRank.remote()
out["trainer"] = ray.get(rank.gpu_ids.remote())  # placed on the devices the servers do not hold
too_many = RolloutConfig(num_workers=3, engine="sglang", inf_tp_size=2)
held = RolloutConfig(num_workers=1, engine="sglang")
for rollout, timeout in ((too_many, 60), (held, 1)):
    try:
        reserve_server_gpus(rollout, timeout_s=timeout)
    except InvalidInferenceSizing as exc:
        out.setdefault("refused", []).append(str(exc))
ray.kill(holder)
print("RESULT " + json.dumps(out))
"""


def test_ray_reserves_each_servers_gpus_on_this_node_and_other_actors_get_the_rest(tmp_path):
    """In a Ray of 4 GPU slots (no device needed: Ray hands out ids): 2 servers and 3 trainer GPUs do not fit apart, so
    nothing is reserved (they share the devices); 2 servers x inf_tp_size 1 hold 2 ids, an actor
    asking for 2 GPUs gets the other 2; 3 servers x 2 are refused naming both numbers, and with every slot held a
    reservation is refused after its timeout."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(Path(__file__).parents[3])}
    done = subprocess.run([sys.executable, "-c", RESERVE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["shared"]
    assert len(out["reserved"]) == 2 and len(out["trainer"]) == 2
    assert sorted(out["reserved"] + out["trainer"]) == ["0", "1", "2", "3"]
    assert out["refused"] == [
        "3 servers of inf_tp_size=2 devices need 6 gpus, this node has 4",
        "1 servers of inf_tp_size=1 devices need 1 gpus of this node's 4: Ray could not reserve them within 1 s (other "
        "actors hold them); set rollout.gpus to place the servers yourself",
    ]


@pytest.mark.parametrize(("gpus", "placed"), [(None, [None, None]), ([1, 0], ["1", "0"])])
def test_a_run_places_each_server_on_its_own_gpus_and_on_cpu_nowhere(monkeypatch, tmp_path, gpus, placed):
    made: list[Any] = []

    def manager(*args: Any, **kwargs: Any) -> Any:
        made.append(inference_manager(*args, server_command=fake_command, health_interval=0.2, **kwargs))
        return made[-1]

    def start_workers(self: GRPORun, info: Any, spec: EngineSpec) -> Any:
        raise RuntimeError("an actor did not start")

    monkeypatch.setattr(grpo_run, "inference_manager", manager)
    monkeypatch.setattr(grpo_run.transfer_queue, "init", lambda **kwargs: SimpleNamespace(controller_info=None))
    monkeypatch.setattr(grpo_run.transfer_queue, "shutdown", lambda: None)
    monkeypatch.setattr(GRPORun, "start_workers", start_workers)
    overrides = {"output_dir": str(tmp_path), "rollout.engine": "sglang", "rollout.num_workers": 2}
    config = load_config(CONFIG, {**overrides, "weight_sync": "memory", "rollout.gpus": gpus})
    with pytest.raises(RuntimeError, match="an actor did not start"):
        GRPORun(config)  # no Ray here: on a node without GPUs nothing is reserved
    (started,) = made
    assert [server.env.get("CUDA_VISIBLE_DEVICES") for server in started.servers] == placed
