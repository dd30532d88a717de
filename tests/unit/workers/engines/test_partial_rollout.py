"""Partial rollouts with the HF engine: a weight update mid-generation stops the engine, keeps the unfinished
responses and resumes them on the new weights; every token records (and was scored by) the version that sampled
it; engines without abort run in chunks; the off-policy token mask."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rl_contracts.partial import mask_offpolicy_tokens
from workers.engines import HFEngine, SamplingParams
from workers.engines.partial import PartialRollout
from workers.models import build_tiny_causal_lm

VOCAB, PAD = 24, 0
NEVER = 10_000  # an eos id outside the vocabulary: responses run to max_new_tokens
PROMPTS = [[1, 5, 6], [1, 3, 9, 9]]


def model(seed: int):
    return build_tiny_causal_lm(VOCAB, max_position_embeddings=256, seed=seed)


def engine(seed: int = 0) -> HFEngine:
    return HFEngine(model(seed), pad_token_id=PAD, eos_token_id=NEVER)


def scored(m, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = m(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


class AfterPolls:
    """A weight source that has version 1 ready after ``polls`` checks."""

    def __init__(self, polls: int, state_dict):
        self.polls, self.state_dict, self.calls, self.given = polls, state_dict, 0, False

    def __call__(self):
        self.calls += 1
        if self.calls >= self.polls and not self.given:
            self.given = True
            return (1, self.state_dict, None)
        return None


def check_tokens_scored_by_their_version(groups, old, new) -> None:
    switched = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for g in group:
            assert len(g.versions) == len(g.token_ids) == len(g.logprobs)
            assert g.versions == sorted(g.versions)  # never back to older weights
            by_old, by_new = scored(old, prompt, g.token_ids), scored(new, prompt, g.token_ids)
            for v, lp, a, b in zip(g.versions, g.logprobs, by_old, by_new, strict=True):
                assert lp == pytest.approx(a if v == 0 else b, abs=1e-4)
            switched += 0 < g.versions.count(1) < len(g.versions)
    assert switched > 0, "no response spans the update"


@pytest.mark.parametrize("abortable", [True, False])
def test_an_update_mid_generation_resumes_on_the_new_weights(abortable):
    eng = engine()
    if not abortable:
        eng.supports_abort = False  # the chunked path, as for engines without should_abort
    new = model(1).eval()
    source = AfterPolls(5 if abortable else 2, new.state_dict())
    partial = PartialRollout(eng, newer_weights=source, chunk_tokens=4)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=0)
    groups = partial.generate(PROMPTS, 3, params)
    assert partial.version == 1 and partial.updates_during_generation == 1
    assert all(len(g.token_ids) == 20 and g.finish_reason == "length" for group in groups for g in group)
    check_tokens_scored_by_their_version(groups, model(0).eval(), new)
    assert partial.resumes > 0


def test_without_updates_every_token_is_version_zero():
    partial = PartialRollout(HFEngine(model(0), pad_token_id=PAD, eos_token_id=2))
    groups = partial.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=1))
    for group in groups:
        for g in group:
            assert g.versions == [0] * len(g.token_ids) and g.finish_reason in ("stop", "length")
            if g.finish_reason == "stop":
                assert g.token_ids[-1] == 2


def test_update_weights_from_another_thread_does_not_wait_for_the_generation():
    eng = engine()
    partial = PartialRollout(eng)
    new = model(1).eval()
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=0)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("groups", partial.generate(PROMPTS, 4, params)))
    worker.start()
    while not partial._generating.locked():
        time.sleep(0.001)
    partial.update_weights(1, state_dict=new.state_dict())  # returns once loaded, mid-generation
    assert eng.version == 1
    still_generating = worker.is_alive()
    worker.join()
    assert still_generating
    versions = [v for group in result["groups"] for g in group for v in g.versions]
    assert 0 in versions and 1 in versions
    # idle: nothing generates -> the update loads at once
    partial.update_weights(2, state_dict=model(2).state_dict())
    assert eng.version == 2


def test_mask_offpolicy_tokens():
    mask = torch.ones(2, 4)
    versions = torch.tensor([[3, 3, 5, 5], [4, 5, 5, 5]])
    out = mask_offpolicy_tokens(mask, versions, train_version=6, max_staleness=1)
    assert out.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    with pytest.raises(ValueError, match=r"token_versions has shape \(4,\), expected response_mask's \(2, 4\)"):
        mask_offpolicy_tokens(mask, versions[0], 6, 1)


def test_the_trainer_masks_offpolicy_tokens_of_partial_rollouts():
    import numpy as np

    from rl_contracts.rows import jagged
    from tests.unit.orchestration.test_rl_pieces import _rollout_data, _trainer_config
    from trainers.grpo import build_train_batch

    data = _rollout_data([1.0, 0.0], [5, 5], response_lens=[3, 3])
    data["response_versions"] = jagged([[3, 4, 5], [5, 5, 5]], torch.int64)  # row 0 spans two updates
    kwargs = dict(pad_token_id=0, trainer_version=5, max_staleness=1)
    plain = build_train_batch(data, np.array([0, 0]), config=_trainer_config(), **kwargs)
    masked = build_train_batch(
        data, np.array([0, 0]), config=_trainer_config(mask_offpolicy_in_partial_rollout=True), **kwargs
    )
    assert plain.tensors["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert masked.tensors["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]


def test_engine_spec_kinds_and_config():
    from orchestration.config import ConfigError, RLConfig, RolloutConfig
    from workers.engines.host import EngineSpec

    with pytest.raises(ValueError, match="engine kind 'sglang' is a client of a running server: give url="):
        EngineSpec(kind="sglang").build()
    with pytest.raises(ValueError, match="engine kind 'tgi' is unknown; expected 'hf', 'vllm', 'vllm-server' or"):
        EngineSpec(kind="tgi").build()
    from workers.engines.sglang import SGLangEngine

    assert isinstance(EngineSpec(kind="sglang", url="http://127.0.0.1:1").build(), SGLangEngine)
    cfg = RLConfig(rollout=RolloutConfig(engine="vllm", partial_rollout=True), mode="async", max_staleness=1)
    assert cfg.recompute_old_logprobs  # another engine's numerics: the trainer recomputes the old log-probs
    assert isinstance(ConfigError("x"), ValueError)
