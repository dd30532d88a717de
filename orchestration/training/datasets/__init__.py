"""Prompts and SFT data: ``DataBuffer`` (prompt cycling with seeded per-epoch shuffles, checkpointable) and
``load_sft_dataset`` (local JSONL files or ``save_to_disk`` directories into ``Sample``s)."""

from orchestration.training.datasets.data_buffer import DataBuffer
from orchestration.training.datasets.sft import load_sft_dataset, sample_from_row

__all__ = ["DataBuffer", "load_sft_dataset", "sample_from_row"]
