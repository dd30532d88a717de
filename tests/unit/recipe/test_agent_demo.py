"""The agent demo's command line: settings its loop would leave unused are refused before anything starts."""

from __future__ import annotations

import pytest

import recipe.agent_demo as agent_demo


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["eval_every=5"],
            "agent_demo.py: error: eval_every=5: the agent demo evaluates no held-out split (the run's evaluation "
            "scores single-turn answers); every step's episodes report success, num_turns and env_reward in "
            "metrics.jsonl. Set eval_every=0\n",
        ),
        (
            ["rollout.task_server_env=null"],
            "agent_demo.py: error: rollout.task_server_env is not set; the agent demo serves an environment, e.g. "
            "guess-number\n",
        ),
    ],
)
def test_a_setting_the_loop_would_ignore_is_refused_before_anything_starts(
    monkeypatch, capsys, tmp_path, overrides, message
):
    started = []
    monkeypatch.setattr(agent_demo, "TaskServerProcess", lambda *a, **k: started.append("server"))
    monkeypatch.setattr(agent_demo, "connect_ray", lambda *a, **k: started.append("ray"))
    assert agent_demo.main([f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    assert capsys.readouterr().err == message
    assert started == []
