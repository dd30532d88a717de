"""Multi-turn trajectories as the trainer reads them: jagged ``tokens``, ``loss_mask`` and ``logprobs`` rows (written
by ``workers.agents``), split into the prompt/response pairs the trainer's batch is built from."""

from __future__ import annotations

#: the queue fields of a trajectory row that training reads
TRAJECTORY_FIELDS = ["tokens", "loss_mask", "logprobs", "policy_version", "reward", "reward_failed"]


def split_trajectories(
    tokens: list[list[int]], loss_mask: list[list[float]], logprobs: list[list[float]]
) -> tuple[list[list[int]], list[list[int]], list[list[float]], list[list[float]]]:
    """Trajectories as the trainer's prompt/response pairs: the prompt is everything before the first trained
    token, the response everything after, with its own loss mask (0 on environment tokens) and log-probs."""
    prompts, responses, response_logprobs, response_masks = [], [], [], []
    for ids, mask, lps in zip(tokens, loss_mask, logprobs, strict=True):
        start = next((i for i, m in enumerate(mask) if m > 0), len(ids))
        start = max(start, 1)  # the trainer predicts a token from the one before: at least one prompt token
        prompts.append(ids[:start])
        responses.append(ids[start:])
        response_logprobs.append(lps[start:])
        response_masks.append(mask[start:])
    return prompts, responses, response_logprobs, response_masks
