"""The trainer ranks' DP shares over a real queue: in every DP round each rank reads its own share, the shares are
disjoint and cover the step, and each row is acknowledged exactly once (after the optimizer step, ``ack="explicit"``).

A rank that asked for rank 0's share (a wrong ``dp_rank``) would pass everything else: the queue serves a rank's
share again to whoever asks for it (TP peers of a DP rank read the same share), the second ack of it counts once, and
the step is cleared anyway. Only the shares and the acknowledged count tell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from orchestration.config import load_config
from rl_contracts.queue_clock import QueueClock
from rl_contracts.stages import TRAIN_TASK
from trainers import grpo
from trainers.config import TrainerConfig
from trainers.grpo import TRAIN_FIELDS, GRPOTrainerRank
from transfer_queue import TransferQueueClient

ROOT_CONFIG = Path(__file__).resolve().parents[3] / "recipe" / "configs" / "demo.yaml"
RANKS = 2
ROUNDS = 2


def jagged(rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def put_step(client: TransferQueueClient, step: int, prompts: int, n: int) -> None:
    """A step's rows as the rollout and reward workers leave them: every field the trainer reads."""
    rows = prompts * n
    client.put(
        {
            "prompt_ids": jagged([[step, p // n] for p in range(rows)], torch.int64),
            "response_ids": jagged([[p, 1] for p in range(rows)], torch.int64),
            "response_logprobs": jagged([[-0.5, -0.5] for _ in range(rows)], torch.float32),
            "policy_version": torch.zeros(rows, dtype=torch.int64),
            "reward": torch.ones(rows, dtype=torch.float32),
            "reward_failed": torch.zeros(rows, dtype=torch.bool),
        },
        global_step=step,
    )


def trained_once(client: TransferQueueClient, step: int, shares: dict[int, list[list[int]]], rows: int) -> None:
    flat = [i for rank in shares.values() for share in rank for i in share]
    for k in range(ROUNDS):
        mine, other = shares[0][k], shares[1][k]
        assert not set(mine) & set(other), f"round {k}: rank 0 read {mine}, rank 1 read {other}"
    assert len(flat) == rows and sorted(flat) == list(range(min(flat), min(flat) + rows)), shares
    status = client.get_consumption_status(global_step=step, task_name=TRAIN_TASK)["tasks"][TRAIN_TASK]
    assert (status["acknowledged"], status["leased"], status["ready"]) == (rows, 0, 0), status


def test_two_dp_ranks_read_disjoint_shares_and_acknowledge_each_row_once(grpo_queue: Any) -> None:
    """Two clients as ranks 0 and 1 of the trainer's DP rounds, as trainers/grpo.py asks for them."""
    n, prompts = grpo_queue.config["num_n_samples"], grpo_queue.config["global_batch_size"]
    step = grpo_queue.step()
    put_step(grpo_queue.client, step, prompts, n)
    ranks = [grpo_queue.new_client(f"rank{r}") for r in range(RANKS)]
    for client in ranks:
        client.set_task_options(TRAIN_TASK, ack="explicit")
    shares: dict[int, list[list[int]]] = {r: [] for r in range(RANKS)}
    per_rank = prompts * n // (RANKS * ROUNDS)
    for k in range(ROUNDS):
        metas = []
        for rank, client in enumerate(ranks):
            meta = client.get_meta(
                TRAIN_FIELDS,
                per_rank,
                global_step=step,
                task_name=TRAIN_TASK,
                sampler_params={"dp_rank": rank, "dp_size": RANKS, "dp_group_id": f"train/{step}/{k}"},
                get_n_samples=True,
            )
            client.get_data(meta)
            shares[rank].append(sorted(meta.global_indexes.tolist()))
            metas.append(meta)
        for client, meta in zip(ranks, metas, strict=True):
            client.ack(meta)  # after the optimizer step
    trained_once(grpo_queue.client, step, shares, prompts * n)


class _Device:
    device = torch.device("cpu")


def test_the_trainer_ranks_own_read_path_reads_disjoint_shares(
    grpo_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPOTrainerRank's own read (``_read_round``) and ack, on two in-process ranks (no process group: the
    all-reduce that keeps the ranks in step is the identity when every rank read its share)."""
    n, prompts = grpo_queue.config["num_n_samples"], grpo_queue.config["global_batch_size"]
    step = grpo_queue.step()
    put_step(grpo_queue.client, step, prompts, n)
    cfg = TrainerConfig.from_run(load_config(ROOT_CONFIG))
    monkeypatch.setattr(grpo, "_global_sum", lambda value, device: value)
    rank_class = GRPOTrainerRank.__ray_metadata__.modified_class  # the plain class behind the Ray actor
    ranks = [rank_class(r, RANKS, grpo_queue.info, cfg, None) for r in range(RANKS)]
    try:
        shares: dict[int, list[list[int]]] = {r: [] for r in range(RANKS)}
        per_rank = prompts * n // (RANKS * ROUNDS)
        for k in range(ROUNDS):
            metas = []
            for rank in ranks:
                rank.policy = _Device()
                meta, data = rank._read_round(step, k, per_rank, QueueClock())
                assert np.array_equal(np.asarray(data["reward"]), np.ones(per_rank, dtype=np.float32))
                shares[rank.rank].append(sorted(meta.global_indexes.tolist()))
                metas.append(meta)
            for rank, meta in zip(ranks, metas, strict=True):
                rank.client.ack(meta)  # as train_step does after the optimizer step
        trained_once(grpo_queue.client, step, shares, prompts * n)
    finally:
        for rank in ranks:
            rank.client.close()


def test_the_ranks_of_a_tp_group_read_one_share_and_the_groups_disjoint_ones(
    grpo_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.tp_size=2`` on 4 ranks: ranks 0 and 1 (DP rank 0) read the same share of each round through the
    trainer's own read path, ranks 2 and 3 (DP rank 1) the other one; every row is acknowledged once, though both
    ranks of a TP group acknowledge their share (the peer's ack is no error)."""
    n, prompts = grpo_queue.config["num_n_samples"], grpo_queue.config["global_batch_size"]
    step = grpo_queue.step()
    put_step(grpo_queue.client, step, prompts, n)
    world, tp = 4, 2
    cfg = TrainerConfig.from_run(load_config(ROOT_CONFIG, {"train.world_size": world, "train.tp_size": tp}))
    monkeypatch.setattr(grpo, "_global_sum", lambda value, device: value)
    rank_class = GRPOTrainerRank.__ray_metadata__.modified_class  # type: ignore[attr-defined]
    ranks = [rank_class(r, world, grpo_queue.info, cfg, None) for r in range(world)]
    try:
        assert [(rank.dp_rank, rank.dp_size) for rank in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
        shares: dict[int, list[list[int]]] = {r: [] for r in range(world)}
        per_rank = prompts * n // (world // tp * ROUNDS)
        for k in range(ROUNDS):
            metas = []
            for rank in ranks:
                rank.policy = _Device()
                meta, _ = rank._read_round(step, k, per_rank, QueueClock())
                shares[rank.rank].append(sorted(meta.global_indexes.tolist()))
                metas.append(meta)
            for rank, meta in zip(ranks, metas, strict=True):
                rank.client.ack(meta)
        assert shares[0] == shares[1] and shares[2] == shares[3]
        trained_once(grpo_queue.client, step, {0: shares[0], 1: shares[2]}, prompts * n)
    finally:
        for rank in ranks:
            rank.client.close()
