"""orchestration/ledger_run.py's pieces of a ledger run: its metrics (metrics.jsonl rows as GRPORun writes them, a
metrics.png like every recipe), the SFT warm-up's batches over a model directory's tokenizer, and the rows a step
trains on out of the ledger's records (convert_record_to_data_func)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestration.ledger_run import RunRecord, SFTTokens, ledger_rows
from orchestration.metrics import MetricsLog, plotted_panels
from workers.ledger import InvalidRecordData, Ledger, Record, Task
from workers.tasks.addition import AdditionChat, AdditionTokenizer, PretrainedChat


def test_the_run_record_plots_the_warm_up_and_the_steps_while_the_run_goes_and_at_its_end(tmp_path):
    record = RunRecord(tmp_path, None, "AgentRL demo", min_interval_s=0.0)
    record.write({"kind": "sft", "step": 25, "sft_loss": 1.5, "accuracy": 0.1})
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:4] == b"\x89PNG"  # drawn during the run, not only at its end
    png.unlink()
    for step in range(4):
        record.write({"kind": "grpo", "step": step, "reward": step / 4, "staleness": step % 2, "step_s": 0.1})
    assert record.finish() == png and png.exists()
    assert [key for key, _ in plotted_panels(record.log.rows("grpo"))] == ["reward", "staleness"]


def test_a_resumed_run_cuts_the_metrics_back_to_its_checkpoint_and_a_fresh_one_starts_over(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"kind": "sft", "step": 25, "accuracy": 0.2})
    for step in range(5):
        log.write({"kind": "grpo", "step": step, "reward": 0.5})
    RunRecord(tmp_path, 3, "resumed")  # the checkpoint of step 3: steps 3 and 4 are trained again
    assert [(r["kind"], r["step"]) for r in log.rows()] == [("sft", 25), ("grpo", 0), ("grpo", 1), ("grpo", 2)]
    RunRecord(tmp_path, None, "fresh")
    assert log.rows() == []


def test_the_warm_ups_batch_over_a_model_directorys_tokenizer_is_its_chat_prompt_then_the_answer_and_eos(tmp_path):
    from transformers import AutoTokenizer

    from workers.models import save_tiny_chat_model
    from workers.tasks.addition import make_prompts, sft_batch

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_chat_model(tmp_path / "model"))
    chat = PretrainedChat(tokenizer)
    tokens = SFTTokens(chat, tokenizer.pad_token_id, tokenizer.eos_token_id)

    [problem] = tokens.render(make_prompts(1, seed=0))
    batch = sft_batch([problem], tokens)

    prompt = "<|im_start|>user\n49+97=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(problem["prompt_ids"]) == prompt
    answer = [int(i) for i in batch["labels"][0] if i != -100]
    assert answer == [*tokenizer.encode("146", add_special_tokens=False), tokenizer.eos_token_id]
    assert tokens.decode(answer) == "146"  # what the reward reads: the eos is a special token, skipped


# --- convert_record_to_data_func (issue 27): the hook that turns each ledger record into the tokens trained on ------
def write_groups(url: str, sizes: list[int]) -> Ledger:
    """One finished task per group, ``sizes[g]`` scored records each (answers "1", "22", ...), as a sampler writes."""
    ledger = Ledger(url)
    assert ledger.write_epoch("train", 0, [Task(id=f"t{g}") for g in range(len(sizes))], owner="test")
    for g, size in enumerate(sizes):
        claimed = ledger.claim("train", owner="test", lease_s=60)
        assert claimed is not None
        claim, _ = claimed
        answer = str(g + 1) * (g + 1)
        records = [
            Record(
                task_key=claim.task_key,
                task_id=claim.task_id,
                split="train",
                epoch=0,
                sample_index=i,
                claim_id=claim.id,
                messages=[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": answer}],
                score=float(i % 2),
                group_id=f"train/0/{claim.task_id}",
            )
            for i in range(size)
        ]
        ledger.write_records(records)
        ledger.complete(claim.id)
    return ledger


def test_ledger_rows_turn_each_record_into_tokens_by_the_hook_and_pass_over_a_group_it_skips(tmp_path):
    ledger = write_groups(f"sqlite:///{tmp_path}/ledger.db", [2, 2, 1, 2])
    config = SimpleNamespace(prompts_per_step=2, num_generations=2, max_trained_count=1, retrained_interval=0)
    records = {r.id: r for r in ledger.records("train")}
    setup = SimpleNamespace(chat=AdditionChat(AdditionTokenizer()))

    default = ledger_rows(ledger, records, setup, config, 0)
    assert default is not None
    chat = setup.chat
    assert default.prompts == [chat.prompt_ids([{"role": "user", "content": "1+1="}])] * 4  # today's re-tokenising
    assert default.responses == [chat.response_ids("1")] * 2 + [chat.response_ids("22")] * 2

    def skip_the_first_task(record: Record):
        if record.task_id == "t0":
            return None
        answer = record.messages[-1]["content"]
        return {"prompt_ids": [record.sample_index], "response_ids": [len(answer)] * len(answer)}

    skipped: set[int] = set()
    rows = ledger_rows(ledger, records, setup, config, 0, skip_the_first_task, skipped)
    assert rows is not None
    assert skipped == {r.id for r in records.values() if r.task_id == "t0"}
    assert {records[i].task_id for i in rows.record_ids} == {"t1", "t3"}  # t2 is a group short of records
    assert rows.group_ids == [0, 0, 1, 1]
    assert rows.prompts == [[0], [1], [0], [1]]
    assert rows.responses == [[2, 2], [2, 2], [4, 4, 4, 4], [4, 4, 4, 4]]
    assert rows.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    seen: list[str] = []  # the next step: a group the hook skipped is not converted again

    def counting(record: Record):
        seen.append(record.task_id)
        return skip_the_first_task(record)

    assert ledger_rows(ledger, records, setup, config, 0, counting, skipped) is not None
    assert "t0" not in seen and seen.count("t1") == 2
    config.prompts_per_step = 3  # only two whole groups are left once t0's is skipped
    assert ledger_rows(ledger, records, setup, config, 0, skip_the_first_task) is None
    with pytest.raises(InvalidRecordData, match=r"of record \d+ \(task t0\): expected a dict .*got a str: '1'"):
        ledger_rows(ledger, records, setup, config, 0, lambda r: r.messages[-1]["content"])
    ledger.close()
