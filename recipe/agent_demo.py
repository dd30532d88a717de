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

from orchestration import connect_ray
from orchestration.agent_run import AgentGRPORun
from orchestration.config import ConfigError, RLConfig, config_from_cli
from orchestration.grpo_run import time_line
from orchestration.metrics import fifth_means
from orchestration.stopping import SigtermStops, stopped_line
from workers.agents.server_process import TaskServerProcess
from workers.api_key import new_api_key

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "agent_demo.yaml"


def agent_grpo(run: AgentGRPORun) -> list[dict[str, Any]]:
    """The loop: the demo's (recipe/demo.py), with episodes for rollouts."""
    run.begin()  # resume from the latest checkpoint | init_from | SFT warm-up (off in this recipe's config)
    for step in run.steps():
        run.generate(step)  # the step's sample ids, n rows each: agents play the episodes, rewards come with them
        train = run.train(step)  # the FSDP2 ranks train on the model's own tokens (loss_mask) of whole groups
        sync_s = run.sync_weights(step, train)  # every sync_every versions, the engines get the new weights
        run.log(run.end_step(step, train, sync_s))  # + success, num_turns, env_reward, dropped/filtered groups
    return run.rows


def refuse_unused_settings(config: RLConfig) -> None:
    """Settings of a GRPO run that this loop would leave unused, refused instead of ignored (ConfigError)."""
    if config.rollout.task_server_env is None:
        raise ConfigError("rollout.task_server_env is not set; the agent demo serves an environment, e.g. guess-number")
    if config.eval_every:
        raise ConfigError(
            f"eval_every={config.eval_every}: the agent demo evaluates no held-out split (the run's evaluation scores "
            "single-turn answers); every step's episodes report success, num_turns and env_reward in metrics.jsonl. "
            "Set eval_every=0"
        )


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_cli(__doc__ or "", DEFAULT_CONFIG, argv)
        refuse_unused_settings(config)
    except ConfigError as exc:
        print(f"agent_demo.py: error: {exc}", file=sys.stderr)
        return 2
    cfg = config.rollout
    env = cfg.task_server_env
    assert env is not None  # refused above
    started, sigterm = time.perf_counter(), SigtermStops()
    try:
        with contextlib.ExitStack() as stack:  # every piece stopped on the way out, the run first
            api_key = new_api_key()  # this run's task servers all take one fresh key
            servers = [
                stack.enter_context(
                    TaskServerProcess(env, max_episodes=cfg.task_server_max_episodes,
                                      idle_timeout=cfg.task_server_idle_timeout, api_key=api_key)
                )
                for _ in range(cfg.num_task_servers)
            ]  # fmt: skip
            print(f"task servers: {[s.url for s in servers]} pids {[s.process.pid for s in servers]}", flush=True)
            connect_ray()
            stack.enter_context(sigterm)  # after Ray's start: ray.init installs a SIGTERM handler of its own
            run = stack.enter_context(AgentGRPORun(config, [str(s.url) for s in servers], api_key))
            rows = agent_grpo(run)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the run's actors, queue and task servers are stopped by now
        print(stopped_line(config, exc), file=sys.stderr)
        return sigterm.exit_code()
    finally:
        ray.shutdown()
    first, last = fifth_means([r["success"] for r in rows])
    print(f"\nepisode success: first fifth {first:.3f} -> last fifth {last:.3f} ({last - first:+.3f})")
    print(time_line(len(rows), time.perf_counter() - started, run.timings))
    print(f"metrics: {config.output_path / 'metrics.jsonl'}\nplot: {config.output_path / 'metrics.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
