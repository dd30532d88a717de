"""AgentGRPORun: a GRPORun whose rollouts are multi-turn episodes against task servers (``rollout.generate_fn``,
docs/agents.md). Its rows hold sample ids instead of prompts; the agent rollout workers play ``n_samples`` episodes
per id and write whole trajectories (tokens, loss mask, log-probs, reward) into them, so no reward worker runs; each
step's row adds the episodes' success, turns, environment reward and dropped or filtered groups.
"""

from __future__ import annotations

from typing import Any

from orchestration.config import RLConfig
from orchestration.grpo_run import GRPORun
from rl_contracts.actors import actor_class
from workers.agents.rollout_worker import AgentRolloutWorker
from workers.engines.host import EngineSpec


class AgentGRPORun(GRPORun):
    """GRPORun whose rollouts are episodes against task servers (``rollout.generate_fn``); rewards come with them."""

    def __init__(self, config: RLConfig, task_server_urls: list[str], task_server_api_key: str | None = None):
        self.task_server_urls = task_server_urls
        self.task_server_api_key = task_server_api_key  # to the rollout actors through Ray, never logged
        super().__init__(config)

    def prompt_fields(self) -> list[str]:
        return ["sample_id"]

    def start_workers(self, info: Any, spec: EngineSpec) -> tuple[list[Any], list[Any]]:
        cfg = self.cfg
        kwargs = {
            "task_server_url": self.task_server_urls,
            "api_key": self.task_server_api_key,
            **cfg.rollout.generate_fn_kwargs,
        }
        workers = [
            actor_class(AgentRolloutWorker).options(**self.worker_options()).remote(
                i, info, self.worker_spec(spec, i), self.sampling, cfg.n_samples, cfg.rollout.groups_per_request,
                cfg.rollout.generate_fn, kwargs, cfg.rollout.filter_fn, cfg.rollout.reward_fn, cfg.queue_timeout,
                cfg.seed + i,
            )
            for i in range(cfg.rollout.num_workers)
        ]  # fmt: skip
        return workers, []

    def put_prompts(self, step: int) -> None:
        """The step's sample ids, each repeated ``n_samples`` times: its group of rows."""
        n = self.cfg.n_samples
        self.prompt_states[step] = self.prompts.state_dict()
        prompts = self.prompts.next_batch(self.cfg.prompts_per_step)
        self.client.put({"sample_id": [str(p["sample_id"]) for p in prompts for _ in range(n)]}, global_step=step)

    def _step_row(
        self, step: int, train: dict[str, float], rollout: list[dict], reward: list[dict], sync_s: float, step_s: float
    ) -> dict[str, Any]:
        row = super()._step_row(step, train, rollout, reward, sync_s, step_s)
        total = {key: sum(s.get(key, 0.0) for s in rollout) for key in rollout[0]}
        episodes = max(total["episodes"], 1.0)
        row.update(
            success=total["success_sum"] / episodes,
            num_turns=total["num_turns_sum"] / episodes,
            env_reward=total["env_reward_sum"] / episodes,
            dropped_groups=total["dropped_groups"],
            filtered_groups=total["filtered_groups"],
        )
        return row
