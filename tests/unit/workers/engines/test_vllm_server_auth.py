"""The vLLM server's authentication, without vLLM: the command and environment ``vllm_server_command`` /
``vllm_server_env`` give it, and the ``--middleware`` they name, loaded as vLLM's api_server loads it (by import
path, ``app.add_middleware(cls)`` with no arguments) into an app with vLLM's development routes."""

from __future__ import annotations

import importlib
import inspect

import httpx
import pytest
from fastapi import FastAPI

from workers.agents.task_server import serve_in_background
from workers.engines.errors import EngineRequestError
from workers.engines.vllm_server import AUTH_MIDDLEWARE, VLLMServerEngine, vllm_server_command, vllm_server_env


def vllm_like_app(middleware: str) -> tuple[FastAPI, list[str]]:
    """vLLM's dev routes the client calls, behind ``middleware`` loaded as vLLM's ``--middleware`` does."""
    app, calls = FastAPI(), []

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.post("/collective_rpc")
    def collective_rpc(body: dict) -> dict:
        calls.append(body["method"])
        return {"results": [None]}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict:
        return {}

    @app.post("/update_weight_version")
    def update_weight_version(body: dict) -> dict:
        return {}

    module_path, name = middleware.rsplit(".", 1)
    imported = getattr(importlib.import_module(module_path), name)
    assert inspect.isclass(imported)
    app.add_middleware(imported)
    return app, calls


def test_the_command_names_the_middleware_and_carries_no_key():
    argv = vllm_server_command("/models/m", 8000)
    assert argv[argv.index("--middleware") + 1] == AUTH_MIDDLEWARE == "workers.engines.vllm_server.VLLMServerAuth"
    assert "--api-key" not in argv
    assert vllm_server_env("k1")["TQ_API_KEY"] == vllm_server_env("k1")["VLLM_API_KEY"] == "k1"
    assert "TQ_API_KEY" not in vllm_server_env()


def test_dev_routes_refuse_a_request_without_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv("TQ_API_KEY", "server-key")
    app, calls = vllm_like_app(AUTH_MIDDLEWARE)
    with serve_in_background(app) as url:
        reply = httpx.post(f"{url}/collective_rpc", json={"method": "tq_load_weights_from_dir"}, trust_env=False)
        assert reply.status_code == 401
        assert reply.headers["www-authenticate"] == "Bearer"
        assert "missing or wrong API key" in reply.json()["detail"]
        wrong = httpx.post(
            f"{url}/collective_rpc", json={"method": "x"}, headers={"Authorization": "Bearer nope"}, trust_env=False
        )
        assert wrong.status_code == 401 and calls == []
        assert httpx.get(f"{url}/health", trust_env=False).status_code == 200  # the health probe stays open
        monkeypatch.delenv("TQ_API_KEY")  # the client is given its key, not reading the environment
        with pytest.raises(EngineRequestError, match=r"POST /collective_rpc answered HTTP 401"):
            VLLMServerEngine(url, model_path=str(tmp_path)).update_weights(1, path=str(tmp_path))
        engine = VLLMServerEngine(url, model_path=str(tmp_path), api_key="server-key")
        engine.update_weights(1, path=str(tmp_path))
        assert calls == ["tq_load_weights_from_dir"] and engine.version == 1


def test_a_server_started_without_a_key_does_not_start_open(monkeypatch):
    monkeypatch.delenv("TQ_API_KEY", raising=False)
    app, _ = vllm_like_app(AUTH_MIDDLEWARE)
    with pytest.raises(ValueError, match=r"BearerAuth needs an API key: expected api_key=\.\.\. or TQ_API_KEY set"):
        app.build_middleware_stack()  # what the server does at its start
