"""The controller: the Ray actor (``actor``), its serving loop (``server``), the translation between the wire and the
bookkeeping (``requests``) and the watch over its storage units through Ray (``unit_watch``).

Import :class:`TransferQueueController` from ``transfer_queue``; this package's ``__init__`` imports nothing so that a
module of it can be imported alone.
"""
