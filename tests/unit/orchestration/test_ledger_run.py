"""orchestration/ledger_run.py's pieces of a ledger run: its metrics (metrics.jsonl rows as GRPORun writes them, a
metrics.png like every recipe) and the SFT warm-up's batches over a model directory's tokenizer."""

from __future__ import annotations

from orchestration.ledger_run import RunRecord, SFTTokens
from orchestration.metrics import MetricsLog, plotted_panels
from workers.tasks.addition import PretrainedChat


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
