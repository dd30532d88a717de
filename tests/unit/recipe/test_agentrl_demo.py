"""recipe/agentrl_demo.py's metrics (metrics.jsonl rows as GRPORun writes them, a metrics.png like every recipe) and
its command line, every recipe's: dotted overrides of its YAML, checked before anything starts; ``--new``."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import recipe.agentrl_demo as demo
from orchestration.config import config_from_cli, config_keys
from orchestration.ledger_run import grpo_optimizer
from orchestration.run_plan import save_config
from recipe.agentrl_demo import AgentRLDemoConfig


@pytest.fixture
def started(monkeypatch) -> list[AgentRLDemoConfig]:
    """The configs the demo's run was started with: ``train`` replaced, so nothing (Ray, the warm-up) runs."""
    calls: list[AgentRLDemoConfig] = []

    def train(config: AgentRLDemoConfig) -> int:
        calls.append(config)
        return 0

    monkeypatch.setattr(demo, "train", train)
    return calls


def test_a_dotted_override_is_applied_on_top_of_the_recipes_yaml(tmp_path, started):
    assert demo.main([f"output_dir={tmp_path / 'run'}", "steps=7", "prompts_from=prompt-source", "lease_s=3"]) == 0

    [config] = started
    assert (config.steps, config.prompts_from, config.lease_s) == (7, "prompt-source", 3.0)
    assert config.num_generations == 8 and config.resume  # the YAML's, and no --new
    assert config == config_from_cli("", demo.DEFAULT_CONFIG, [f"output_dir={tmp_path / 'run'}", "steps=7",
                                                                 "prompts_from=prompt-source", "lease_s=3"],
                                     cls=AgentRLDemoConfig)  # fmt: skip


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stepz=3", "unknown config key 'stepz' in the override stepz=3; did you mean steps?"),
        ("lr_warmup=5", "unknown config key 'lr_warmup' in the override lr_warmup=5; did you mean lr_warmup_steps?"),
        ("steps=-1", "steps must be an int >= 1, got -1 (from the override steps=-1)"),
        ("steps=many", "Expected `int`, got `str` - at `$.steps`"),
        ("lease_s=0.2", "lease_s must be a float > 0.25, got 0.2"),
        ("sft_target=1.5", "sft_target must be a float in [0, 1], got 1.5"),
        ("checkpoint_every=0", "checkpoint_every must be an int >= 1, got 0"),
        ("prompts_from=ledger", "prompts_from must be one of ['prompt-source', 'scheduler'], got 'ledger'"),
        ("db=mysql://x", "db: expected 'sqlite:///PATH' or 'postgresql://"),
        (
            "loss_calculater=GRPOO",
            "loss_calculater: unknown policy loss name='GRPOO', expected one of ['cispo', 'grpo', 'gspo', 'minirl', "
            "'ppo'] (in any case); did you mean grpo, gspo?",
        ),
        ("beta1=1", "beta1 must be a float in [0, 1), got 1"),
        ("beta2=-0.1", "beta2 must be a float in [0, 1), got -0.1"),
        ("inf_mem_ratio=-1", "--inf_mem_ratio: expected a float in (0, 1] (a fraction of device memory), got -1.0"),
        ("inf_mem_ratio=0.6x", "--inf_mem_ratio: expected a float, got '0.6x'"),
        ("eval_strategy=epochs", "eval_strategy must be one of ['epoch', 'no', 'steps'] (any case), got 'epochs'"),
        ("eval_strategy=3", "Expected `bool | str`, got `int` - at `$.eval_strategy`"),
        (
            "eval_stategy=steps",
            "unknown config key 'eval_stategy' in the override eval_stategy='steps'; did you mean "
            "eval_strategy, eval_steps?",
        ),
        ("eval_strategy=steps", "eval_steps: eval_strategy=steps needs eval_steps (an int >= 1), got none"),
        ("eval_steps=5", "eval_steps: only eval_strategy=steps reads it, got eval_steps=5 with eval_strategy=no"),
        ("--eval_strategy=epoch --eval_steps=5", "got eval_steps=5 with eval_strategy=epoch"),
        ("--eval_strategy=steps --eval_steps=0", "eval_steps must be an int >= 1 or None, got 0"),
        ("num_eval_tasks=0", "num_eval_tasks must be an int >= 1, got 0"),
        (
            "eval_strategy=epoch enable_sampling=false",
            "eval_strategy: epoch samples the eval tasks, but enable_sampling=false starts no engine to sample them: "
            "expected eval_strategy=no with enable_sampling=false",
        ),
    ],
)
def test_a_bad_key_or_value_is_refused_with_exit_code_2_before_anything_starts(
    tmp_path, started, capsys, override, message
):
    out = tmp_path / "run"

    assert demo.main([f"output_dir={out}", *override.split()]) == 2

    err = capsys.readouterr().err
    assert err.startswith("agentrl_demo.py: error: ") and message in err, err
    assert started == [] and not out.exists()


def test_help_lists_every_key_with_its_meaning_after_the_whole_description():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        demo.main(["--help"])

    assert exited.value.code == 0
    text = " ".join(out.getvalue().split())
    assert " ".join((demo.__doc__ or "").split()) in text  # every paragraph, to its last sentence
    keys = config_keys(AgentRLDemoConfig)
    assert set(keys) == {"steps", "prompts_from", "prompts_per_step", "num_generations", "num_tasks", "lr",
                         "lr_warmup_steps", "sft_target", "max_trained_count", "retrained_interval", "max_steps_ahead",
                         "checkpoint_every", "lease_s", "seed", "output_dir", "db", "resume", "loss_calculater",
                         "beta1", "beta2", "model_name_or_path", "max_new_tokens", "enable_sampling",
                         "eval_strategy", "eval_steps", "num_eval_tasks", "convert_record_to_data_func",
                         "inference_engine", "inference_dp_size", "inference_tp_size", "inference_ep_size",
                         "inference_mem_ratio", "inference_colocate"}  # fmt: skip
    for key, (_, meaning) in keys.items():
        assert meaning and f"{key} = " in text and " ".join(meaning.split()) in text, key
    assert text.endswith(" ".join(list(keys.values())[-1][1].split()))  # the last key's meaning, whole


@pytest.mark.parametrize(("given", "loss"), [("GRPO", "grpo"), ("grpo", "grpo"), ("Gspo", "gspo"), ("CISPO", "cispo")])
def test_the_loss_calculater_is_a_policy_loss_in_any_case(tmp_path, started, given, loss):
    assert demo.main([f"output_dir={tmp_path / 'run'}", f"loss_calculater={given}"]) == 0

    assert [config.loss_calculater for config in started] == [loss]


def test_the_guides_own_flags_are_overrides_too(tmp_path, started):
    """The RL guide's example says ``--loss_calculater GRPO``: ``--KEY VALUE`` and ``--KEY=VALUE`` are ``KEY=VALUE``."""
    argv = [f"--output_dir={tmp_path / 'run'}", "--loss_calculater", "GRPO", "--beta2", "0.95", "steps=3", "--new"]

    assert demo.main(argv) == 0

    [config] = started
    assert (config.loss_calculater, config.beta2, config.steps, config.resume) == ("grpo", 0.95, 3, False)


def test_a_guide_flag_the_demo_does_not_have_is_refused_naming_the_closest_keys(tmp_path, started, capsys):
    assert demo.main([f"output_dir={tmp_path / 'run'}", "--num_generation", "4"]) == 2
    assert "unknown config key 'num_generation' in the override num_generation=4; did you mean num_generations?" in (
        capsys.readouterr().err
    )

    assert demo.main([f"output_dir={tmp_path / 'run'}", "--loss_calculater"]) == 2
    assert "--loss_calculater needs a value: expected --loss_calculater VALUE or loss_calculater=VALUE, got none" in (
        capsys.readouterr().err
    )
    assert started == []


def test_beta1_and_beta2_are_the_grpo_optimizers_adam_betas():
    config = AgentRLDemoConfig(lr=1e-3, beta1=0.8, beta2=0.95)

    optimizer = grpo_optimizer(torch.nn.Linear(2, 2), config)

    assert isinstance(optimizer, torch.optim.AdamW)
    assert [(g["lr"], g["betas"]) for g in optimizer.param_groups] == [(1e-3, (0.8, 0.95))]


def test_every_numeric_key_has_a_range():
    numeric = {key for key, (default, _) in config_keys(AgentRLDemoConfig).items() if type(default) in (int, float)}
    # and the constrained ones: prompts_from, eval_strategy, eval_steps and inference_mem_ratio (None by default),
    # inference_engine
    constrained = {"prompts_from", "eval_strategy", "eval_steps", "inference_engine", "inference_mem_ratio"}
    assert set(AgentRLDemoConfig.KEY_RANGES) == numeric | constrained


def old_run(out) -> None:
    out.mkdir()
    torch.save({"policy": {}, "optimizer": {}, "step": 10}, out / "checkpoint.pt")
    (out / "metrics.jsonl").write_text("{}\n")


def test_new_with_an_invalid_config_leaves_the_old_run_in_place(tmp_path, started):
    out = tmp_path / "run"
    old_run(out)

    assert demo.main(["--new", f"output_dir={out}", "steps=-1"]) == 2

    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "metrics.jsonl"] and started == []


def test_new_moves_the_old_run_aside_and_starts_over(tmp_path, started, capsys):
    out = tmp_path / "run"
    old_run(out)

    assert demo.main(["--new", f"output_dir={out}", "steps=5"]) == 0

    assert not out.exists() and (tmp_path / "run.prev-1" / "checkpoint.pt").exists()
    assert (
        f"--new: moved the previous run to {tmp_path / 'run.prev-1'}; starting over in {out}" in capsys.readouterr().out
    )
    assert [config.resume for config in started] == [False]


def test_a_resume_goes_on_past_the_checkpoint_and_one_that_would_train_nothing_is_refused(tmp_path, started, capsys):
    out = tmp_path / "run"
    old_run(out)

    assert demo.main([f"output_dir={out}", "steps=10"]) == 2
    assert "holds a run that already finished 10 steps; steps=10 would train nothing" in capsys.readouterr().err
    assert started == []

    assert demo.main([f"output_dir={out}", "steps=11"]) == 0
    assert [config.steps for config in started] == [11] and (out / "checkpoint.pt").exists()


def test_a_resume_with_other_training_settings_is_refused_and_one_with_changeable_ones_goes_on(
    tmp_path, started, capsys
):
    """The run's config.yaml (written as it starts) is what a resume is checked against, as recipe/demo.py does."""
    out = tmp_path / "run"
    old_run(out)
    save_config(out, AgentRLDemoConfig(output_dir=str(out), steps=10, lr=5e-4))

    assert demo.main([f"output_dir={out}", "steps=20", "lr=0.001", "num_generations=4"]) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a run started with other settings (lr: 0.0005 -> 0.001, num_generations: 8 -> 4)" in err
    assert "start over with --new, or pick a new output_dir" in err and started == []

    assert demo.main([f"output_dir={out}", "steps=20", "lease_s=2", "sft_target=0.5", "checkpoint_every=5"]) == 0
    assert [config.steps for config in started] == [20]


# --- AgentRL's RL-guide command line (issue 27) -----------------------------------------------------------------------
def model_dir(tmp_path) -> str:
    """A stand-in for a local Hugging Face directory: the config check looks for config.json (``train`` is replaced
    in these tests, so nothing is loaded)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


def the_guides_example(tmp_path, model: str) -> list[str]:
    """The RL guide's example command's flags, as written there (``torchrun ... src/main.py`` aside)."""
    return [
        "--model_name_or_path", model, "--output_dir", str(tmp_path / "run"),
        "--db_connection_string", f"sqlite:///{tmp_path}/ledger.db", "--enable_sampling", "true",
        "--loss_calculater", "GRPO", "--inf_tp_size", "1", "--inf_ep_size", "1", "--inf_mem_ratio", "0.6",
        "--num_generations", "8", "--max_new_tokens", "8", "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "8", "--learning_rate", "1e-6", "--save_steps", "500",
    ]  # fmt: skip


def test_the_guides_example_command_maps_onto_the_config_and_prints_the_mapping_once(tmp_path, started, capsys):
    model = model_dir(tmp_path)

    assert demo.main(the_guides_example(tmp_path, model)) == 0

    [config] = started
    assert (config.model_name_or_path, config.output_dir, config.db) == (
        model,
        str(tmp_path / "run"),
        f"sqlite:///{tmp_path}/ledger.db",
    )
    assert (config.enable_sampling, config.loss_calculater, config.num_generations, config.max_new_tokens) == (
        True,
        "grpo",
        8,
        8,
    )
    # 1 row per device x 8 accumulation steps x 1 trainer process = 8 rows per step = 1 group of 8
    assert (config.prompts_per_step, config.lr, config.checkpoint_every) == (1, 1e-6, 500)
    assert config.sft_target == 0  # a pretrained model: no warm-up
    out = capsys.readouterr().out
    assert out.count("AgentRL's flags -> this demo's config:") == 1
    lines = [line.strip() for line in out.splitlines() if " -> " in line and line.startswith("  --")]
    assert lines == [
        f"--model_name_or_path {model} -> model_name_or_path={model} (the policy of engine and trainer in place of "
        "the built-in tiny addition Llama; a pretrained model: no SFT warm-up (sft_target=0; set sft_target to warm "
        "up))",
        f"--output_dir {tmp_path / 'run'} -> output_dir={tmp_path / 'run'}",
        f"--db_connection_string sqlite:///{tmp_path}/ledger.db -> db=sqlite:///{tmp_path}/ledger.db (the ledger: "
        "tasks, claims, records)",
        "--enable_sampling true -> enable_sampling=True (the engine's endpoint, the SamplingScheduler and "
        "AdditionSampler write records the trainer learns from)",
        "--loss_calculater GRPO -> loss_calculater=grpo (LedgerTrainingConfig.loss)",
        "--inf_tp_size 1 -> accepted: the hf engine serves the policy on one device (tensor parallel size 1; larger "
        "sizes need engine vllm or sglang through an InferenceManager)",
        "--inf_ep_size 1 -> accepted: the hf engine serves the policy on one device (expert parallel size 1; larger "
        "sizes need engine vllm or sglang through an InferenceManager)",
        "--inf_mem_ratio 0.6 -> accepted, not used: the hf engine does not pre-allocate a KV-cache pool, so there is "
        "no memory to size (an InferenceManager passes it to vLLM as --gpu-memory-utilization, to SGLang as "
        "--mem-fraction-static)",
        "--num_generations 8 -> num_generations=8 (answers sampled per prompt: the GRPO group)",
        "--max_new_tokens 8 -> max_new_tokens=8 (SamplingConfig.max_new_tokens: the longest answer)",
        "--per_device_train_batch_size 1 -> prompts_per_step=1 (1 x 8 x 1 trainer process = 8 rows per optimizer "
        "step = 1 group of num_generations=8)",
        "--gradient_accumulation_steps 8 -> prompts_per_step=1 (with per_device_train_batch_size; one optimizer step "
        "per 8 rows, taken in one forward and backward)",
        "--learning_rate 1e-6 -> lr=1e-06 (GRPO's AdamW, warmed up over lr_warmup_steps=20)",
        "--save_steps 500 -> checkpoint_every=500 (output_dir/checkpoint.pt; one at the end too)",
    ]


def test_the_command_lines_own_flags_may_come_between_the_guides(tmp_path, started):
    argv = ["--output_dir", str(tmp_path / "run"), "--new", "--num_generations", "4", "--print-config", "steps=3"]

    assert demo.main(argv) == 0

    assert started == []  # --print-config: printed, nothing run
    assert demo.main([*argv[:-2], "steps=3"]) == 0
    assert [(c.num_generations, c.steps, c.resume) for c in started] == [(4, 3, False)]


def test_without_the_guides_flags_nothing_is_mapped_or_printed(tmp_path, started, capsys):
    assert demo.main([f"output_dir={tmp_path / 'run'}", "steps=3"]) == 0

    assert "AgentRL's flags" not in capsys.readouterr().out
    assert [(c.prompts_per_step, c.lr, c.sft_target) for c in started] == [(16, 5e-4, 0.2)]  # the YAML's


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8"], 2),
        (["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "4", "--num_generations", "4"], 3),
        (["--gradient_accumulation_steps", "16"], 2),  # per_device_train_batch_size 1
    ],
)
def test_the_guides_batch_is_rows_per_step_in_whole_groups(tmp_path, started, flags, expected):
    assert demo.main([f"output_dir={tmp_path / 'run'}", *flags]) == 0

    assert [config.prompts_per_step for config in started] == [expected]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--db_connection_string", "mongodb://localhost:27017/agentrl"],
            "--db_connection_string: MongoDB (AgentRL's database) is not a ledger backend: expected 'sqlite:///PATH' "
            "or 'postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE', got 'mongodb://localhost:27017/agentrl'; "
            "docs/sampling.md maps AgentRL's MongoDB collections onto the ledger's tables",
        ),
        (
            ["--db_connection_string", "mongodb+srv://alice:s3cret@cluster0.example.net/agentrl"],
            "got 'mongodb+srv://alice:***@cluster0.example.net/agentrl'; docs/sampling.md maps",
        ),
        (
            ["--inf_tp_size", "2"],
            "--inf_tp_size: expected 1 (the demo's engine, HFEngine, serves the policy in this process on one device: "
            "no tensor parallelism), got 2; tensor-parallel serving is inference_engine=vllm or sglang: the run's "
            "InferenceManager starts inference_dp_size servers (one per DP group) sized by the guide's inf_tp_size / "
            "inf_ep_size / inf_mem_ratio and registers them in the ledger (workers/engines/manager.py; "
            "docs/sampling.md)",
        ),
        (["--inf_ep_size", "4"], "--inf_ep_size: expected 1 (the demo's engine, HFEngine, serves the policy in this"),
        (["--inf_tp_size", "two"], "--inf_tp_size: expected an int, got 'two'"),
        (
            ["--inf_mem_ratio", "0"],
            "--inf_mem_ratio: expected a float in (0, 1] (a fraction of device memory), got 0.0",
        ),
        (
            ["--inf_mem_ratio", "1.5"],
            "--inf_mem_ratio: expected a float in (0, 1] (a fraction of device memory), got 1.5",
        ),
        (["--inf_mem_ratio", "most"], "--inf_mem_ratio: expected a float, got 'most'"),
        (
            ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "6"],
            "--per_device_train_batch_size 1 x --gradient_accumulation_steps 6 x 1 trainer process = 6 rows per "
            "optimizer step, which do not split into whole GRPO groups of num_generations=8: expected a multiple of 8 "
            "(e.g. --gradient_accumulation_steps 8)",
        ),
        (
            ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3"],
            "= 12 rows per optimizer step, which do not split into whole GRPO groups of num_generations=8: expected a "
            "multiple of 8 (e.g. --gradient_accumulation_steps 2)",
        ),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size: expected an int >= 1, got 0"),
        (["--learning_rate", "-1e-6"], "--learning_rate: lr must be a float > 0, got -1e-06"),
        (["--save_steps", "0"], "--save_steps: checkpoint_every must be an int >= 1, got 0"),
        (
            ["--model_name_or_path", "Qwen/Qwen2.5-7B"],
            "model_name_or_path: expected a local Hugging Face model directory (config.json, weights, tokenizer; "
            "nothing is downloaded), got 'Qwen/Qwen2.5-7B', which is not a directory",
        ),
    ],
)
def test_a_guide_flag_this_run_cannot_honour_is_refused_with_exit_code_2(tmp_path, started, capsys, flags, message):
    out = tmp_path / "run"

    assert demo.main([f"output_dir={out}", *flags]) == 2

    err = capsys.readouterr().err
    assert err.startswith("agentrl_demo.py: error: ") and message in err, err
    assert "s3cret" not in err and started == [] and not out.exists()


def test_a_model_directory_needs_its_config_and_is_warmed_up_only_when_asked(tmp_path, started, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert demo.main([f"output_dir={tmp_path / 'run'}", "--model_name_or_path", str(empty)]) == 2
    assert f"got {str(empty)!r} without config.json" in capsys.readouterr().err
    assert started == []

    model = model_dir(tmp_path)
    assert demo.main([f"output_dir={tmp_path / 'run'}", "--model_name_or_path", model, "sft_target=0.3"]) == 0
    assert [config.sft_target for config in started] == [0.3]
    assert (
        f"-> model_name_or_path={model} (the policy of engine and trainer in place of the built-in tiny addition "
        "Llama; SFT warm-up to sampled accuracy sft_target=0.3, asked for)"
    ) in capsys.readouterr().out


def test_enable_sampling_false_is_said_in_the_mapping(tmp_path, started, capsys):
    assert demo.main([f"output_dir={tmp_path / 'run'}", "--enable_sampling", "false"]) == 0

    assert [config.enable_sampling for config in started] == [False]
    assert (
        "--enable_sampling false -> enable_sampling=False (no engine, scheduler or samplers (no SFT warm-up): train "
        "from the untrained records in the ledger, stop when too few are left for a step)"
    ) in capsys.readouterr().out


def test_the_mongodb_refusal_is_a_typed_ledger_error():
    from workers.ledger import MalformedConnectionString, UnsupportedBackend, parse_connection_string

    with pytest.raises(UnsupportedBackend, match=r"expected 'sqlite:///PATH' or 'postgresql://") as exc:
        parse_connection_string("MONGODB://db:27017")
    assert isinstance(exc.value, MalformedConnectionString)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], ("no", None)),
        (["eval_strategy=no"], ("no", None)),  # YAML reads an unquoted no as false
        (["--eval_strategy", "STEPS", "--eval_steps", "50"], ("steps", 50)),
        (["eval_strategy=Epoch"], ("epoch", None)),
    ],
)
def test_eval_strategy_is_hf_trainers_in_any_case(tmp_path, started, flags, expected):
    assert demo.main([f"output_dir={tmp_path / 'run'}", *flags]) == 0

    assert [(c.eval_strategy, c.eval_steps) for c in started] == [expected]


def test_the_guides_eval_flags_are_said_in_the_mapping(tmp_path, started, capsys):
    argv = [f"output_dir={tmp_path / 'run'}", "--eval_strategy", "steps", "--eval_steps", "50"]

    assert demo.main(argv) == 0

    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    assert lines == [
        "--eval_strategy steps -> eval_strategy=steps (every eval_steps=50 GRPO steps; held-out tasks sampled through "
        "the ledger's split eval, never trained; eval rows in metrics.jsonl)",
        "--eval_steps 50 -> eval_steps=50 (GRPO steps between evaluations)",
    ]


@pytest.mark.parametrize(
    ("strategy", "eval_steps", "expected"),
    [
        ("no", None, []),
        ("steps", 2, [1, 3, 5, 7, 9]),  # after steps 2, 4, ... (0-based step + 1)
        ("steps", 3, [2, 5, 8]),
        ("epoch", None, [3, 6, 9]),  # 10 tasks, 3 prompts a step: 12, 21 and 30 prompts trained pass 10, 20, 30
    ],
)
def test_eval_due_after_every_eval_steps_or_each_epoch_of_the_training_tasks(strategy, eval_steps, expected):
    from orchestration.ledger_run import eval_due

    config = AgentRLDemoConfig(eval_strategy=strategy, eval_steps=eval_steps, num_tasks=10, prompts_per_step=3)

    assert [step for step in range(10) if eval_due(config, step)] == expected


def test_the_held_out_tasks_are_fixed_and_none_is_a_training_task():
    config = AgentRLDemoConfig(num_tasks=200, num_eval_tasks=40)

    held_out = [item["prompt"] for item in demo.held_out_dataset(config).items]

    assert len(held_out) == 40 and held_out == [item["prompt"] for item in demo.held_out_dataset(config).items]
    assert not set(held_out) & {item["prompt"] for item in demo.AdditionDataset(200, seed=0).items}


# --- inference_engine (issue 27 §1): vllm / sglang servers of an InferenceManager for the ledger flow ---------------
def test_the_guides_inference_flags_size_the_servers_of_inference_engine_vllm(tmp_path, started, capsys):
    model = model_dir(tmp_path)
    argv = [f"output_dir={tmp_path / 'run'}", f"model_name_or_path={model}", "inference_engine=vllm",
            "inference_dp_size=2", "--inf_tp_size", "2", "--inf_ep_size", "2", "--inf_mem_ratio", "0.4"]  # fmt: skip

    assert demo.main(argv) == 0

    [config] = started
    assert (config.inference_engine, config.inference_dp_size) == ("vllm", 2)
    assert (config.inference_tp_size, config.inference_ep_size, config.inference_mem_ratio) == (2, 2, 0.4)
    cfg = demo.sampling_config(config, tmp_path)
    assert (cfg.inf_tp_size, cfg.inf_ep_size, cfg.inf_mem_ratio) == (2, 2, 0.4)  # InferenceManager.from_config's
    printed = capsys.readouterr().out
    servers = "each of the inference_dp_size=2 vllm servers the run's InferenceManager starts"
    assert f"--inf_tp_size 2 -> inference_tp_size=2 (tensor parallel size of {servers})" in printed
    assert f"--inf_ep_size 2 -> inference_ep_size=2 (expert parallel size of {servers})" in printed
    assert f"--inf_mem_ratio 0.4 -> inference_mem_ratio=0.4 ({servers}: --gpu-memory-utilization 0.4)" in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["inference_engine=vlm"],
            "inference_engine must be one of ['hf', 'sglang', 'vllm'], got 'vlm' (from the override "
            "inference_engine='vlm')",
        ),
        (
            ["inference_engin=vllm"],
            "unknown config key 'inference_engin' in the override inference_engin='vllm'; did you mean "
            "inference_engine, inference_ep_size, inference_mem_ratio?",
        ),
        (["inference_dp_size=0"], "inference_dp_size must be an int >= 1, got 0"),
        (["inference_mem_ratio=1.5"], "inference_mem_ratio must be"),
        (
            ["inference_dp_size=2"],
            "inference_dp_size: sets the servers of inference_engine=vllm or sglang, but inference_engine=hf serves "
            "the policy in this process: expected inference_dp_size=1 with it, got 2",
        ),
        (
            ["inference_colocate=true"],
            "inference_colocate: sets the servers of inference_engine=vllm or sglang, but inference_engine=hf serves "
            "the policy in this process: expected inference_colocate=False with it, got True",
        ),
        (
            ["inference_engine=vllm"],
            "inference_engine: vllm servers apply the tokenizer's chat template to the samplers' messages, and the "
            "built-in addition tokenizer has none: expected model_name_or_path (a local model directory) with "
            "inference_engine=vllm",
        ),
        (
            ["inference_engine=sglang", "MODEL", "prompts_from=prompt-source"],
            "inference_engine: sglang servers answer the ledger's samplers, but prompts_from=prompt-source samples "
            "the in-process engine: expected prompts_from=scheduler with inference_engine=sglang",
        ),
        (
            ["inference_engine=vllm", "MODEL", "enable_sampling=false"],
            "inference_engine: vllm serves the samplers, but enable_sampling=false samples nothing: expected "
            "inference_engine=hf (the default) with enable_sampling=false",
        ),
        (
            ["inference_engine=vllm", "MODEL", "inference_tp_size=4", "inference_ep_size=2"],
            "inference_engine=vllm: inf_ep_size=2 with inf_tp_size=4: vLLM's --enable-expert-parallel spreads the "
            "experts over the whole tensor-parallel group of a server",
        ),
        (
            ["inference_engine=sglang", "MODEL", "--inf_tp_size", "4", "--inf_ep_size", "3"],
            "inference_engine=sglang: inf_ep_size=3 with inf_tp_size=4: SGLang's --ep-size splits the --tp-size ranks "
            "of a server into expert groups, so it supports an inf_ep_size that divides inf_tp_size=4",
        ),
    ],
)
def test_an_inference_setting_the_run_cannot_honour_is_refused_with_exit_code_2(
    tmp_path, started, capsys, args, message
):
    out = tmp_path / "run"
    args = [f"model_name_or_path={model_dir(tmp_path)}" if arg == "MODEL" else arg for arg in args]

    assert demo.main([f"output_dir={out}", *args]) == 2

    err = capsys.readouterr().err
    assert err.startswith("agentrl_demo.py: error: ") and message in err, err
    assert started == [] and not out.exists()
