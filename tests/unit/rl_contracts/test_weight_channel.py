"""WeightChannel: versions of a state dict passed through shared memory, newest first, atomically."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rl_contracts.weight_channel import WeightChannel, WeightChannelTimeout

ROOT = Path(__file__).resolve().parents[3]


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), value), "b": torch.arange(4) + int(value)}


def test_a_reader_gets_the_newest_write_and_its_version(tmp_path):
    writer, reader = WeightChannel(tmp_path), WeightChannel(tmp_path)
    assert reader.newest() is None and reader.newest_version() is None
    writer.write(0, state(0.0))
    writer.write(0, state(0.5))  # the same version again (a warm-up's evaluations): a newer write
    writer.write(3, state(3.0))
    serial, version, got = reader.load(min_version=3)
    assert (serial, version) == (2, 3)
    assert torch.equal(got["w"], state(3.0)["w"]) and torch.equal(got["b"], state(3.0)["b"])


def test_old_versions_are_pruned_and_versions_never_go_back(tmp_path):
    channel = WeightChannel(tmp_path, keep=2)
    for v in range(5):
        channel.write(v, state(float(v)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000000000003.v3.pt", "000000000004.v4.pt"]
    with pytest.raises(ValueError, match="version 2 is older than the channel's newest, 4"):
        channel.write(2, state(2.0))
    with pytest.raises(ValueError, match="keep=0 must be >= 1"):
        WeightChannel(tmp_path, keep=0)


def test_load_waits_for_the_version_it_needs(tmp_path):
    channel = WeightChannel(tmp_path)
    channel.write(1, state(1.0))
    with pytest.raises(WeightChannelTimeout, match=r"no weights of version >= 2 in .* after 0.1 s \(newest: 1\)"):
        channel.load(min_version=2, timeout=0.1)
    writer = threading.Timer(0.05, lambda: WeightChannel(tmp_path).write(2, state(2.0)))
    started = time.monotonic()
    writer.start()
    _, version, got = channel.load(min_version=2, timeout=5.0)
    assert version == 2 and got["w"][0, 0] == 2.0 and time.monotonic() - started < 2.0


def test_close_removes_the_channel(tmp_path):
    channel = WeightChannel(tmp_path / "ch")
    channel.write(0, state(0.0))
    channel.close()
    channel.close()  # idempotent: a run's shutdown after a failed start-up's
    assert not (tmp_path / "ch").exists()
    created = WeightChannel.create()
    try:
        assert created.path.is_dir() and created.path.name.startswith(f"tq-weights-{os.getpid()}-")
    finally:
        created.close()
    assert not created.path.exists()


def test_a_created_channel_belongs_to_its_process_and_is_swept_once_that_is_killed(tmp_path):
    # a run killed outright (SIGKILL, OOM) runs no cleanup: its channel is swept by the next run's create
    code = (
        "import os, signal, torch\n"
        "from rl_contracts.weight_channel import WeightChannel\n"
        f"channel = WeightChannel.create(root={str(tmp_path)!r})\n"
        "channel.write(0, {'w': torch.zeros(3)})\n"
        "print(channel.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    orphan = Path(killed.stdout.strip())
    assert killed.returncode == -signal.SIGKILL and (orphan / "000000000000.v0.pt").is_file(), killed.stderr
    channel = WeightChannel.create(root=str(tmp_path))
    assert not orphan.exists()
    assert [p.name for p in tmp_path.iterdir()] == [channel.path.name]
    channel.close()
    assert list(tmp_path.iterdir()) == []
