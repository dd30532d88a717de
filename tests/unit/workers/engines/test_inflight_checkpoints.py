"""In-flight checkpoints of partial rollouts (``rollout.checkpoint_inflight``): a generation that dies after k chunks
leaves their partial responses behind, and a new generation resumes from them, generating only the tokens that
were not checkpointed, the old tokens' log-probs and versions kept; the staleness rule of a partial; the config."""

from __future__ import annotations

import pytest

from rl_contracts.inflight import Partial, fresh_enough, inflight_partition, row_keys
from workers.engines import HFEngine, SamplingParams
from workers.engines.partial import PartialRollout
from workers.models import build_tiny_causal_lm

VOCAB, PAD = 24, 0
NEVER = 10_000  # an eos id outside the vocabulary: responses run to max_new_tokens
PROMPTS = [[1, 5, 6], [1, 3, 9, 9]]
N, MAX_NEW, CHUNK = 3, 12, 4


class Counting:
    """An engine that counts the tokens it generates (and otherwise is ``engine``)."""

    def __init__(self, engine: HFEngine):
        self.engine, self.generated = engine, 0
        self.supports_abort = False

    @property
    def version(self) -> int:
        return self.engine.version

    def update_weights(self, version, state_dict=None, path=None):
        return self.engine.update_weights(version, state_dict=state_dict, path=path)

    def generate(self, prompts, n, params, **kwargs):
        out = self.engine.generate(prompts, n, params, **kwargs)
        self.generated += sum(len(g.token_ids) for group in out for g in group)
        return out


class Killed(Exception):
    """Stands for the process's death after some chunks."""


def engine(seed: int = 0) -> HFEngine:
    return HFEngine(build_tiny_causal_lm(VOCAB, max_position_embeddings=256, seed=seed), pad_token_id=PAD,
                    eos_token_id=NEVER)  # fmt: skip


def test_a_generation_killed_after_k_chunks_resumes_from_them_keeping_tokens_and_versions():
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    saved: dict[int, Partial] = {}
    chunks = 0

    def checkpoint_then_die(rows: list[int], partials: list[Partial]) -> None:
        nonlocal chunks
        saved.update(zip(rows, partials, strict=True))
        chunks += 1
        if chunks == 2:
            raise Killed

    first = PartialRollout(Counting(engine()), chunk_tokens=CHUNK)
    with pytest.raises(Killed):
        first.generate(PROMPTS, N, params, on_chunk=checkpoint_then_die)
    assert sorted(saved) == list(range(len(PROMPTS) * N))
    checkpointed = sum(len(p.token_ids) for p in saved.values())
    assert checkpointed == len(PROMPTS) * N * 2 * CHUNK

    restarted = Counting(engine())
    restarted.update_weights(
        1, state_dict=build_tiny_causal_lm(VOCAB, max_position_embeddings=256, seed=1).state_dict()
    )
    second = PartialRollout(restarted, chunk_tokens=CHUNK)
    resume = [saved[i] for i in range(len(PROMPTS) * N)]
    seen: list[int] = []
    groups = second.generate(PROMPTS, N, params, resume=resume, on_chunk=lambda rows, _: seen.extend(rows))

    total = len(PROMPTS) * N * MAX_NEW
    assert restarted.generated == total - checkpointed  # only what the dead generation had not checkpointed
    assert second.resumed_tokens == checkpointed
    assert len(seen) == len(PROMPTS) * N  # one more chunk each, checkpointed too
    for partial, g in zip(resume, [g for group in groups for g in group], strict=True):
        kept = len(partial.token_ids)
        assert g.token_ids[:kept] == partial.token_ids and g.logprobs[:kept] == partial.logprobs
        assert g.versions == [0] * kept + [1] * (MAX_NEW - kept)  # the old tokens keep their version
        assert g.finish_reason == "length"


def test_a_finished_partial_is_taken_as_it_is_and_checkpointing_chunks_an_abortable_engine():
    eng = Counting(engine())
    eng.supports_abort = True  # checkpointing runs it in chunks anyway: a kill loses one chunk at most
    partial = PartialRollout(eng, chunk_tokens=CHUNK)
    done = Partial([4, 5], [-1.0, -2.0], [0, 0], "stop")
    calls: list[int] = []
    groups = partial.generate([PROMPTS[0]], 2, SamplingParams(max_new_tokens=MAX_NEW, seed=0), resume=[done, None],
                              on_chunk=lambda rows, _: calls.append(len(rows)))  # fmt: skip
    assert groups[0][0].token_ids == [4, 5] and groups[0][0].finish_reason == "stop"
    assert len(groups[0][1].token_ids) == MAX_NEW and eng.generated == MAX_NEW
    assert calls == [1] * (MAX_NEW // CHUNK)
    with pytest.raises(ValueError, match=r"resume needs one entry per response \(1 prompts x 2\), got 1"):
        partial.generate([PROMPTS[0]], 2, SamplingParams(max_new_tokens=4), resume=[None])


def test_a_partial_older_than_max_staleness_is_not_fresh_enough():
    partial = Partial([1, 2, 3], [-0.1, -0.2, -0.3], [2, 3, 4])
    assert fresh_enough(partial, train_version=3, max_staleness=1)
    assert not fresh_enough(partial, train_version=4, max_staleness=1)  # its first token is 2 versions old
    assert fresh_enough(partial, train_version=None, max_staleness=0)
    with pytest.raises(ValueError, match="one log-prob and one version per token: 2 tokens, 2 log-probs, 1 versions"):
        Partial([1, 2], [-0.1, -0.2], [0])
    assert row_keys([7, 7, 9, 9], 2) == ["7/0", "7/1", "9/0", "9/1"]
    assert inflight_partition(3) == "inflight/step_3"


def test_checkpoint_inflight_needs_partial_rollouts():
    from orchestration.config import ConfigError, RLConfig, RolloutConfig

    with pytest.raises(
        ConfigError,
        match=r"rollout\.checkpoint_inflight=true checkpoints a partial rollout's chunks: "
        r"it needs rollout\.partial_rollout=true and no rollout\.generate_fn, got partial_rollout=false",
    ):
        RLConfig(rollout=RolloutConfig(checkpoint_inflight=True))
    RLConfig(rollout=RolloutConfig(checkpoint_inflight=True, partial_rollout=True, chunk_tokens=2))
