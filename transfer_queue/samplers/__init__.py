"""Samplers decide what a ``get_meta`` returns: see :mod:`transfer_queue.samplers.base`."""

from transfer_queue.errors import InvalidSampler
from transfer_queue.samplers.base import BaseSampler, SamplerSpec
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


def make_sampler(spec: SamplerSpec | None) -> BaseSampler:
    """A sampler from an instance, a class, or a callable returning one (``None``: SequentialSampler)."""
    if spec is None:
        return SequentialSampler()
    if isinstance(spec, BaseSampler):
        return spec
    if callable(spec):
        sampler = spec()
        if isinstance(sampler, BaseSampler):
            return sampler
        raise InvalidSampler(f"a sampler constructor must return a BaseSampler, got {type(sampler).__name__}")
    raise InvalidSampler(f"sampler must be a BaseSampler, a BaseSampler class or a callable, got {type(spec).__name__}")
