"""orchestration/ledger_grpo.py's loss: the policy loss ``LedgerTrainingConfig.loss`` names (a key of
``trainers.losses.LOSSES``, in any case), token-mean aggregated, on a tiny policy without a queue or a ledger."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerRows, LedgerTrainingConfig
from trainers.losses import policy_loss


class TinyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(8, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.embed(input_ids))


def trainer(loss: str) -> LedgerGRPOTrainer:
    policy = TinyPolicy()
    optimizer = torch.optim.AdamW(policy.parameters())
    return LedgerGRPOTrainer(policy, optimizer, None, None, "p", LedgerTrainingConfig(loss=loss))  # type: ignore[arg-type]


def batch_of(t: LedgerGRPOTrainer) -> dict[str, torch.Tensor]:
    batch = t._batch([[1, 2], [3]], [[4, 5, 6], [7, 1]], [[0.0, 0.0, 0.0], [0.0, 0.0]])
    batch["old_logprobs"] = t._logprobs(batch).detach() - 0.1  # the sampler's policy, a little behind
    return batch


def test_the_trainer_takes_the_configured_policy_loss_in_any_case():
    advantages = torch.tensor([1.0, -1.0])
    cispo, grpo = trainer("CISPO"), trainer("grpo")
    batch = batch_of(cispo)

    expected, _ = policy_loss("cispo", cispo._logprobs(batch), batch["old_logprobs"], advantages,
                              batch["response_mask"], loss_agg="token-mean")  # fmt: skip

    assert cispo.cfg.loss == "cispo"
    assert cispo._loss(batch, advantages).item() == pytest.approx(expected.item())
    assert grpo._loss(batch, advantages).item() != pytest.approx(expected.item())


def test_an_unknown_loss_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"unknown policy loss name='grpoo', .*; did you mean grpo\b"):
        LedgerTrainingConfig(loss="grpoo")


class MarkingLedger:
    """A ledger that lets every record but ``refused`` be trained, and remembers the steps it was told of."""

    def __init__(self, refused: int) -> None:
        self.refused, self.marked = refused, []

    def mark_trained(self, ids, step, max_trained_count, retrained_interval):
        self.marked.append((list(ids), step))
        return [i for i in ids if i != self.refused]


def test_a_step_on_rows_rebuilt_from_records_takes_the_policys_own_log_probs_as_the_old_ones():
    """The ledger keeps no log-probs: the step's ratio starts at 1, so GRPO's loss is minus the mean advantage."""
    t = trainer("grpo")
    t.ledger = MarkingLedger(refused=12)  # type: ignore[assignment]
    before = t.policy.embed.weight.detach().clone()
    rows = LedgerRows(
        record_ids=[10, 11, 12, 13],
        group_ids=[0, 0, 1, 1],
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        policy_versions=torch.tensor([3.0, 3.0, 4.0, 4.0]),
        prompts=[[1, 2], [1, 2], [3], [3]],
        responses=[[4, 5], [6], [7, 1], [7]],
    )

    metrics = t.step_on(5, rows)

    assert t.ledger.marked == [([10, 11, 12, 13], 5)]  # type: ignore[attr-defined]
    assert (metrics["rows"], metrics["rows_trained"], metrics["staleness"]) == (4, 3, 1.5)
    # the trained rows' advantages (group 0: +-0.707, group 1's one row left: 0) are token-mean weighted at ratio 1
    assert metrics["loss"] == pytest.approx(-(2 * 0.7071 - 0.7071) / 4, abs=1e-3)
    assert not torch.equal(t.policy.embed.weight, before)


def test_rows_without_the_samplers_log_probs_take_the_policys_own_and_the_others_keep_theirs():
    """A ``convert_record_to_data_func`` that changed a row's tokens leaves it without log-probs (an empty list)."""
    t = trainer("grpo")
    t.ledger = MarkingLedger(refused=-1)  # type: ignore[assignment]
    olds = []

    def spy(batch, advantages):
        olds.append(batch["old_logprobs"].clone())
        return LedgerGRPOTrainer._loss(t, batch, advantages)

    t._loss = spy  # type: ignore[method-assign]
    rows = LedgerRows(
        record_ids=[10, 11, 12],
        group_ids=[0, 0, 0],
        rewards=torch.tensor([1.0, 0.0, 1.0]),
        policy_versions=torch.tensor([3.0, 3.0, 3.0]),
        prompts=[[1, 2], [3], [1]],
        responses=[[4, 5], [7, 1, 6], [2]],
        logprobs=[[-0.5, -0.25], [], [-1.0]],
    )
    own = t._logprobs(t._batch(rows.prompts, rows.responses, [[0.0] * 2, [0.0] * 3, [0.0]])).detach()

    metrics = t.step_on(0, rows)

    [old] = olds
    assert old[0, 2:4].tolist() == [-0.5, -0.25] and old[2, 1].item() == -1.0  # the sampler's, as they came
    assert torch.allclose(old[1, 1:4], own[1, 1:4]) and old[1, 0].item() == 0.0  # the policy's own, response only
    assert metrics["rows_trained"] == 3 and torch.isfinite(torch.tensor(metrics["loss"]))
