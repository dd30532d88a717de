"""The task server: one environment behind the task-server HTTP protocol (AReaL / AgentBench compatible).

    TQ_API_KEY=KEY python -m workers.agents.task_server ENV_NAME --port P [--host 127.0.0.1] [--max-episodes N]
                                                    [--idle-timeout S] [--shutdown-timeout S]

Endpoints, under ``/api``: ``GET /health``, ``GET /task/info``, ``GET /task/samples``, ``POST /episode/start``,
``POST /episode/step``, ``POST /episode/cancel`` (bodies in :mod:`workers.agents.protocol`). Errors answer
``{"detail": "..."}`` with 400 (bad request, episode already done), 404 (unknown sample or episode), 503
(``--max-episodes`` running) or 500 (the environment failed).

With a key (``TQ_API_KEY`` in its environment, ``create_app(api_key=...)``), every route but ``/api/health`` answers
401 without ``Authorization: Bearer KEY`` (``workers/api_key.py``); ``TaskServerProcess`` starts each server with a
fresh one. Without a key the server answers everyone, and says so at its start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from workers.agents.environment import Environment, EpisodeError, InvalidAction, UnknownSample, environment_class
from workers.agents.episodes import (
    BadRequest,
    EnvironmentFailure,
    Episode,
    EpisodeRefused,
    EpisodeTable,
    NotFound,
)
from workers.agents.protocol import (
    CancelRequest,
    CancelResponse,
    EpisodeResponse,
    HealthResponse,
    Observation,
    SampleList,
    StartRequest,
    StepRequest,
    TaskInfo,
)
from workers.agents.sandbox_cgroup import memory_available
from workers.api_key import BearerAuth, key_from_env

logger = logging.getLogger(__name__)

#: an environment's deliberate errors, as the protocol answers them
_REFUSAL_OF_ENVIRONMENT_ERROR: dict[type[EpisodeError], type[EpisodeRefused]] = {
    UnknownSample: NotFound,
    InvalidAction: BadRequest,
}


class TaskServer:
    """The protocol's handlers over one environment class: plain async methods, wired to routes by :func:`create_app`.

    The environment runs in worker threads (its calls may block); one episode's calls never overlap.
    """

    def __init__(
        self,
        environment: type[Environment],
        task_name: str,
        table: EpisodeTable,
        environment_kwargs: dict[str, Any],
    ) -> None:
        self.environment = environment
        self.task_name = task_name
        self.table = table
        self.environment_kwargs = environment_kwargs
        #: every episode whose environment is not closed yet: shutdown closes them, even one whose close was cut off
        #: (a request cancelled at the end of the graceful-shutdown period)
        self._opened: dict[str, Episode] = {}
        #: starts in flight by request_id: a start re-sent meanwhile waits for the first one's reply
        self._starting: dict[str, asyncio.Future[EpisodeResponse]] = {}

    async def health(self) -> HealthResponse:
        return HealthResponse(status="healthy", active_episodes=len(self.table), task_name=self.task_name)

    async def task_info(self) -> TaskInfo:
        env = self.environment
        return TaskInfo(
            name=self.task_name,
            num_samples=len(env.sample_ids()),
            max_episode_length=env.max_turns,
            observation_type=env.observation_type,
            action_type=env.action_type,
            description=env.description,
        )

    async def task_samples(self) -> SampleList:
        return SampleList(sample_ids=list(self.environment.sample_ids()))

    async def start(self, body: StartRequest) -> EpisodeResponse:
        request_id = body.request_id
        if request_id is None:
            return await self._start(body)
        replayed = self.table.replay_start(request_id)
        if replayed is not None:
            return replayed
        first = self._starting.get(request_id)
        if first is not None:  # the first try is still starting its episode: answer with it
            return await asyncio.shield(first)
        first = self._starting[request_id] = asyncio.get_running_loop().create_future()
        try:
            reply = await self._start(body)
        except asyncio.CancelledError:
            first.cancel()
            raise
        except BaseException as exc:
            first.set_exception(exc)
            first.exception()  # a failure nobody re-sent is not "never retrieved"
            raise
        else:
            self.table.remember_start(request_id, reply)
            first.set_result(reply)
        finally:
            del self._starting[request_id]
        return reply

    async def _start(self, body: StartRequest) -> EpisodeResponse:
        sample_id = str(body.sample_id)
        max_turns = _max_turns(body.config, self.environment.max_turns)
        await self.close(self.table.expire_idle())
        self.table.check_capacity()
        new_environment = await _call(lambda: self.environment(**self.environment_kwargs))
        try:
            episode = self.table.open(sample_id, new_environment, max_turns)
        except EpisodeRefused:
            await run_in_threadpool(_close_quietly, new_environment)
            raise
        self._opened[episode.episode_id] = episode
        async with episode.lock:
            try:
                observation = await _call(episode.environment.reset, sample_id, body.config)
                if not isinstance(observation, str):
                    raise EnvironmentFailure(f"environment reset returned {observation!r}; expected a str")
                with contextlib.suppress(UnknownSample):  # an environment may accept ids beyond sample_ids()
                    episode.sample_id = self.environment.resolve_sample_id(sample_id)
            except BaseException:
                self.table.end(episode, "failed at start")
                await self.close([episode])
                raise
        logger.info("episode %s started on sample %s", episode.episode_id, episode.sample_id)
        return EpisodeResponse(
            episode_id=episode.episode_id,
            observation=self._observation(observation),
            reward=0.0,
            done=False,
            info={"max_turns": max_turns, "sample_id": episode.sample_id, "turn": 0},
        )

    async def step(self, body: StepRequest) -> EpisodeResponse:
        expected = self.environment.action_type
        if body.action.type != expected:
            raise BadRequest(f"action type {body.action.type!r} is not supported; expected {expected!r}")
        replayed = self.table.replay(body.episode_id, body.request_id)
        if replayed is not None:
            return replayed
        episode = self.table.get(body.episode_id)
        async with episode.lock:
            replayed = self.table.replay(body.episode_id, body.request_id)  # the first try ran while this one waited
            if replayed is not None:
                return replayed
            episode = self.table.get(body.episode_id)  # it may have ended while this call waited for the lock
            try:
                result = await _call(episode.environment.step, body.action.content)
                done, info = self.table.record_step(episode, result)
            except BaseException:
                self.table.end(episode, "failed: the environment raised")
                await self.close([episode])
                raise
            reply = EpisodeResponse(
                episode_id=episode.episode_id,
                observation=self._observation(result.observation),
                reward=float(result.reward),
                done=done,
                info=info,
            )
            self.table.remember(episode.episode_id, body.request_id, reply)
        if done:
            await self.close([episode])
            logger.info("episode %s done: reward %s, %s", episode.episode_id, result.reward, info)
        return reply

    async def cancel(self, body: CancelRequest) -> CancelResponse:
        try:
            episode = self.table.get(body.episode_id)
        except BadRequest:  # already done: cancelling is idempotent
            return CancelResponse(episode_id=body.episode_id, cancelled=False)
        cancelled = self.table.end(episode, "cancelled") is not None
        async with episode.lock:  # let a call in flight finish before closing the environment under it
            await self.close([episode])
        return CancelResponse(episode_id=body.episode_id, cancelled=cancelled)

    async def close(self, episodes: list[Episode]) -> None:
        """Close the environments of ``episodes`` (each once)."""
        for episode in episodes:
            if not episode.closed:
                episode.closed = True
                await run_in_threadpool(_close_quietly, episode)
                self._opened.pop(episode.episode_id, None)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Expire idle episodes while serving; at shutdown, end every episode and close every environment."""

        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(self.table.idle_timeout / 4, 5.0))
                await self.close(self.table.expire_idle())

        sweeper = asyncio.create_task(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            self.table.drain()
            unfinished = [e for e in self._opened.values() if not e.close_returned]
            for episode in unfinished:
                episode.closed = False  # its close never ran or was cut off: run it (close() must be idempotent)
            await self.close(unfinished)

    def _observation(self, content: str | None) -> Observation | None:
        return None if content is None else Observation(type=self.environment.observation_type, content=content)


def create_app(
    environment: type[Environment],
    *,
    task_name: str | None = None,
    max_episodes: int | None = None,
    idle_timeout: float = 300.0,
    environment_kwargs: dict[str, Any] | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """A FastAPI app serving ``environment`` (a fresh instance per episode, built with ``environment_kwargs``).

    Args:
        task_name: reported by ``/health`` and ``/task/info`` (default: the environment's registered name).
        max_episodes: most episodes running at once; ``/episode/start`` answers 503 beyond it.
        idle_timeout: seconds without a call after which an episode expires (its environment closed).
        api_key: when set, every route but ``/api/health`` answers 401 without ``Authorization: Bearer <api_key>``.

    >>> app = create_app(environment_class("guess-number"), max_episodes=64)
    """
    table = EpisodeTable(max_episodes=max_episodes, idle_timeout=idle_timeout)
    name = task_name or environment.name or environment.__name__
    server = TaskServer(environment, name, table, dict(environment_kwargs or {}))
    app = FastAPI(title=f"task server: {name}", lifespan=server.lifespan)
    app.state.task_server = server
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, open_paths=("/api/health",))
    app.add_exception_handler(EpisodeRefused, _refused)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.get("/api/health")(server.health)
    app.get("/api/task/info")(server.task_info)
    app.get("/api/task/samples")(server.task_samples)
    app.post("/api/episode/start")(server.start)
    app.post("/api/episode/step")(server.step)
    app.post("/api/episode/cancel")(server.cancel)
    return app


async def _refused(request: Request, err: EpisodeRefused) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=err.status)


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
    return JSONResponse({"detail": "bad request: " + "; ".join(parts)}, status_code=400)


async def _call(fn: Any, *args: Any) -> Any:
    """Run an environment call off the event loop; map its errors to the protocol's statuses."""
    try:
        return await run_in_threadpool(fn, *args)
    except EpisodeRefused:
        raise
    except EpisodeError as err:
        refusal = next(r for cls, r in _REFUSAL_OF_ENVIRONMENT_ERROR.items() if isinstance(err, cls))
        raise refusal(str(err)) from err
    except Exception as err:
        logger.exception("environment call %s failed", getattr(fn, "__qualname__", fn))
        raise EnvironmentFailure(f"environment failure: {type(err).__name__}: {err}") from err


def _max_turns(config: dict[str, Any], default: int) -> int:
    value = config.get("max_turns", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= default:
        raise BadRequest(f"config max_turns={value!r} must be an int in [1, {default}]")
    return value


def _close_quietly(target: Episode | Environment) -> None:
    environment = target.environment if isinstance(target, Episode) else target
    try:
        environment.close()
    except Exception:
        logger.exception("closing %s failed", type(environment).__name__)
    if isinstance(target, Episode):
        target.close_returned = True


def banner(task_name: str, host: str, port: int, authenticated: bool = False) -> str:
    """The startup banner: server URL, API base, health and task-info URLs, and whether a key is required."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    rule = "=" * 70
    return "\n".join(
        [
            rule,
            f"Starting Task Server: {task_name}",
            rule,
            f"Server URL: {url}",
            f"API Base:   {url}/api",
            f"Health:     {url}/api/health",
            f"Task Info:  {url}/api/task/info",
            "Auth:       bearer key (TQ_API_KEY) on every route but /api/health"
            if authenticated
            else "Auth:       none (no TQ_API_KEY): every request is accepted",
            rule,
        ]
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``(host, port)``; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def serve_in_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Serve ``app`` from a thread of this process; yield its base URL (``http://host:port``); stop on exit.

    For tests and notebooks; a real deployment runs the CLI in its own process.
    """
    sock = bind(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="task-server", daemon=True)
    thread.start()
    try:
        for _ in range(int(timeout / 0.01)):
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not server.started:
            raise RuntimeError(f"task server did not start within {timeout} s")
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def default_max_episodes(environment: type[Environment], available: int | None = None) -> int | None:
    """``--max-episodes`` when not given: the memory free now (``available``, default :func:`memory_available`) over
    the environment's ``episode_memory_bytes``, at least 1; None (unbounded) for an environment that declares none.

    >>> default_max_episodes(environment_class("os-interaction"), available=20 * 2**30)  # a 1 GiB budget each
    20
    """
    if environment.episode_memory_bytes is None:
        return None
    free = memory_available() if available is None else available
    return max(1, free // environment.episode_memory_bytes)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, build the app, print the banner and serve until SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m workers.agents.task_server", description=__doc__.split("\n")[0])
    parser.add_argument("env_name", metavar="ENV_NAME", help="a registered environment, or 'package.module:Class'")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--max-episodes",
        type=int,
        default=None,
        help="most episodes at once (503 beyond); default: the free memory over the environment's episode budget",
    )
    parser.add_argument("--idle-timeout", type=float, default=300.0, help="seconds before an idle episode expires")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM, seconds requests in flight get before every environment (and sandbox) is closed",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = key_from_env()
    try:
        environment = environment_class(args.env_name)
        max_episodes = args.max_episodes if args.max_episodes is not None else default_max_episodes(environment)
        logger.info("serving at most %s episodes at once", max_episodes if max_episodes is not None else "unbounded")
        app = create_app(
            environment,
            task_name=args.env_name,
            max_episodes=max_episodes,
            idle_timeout=args.idle_timeout,
            api_key=api_key,
        )
    except (LookupError, ValueError) as err:
        parser.error(str(err))
    try:
        sock = bind(args.host, args.port)
    except OSError as err:
        parser.error(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}")
    print(banner(args.env_name, args.host, sock.getsockname()[1], api_key is not None), flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT (episodes drained, environments closed), then re-raises the
    # signal under the handler it found: make that handler an ordinary exit, so a clean shutdown exits 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(0))
    config = uvicorn.Config(
        app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=args.shutdown_timeout
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
