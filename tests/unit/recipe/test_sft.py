"""recipe/sft.py's command line, every recipe's: recipe/configs/demo.yaml with output_dir=outputs/sft under the
command line's overrides, a bad value refused before Ray starts, ``--new`` moving a previous run aside."""

from __future__ import annotations

import json

import pytest

import orchestration
import recipe.sft as sft
from orchestration.config import config_from_cli
from trainers.checkpoint import checkpoint_path


class Started(Exception):
    """Raised where the recipe would connect to Ray: the config was taken."""


@pytest.fixture
def no_ray(monkeypatch) -> None:
    def connect_ray() -> None:
        raise Started

    monkeypatch.setattr(orchestration, "connect_ray", connect_ray)


def test_the_recipes_output_dir_is_under_the_command_lines_overrides(tmp_path):
    assert config_from_cli("", sft.DEFAULT_CONFIG, [], preset=sft.PRESET).output_dir == "outputs/sft"
    config = config_from_cli("", sft.DEFAULT_CONFIG, [f"output_dir={tmp_path}", "sft.lr=0.01"], preset=sft.PRESET)
    assert (config.output_dir, config.sft.lr, config.steps) == (str(tmp_path), 0.01, 1000)  # 1000: demo.yaml's


def test_a_bad_value_is_refused_with_exit_code_2_before_ray_starts(tmp_path, no_ray, capsys):
    assert sft.main([f"output_dir={tmp_path / 'sft'}", "sft.lr=0"]) == 2
    assert "sft.py: error: sft.lr must be a float > 0, got 0 (from the override sft.lr=0)" in capsys.readouterr().err


def previous_run(out) -> None:
    path = checkpoint_path(out / "checkpoints", 0)
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / ".metadata").touch()
    (path / "checkpoint.json").write_text(json.dumps({"extra_state": {"step": 0}}))


def test_new_moves_a_previous_run_aside_only_once_the_config_is_valid(tmp_path, no_ray):
    out = tmp_path / "sft"
    previous_run(out)

    assert sft.main(["--new", f"output_dir={out}", "sft.max_steps=0"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["sft"]

    with pytest.raises(Started):
        sft.main(["--new", f"output_dir={out}"])
    assert not out.exists() and (tmp_path / "sft.prev-1" / "checkpoints").is_dir()
