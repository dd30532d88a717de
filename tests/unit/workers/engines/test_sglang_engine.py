"""SGLangEngine against a loopback server speaking SGLang's native API (tests/engine_fakes.py, over a real
HFEngine): generation, weights from a directory and from memory, abort, pause, memory release, typed errors;
and sync_weights_to_engines over several engines, one of them failing."""

from __future__ import annotations

import threading
from dataclasses import replace

import httpx
import pytest
import torch

from tests.engine_fakes import create_sglang_app
from workers.agents.task_server import serve_in_background
from workers.engines import HFEngine, SamplingParams
from workers.engines.errors import EngineRequestError, EngineUnavailable
from workers.engines.sglang import SGLangEngine
from workers.engines.weight_sync import sync_state_dict_to_engines, sync_weights_to_engines
from workers.models import build_tiny_causal_lm

VOCAB, EOS = 24, 2
PROMPTS = [[1, 5, 6, 7], [1, 3]]


def save_model(directory, seed: int) -> str:
    model = build_tiny_causal_lm(VOCAB, eos_token_id=EOS, max_position_embeddings=256, seed=seed)
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-models")
    return save_model(root / "v0", 0), save_model(root / "v1", 1)


@pytest.fixture
def server(model_dirs):
    app = create_sglang_app(model_dirs[0], eos_token_id=EOS)
    with serve_in_background(app) as url:
        yield url, app.state.fake


def per_row(engine: HFEngine, prompts: list[list[int]], n: int, params: SamplingParams):
    """What a deterministic server answers: each response sampled alone, response ``i`` (prompt-major) with the seed
    ``seed + i``, as the client sends them."""
    groups, index = [], 0
    for prompt in prompts:
        group = []
        for _ in range(n):
            seed = None if params.seed is None else params.seed + index
            [[generation]] = engine.generate([prompt], 1, replace(params, seed=seed))
            group.append(generation)
            index += 1
        groups.append(group)
    return groups


def reference(path: str, params: SamplingParams, n: int, prompts: list[list[int]] = PROMPTS):
    return per_row(HFEngine(model_path=path, pad_token_id=0, eos_token_id=EOS), prompts, n, params)


def same(got, expected) -> None:
    for group_a, group_b in zip(got, expected, strict=True):
        assert len(group_a) == len(group_b)
        for a, b in zip(group_a, group_b, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_generate_matches_the_engine_behind_the_server(server, model_dirs):
    url, _ = server
    engine = SGLangEngine(url)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    got = engine.generate(PROMPTS, 3, params)
    assert [len(group) for group in got] == [3, 3]
    assert all(len(g.token_ids) == len(g.logprobs) <= 6 for group in got for g in group)
    same(got, reference(model_dirs[0], params, 3))
    assert engine.health()["ok"] is True


def test_sampling_params_follow_sglang_names():
    sp = SGLangEngine.sampling_params(SamplingParams(max_new_tokens=5, temperature=0.7, top_k=0, seed=9))
    assert sp["max_new_tokens"] == 5 and sp["top_k"] == -1 and sp["sampling_seed"] == 9


def test_the_n_samples_of_a_prompt_go_out_with_distinct_seeds(server, model_dirs):
    url, fake = server
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    got = SGLangEngine(url).generate([[1, 5]], 4, params)
    # one sampling_params per row, row i seeded seed + i (as VLLMServerEngine seeds request i)
    assert fake["seeds"][-1] == [11, 12, 13, 14]
    same(got, reference(model_dirs[0], params, 4, prompts=[[1, 5]]))
    # one seed for all four rows would have made the four samples identical on this (deterministic) server
    assert len({tuple(g.token_ids) for g in got[0]}) > 1
    SGLangEngine(url).generate([[1, 5]], 2, replace(params, seed=None))
    assert fake["seeds"][-1] == [None, None]


def test_flush_cache_is_refused_while_a_request_waits(server):
    url, fake = server
    engine = SGLangEngine(url)
    engine.pause_generation("in_place")
    waiting = threading.Thread(target=engine.generate, args=([[1, 5]], 1, SamplingParams(max_new_tokens=2)))
    waiting.start()
    try:
        while fake["in_flight"] == 0:
            waiting.join(0.01)
        with pytest.raises(EngineRequestError, match=r"POST /flush_cache answered HTTP 400, expected 2xx: Cache"):
            engine.flush_cache()
    finally:
        engine.continue_generation()
        waiting.join()
    engine.flush_cache()
    assert fake["flushes"] == 1


def test_both_health_routes_generate(server):
    url, fake = server
    assert SGLangEngine(url).health()["ok"] is True
    assert fake["health_generations"] == 1
    assert httpx.get(url + "/health", trust_env=False).status_code == 200
    assert fake["health_generations"] == 2
    fake["released"] = True  # no memory: no generation, on either route
    assert httpx.get(url + "/health", trust_env=False).status_code == 503


def test_weights_from_a_directory_record_the_version(server, model_dirs):
    url, _ = server
    engine = SGLangEngine(url)
    params = SamplingParams(max_new_tokens=5, seed=1)
    engine.update_weights(4, path=model_dirs[1])
    assert engine.version == 4 and engine.served_version() == "4"
    same(engine.generate(PROMPTS, 2, params), reference(model_dirs[1], params, 2))
    with pytest.raises(ValueError, match="version must not go backwards: current version=4, got 3"):
        engine.update_weights(3, path=model_dirs[0])


def test_weights_from_memory_go_through_a_directory(server, model_dirs):
    url, _ = server
    engine = SGLangEngine(url)
    state = build_tiny_causal_lm(VOCAB, eos_token_id=EOS, max_position_embeddings=256, seed=1).state_dict()
    engine.update_weights(1, state_dict=state)
    params = SamplingParams(max_new_tokens=5, seed=2)
    same(engine.generate(PROMPTS, 2, params), reference(model_dirs[1], params, 2))


def test_a_refused_update_is_a_typed_error(server, tmp_path):
    url, _ = server
    engine = SGLangEngine(url)
    with pytest.raises(EngineRequestError, match=r"/update_weights_from_disk answered HTTP 400, expected 2xx"):
        engine.update_weights(1, path=str(tmp_path / "missing"))
    assert engine.version == 0


def test_abort_returns_the_unfinished_responses(server):
    url, fake = server
    engine = SGLangEngine(url)
    params = SamplingParams(max_new_tokens=200, seed=0)
    fake["hold_for_abort"] = True  # the rows wait for the abort (on a loaded machine they finished before it came)
    got = engine.generate([[1, 5]] * 4, 1, params, should_abort=fake["generating"].is_set)
    reasons = {g.finish_reason for group in got for g in group}
    assert "abort" in reasons
    assert all(len(g.token_ids) == len(g.logprobs) < 200 for group in got for g in group)


def test_pause_continue_flush_and_memory(server):
    url, fake = server
    engine = SGLangEngine(url)
    engine.pause_generation("in_place")
    assert fake["paused"] is True
    engine.continue_generation()
    assert fake["paused"] is False
    engine.flush_cache()
    assert fake["flushes"] == 1
    engine.release_memory()
    assert engine.health()["ok"] is False
    engine.resume_memory()
    assert engine.health()["ok"] is True


def test_an_unreachable_server_is_a_typed_error():
    from workers.engines.server import free_port

    engine = SGLangEngine(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    with pytest.raises(EngineUnavailable, match=r"sglang server at http://127\.0\.0\.1:\d+: POST /generate failed"):
        engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))
    assert engine.health()["ok"] is False


def test_sync_weights_to_engines_reports_each_engine(server, model_dirs):
    from workers.engines.server import free_port

    url, _ = server
    good = SGLangEngine(url)
    local = HFEngine(model_path=model_dirs[0], pad_token_id=0, eos_token_id=EOS)
    dead = SGLangEngine(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    replies = sync_weights_to_engines([good, dead, local], model_dirs[1], version=7)
    assert [r["success"] for r in replies] == [True, False, True]
    assert "EngineUnavailable" in replies[1]["error"]
    assert good.version == 7 and local.version == 7 and dead.version == 0
    assert all(r["seconds"] >= 0 for r in replies)
    params = SamplingParams(max_new_tokens=4, seed=5)
    same(good.generate(PROMPTS, 1, params), per_row(local, PROMPTS, 1, params))

    state = {k: v.clone() for k, v in local.model.state_dict().items()}
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], 0.5)
    replies = sync_state_dict_to_engines([good, local], state, version=8)
    assert [r["version"] for r in replies] == [8, 8]
    same(good.generate(PROMPTS, 1, params), per_row(local, PROMPTS, 1, params))


def test_a_server_with_an_api_key_refuses_a_client_without_it_and_serves_one_with_it(model_dirs):
    app = create_sglang_app(model_dirs[0], eos_token_id=EOS, api_key="run-key")
    with serve_in_background(app) as url:
        refused = SGLangEngine(url)
        with pytest.raises(EngineRequestError, match=r"POST /update_weights_from_disk answered HTTP 401"):
            refused.update_weights(1, path=model_dirs[1])
        assert refused.version == 0
        assert httpx.post(f"{url}/generate", json={}, trust_env=False).status_code == 401
        assert httpx.get(f"{url}/health_generate", trust_env=False).status_code == 200  # open, as SGLang's
        engine = SGLangEngine(url, api_key="run-key")
        engine.update_weights(1, path=model_dirs[1])
        assert engine.served_version() == "1"
        assert len(engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))) == 2


def test_the_client_takes_the_key_from_the_environment(model_dirs, monkeypatch):
    monkeypatch.setenv("TQ_API_KEY", "env-key")
    app = create_sglang_app(model_dirs[0], eos_token_id=EOS, api_key="env-key")
    with serve_in_background(app) as url:
        assert SGLangEngine(url).served_version() == "default"
