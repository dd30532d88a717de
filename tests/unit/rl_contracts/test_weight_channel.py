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

from rl_contracts.weight_channel import WeightChannel, WeightChannelTimeout, WeightLayoutMismatch

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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000000000003.v3.weights", "000000000004.v4.weights"]
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
    assert killed.returncode == -signal.SIGKILL and (orphan / "000000000000.v0.weights").is_file(), killed.stderr
    channel = WeightChannel.create(root=str(tmp_path))
    assert not orphan.exists()
    assert [p.name for p in tmp_path.iterdir()] == [channel.path.name]
    channel.close()
    assert list(tmp_path.iterdir()) == []


def model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 32, generator=g)
    return {
        "embed.weight": embed,
        "layer.weight": torch.randn(48, 32, generator=g),
        "norm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "head.weight": embed,  # tied: stored once
    }


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros_like(t) for n, t in state.items() if n != "head.weight"}
    out["head.weight"] = out["embed.weight"]
    return out


def test_read_into_fills_a_models_tensors_from_the_newest_write_and_reuses_the_oldest_file(tmp_path):
    channel = WeightChannel(tmp_path, keep=2)
    stats = [channel.write(v, model_state(v)) for v in range(4)]
    assert [s.reused for s in stats] == [False, False, True, True]
    assert stats[0].data_bytes == 64 * 32 * 4 + 48 * 32 * 4 + 32 * 2  # the tied tensor once
    target = zeros_like(model_state(0))
    got = WeightChannel(tmp_path).read_into(target, min_version=3)
    assert (got.serial, got.version, got.bytes_copied) == (3, 3, stats[0].data_bytes)
    assert all(torch.equal(target[n], t) for n, t in model_state(3).items())
    cast = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in model_state(0).items()}  # another dtype: cast
    WeightChannel(tmp_path).read_into(cast)
    assert all(torch.equal(cast[n], t.double()) for n, t in model_state(3).items())
    with pytest.raises(WeightLayoutMismatch, match=r"missing \['norm.weight'\], unexpected \[\], shapes \[\]"):
        WeightChannel(tmp_path).read_into({n: t for n, t in target.items() if n != "norm.weight"})
    with pytest.raises(WeightLayoutMismatch, match=r"shapes \['layer.weight: written \(48, 32\), given \(4,\)'\]"):
        WeightChannel(tmp_path).read_into({**target, "layer.weight": torch.zeros(4)})


def test_a_delta_write_marks_the_changed_chunks_and_a_reader_one_behind_copies_only_those(tmp_path):
    writer = WeightChannel(tmp_path, keep=2, delta=True, chunk_bytes=1024)
    state = model_state(0)
    first = writer.write(0, state)
    assert first.changed_chunks == first.chunks == 15  # nothing to compare with: all
    near, far = zeros_like(state), zeros_like(state)
    reader = WeightChannel(tmp_path)
    have = reader.read_into(near).serial
    far_have = reader.read_into(far).serial
    for version in range(1, 6):
        state = {n: t.clone() for n, t in state.items() if n != "head.weight"}
        state["head.weight"] = state["embed.weight"]
        state["layer.weight"][version, 0] += 1.0  # one element: one chunk of the 6 KiB layer
        state["norm.weight"][0] += 1.0
        wrote = writer.write(version, state)
        assert wrote.changed_chunks == 2 and wrote.changed_fraction == 2 / 15
        if version >= 2:  # the reused file held the write two back: it lacked both writes' changes
            assert wrote.reused and wrote.bytes_written <= 4 * 1024
        got = reader.read_into(near, have)
        assert got.chunks_copied == 2 and got.bytes_copied <= 2 * 1024
        have = got.serial
        assert all(torch.equal(near[n], t) for n, t in state.items())
    skipped = reader.read_into(far, far_have)  # four versions behind: all of it
    assert skipped.chunks_copied == 15 and all(torch.equal(far[n], t) for n, t in state.items())
    plain = WeightChannel(tmp_path / "plain", chunk_bytes=1024)  # without delta: every chunk counts as changed
    plain.write(0, state)
    assert plain.write(1, state).changed_chunks == 15


def test_a_reader_whose_file_is_reused_while_it_copies_copies_the_newest_again(tmp_path, monkeypatch):
    import rl_contracts.weight_channel as wc

    writer = WeightChannel(tmp_path, keep=2)
    writer.write(0, model_state(0))
    writer.write(1, model_state(1))
    copy, calls = wc._copy, []

    def copy_then_publish(*args):
        copied = copy(*args)
        calls.append(copied)
        if len(calls) == 1:  # two more writes: the second reuses the file this reader is copying from (version 1's)
            writer.write(2, model_state(2))
            writer.write(3, model_state(3))
        return copied

    monkeypatch.setattr(wc, "_copy", copy_then_publish)
    target = zeros_like(model_state(0))
    got = WeightChannel(tmp_path).read_into(target, have_serial=-1)
    assert len(calls) == 2 and (got.serial, got.version) == (3, 3)
    assert all(torch.equal(target[n], t) for n, t in model_state(3).items())


def test_close_unmaps_the_deleted_files(tmp_path):
    """The writer's mappings of its files go with close(): a deleted /dev/shm file stays in RAM while it is mapped."""
    channel = WeightChannel(tmp_path / "ch")
    for version in range(3):
        channel.write(version, state(float(version)))
    assert channel._maps
    channel.close()
    assert not channel._maps


def test_a_channel_that_keeps_one_version_never_rewrites_it_in_place(tmp_path):
    """keep=1: reusing the only file would take the newest version away from readers while it is rewritten."""
    channel = WeightChannel(tmp_path / "ch", keep=1)
    stats = [channel.write(version, state(float(version))) for version in range(3)]
    assert [s.reused for s in stats] == [False, False, False]
    _, version, got = channel.load(min_version=2, timeout=1.0)
    assert version == 2 and got["w"][0, 0] == 2.0
    channel.close()
