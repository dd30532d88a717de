"""Inference engines: token ids in, sampled token ids and their log-probs out."""

from workers.engines.base import Engine, Generation, SamplingParams
from workers.engines.hf import HFEngine

__all__ = ["Engine", "Generation", "HFEngine", "SamplingParams"]
