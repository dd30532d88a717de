"""recipe/agentrl_demo.py end to end: killed mid-run (SIGKILL) and resumed, it re-dispatches the tasks the dead run had
claimed and trains no record twice; in the slow tier, the full run learns."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import recipe.agentrl_demo  # noqa: F401  (registers the demo's AdditionProblem in this process)
from workers.ledger import Ledger

ROOT = Path(__file__).resolve().parents[4]
SMALL = ["sft_target=0", "prompts_per_step=4", "num_generations=4", "num_tasks=32", "checkpoint_every=2", "lease_s=2"]


def demo(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "recipe" / "agentrl_demo.py"), f"output_dir={out}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def running_tasks(url: str) -> list[tuple[str, int]]:
    ledger = Ledger(url)
    try:
        return [(t.id, t.epoch) for t in ledger.tasks("train") if t.status == "running"]
    finally:
        ledger.close()


@pytest.mark.slow  # two demo runs, each starting Ray: two to three minutes on a loaded 2-core machine
def test_killed_and_resumed_it_redispatches_claimed_tasks_and_trains_no_record_twice(tmp_path):
    out = tmp_path / "demo"
    first = demo(out, "steps=40", *SMALL)
    url = f"sqlite:///{out}/ledger.db"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3 and running_tasks(url):
                break
            time.sleep(0.05)
        assert first.poll() is None, f"the demo ended before it could be killed:\n{first.stdout.read()[-3000:]}"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the ledger's writer (the driver) dies with its process group
        first.wait(30)
    # read after the kill: a claim seen running a moment before may have finished before the kill landed
    running = running_tasks(url)
    assert running, "no task was claimed when the run was killed"
    killed_at = len((out / "metrics.jsonl").read_text().splitlines())

    second = demo(out, f"steps={killed_at + 6}", *SMALL)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-3000:]
    assert "resumed from" in output
    ledger = Ledger(url)
    tasks = {(t.id, t.epoch): t for t in ledger.tasks("train")}
    claims = ledger.claims("train")
    for task_id, epoch in running:  # the dead run's claims expired; a claim of the resumed run finished the task
        mine = [c for c in claims if (c.task_id, c.epoch) == (task_id, epoch)]
        assert mine[0].status == "expired" and "lease ended" in mine[0].last_error, mine
        assert tasks[(task_id, epoch)].status == "done" and mine[-1].status == "done", mine
        assert mine[-1].attempt == 2, mine
    records = ledger.records("train")
    assert max(r.trained_count for r in records) == 1  # max_trained_count=1: never trained twice
    trained_steps = sorted({r.last_trained_step for r in records if r.trained_count})
    assert trained_steps[-1] == killed_at + 5
    keys = [(r.task_key, r.sample_index) for r in records]
    assert len(keys) == len(set(keys))


@pytest.mark.slow  # about 2 minutes on a quiet 2-core machine
def test_the_demo_learns(tmp_path):
    run = demo(tmp_path / "demo", "steps=250")
    output, _ = run.communicate(timeout=1800)
    assert run.returncode == 0, output[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "sft" and (tmp_path / "demo" / "metrics.png").exists()
    rows = [row for row in rows if row["kind"] == "grpo"]
    k = len(rows) // 5
    first, last = (sum(r["reward"] for r in part) / k for part in (rows[:k], rows[-k:]))
    # a fifth is 50 steps x 128 samples: a standard error of about 0.01, so 0.05 is a margin noise does not reach
    assert last > first + 0.05, output[-2000:]


# --- AgentRL's RL-guide command line (issue 27): the example's flags, as written, on a small local model -----------
def save_model(path: Path, chat_template: bool = True) -> Path:
    """A tiny Llama and its character-level tokenizer saved with ``save_pretrained`` (no hub download); without
    ``chat_template`` the prompts are the plain question."""
    from transformers import AutoTokenizer

    from workers.models import save_tiny_chat_model

    save_tiny_chat_model(path)
    if not chat_template:
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = None
        (path / "chat_template.jinja").unlink(missing_ok=True)
        tokenizer.save_pretrained(path)
        assert not AutoTokenizer.from_pretrained(path).chat_template
    return path


def the_guides_example(model: Path, out: Path, db: str, sampling: str = "true") -> list[str]:
    """The RL guide's example command's flags as written there (``torchrun ... src/main.py`` aside)."""
    return [
        "--model_name_or_path", str(model), "--output_dir", str(out), "--db_connection_string", db,
        "--enable_sampling", sampling, "--loss_calculater", "GRPO", "--inf_tp_size", "1", "--inf_ep_size", "1",
        "--inf_mem_ratio", "0.6", "--num_generations", "8", "--max_new_tokens", "8",
        "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "8", "--learning_rate", "1e-6",
        "--save_steps", "500",
    ]  # fmt: skip


def test_the_guides_example_command_trains_a_local_model_from_the_ledgers_records(tmp_path, ray_session, capsys):
    from recipe.agentrl_demo import main

    db = f"sqlite:///{tmp_path}/ledger.db"
    out = tmp_path / "run"

    assert main([*the_guides_example(save_model(tmp_path / "model"), out, db), "steps=2", "num_tasks=8"]) == 0

    printed = capsys.readouterr().out
    assert (
        printed.count("AgentRL's flags -> this demo's config:") == 1 and "--learning_rate 1e-6 -> lr=1e-06" in printed
    )
    ledger = Ledger(db)
    try:
        records = ledger.records("train")
        trained = [r for r in records if r.trained_count]
        assert len(trained) == 16 and {r.last_trained_step for r in trained} == {0, 1}  # 2 steps x 1 group of 8
        prompt = records[0].messages[0]["content"]
        assert "+" in prompt and prompt.endswith("=")  # the addition problems
    finally:
        ledger.close()
    import torch

    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2


def write_groups(db: str, groups: int, size: int = 8) -> None:
    """``groups`` finished addition tasks of ``size`` scored records each (and one group short of ``size``), written
    into the ledger as a sampler does: an epoch of tasks, a claim each, a record per sample, the claim done."""
    from recipe.agentrl_demo import AdditionDataset
    from workers.ledger import Record

    ledger = Ledger(db)
    try:
        dataset = AdditionDataset(groups + 1, seed=5)
        tasks = [dataset[i].model_copy(update={"id": f"problem-{i}"}) for i in range(groups + 1)]
        assert ledger.write_epoch("train", 0, tasks, owner="test")
        for g in range(groups + 1):
            claimed = ledger.claim("train", owner="test", lease_s=60)
            assert claimed is not None
            claim, task = claimed
            records = [
                Record(
                    task_key=claim.task_key,
                    task_id=claim.task_id,
                    split="train",
                    epoch=0,
                    sample_index=i,
                    claim_id=claim.id,
                    messages=[{"role": "user", "content": task.question}, {"role": "assistant", "content": "042"}],
                    score=float(i % 2),
                    group_id=f"train/0/{claim.task_id}",
                )
                for i in range(size if g < groups else size - 1)
            ]
            ledger.write_records(records)
            ledger.complete(claim.id)
    finally:
        ledger.close()


def test_enable_sampling_false_trains_the_ledgers_records_without_an_engine_and_stops(tmp_path, monkeypatch, capsys):
    import orchestration.ledger_run as ledger_run
    import recipe.agentrl_demo as demo

    def no_service(*args, **kwargs):
        raise AssertionError("enable_sampling=false started an engine, a service or Ray")

    monkeypatch.setattr(demo, "HFEngine", no_service)
    for name in ("serve_in_background", "SamplingScheduler", "init_ray"):
        monkeypatch.setattr(ledger_run, name, no_service)
    db = f"sqlite:///{tmp_path}/ledger.db"
    write_groups(db, groups=3)
    model = save_model(tmp_path / "model", chat_template=False)

    assert demo.main(the_guides_example(model, tmp_path / "run", db, sampling="false")) == 0

    printed = capsys.readouterr().out
    assert "enable_sampling=false: training from the 31 records in sqlite:///" in printed
    assert (
        "enable_sampling=false: stopping at step 3: 7 trainable records left, fewer than a step's 1 whole groups of "
        "num_generations=8"
    ) in printed
    ledger = Ledger(db)
    try:
        counts = sorted((r.trained_count, r.last_trained_step) for r in ledger.records("train"))
    finally:
        ledger.close()
    assert counts == [(0, None)] * 7 + [(1, 0)] * 8 + [(1, 1)] * 8 + [(1, 2)] * 8  # the short group is left
    import torch

    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rows_trained"]) for r in rows if r["kind"] == "grpo"] == [(0, 8), (1, 8), (2, 8)]


def skip_problem_0(record):
    """A ``convert_record_to_data_func``: task problem-0's records skipped, the others' answers as fixed tokens."""
    if record.task_id == "problem-0":
        return None
    return {"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}


def test_convert_record_to_data_func_turns_the_records_into_what_is_trained_and_skips_what_it_returns_none_for(
    tmp_path, monkeypatch, capsys
):
    import orchestration.ledger_grpo as ledger_grpo
    import recipe.agentrl_demo as demo

    db = f"sqlite:///{tmp_path}/ledger.db"
    write_groups(db, groups=3)
    model = save_model(tmp_path / "model", chat_template=False)
    seen = []
    step_on = ledger_grpo.LedgerGRPOTrainer.step_on

    def spy(self, step, rows):
        seen.append((rows.prompts, rows.responses))
        return step_on(self, step, rows)

    monkeypatch.setattr(ledger_grpo.LedgerGRPOTrainer, "step_on", spy)
    hook = f"{__name__}:skip_problem_0"
    argv = the_guides_example(model, tmp_path / "run", db, sampling="false")

    assert demo.main([*argv, "--convert_record_to_data_func", hook]) == 0

    printed = capsys.readouterr().out
    assert f"--convert_record_to_data_func {hook} -> convert_record_to_data_func={hook} (each ledger Record" in printed
    assert (
        "enable_sampling=false: stopping at step 2: 15 trainable records left (8 of them skipped by "
        "convert_record_to_data_func), fewer than a step's 1 whole groups of num_generations=8"
    ) in printed
    assert seen == [([[5, 6, 7]] * 8, [[8, 9]] * 8)] * 2
    ledger = Ledger(db)
    try:
        untrained = {r.task_id for r in ledger.records("train") if not r.trained_count}
    finally:
        ledger.close()
    assert untrained == {"problem-0", "problem-3"}  # skipped, and the group short of records


def test_a_convert_record_to_data_func_that_does_not_import_or_is_not_read_is_refused(tmp_path, capsys):
    from recipe.agentrl_demo import main

    out = str(tmp_path / "run")
    assert main([f"output_dir={out}", "enable_sampling=false", "convert_record_to_data_func=no_such_module:f"]) == 2
    assert (
        "agentrl_demo.py: error: invalid config: convert_record_to_data_func: expected a dotted name "
        "'package.module:function' of an importable function, got 'no_such_module:f': cannot import module "
        "'no_such_module' of 'no_such_module:f': No module named 'no_such_module'"
    ) in capsys.readouterr().err
    hook = f"convert_record_to_data_func={__name__}:skip_problem_0"
    assert main([f"output_dir={out}", "prompts_from=prompt-source", hook]) == 2
    assert (
        "agentrl_demo.py: error: invalid config: convert_record_to_data_func: turns ledger records into training "
        "data, but prompts_from=prompt-source writes no records: expected prompts_from=scheduler with it"
    ) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# --- convert_record_to_data_func with enable_sampling=true: each finished group's records pass through it ----------
SAMPLED = [*SMALL[:4], "prompts_per_step=2", "num_generations=2"]  # 4 rows a step


def sampling_run(tmp_path, monkeypatch, hook=None, samples=None, steps: int = 3, argv: tuple[str, ...] = ()):
    """The demo with sampling, in process, with ``hook`` (a callable; None: ``argv``'s dotted name, if any); the rows
    each trainer step got. ``samples`` is filled with the samples the samplers wrote, by (task, epoch, sample
    index), as they write them."""
    import orchestration.ledger_grpo as ledger_grpo
    import recipe.agentrl_demo as demo
    from orchestration.config import config_from_cli
    from workers.ledger import AsyncSampler

    samples = {} if samples is None else samples
    steps_rows = []
    write_records, train = AsyncSampler.write_records, ledger_grpo.LedgerGRPOTrainer._train

    async def remember(self, batch, first_index=0):
        for i, sample in enumerate(batch):
            samples[(self.claim.task_id, self.claim.epoch, first_index + i)] = sample
        return await write_records(self, batch, first_index)

    def spy(self, step, data, wait_s):
        steps_rows.append(data)
        return train(self, step, data, wait_s)

    monkeypatch.setattr(AsyncSampler, "write_records", remember)
    monkeypatch.setattr(ledger_grpo.LedgerGRPOTrainer, "_train", spy)
    cli = [f"output_dir={tmp_path / 'run'}", f"steps={steps}", *SAMPLED, *argv]
    config = config_from_cli("", demo.DEFAULT_CONFIG, cli, cls=demo.AgentRLDemoConfig)
    assert demo.train(config, hook) == 0
    return steps_rows


def train_records(tmp_path: Path) -> dict[int, Any]:
    """The run's ledger's records of split train, by id."""
    ledger = Ledger(f"sqlite:///{tmp_path}/run/ledger.db")
    try:
        return {r.id: r for r in ledger.records("train")}
    finally:
        ledger.close()


def sample_of(samples, record):
    return samples[(record.task_id, record.epoch, record.sample_index)]


def test_a_hook_returning_the_sampled_tokens_trains_the_samplers_rows_log_probs_and_versions(
    tmp_path, monkeypatch, ray_session
):
    samples: dict = {}
    seen = []

    def same_tokens(record):
        seen.append(record.id)
        sample = sample_of(samples, record)
        return {"prompt_ids": list(sample.prompt_ids), "response_ids": list(sample.response_ids)}

    steps_rows = sampling_run(tmp_path, monkeypatch, same_tokens, samples)
    records = train_records(tmp_path)
    assert len(steps_rows) == 3
    for rows in steps_rows:
        assert rows.logprobs is not None and len(rows.record_ids) == 4
        for i, record_id in enumerate(rows.record_ids):
            assert record_id in seen  # each trained row passed through the hook
            sample = sample_of(samples, records[record_id])
            assert (rows.prompts[i], rows.responses[i]) == (sample.prompt_ids, sample.response_ids)
            assert rows.logprobs[i] == pytest.approx(sample.response_logprobs, abs=1e-6)  # the sampler's (float32)
            assert rows.policy_versions[i].item() == sample.policy_version


# --- eval_strategy (issue 27): evaluation sampling through the ledger's split eval, never trained ------------------
def test_eval_strategy_steps_samples_held_out_tasks_every_eval_steps_and_trains_none_of_them(tmp_path, ray_session):
    from recipe.agentrl_demo import main

    out = tmp_path / "run"
    argv = [f"output_dir={out}", "steps=4", *SMALL[:4], "prompts_per_step=2", "num_generations=2"]

    assert main([*argv, "--eval_strategy", "Steps", "--eval_steps", "2", "num_eval_tasks=3"]) == 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [(r["step"], r["eval_records"]) for r in evals] == [(2, 6), (4, 6)]  # 3 tasks x 2 answers, every 2 steps
    for r in evals:
        assert 0 <= r["eval_accuracy"] <= 1 and r["eval_reward"] == r["eval_accuracy"]  # addition's reward is 0 or 1
    grpo = [(r["step"], r["rows_trained"]) for r in rows if r["kind"] == "grpo"]
    assert grpo == [(0, 4), (1, 4), (2, 4), (3, 4)]  # a step's 2 groups of 2, as without evaluation
    ledger = Ledger(f"sqlite:///{out}/ledger.db")
    try:
        evaluated = ledger.records("eval")
        trained = [r for r in ledger.records() if r.trained_count]
        train_questions = {r.messages[0]["content"] for r in ledger.records("train")}
        eval_tasks = ledger.tasks("eval")
    finally:
        ledger.close()
    assert sorted({r.epoch for r in evaluated}) == [2, 4] and len(evaluated) == 12
    assert all(r.trained_count == 0 and r.partition_id is None for r in evaluated)  # never queued, never trained
    assert len(trained) == 16 and {r.split for r in trained} == {"train"}
    assert {t.status for t in eval_tasks} == {"done"} and len({t.id for t in eval_tasks}) == 3  # the same 3 each time
    assert not {r.messages[0]["content"] for r in evaluated} & train_questions  # held out


def skip_low_questions(record):
    """A ``convert_record_to_data_func`` for the sampling run: the records of problems whose first digit is below 5
    skipped, the others' as fixed tokens (<bos>012345 -> 67<eos>)."""
    question = record.messages[0]["content"]
    if question[0] < "5":
        return None
    return {"prompt_ids": [1, *range(3, 9)], "response_ids": [9, 10, 2]}


def test_a_hook_skipping_records_keeps_their_groups_out_of_the_queue_and_the_run_counts_them(
    tmp_path, monkeypatch, ray_session, capsys
):
    import recipe.agentrl_demo as demo

    hook = f"{__name__}:skip_low_questions"
    argv = [f"output_dir={tmp_path / 'run'}", "steps=3", *SAMPLED, "--convert_record_to_data_func", hook]

    assert demo.main(argv) == 0

    printed = capsys.readouterr().out
    assert f"--convert_record_to_data_func {hook} -> convert_record_to_data_func={hook} (each ledger Record" in printed
    ledger = Ledger(f"sqlite:///{tmp_path}/run/ledger.db")
    try:
        records = ledger.records("train")
    finally:
        ledger.close()
    skipped = [r for r in records if r.messages[0]["content"][0] < "5"]
    assert skipped and all(r.partition_id is None and not r.trained_count for r in skipped)  # recorded, never queued
    trained = [r for r in records if r.trained_count]
    assert len(trained) == 12 and all(r.messages[0]["content"][0] >= "5" for r in trained)  # 3 steps x 2 groups of 2
    stats = re.search(r"scheduler: \{.*\}", printed)
    assert stats is not None
    counts = dict(re.findall(r"'(records_skipped|groups_skipped)': (\d+)", stats.group()))
    assert counts == {"records_skipped": str(len(skipped)), "groups_skipped": str(len(skipped) // 2)}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["kind"] == "grpo"]
    assert [r["rows_trained"] for r in grpo] == [4, 4, 4]
    assert all(r["records_skipped"] == 2 * r["groups_skipped"] for r in grpo) and grpo[-1]["groups_skipped"] >= 1


def test_a_hook_changing_the_tokens_trains_its_tokens_with_the_policys_own_log_probs_as_the_old_ones(
    tmp_path, monkeypatch, ray_session
):
    samples: dict = {}
    fixed = {"prompt_ids": [1, 3, 4, 11, 5, 6, 12], "response_ids": [7, 8, 9, 2]}  # <bos>01+23= -> 456<eos>

    def change_first(record):
        """Sample 0 of each group changed to fixed tokens, sample 1 as sampled."""
        if record.sample_index == 0:
            return fixed
        sample = sample_of(samples, record)
        return {"prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids}

    steps_rows = sampling_run(tmp_path, monkeypatch, change_first, samples)

    records = train_records(tmp_path)
    assert len(steps_rows) == 3
    for rows in steps_rows:
        assert rows.logprobs is not None and len(rows.record_ids) == 4
        for i, record_id in enumerate(rows.record_ids):
            record = records[record_id]
            sample = sample_of(samples, record)
            assert rows.policy_versions[i].item() == sample.policy_version  # the record's, changed tokens or not
            if record.sample_index == 0 and (sample.prompt_ids, sample.response_ids) != tuple(fixed.values()):
                assert (rows.prompts[i], rows.responses[i], rows.logprobs[i]) == (*fixed.values(), [])
            else:
                assert (rows.prompts[i], rows.responses[i]) == (sample.prompt_ids, sample.response_ids)
                assert rows.logprobs[i] == pytest.approx(sample.response_logprobs, abs=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "grpo"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def prompt_ids_only(record):
    """A ``convert_record_to_data_func`` of the wrong shape: no ``response_ids``."""
    return {"prompt_ids": [1, 3, 4]}


WRONG_SHAPE = (
    re.escape("convert_record_to_data_func prompt_ids_only of record ")
    + r"\d+ \(task \d+\): "
    + re.escape(
        "expected a dict {'prompt_ids': [int, ...], 'response_ids': [int, ...]} (the answer non-empty), or None / [] "
        "to skip the record, got a dict without ['response_ids']: keys ['prompt_ids']"
    )
)


def short_queue_timeout(monkeypatch):
    """The trainer's queue timeout cut to 30 s: a backstop, so that a run which does not stop at the hook's error ends
    with GetMetaTimeout (the test fails) rather than waiting 120 s."""
    import functools

    import recipe.agentrl_demo as demo

    monkeypatch.setattr(demo, "LedgerTrainingConfig", functools.partial(demo.LedgerTrainingConfig, queue_timeout=30))


def test_a_hook_returning_the_wrong_shape_with_sampling_stops_the_run_at_once_with_exit_code_2(
    tmp_path, monkeypatch, ray_session, capsys
):
    import recipe.agentrl_demo as demo

    short_queue_timeout(monkeypatch)
    hook = f"{__name__}:prompt_ids_only"
    argv = [f"output_dir={tmp_path / 'run'}", "steps=3", *SAMPLED, "--convert_record_to_data_func", hook]

    assert demo.main(argv) == 2

    err = capsys.readouterr().err
    assert re.search("agentrl_demo.py: error: " + WRONG_SHAPE, err), err[-2000:]
    import torch

    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was taken (no sft warm-up either)
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["step"] == 0
    ledger = Ledger(f"sqlite:///{tmp_path}/run/ledger.db")
    try:
        failed = [c for c in ledger.claims("train") if c.last_error and "InvalidRecordData" in c.last_error]
        running = [t for t in ledger.tasks("train") if t.status == "running"]
    finally:
        ledger.close()
    assert failed  # the claim whose group met the hook records the error
    assert not running  # the other samplers were cancelled and returned their claims


def test_train_with_sampling_raises_the_hooks_invalid_record_data(tmp_path, monkeypatch, ray_session):
    from workers.ledger import InvalidRecordData

    short_queue_timeout(monkeypatch)
    with pytest.raises(InvalidRecordData, match=WRONG_SHAPE):
        sampling_run(tmp_path, monkeypatch, prompt_ids_only)
