"""The queue's bookkeeping, as plain Python and numpy: no Ray, no sockets, no wire format.

One concept a file: a partition's rows and tasks (``partition``, ``ready_index``), the table of partitions
(``partition_table``), puts from reservation to commit (``put_ledger``, ``placement``), delivery with leases and acks
(``delivery``), DP rounds (``dp_rounds``), what a ``get_meta`` returns (``reader``, ``selection``), parked calls
(``waiting``), the key-value view (``kv_state``), rows lost with storage units (``lost_rows``), the events the state
reports (``events``), the facade over all of them (``queue_state``) and its checkpoint form (``snapshot``). The
controller's request table translates the wire into calls on :class:`~transfer_queue.state.queue_state.QueueState`.
"""
