"""The FSDP2 engine's smoke run as a user starts it (``torchrun trainers/run_fsdp_smoke.py``): gloo on CPU here, and
NCCL with bf16 on every GPU of a machine that has them (``make test-gpu``). It checks on its way that the loss falls,
the gradient norm is finite, ``full_state_dict`` is complete on rank 0 and a checkpoint round-trips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def smoke(nproc: int, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "trainers" / "run_fsdp_smoke.py"), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"smoke run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "ok: loss fell, full_state_dict complete, checkpoint round-trip" in result.stdout
    return result.stdout


@pytest.mark.slow  # two torchrun ranks start torch and build a model: ~30 s here
def test_two_gloo_ranks_on_cpu() -> None:
    assert "backend=gloo device=cpu world_size=2" in smoke(2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_ranks_on_every_gpu() -> None:
    gpus = torch.cuda.device_count()
    out = smoke(gpus)
    assert f"backend=nccl device=cuda:0 world_size={gpus}" in out, out
