"""The README's code runs as written (in its own process, with its own local Ray)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_readme_queue_example_runs(tmp_path):
    (block,) = re.findall(r"## Using the queue\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    script = tmp_path / "readme_example.py"
    script.write_text(block + "\nassert len(ready) == 4 and batch['prompt_ids'].shape == (4, 16)\nprint('ok')\n")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
