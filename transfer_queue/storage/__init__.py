"""Storage units: the actor and its block store (``unit``) and checkpoints on disk (``checkpoint``).

Import :class:`StorageUnit` from ``transfer_queue``; this package's ``__init__`` imports nothing, so the controller can
use ``checkpoint`` without loading the unit (and torch).
"""
