"""orchestration/ledger_grpo.py's loss: the policy loss ``LedgerTrainingConfig.loss`` names (a key of
``trainers.losses.LOSSES``, in any case), token-mean aggregated, on a tiny policy without a queue or a ledger."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from orchestration.ledger_grpo import LedgerGRPOTrainer, LedgerTrainingConfig
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
