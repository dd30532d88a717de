"""The wire: every message's format (``protocol``), a field's rows as frames (``columns``), sockets and the calls
over them (``transport``, ``unix_socket``, ``server``), the handshake (``auth``) and where Unix sockets live
(``socket_dirs``). Knows nothing of the queue's bookkeeping.
"""
