"""The agent demo: GRPO teaches a tiny Llama the guess-number game over the task-server protocol, on CPU.

    1. start task servers (python -m workers.agents.task_server guess-number, own processes on 127.0.0.1)
    2. start the queue, agent rollout workers (TaskServerWorkflow via rollout.generate_fn), 2 FSDP2 trainer ranks
    3. each step: put the step's sample ids (n rows each); the workflow plays n episodes per id against the servers,
       token in / token out, and writes trajectories (tokens, loss_mask, logprobs, reward, ...) into those rows;
       the trainer trains on the model's own tokens only, then the engines get the new weights
    4. metrics.jsonl (reward, success, num_turns, dropped_groups per step) and metrics.png under output_dir

Run it with ``make agent-demo`` (or ``python recipe/agent_demo.py [--config FILE] [key=value ...]``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

import ray

from orchestration import GRPORun, connect_ray
from orchestration.config import ConfigError, RLConfig, config_from_cli
from orchestration.grpo_run import time_line
from orchestration.metrics import fifth_means
from orchestration.stopping import RunStopped, SigtermStops, stopped_line
from rl_contracts.actors import actor_class
from workers.agents.rollout_worker import AgentRolloutWorker
from workers.agents.server_process import TaskServerProcess
from workers.api_key import new_api_key
from workers.engines.host import EngineSpec

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "agent_demo.yaml"


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
            actor_class(AgentRolloutWorker).remote(
                i, info, spec, self.sampling, cfg.n_samples, cfg.rollout.groups_per_request,
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

    def _step_row(self, step, train, rollout, reward, sync_s, step_s) -> dict[str, Any]:
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


def _run(config: RLConfig, env: str, sigterm: SigtermStops) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The task servers, then the run on them; every piece stopped on the way out (RunStopped on a Ctrl-C, or on a
    SIGTERM once Ray is up: ``sigterm``). Returns the GRPO rows and the run's ``timings``."""
    with contextlib.ExitStack() as stack:
        api_key = new_api_key()  # this run's task servers all take one fresh key
        servers = [
            stack.enter_context(
                TaskServerProcess(
                    env,
                    max_episodes=config.rollout.task_server_max_episodes,
                    idle_timeout=config.rollout.task_server_idle_timeout,
                    api_key=api_key,
                )
            )
            for _ in range(config.rollout.num_task_servers)
        ]
        print(f"task servers: {[s.url for s in servers]} pids {[s.process.pid for s in servers]}", flush=True)
        connect_ray()
        stack.enter_context(sigterm)  # after Ray's start: ray.init installs a SIGTERM handler of its own
        run = AgentGRPORun(config, [str(s.url) for s in servers], api_key)
        try:
            return run.run(), run.timings
        except KeyboardInterrupt:
            raise RunStopped(run.step) from None
        finally:
            run.shutdown()


def main(argv: list[str] | None = None) -> int:
    config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv)
    env = config.rollout.task_server_env
    if env is None:
        raise ConfigError("rollout.task_server_env is not set; the agent demo serves an environment, e.g. guess-number")
    started = time.perf_counter()
    sigterm = SigtermStops()
    try:
        rows, timings = _run(config, env, sigterm)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the run's actors, queue and task servers are stopped by now
        print(stopped_line(config, exc), file=sys.stderr)
        return sigterm.exit_code()
    finally:
        ray.shutdown()
    first, last = fifth_means([r["success"] for r in rows])
    print(f"\nepisode success: first fifth {first:.3f} -> last fifth {last:.3f} ({last - first:+.3f})")
    print(time_line(len(rows), time.perf_counter() - started, timings))
    print(f"metrics: {config.output_path / 'metrics.jsonl'}")
    print(f"plot: {config.output_path / 'metrics.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
