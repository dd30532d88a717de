"""Samplers decide what a ``get_meta`` returns: see :mod:`transfer_queue.samplers.base`."""

from transfer_queue.samplers.base import BaseSampler, SamplerSpec, make_sampler
from transfer_queue.samplers.dp import DPSampler
from transfer_queue.samplers.groups import GroupSampler, sample_whole_groups
from transfer_queue.samplers.grpo import GRPOSampler
from transfer_queue.samplers.seqlen_balanced import SeqlenBalancedSampler, balanced_shares
from transfer_queue.samplers.sequential import SequentialSampler

__all__ = [
    "BaseSampler",
    "DPSampler",
    "GRPOSampler",
    "GroupSampler",
    "SamplerSpec",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "balanced_shares",
    "make_sampler",
    "sample_whole_groups",
]
