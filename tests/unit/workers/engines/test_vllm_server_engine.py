"""VLLMServerEngine's checks made before anything is sent (workers/engines/vllm_server.py), against a closed port: a
call that sends fails with EngineUnavailable, one refused by the client with its own typed error. The routes on a
real vLLM server: tests/vllm_tier (``make test-vllm``)."""

import re
import socket

import pytest

from workers.engines.errors import EngineUnavailable, EngineUnsupported
from workers.engines.vllm_server import VLLMServerEngine


@pytest.fixture
def url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_sleep_and_wake_up_are_refused_without_sleep_mode(url):
    # vLLM's CPU worker answers /sleep with 200 and frees nothing, leaving the server paused: refuse, send nothing
    engine = VLLMServerEngine(url, model_path="/m")
    assert engine.supports_release_memory is False
    for call, route in ((engine.release_memory, "/sleep"), (engine.resume_memory, "/wake_up")):
        with pytest.raises(
            EngineUnsupported,
            match=rf"vllm-server server at {re.escape(url)}: POST {route} needs a server started with "
            r"--enable-sleep-mode \(a GPU: .*\) and VLLMServerEngine\(sleep_mode=True\), got sleep_mode=False",
        ):
            call()
    sleeping = VLLMServerEngine(url, model_path="/m", sleep_mode=True)
    for call, route in ((sleeping.release_memory, "/sleep"), (sleeping.resume_memory, "/wake_up")):
        with pytest.raises(EngineUnavailable, match=rf"POST {route} failed"):
            call()


def test_pause_takes_vllm_modes_only(url):
    engine = VLLMServerEngine(url, model_path="/m")
    for mode in ("in_place", "retract"):  # SGLang's
        with pytest.raises(ValueError, match=rf"vllm-server pause mode must be one of abort, wait, keep, got '{mode}'"):
            engine.pause_generation(mode)
    for mode in ("abort", "wait", "keep"):
        with pytest.raises(EngineUnavailable, match=r"POST /pause failed"):
            engine.pause_generation(mode)
    with pytest.raises(EngineUnavailable, match=r"POST /resume failed"):
        engine.continue_generation()
