"""The task server: one environment behind the task-server HTTP protocol (AReaL / AgentBench compatible).

    python -m workers.agents.task_server ENV_NAME --port P [--host 127.0.0.1] [--max-episodes N] [--idle-timeout S]

Endpoints, under ``/api``: ``GET /health``, ``GET /task/info``, ``GET /task/samples``, ``POST /episode/start``,
``POST /episode/step``, ``POST /episode/cancel``. Errors answer ``{"detail": "..."}`` with 400 (bad request, episode
already done), 404 (unknown sample or episode), 503 (``--max-episodes`` running) or 500 (the environment failed).
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
from pydantic import BaseModel, Field

from workers.agents.environment import Environment, EpisodeError, InvalidAction, UnknownSample, environment_class
from workers.agents.episodes import (
    BadRequest,
    EnvironmentFailure,
    Episode,
    EpisodeRefused,
    EpisodeTable,
    NotFound,
)

logger = logging.getLogger(__name__)

_STATUS_OF_ENVIRONMENT_ERROR: dict[type[EpisodeError], int] = {UnknownSample: 404, InvalidAction: 400}


class Observation(BaseModel):
    type: str = "text"
    content: str


class StartRequest(BaseModel):
    sample_id: str | int
    config: dict[str, Any] = Field(default_factory=dict)


class Action(BaseModel):
    type: str = "text"
    content: str


class StepRequest(BaseModel):
    episode_id: str
    action: Action


class CancelRequest(BaseModel):
    episode_id: str


class EpisodeResponse(BaseModel):
    episode_id: str
    observation: Observation | None
    reward: float
    done: bool
    info: dict[str, Any]


class CancelResponse(BaseModel):
    episode_id: str
    cancelled: bool


class HealthResponse(BaseModel):
    status: str
    active_episodes: int
    task_name: str


class TaskInfo(BaseModel):
    name: str
    num_samples: int
    max_episode_length: int
    observation_type: str
    action_type: str
    description: str


class SampleList(BaseModel):
    sample_ids: list[str]


def create_app(
    environment: type[Environment],
    *,
    task_name: str | None = None,
    max_episodes: int | None = None,
    idle_timeout: float = 300.0,
    environment_kwargs: dict[str, Any] | None = None,
) -> FastAPI:
    """A FastAPI app serving ``environment`` (a fresh instance per episode, built with ``environment_kwargs``).

    Args:
        task_name: reported by ``/health`` and ``/task/info`` (default: the environment's registered name).
        max_episodes: most episodes running at once; ``/episode/start`` answers 503 beyond it.
        idle_timeout: seconds without a call after which an episode expires (its environment closed).
    """
    name = task_name or environment.name or environment.__name__
    kwargs = dict(environment_kwargs or {})
    table = EpisodeTable(max_episodes=max_episodes, idle_timeout=idle_timeout)

    async def close(episodes: list[Episode]) -> None:
        for episode in episodes:
            if not episode.closed:
                episode.closed = True
                await run_in_threadpool(_close_quietly, episode.environment)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(min(idle_timeout / 4, 5.0))
                await close(table.expire_idle())

        sweeper = asyncio.create_task(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            await close(table.drain())

    app = FastAPI(title=f"task server: {name}", lifespan=lifespan)
    app.state.episodes = table

    @app.exception_handler(EpisodeRefused)
    async def refused(request: Request, err: EpisodeRefused) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]
        return JSONResponse({"detail": "bad request: " + "; ".join(parts)}, status_code=400)

    @app.get("/api/health")
    async def health() -> HealthResponse:
        return HealthResponse(status="healthy", active_episodes=len(table), task_name=name)

    @app.get("/api/task/info")
    async def task_info() -> TaskInfo:
        return TaskInfo(
            name=name,
            num_samples=len(environment.sample_ids()),
            max_episode_length=environment.max_turns,
            observation_type=environment.observation_type,
            action_type=environment.action_type,
            description=environment.description,
        )

    @app.get("/api/task/samples")
    async def task_samples() -> SampleList:
        return SampleList(sample_ids=list(environment.sample_ids()))

    @app.post("/api/episode/start")
    async def start(body: StartRequest) -> EpisodeResponse:
        sample_id = str(body.sample_id)
        max_turns = _max_turns(body.config, environment.max_turns)
        await close(table.expire_idle())
        table.check_capacity()
        new_environment = await _call(lambda: environment(**kwargs))
        try:
            episode = table.open(sample_id, new_environment, max_turns)
        except EpisodeRefused:
            await run_in_threadpool(_close_quietly, new_environment)
            raise
        async with episode.lock:
            try:
                observation = await _call(episode.environment.reset, sample_id, body.config)
                if not isinstance(observation, str):
                    raise EnvironmentFailure(f"environment reset returned {observation!r}; expected a str")
                with contextlib.suppress(UnknownSample):  # an environment may accept ids beyond sample_ids()
                    episode.sample_id = environment.resolve_sample_id(sample_id)
            except BaseException:
                table.end(episode, "failed at start")
                await close([episode])
                raise
        info = {"max_turns": max_turns, "sample_id": episode.sample_id, "turn": 0}
        logger.info("episode %s started on sample %s", episode.episode_id, episode.sample_id)
        return EpisodeResponse(
            episode_id=episode.episode_id,
            observation=Observation(type=environment.observation_type, content=observation),
            reward=0.0,
            done=False,
            info=info,
        )

    @app.post("/api/episode/step")
    async def step(body: StepRequest) -> EpisodeResponse:
        if body.action.type != environment.action_type:
            raise BadRequest(f"action type {body.action.type!r} is not supported; expected {environment.action_type!r}")
        episode = table.get(body.episode_id)
        async with episode.lock:
            episode = table.get(body.episode_id)  # it may have ended while this call waited for the lock
            try:
                result = await _call(episode.environment.step, body.action.content)
                done, info = table.record_step(episode, result)
            except BaseException:
                table.end(episode, "failed: the environment raised")
                await close([episode])
                raise
        if done:
            await close([episode])
            logger.info("episode %s done: reward %s, %s", episode.episode_id, result.reward, info)
        observation = (
            None
            if result.observation is None
            else Observation(type=environment.observation_type, content=result.observation)
        )
        return EpisodeResponse(
            episode_id=episode.episode_id, observation=observation, reward=float(result.reward), done=done, info=info
        )

    @app.post("/api/episode/cancel")
    async def cancel(body: CancelRequest) -> CancelResponse:
        try:
            episode = table.get(body.episode_id)
        except BadRequest:  # already done: cancelling is idempotent
            return CancelResponse(episode_id=body.episode_id, cancelled=False)
        cancelled = table.end(episode, "cancelled") is not None
        async with episode.lock:  # let a call in flight finish before closing the environment under it
            await close([episode])
        return CancelResponse(episode_id=body.episode_id, cancelled=cancelled)

    return app


async def _call(fn: Any, *args: Any) -> Any:
    """Run an environment call off the event loop; map its errors to the protocol's statuses."""
    try:
        return await run_in_threadpool(fn, *args)
    except EpisodeRefused:
        raise
    except EpisodeError as err:
        status = next(s for cls, s in _STATUS_OF_ENVIRONMENT_ERROR.items() if isinstance(err, cls))
        raise (NotFound if status == 404 else BadRequest)(str(err)) from err
    except Exception as err:
        logger.exception("environment call %s failed", getattr(fn, "__qualname__", fn))
        raise EnvironmentFailure(f"environment failure: {type(err).__name__}: {err}") from err


def _max_turns(config: dict[str, Any], default: int) -> int:
    value = config.get("max_turns", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= default:
        raise BadRequest(f"config max_turns={value!r} must be an int in [1, {default}]")
    return value


def _close_quietly(environment: Environment) -> None:
    try:
        environment.close()
    except Exception:
        logger.exception("closing %s failed", type(environment).__name__)


def banner(task_name: str, host: str, port: int) -> str:
    """The startup banner: server URL, API base, health and task-info URLs."""
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


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, build the app, print the banner and serve until SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m workers.agents.task_server", description=__doc__.split("\n")[0])
    parser.add_argument("env_name", metavar="ENV_NAME", help="a registered environment, or 'package.module:Class'")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--max-episodes", type=int, default=None, help="most episodes at once (503 beyond)")
    parser.add_argument("--idle-timeout", type=float, default=300.0, help="seconds before an idle episode expires")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        environment = environment_class(args.env_name)
        app = create_app(
            environment, task_name=args.env_name, max_episodes=args.max_episodes, idle_timeout=args.idle_timeout
        )
    except (LookupError, ValueError) as err:
        parser.error(str(err))
    sock = bind(args.host, args.port)
    print(banner(args.env_name, args.host, sock.getsockname()[1]), flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT (episodes drained, environments closed), then re-raises the
    # signal under the handler it found: make that handler an ordinary exit, so a clean shutdown exits 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(0))
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, lifespan="on")).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
