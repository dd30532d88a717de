"""Kill anything, lose nothing (issue 28): the demo in async mode, with actors SIGKILLed at random moments, against an
uninterrupted run on the same seed.

    .venv/bin/python benchmarks/kill_anything.py              # every kind: 2 kills each
    .venv/bin/python benchmarks/kill_anything.py --seed 1 --kills 3 --steps 24 --clean-runs 2
    .venv/bin/python benchmarks/kill_anything.py --kinds rollout,reward,unit   # not the controller

Two runs of recipe/demo.py's configuration (``mode=async max_staleness=1``, ``queue_replicas=2`` over 3 storage
units, an SFT warm-up to a sampled accuracy of 0.3, 8 prompts x 4 samples a step), one after the other, each in a child
process: ``clean`` kills nothing, ``killed`` draws from ``--seed`` (``random.Random``), for each kind in ``--kinds``
and each of its ``--kills``, a GRPO step and a delay after that step's launch, and then SIGKILLs (``os.kill`` of the
actor's process; a worker being restarted from an earlier kill is killed once it is back):

- ``rollout``: a rollout worker (Ray restarts it; the run's supervisor makes its calls again:
  orchestration/supervisor.py)
- ``reward``: a reward worker (the same)
- ``unit``: a storage unit (its rows' second copies serve; Ray restarts it, refilled)
- ``controller``: the queue's controller (``ray.kill(no_restart=False)``; ``queue_journal=true``: Ray restarts it over
  its journal, the leases and DP rounds in flight included; the run's supervisor tells it which workers died).
- ``trainer``: a trainer rank (the trainer group restarts from the run's last checkpoint in the same process,
  orchestration/trainer_restarts.py; with this kind both runs save one every ``TRAINER_CHECKPOINT_EVERY`` steps and
  ``train.max_restarts`` is ``--kills``; ``train.restart_keeps_rows``, the default, keeps the queue and the rows of
  the steps since the checkpoint across the restart). The killed run's figures join the starts as the run's metrics
  do: the audits and metrics rows of the final model's lineage count (each start's up to the step the next one
  resumed at); the rows a restart generated again (those of the steps from its checkpoint on that the dead start had
  trained or begun to generate, less those the next start resumed with their responses) count as regenerated.
- ``engine``: an engine server the run started (``rollout.engine=sglang`` in both runs, one server per rollout worker;
  its ``EngineServer`` restarts it on the same URL; the rollout worker's generation in flight waits for it, loads the
  newest weights into it and is made again: workers/engines/host.py). SGLang needs CUDA: the servers are
  tests/engine_fakes.py's SGLang stand-in, SGLang's routes over an ``HFEngine`` of the run's model directory (real
  samples and log-probs, each published version loaded from disk).

Before each step is cleared, the killed run records what the queue says about it (the trainer's acknowledgements, the
rows lost, the live rows' group ids). Reported, as JSON (``--out``) and a table:

- rows lost silently: rows of a step never trained (a step's ``prompts_per_step * n_samples`` less those the trainer
  acknowledged), and rows the queue reports lost;
- samples trained twice: acknowledgements beyond a step's rows, rows of a group beyond its ``n_samples``, and the
  rows of a step audited twice in the final model's lineage (:func:`lineage`: a step a trainer-group restart trains
  again after rolling back to a checkpoint before it is trained once in that lineage; a step a start trains that its
  own checkpoint covers, or trains twice, is not);
- staleness: each trained row's sampling policy version (read back from the queue before the step is cleared) against
  the version that trained it, over ``max_staleness``;
- kills per kind, and the restarts the run counted (``restarts_rollout`` / ``restarts_reward`` /
  ``restarts_trainer`` of its metrics rows, the controller's ``storage_units_restarted``, the engine servers'
  ``EngineServer`` restarts);
- the share of generated tokens regenerated after kills: the rows a killed rollout worker, or the worker a killed
  engine server served, was generating just before the kill (``RolloutWorker.rows_generating``: its batches from
  the engine's ``generate`` to their write; a batch whose step's weights still load into the engine is not counted)
  and those a trainer-group restart generated again
  (:func:`rerun_by_restart`: of the steps launched, the rows written or being generated at the death, less those the
  next start resumed with their responses), times the run's tokens per generated row, less the tokens resumed from
  in-flight checkpoints (``resumed_tokens``, ``rollout.checkpoint_inflight``), over all tokens generated. An upper
  bound still (a kill mid-generation loses the tokens made so far, not a whole row's). The earlier, coarser estimate
  is reported beside it (``regenerated_token_share_leased``): every rollout worker's leased rows at each kill, rows
  taken and waiting for weights (nothing generated for them yet) and the other workers' included;
- the final reward (mean of the last fifth of the steps) of both runs (``--clean-runs 2``: of two untouched runs).

``killed_figures`` is what tests/e2e/test_kill_anything_soak.py (slow) checks of a short killed run. Figures measured:
benchmarks/README.md, "kill anything, lose nothing".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("rollout", "reward", "unit", "controller", "trainer", "engine")
DEFAULT_KINDS = ",".join(KINDS)
PROMPTS, N = 8, 4
TRAINER_CHECKPOINT_EVERY = 2  # with ``trainer`` killed: a trainer-group restart trains at most 2 steps again
#: the demo's overrides: async mode, two copies of each row over 3 units, a short warm-up, a small step
OVERRIDES = [
    "mode=async", "max_staleness=1", "queue_replicas=2", "num_storage_units=3", f"prompts_per_step={PROMPTS}",
    f"n_samples={N}", "rollout.groups_per_request=2", "rollout.reward_groups_per_request=2",
    "task.num_train_prompts=4096", "task.num_eval_prompts=64", "sft.max_steps=1000", "sft.eval_every=50",
    "sft.batch_size=64", "sft.target_accuracy=0.3", "queue_timeout=120", "checkpoint_every=1000",
]  # fmt: skip


# an engine server or storage unit being restarted has no process id (None, 0) until its new process started
RESTART_PID_WAIT_S = 60.0


def _is_pid(pid: Any) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and pid >= 1


def sigkill(pid: Any, what: str) -> int:
    """SIGKILL process ``pid``; returns it. An unknown pid (None, 0, negative) is refused with ValueError:
    ``os.kill(0, ...)`` would kill this process's own group (the harness and whatever started it)."""
    if not _is_pid(pid):
        raise ValueError(f"{what}: no process id to kill (got {pid!r}); expected a pid >= 1")
    os.kill(pid, signal.SIGKILL)
    return pid


def pid_when_known(read: Any, wait_s: float) -> Any:
    """``read()`` once it gives a pid (an int >= 1), asked again every 0.2 s for up to ``wait_s`` seconds (a server
    being restarted has none until its new process started); what it gave last otherwise (:func:`sigkill` refuses
    it)."""
    deadline = time.monotonic() + wait_s
    while True:
        pid = read()
        if _is_pid(pid) or time.monotonic() > deadline:
            return pid
        time.sleep(0.2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="GRPO steps of each run (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed and the kill schedule's (default 0)")
    parser.add_argument("--kills", type=int, default=2, help="kills of each kind (default 2)")
    parser.add_argument("--kinds", default=DEFAULT_KINDS, help=f"what is killed, of {','.join(KINDS)}")
    parser.add_argument("--out", default=None, help="the JSON report (default benchmarks/results/kill-anything-*.json)")
    parser.add_argument("--keep", default=None, help="a folder for both runs' outputs and logs (emptied first)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both runs (repeatable)"
    )
    parser.add_argument(
        "--clean-runs", type=int, default=1, help="untouched runs on the same seed (>1: their spread is the noise)"
    )
    parser.add_argument("--child", choices=("clean", "killed"), help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    if args.steps < 4:
        parser.error(f"--steps: at least 4 (kills fall on steps 1 .. steps - 2), got {args.steps}")
    return args


def schedule(seed: int, kinds: list[str], kills: int, steps: int) -> list[dict[str, Any]]:
    """The kills, drawn from ``seed``: per kind ``kills`` times a GRPO step in [1, steps - 2] and a delay in
    [0, 1) s after that step's launch."""
    rng = random.Random(seed)
    plan = [
        {"kind": kind, "step": rng.randint(1, steps - 2), "delay_s": round(rng.random(), 3), "pick": rng.random()}
        for kind in kinds
        for _ in range(kills)
    ]
    return sorted(plan, key=lambda k: (k["step"], k["delay_s"]))


def serve_policy_with_stand_ins() -> None:
    """The run's engine servers (``rollout.engine=sglang``, one per rollout worker, started and restarted by its
    ``InferenceManager``) are tests/engine_fakes.py's SGLang stand-in: SGLang's routes over an ``HFEngine`` of the
    run's model directory (real samples and log-probs; ``/update_weights_from_disk`` loads each published version).
    SGLang itself needs CUDA."""
    from orchestration import grpo_run
    from orchestration.inference import inference_manager
    from workers.api_key import KEY_PLACEHOLDER

    def stand_in(model_path: str, port: int, host: str = "127.0.0.1", *, extra: list[str] | None = None) -> list[str]:
        return [sys.executable, str(ROOT / "tests" / "engine_fakes.py"), "--host", host, "--port", str(port),
                "--api-key", KEY_PLACEHOLDER, "--model-path", model_path, "--eos-token-id", "2"]  # fmt: skip

    def manager(*args: Any, **kwargs: Any) -> Any:
        return inference_manager(*args, server_command=stand_in, health_interval=0.5, **kwargs)

    grpo_run.inference_manager = manager  # type: ignore[assignment]


# ---- the child runs ---------------------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    import ray

    import transfer_queue
    from orchestration.config import config_from_cli
    from orchestration.grpo_run import connect_ray
    from orchestration.supervisor import when_up
    from orchestration.trainer_restarts import joined_rows, run_with_trainer_restarts
    from rl_contracts.stages import ROLLOUT_TASK, TRAIN_TASK
    from tests.e2e.unit_death_run import AuditedRun

    overrides = [*OVERRIDES, *args.set, f"steps={args.steps}", f"seed={args.seed}", f"output_dir={args.output_dir}"]
    if "controller" in args.kinds:  # a journaled queue takes no snapshots into checkpoints: neither run's does
        overrides.append("checkpoint_queue=false")
        if args.child == "killed":
            overrides.append("queue_journal=true")
    if "trainer" in args.kinds:  # a dead trainer rank: the run resumes from its last checkpoint (both runs save them)
        overrides += [f"checkpoint_every={TRAINER_CHECKPOINT_EVERY}", f"train.max_restarts={args.kills}"]
    if "engine" in args.kinds:  # the run starts its engine servers: SGLang stand-ins over the run's HF policy
        overrides.append("rollout.engine=sglang")
        serve_policy_with_stand_ins()
    config = config_from_cli(__doc__ or "", ROOT / "recipe" / "configs" / "demo.yaml", overrides)
    plan = schedule(args.seed, args.kinds, args.kills, args.steps) if args.child == "killed" else []

    class Shared:  # what the run's starts (a trainer-group restart starts it again) share
        def __init__(self) -> None:
            self.kills: list[dict[str, Any]] = []
            self.made: set[int] = set()  # the plan's kills made (one a start's end cancelled: the next start's)
            self.held_rows = 0  # rows killed rollout workers and engine servers were generating
            self.held_rows_leased = 0  # rows every rollout worker held at those kills (the earlier, upper estimate)
            self.units_restarted = 0
            # the storage unit restarts a queue a trainer-group restart kept had counted (its controller's count goes
            # on: the next start's reading includes them)
            self.units_counted = 0
            self.engines_restarted = 0

    shared = Shared()

    class KillingRun(AuditedRun):
        audit_mode = "a"
        closed = True  # until started: a start-up that fails shuts down what it started, nothing of this class

        def __init__(self, config: Any):
            super().__init__(config)
            self.kills = shared.kills
            self.killer = transfer_queue.TransferQueueClient("killer", self.client.controller_info)
            self.timers: list[threading.Timer] = []
            self.closed = False  # started: shutdown() reads the counts first
            self.unit_kills = 0  # storage units this start killed
            self.ahead_rows = 0  # at a trainer rank's death: rollout rows of the steps launched, written or generating
            self.ahead_rows_leased = 0  # the same with every leased row (the earlier, upper estimate)
            self.attempt = len(attempts)  # this start's index (a trainer-group restart starts the run again)

        def launch(self, step: int, min_version: int | None = None) -> tuple[list[Any], list[Any]]:
            refs = super().launch(step, min_version)
            self.plan_kills(step)
            return refs

        def _restart_step(self, s: int, start: int, first_version: int) -> tuple[list[Any], list[Any]]:
            """A step a start resumed from its queue (its prompts there) is launched here: its kills too."""
            refs = super()._restart_step(s, start, first_version)
            self.plan_kills(s)
            return refs

        def plan_kills(self, step: int) -> None:
            for i, kill in enumerate(plan):
                if kill["step"] == step and i not in shared.made:
                    timer = threading.Timer(kill["delay_s"], self.kill_one, (i, kill))
                    timer.start()
                    self.timers.append(timer)

        def kill_one(self, i: int, kill: dict[str, Any]) -> None:
            if self.closed or i in shared.made:  # this start ended (a trainer rank died): the next one kills
                return
            shared.made.add(i)
            kind, pick = kill["kind"], kill["pick"]
            record = dict(kill)
            try:
                if kind == "controller":
                    ray.kill(transfer_queue.get_controller(), no_restart=False)
                else:
                    if kind == "unit":

                        def unit_pid() -> Any:  # a unit being restarted reports pid 0 until it is back
                            units = ray.get(transfer_queue.get_controller().storage_stats.remote())
                            record["unit"] = int(pick * len(units))
                            return units[record["unit"]]["pid"]

                        pid = pid_when_known(lambda: when_up(unit_pid), RESTART_PID_WAIT_S)
                        self.unit_kills += 1
                    elif kind == "engine":
                        assert self.inference is not None, "the engine kind needs servers the run started"
                        servers = self.inference.servers
                        record["server"] = int(pick * len(servers))
                        pid = pid_when_known(lambda: servers[record["server"]].record.pid, RESTART_PID_WAIT_S)
                    elif kind == "trainer":
                        record["rank"] = int(pick * len(self.trainer))
                        pid = int(ray.get(self.trainer[record["rank"]].pid.remote()))
                    else:
                        workers = self.rollout if kind == "rollout" else self.reward
                        record["worker"] = int(pick * len(workers))
                        pid = when_up(lambda: int(ray.get(workers[record["worker"]].pid.remote())))
                    if kind in ("rollout", "engine"):  # a dead server's generations in flight are made again
                        # the rows the killed worker (or the worker server i serves) was generating; every rollout
                        # worker's leased rows as well, the earlier estimate (rows waiting for weights included)
                        index = record["worker"] if kind == "rollout" else record["server"]
                        record["held_rows"] = self.rows_generating([index])
                        record["held_rows_leased"] = self.rollout_rows_held()
                        shared.held_rows += record["held_rows"]
                        shared.held_rows_leased += record["held_rows_leased"]
                    record["pid"] = sigkill(pid, f"the {kind} kill")
                record["at"] = time.time()
            except Exception as exc:  # a kill that could not be made is reported, not hidden
                record["error"] = f"{type(exc).__name__}: {exc}"
            self.kills.append(record)
            print(f"kill: {record}", flush=True)

        def shutdown(self, keep_queue: bool = False) -> None:
            """Before the queue stops: the storage units its controller restarted (a unit killed late: Ray's
            restart may come after the last step), and, a trainer rank dead, the rollout rows of the steps in
            flight (those the next start does not restore are generated again)."""
            if not self.closed:
                self.closed = True
                for timer in self.timers:
                    timer.cancel()
                if self.inference is not None:  # the engine servers their EngineServer restarted after a crash
                    shared.engines_restarted += sum(server.record.restarts for server in self.inference.servers)
                try:
                    deadline = time.monotonic() + 60
                    while True:
                        stats = when_up(lambda: ray.get(transfer_queue.get_controller().server_stats.remote()))
                        restarted = sum(stats["storage_units_restarted"].values()) - shared.units_counted
                        if restarted >= self.unit_kills or time.monotonic() > deadline:
                            break
                        time.sleep(0.2)
                    shared.units_restarted += restarted
                    shared.units_counted = shared.units_counted + restarted if keep_queue else 0
                    # right before the drain (super().shutdown): a batch begun in the few ms between is restored
                    # by the next start without being counted here; one written between the two reads counts twice
                    generating = self.rows_generating(range(len(self.rollout)))
                    self.ahead_rows = self.rollout_rows_held(("acknowledged",)) + generating
                    self.ahead_rows_leased = self.rollout_rows_held(("acknowledged", "leased"))
                finally:
                    super().shutdown(keep_queue)
            else:
                super().shutdown(keep_queue)

        def rows_generating(self, workers: Any) -> int:
            """Rows rollout workers ``workers`` (indexes) are generating now (``RolloutWorker.rows_generating``: rows
            taken and waiting for weights are not: a kill costs no generation for them); a dead worker's none."""
            held = 0
            for index in workers:
                try:
                    held += int(ray.get(self.rollout[index].rows_generating.remote(), timeout=30))
                except (ray.exceptions.RayError, TimeoutError):
                    pass
            return held

        def rollout_rows_held(self, states: tuple[str, ...] = ("leased",)) -> int:
            held = 0
            for step in list(self.pending):
                try:
                    status = self.killer.get_consumption_status(global_step=step, task_name=ROLLOUT_TASK)
                except Exception:  # a step cleared meanwhile
                    continue
                held += sum(int(status["tasks"][ROLLOUT_TASK][state]) for state in states)
            return held

        def write_audit(self, step: int) -> None:
            capacity = self.cfg.prompts_per_step * self.cfg.n_samples
            live = self.client.get_meta(
                ["policy_version"], capacity, global_step=step, task_name="audit", peek=True, timeout=60
            )
            row = {
                "step": step,
                # the start that trained it and the step it resumed from (killed_figures: the final model's lineage);
                # a step a start clears without training it (a checkpoint covers it: an earlier start trained it and
                # died before its clear) is audited as that earlier start left it
                "attempt": self.attempt,
                "start": self.start,
                "trained": step in {int(r["step"]) for r in self.rows},
                "live_groups": live.group_ids.tolist(),
                # the policy version that sampled each row, read back from the queue (the staleness check)
                "policy_versions": self.client.get_data(live)["policy_version"].reshape(-1).int().tolist(),
                "train": self.client.get_consumption_status(global_step=step, task_name=TRAIN_TASK)["tasks"][
                    TRAIN_TASK
                ],
                "rows_lost": self.client.get_production_status(global_step=step)["rows_lost"],
            }
            self.audit.write(json.dumps(row) + "\n")
            self.audit.flush()

    def attempt(cfg: Any, restarts: int) -> tuple[KillingRun, list[dict[str, Any]]]:
        with KillingRun(cfg) as run:
            run.restarts_trainer = restarts
            attempts.append(run)  # a trainer rank's death ends it: the next attempt resumes from its checkpoint
            rows = run.run()
        return run, rows

    connect_ray()
    attempts: list[KillingRun] = []
    started = time.perf_counter()
    # a dead trainer rank: the run stops and resumes from its last checkpoint (orchestration/trainer_restarts.py)
    last, last_rows = run_with_trainer_restarts(config, attempt)
    seconds = time.perf_counter() - started
    for run in attempts:
        for timer in run.timers:
            timer.join()
    # each start's rows up to the step the next one resumed from
    died = [(run.start, run.rows) for run in attempts[:-1]]
    rows = joined_rows([*died, (last.start, last_rows)])
    rerun_rows, rerun_rows_leased = (
        sum(
            rerun_by_restart(run.rows, getattr(run, ahead), after.start, restored_rows(after), PROMPTS * N)
            for run, after in itertools.pairwise(attempts)
        )
        for ahead in ("ahead_rows", "ahead_rows_leased")
    )
    summary = {
        "seconds": seconds,
        "retrained": [retrained(run.rows, after.rows, after.start) for run, after in itertools.pairwise(attempts)],
        # what each trainer-group restart resumed: from which step, rows restored (not generated again) and re-launched
        "resumes": [run.queue_resume.row(ROLLOUT_TASK) for run in attempts[1:] if run.queue_resume is not None],
        "kills": shared.kills,
        "held_rows": shared.held_rows,
        "held_rows_leased": shared.held_rows_leased,
        "rerun_rows": rerun_rows,  # rows a trainer-group restart generated again
        "rerun_rows_leased": rerun_rows_leased,
        "restarts": [dict(run.supervisor.restarts) for run in attempts],
        "units_restarted": shared.units_restarted,
        "engines_restarted": shared.engines_restarted,
        "groups_put_again": sum(run.lost_prompts.groups_put_again for run in attempts),
        "rows": rows,
    }
    (Path(args.output_dir) / "kill_anything.json").write_text(json.dumps(summary))
    return 0


def restored_rows(run: Any) -> int:
    """Rows of the steps a start resumed from its queue (a queue checkpoint's, or the queue a trainer-group restart
    kept) whose responses were there: not generated again."""
    from rl_contracts.stages import ROLLOUT_TASK

    return run.queue_resume.restored_rows(ROLLOUT_TASK) if run.queue_resume is not None else 0


def rerun_by_restart(
    died_rows: list[dict[str, Any]], ahead_rows: int, resumed_at: int, restored: int, rows: int
) -> int:
    """Rollout rows a trainer-group restart generated again: those of the steps from the one it resumed at
    (``resumed_at``) that the dead start had trained (``rows`` each, its metrics rows ``died_rows``) or had begun to
    generate (``ahead_rows``: taken by a rollout worker, of the steps launched and not trained), less the ``restored``
    rows the next start resumed with their responses."""
    trained = sum(rows for r in died_rows if int(r["step"]) >= resumed_at)
    return max(0, trained + ahead_rows - restored)


def retrained(
    died_rows: list[dict[str, Any]], again_rows: list[dict[str, Any]], resumed_at: int
) -> list[dict[str, Any]]:
    """The steps a dead start had trained past the checkpoint the next start resumed at, as each start trained them:
    the same rows (``prompts_crc``: the prompts) and, trained again from the same checkpoint on the same samples, the
    same gradient norm, up to floating point; other samples (generated again) give another."""
    again = {int(r["step"]): r for r in again_rows}
    return [
        {key: [r.get(key), again[int(r["step"])].get(key)] for key in ("grad_norm", "prompts_crc", "reward")}
        | {"step": int(r["step"])}
        for r in died_rows
        if int(r["step"]) >= resumed_at and int(r["step"]) in again
    ]


def lineage(audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The audits of the final model's lineage, in order: each start's audits of the steps before the one the next
    start resumed at (``start``) and the last start's, as the run's metrics rows are joined
    (trainer_restarts.joined_rows). A step trained again after a trainer-group restart rolled the run back to a
    checkpoint before it counts once; a step a start trained that its own checkpoint covered (before its ``start``),
    or trained twice in one start, appears twice. An audit of a step its start cleared without training it (an
    earlier start trained it, then died after the checkpoint that covers it, before clearing it) counts only for a
    step no start's training audit names."""
    trained = [a for a in audits if a.get("trained", True)]
    starts: dict[int, int] = {}
    for a in trained:
        starts.setdefault(int(a.get("attempt", 0)), int(a.get("start", 0)))
    kept: list[dict[str, Any]] = []
    for attempt in sorted(starts):
        kept = [a for a in kept if a["step"] < starts[attempt]]
        kept += [a for a in trained if int(a.get("attempt", 0)) == attempt]
    named = {a["step"] for a in kept}
    cleared = {a["step"]: a for a in audits if not a.get("trained", True) and a["step"] not in named}
    return sorted(kept + list(cleared.values()), key=lambda a: a["step"])


# ---- the parent: both runs, the report --------------------------------------------------------------------------
def last_fifth(values: list[float]) -> float:
    tail = values[-max(1, len(values) // 5) :]
    return sum(tail) / len(tail) if tail else float("nan")


def killed_figures(run_dir: Path, steps: int, kinds: list[str], max_staleness: int = 1) -> dict[str, Any]:
    """The killed run's figures, from its ``kill_anything.json`` and ``audit.jsonl`` in ``run_dir`` (a run of
    ``steps`` GRPO steps of ``PROMPTS * N`` rows, killing ``kinds``); tests/e2e/test_kill_anything_soak.py checks
    them too."""
    killed = json.loads((run_dir / "kill_anything.json").read_text())
    # a trainer-group restart trains the steps after its checkpoint again: the audits of the final model's lineage
    # count (each start's up to the step the next one resumed at); a step in it twice was trained twice
    audited = lineage([json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()])
    by_step = {a["step"]: a for a in audited}
    audits = [by_step[s] for s in sorted(by_step)]
    grpo = killed["rows"]
    supervisors = killed["restarts"] if isinstance(killed["restarts"], list) else [killed["restarts"]]
    rows = PROMPTS * N
    lost_silently = sum(max(0, rows - a["train"]["acknowledged"]) for a in audits)
    lost_silently += rows * (steps - len(audits))  # a step that never finished
    rows_lost = sum(a["rows_lost"] for a in audits)
    twice = sum(max(0, a["train"]["acknowledged"] - rows) for a in audits)
    twice += rows * (len(audited) - len(audits))  # a step audited twice in the lineage: its rows trained twice
    twice += sum(max(0, a["live_groups"].count(g) - N) for a in audits for g in set(a["live_groups"]))
    # staleness: each row's sampling version (read back from the queue) against the version that trained it (the
    # trainer's version before the step: its ``policy_version`` after it, less one)
    trained_by = {int(r["step"]): int(r["policy_version"]) - 1 for r in grpo}
    staleness = [trained_by[a["step"]] - v for a in audits if a["step"] in trained_by for v in a["policy_versions"]]
    tokens = sum(r["tokens"] for r in grpo)
    per_row = tokens / max(1.0, sum(r["generated_rows"] for r in grpo))
    resumed = sum(r.get("resumed_tokens", 0) for r in grpo)  # in-flight checkpoints: tokens not generated again
    regenerated = max(0.0, (killed["held_rows"] + killed.get("rerun_rows", 0)) * per_row - resumed)
    # the earlier estimate: every rollout worker's leased rows at a kill, rows waiting for weights included
    leased = killed.get("held_rows_leased", killed["held_rows"]) + killed.get("rerun_rows_leased", 0)
    regenerated_leased = max(0.0, leased * per_row - resumed)
    return {
        "steps": steps,
        "kinds": kinds,
        "kills": {kind: sum(1 for k in killed["kills"] if k["kind"] == kind and "error" not in k) for kind in kinds},
        "kill_errors": [k for k in killed["kills"] if "error" in k],
        "steps_finished": len(audits),
        "rows_per_step": [a["train"]["rows"] for a in audits],
        "rows_lost_silently": lost_silently,
        "rows_reported_lost": rows_lost,
        "samples_trained_twice": twice,
        "rows_version_checked": len(staleness),
        "staleness_max": max(staleness, default=0),
        "rows_beyond_max_staleness": sum(1 for s in staleness if s > max_staleness),
        "rows_left_out_as_stale": sum(int(r.get("stale_rows", 0)) for r in grpo),
        "restarts": {
            # each start's supervisor (a row that counted one may be cut back by a trainer-group restart)
            **{kind: sum(int(start.get(kind, 0)) for start in supervisors) for kind in ("rollout", "reward")},
            "unit": killed["units_restarted"],
            "trainer": sum(r.get("restarts_trainer", 0) for r in grpo),
            "engine": killed.get("engines_restarted", 0),
        },
        "groups_put_again": killed["groups_put_again"],
        "regenerated_token_share": regenerated / (tokens + regenerated) if tokens else 0.0,
        "regenerated_token_share_leased": regenerated_leased / (tokens + regenerated_leased) if tokens else 0.0,
        "resumed_tokens": resumed,
        # rows generated again: those killed rollout workers and engine servers held, those a trainer-group restart
        # generated again (the steps past its checkpoint and those launched ahead)
        "regenerated_rows": {"held_at_kills": killed["held_rows"], "trainer_restarts": killed.get("rerun_rows", 0)},
        "regenerated_rows_leased": {
            "held_at_kills": leased - killed.get("rerun_rows_leased", 0),
            "trainer_restarts": killed.get("rerun_rows_leased", 0),
        },
        "trainer_resumes": killed.get("resumes", []),
        # the steps trained again after a restart: each start's gradient norm of it (equal: the same samples trained
        # from the same checkpoint, the final lineage the same as the one rolled back)
        "retrained_steps": [step for restart in killed.get("retrained", []) for step in restart],
        "final_reward": last_fifth([r["reward"] for r in grpo]),
        "seconds": killed["seconds"],
        "kill_log": killed["kills"],
    }


def report(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cleans = [json.loads((work / name / "kill_anything.json").read_text()) for name in clean_names(args)]
    killed = killed_figures(work / "killed", args.steps, args.kinds)
    rewards = [last_fifth([r["reward"] for r in clean["rows"]]) for clean in cleans]
    return {
        "seed": args.seed,
        **killed,
        "final_reward": {"killed": killed["final_reward"], "clean": rewards[0], "clean_runs": rewards},
        "seconds": {"killed": killed["seconds"], "clean": cleans[0]["seconds"]},
    }


def clean_names(args: argparse.Namespace) -> list[str]:
    return ["clean", *(f"clean{i}" for i in range(2, args.clean_runs + 1))]


def table(out: dict[str, Any]) -> str:
    lines = [
        f"| seed {out['seed']}, {out['steps']} steps | |",
        "|---|---|",
        f"| kills per kind | {', '.join(f'{k} {v}' for k, v in out['kills'].items())} |",
        f"| restarts counted | {', '.join(f'{k} {v}' for k, v in out['restarts'].items())} |",
        f"| steps finished | {out['steps_finished']} of {out['steps']} |",
        f"| rows lost silently | {out['rows_lost_silently']} |",
        f"| rows the queue reported lost | {out['rows_reported_lost']} |",
        f"| samples trained twice | {out['samples_trained_twice']} |",
        f"| rows trained beyond max_staleness (of rows checked) | {out['rows_beyond_max_staleness']} "
        f"(of {out['rows_version_checked']}; staleness max {out['staleness_max']}) |",
        f"| generated tokens regenerated after kills | {100 * out['regenerated_token_share']:.2f} % "
        f"(rows being generated; every leased row: {100 * out.get('regenerated_token_share_leased', 0.0):.2f} %) |",
        f"| final reward (last fifth): killed / clean | {out['final_reward']['killed']:.3f} / "
        + " and ".join(f"{r:.3f}" for r in out["final_reward"]["clean_runs"])
        + " |",
        f"| GRPO wall time: killed / clean | {out['seconds']['killed']:.0f} s / {out['seconds']['clean']:.0f} s |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kill-anything-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    for name in [*clean_names(args), "killed"]:
        shutil.rmtree(work / name, ignore_errors=True)  # a run finds a checkpoint in its output_dir and resumes
        cmd = [
            sys.executable, __file__, "--child", name.rstrip("0123456789"), "--output-dir", str(work / name),
            "--steps", str(args.steps),
            "--seed", str(args.seed), "--kills", str(args.kills), "--kinds", ",".join(args.kinds),
            *(f"--set={o}" for o in args.set),
        ]  # fmt: skip
        log = work / f"{name}.log"
        print(f"{name} run: {' '.join(cmd[1:])} (log {log})", flush=True)
        with log.open("w") as f:
            code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        if code != 0:
            sys.exit(f"the {name} run failed ({code}); its output: {log}")
    out = report(args, work)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"kill-anything-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "kill_log"}))
    print(table(out))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
