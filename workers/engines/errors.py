"""Typed errors of the inference engines and their servers; each message says what was expected and what came."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base of every engine error."""


class EngineRequestError(EngineError):
    """An engine server answered a request with an error status or ``success: false``."""


class EngineUnavailable(EngineError, ConnectionError):
    """An engine server could not be reached (refused, reset, timed out)."""


class EngineUnsupported(EngineError, NotImplementedError):
    """An engine client was asked for a call its server cannot do as it was started (the message names the route,
    the engine and what the call needs)."""


class EngineServerError(EngineError):
    """Base of the errors of ``EngineServer`` (the server process's lifecycle)."""


class PortInUse(EngineServerError, OSError):
    """The port asked for is taken by another process."""


class EngineNeverHealthy(EngineServerError, TimeoutError):
    """The server did not answer its health check before the deadline (the message quotes its log's last lines)."""


class EngineServerExited(EngineServerError):
    """The server process exited while it was expected to run (the message quotes its log's last lines)."""


class RestartBudgetExhausted(EngineServerError):
    """The server crashed more often than its restart budget allows."""


class EngineSyncTimeout(EngineError, TimeoutError):
    """An engine did not finish loading new weights within the weight sync's timeout (``sync_weights_to_engines``).

    Attributes:
        engine: the engine's name (its ``name``, its URL, or ``Type[index]``).
        timeout: the seconds it was given.
    """

    def __init__(self, engine: str, timeout: float):
        super().__init__(
            f"engine {engine} did not finish loading the new weights within {timeout:g} s; expected it to answer "
            "within the sync's timeout (a late reply is dropped)"
        )
        self.engine, self.timeout = engine, timeout

    def __reduce__(self) -> tuple[type, tuple[str, float]]:  # pickles (e.g. through Ray) with its attributes
        return (type(self), (self.engine, self.timeout))


class EngineBusy(EngineError):
    """An engine was still loading the weights of an earlier sync (one that timed out) when a new sync came: the new
    sync does not start a second load beside it (the older one could finish last and leave the old weights served).

    Attributes:
        engine: the engine's name (its ``name``, its URL, or ``Type[index]``).
    """

    def __init__(self, engine: str):
        super().__init__(
            f"engine {engine} is still loading the weights of an earlier sync (it did not finish within that sync's "
            "timeout); expected it idle before a new load, so this sync did not load it"
        )
        self.engine = engine

    def __reduce__(self) -> tuple[type, tuple[str]]:  # pickles (e.g. through Ray) with its attribute
        return (type(self), (self.engine,))


class InvalidInferenceSizing(EngineError, ValueError):
    """An ``InferenceManager`` was asked for services its engine cannot run as sized (``inf_tp_size``,
    ``inf_ep_size``, ``inf_mem_ratio``, the data-parallel size or the devices): the message names the engine, the
    value, and what the engine supports."""


class ImagesNotSupported(EngineError, ValueError):
    """An engine was given images for a model that takes text only (the message names the model's class)."""


class ImageTokenMismatch(EngineError, ValueError):
    """A vision-language prompt whose image placeholder tokens do not match its images (the message gives both
    counts)."""
