"""A loopback SGLang-compatible server for tests: SGLang's native request and response schemas (as of SGLang's
``io_struct.py``: ``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``, ``PauseGenerationReqInput``, ...) over a
real ``HFEngine``, so replies carry real samples and log-probs. SGLang itself cannot run on these CPUs. As strict as
the real server where it matters: ``sampling_params`` is one dict or one per input, and each input is sampled with
its own ``sampling_seed`` (so one seed for the ``n`` copies of a prompt gives ``n`` identical samples, as on a
deterministic server); ``/flush_cache`` answers 400 while requests run or wait; ``/health`` and
``/health_generate`` both generate a token. With ``api_key``, every route but ``/health*`` and ``/metrics`` answers
401 without ``Authorization: Bearer <api_key>``, as SGLang's ``--api-key`` does.

Also a command-line server for the ``EngineServer`` tests (``python tests/engine_fakes.py --port P --model-path D``)
with switches that make it misbehave: ``--crash-after N`` (exit after N generate requests), ``--never-healthy``,
``--startup-delay S``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workers.engines.base import Generation, SamplingParams
from workers.engines.hf import HFEngine


def _sampling_params(sp: dict[str, Any]) -> SamplingParams:
    """Ours for one of SGLang's ``sampling_params`` dicts."""
    return SamplingParams(
        max_new_tokens=int(sp.get("max_new_tokens", 128)),
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=max(0, int(sp.get("top_k", -1))),
        stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
        seed=sp.get("sampling_seed"),
    )


def create_sglang_app(
    model_path: str,
    *,
    crash_after: int | None = None,
    never_healthy: bool = False,
    eos_token_id: int | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """An app answering SGLang's routes for the model in ``model_path`` (see the module docstring)."""
    engine = HFEngine(model_path=model_path, eos_token_id=eos_token_id, pad_token_id=0)
    app = FastAPI()
    if api_key is not None:

        @app.middleware("http")
        async def authentication(request: Request, call_next: Any) -> Any:  # SGLang's add_api_key_middleware
            if request.method == "OPTIONS" or request.url.path.startswith(("/health", "/metrics")):
                return await call_next(request)
            if request.headers.get("Authorization") != "Bearer " + api_key:
                return JSONResponse(content={"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    state: dict[str, Any] = {
        "weight_version": "default",
        "abort": threading.Event(),
        "running": threading.Event(),
        "paused": False,
        "released": False,
        "generates": 0,
        "generating": threading.Event(),
        "flushes": 0,
        "in_flight": 0,  # generate requests waiting or running
        "seeds": [],  # the sampling_seed of each row, one list per generate request
        "health_generations": 0,
        # a test of aborts sets it: each row waits (up to 60 s) for the abort before it runs, so a loaded machine
        # cannot finish the rows before the abort reaches the server
        "hold_for_abort": False,
    }
    state["running"].set()
    lock = threading.Lock()  # one generation at a time on the HF model; weight loads wait for it
    counter = threading.Lock()
    app.state.fake = state

    def _one(row: list[int], params: SamplingParams) -> Generation:
        if state["hold_for_abort"]:
            state["abort"].wait(60)
        if state["abort"].is_set():
            return Generation([], [], "abort")
        [[generation]] = engine.generate([row], 1, params, should_abort=state["abort"].is_set)
        return generation

    @contextlib.contextmanager
    def in_flight() -> Iterator[None]:
        """Counts a request from its arrival (waiting) to its reply (running), as SGLang's scheduler queues do."""
        with counter:
            state["in_flight"] += 1
        try:
            yield
        finally:
            with counter:
                state["in_flight"] -= 1

    @app.post("/generate")
    def generate(body: dict[str, Any]) -> Any:
        state["generates"] += 1
        if crash_after is not None and state["generates"] > crash_after:
            os._exit(3)
        input_ids = body["input_ids"]
        batch = isinstance(input_ids[0], list)
        rows = input_ids if batch else [input_ids]
        if not body.get("return_logprob"):
            return JSONResponse({"error": "this fake only answers return_logprob=true"}, status_code=400)
        # SGLang: one dict for every input, or a list of one dict per input
        sps = body.get("sampling_params") or {}
        if isinstance(sps, list) and len(sps) != len(rows):
            message = f"sampling_params has {len(sps)} entries for {len(rows)} inputs; expected one per input"
            return JSONResponse({"error": message}, status_code=400)
        per_row = [_sampling_params(sp) for sp in (sps if isinstance(sps, list) else [sps] * len(rows))]
        state["seeds"].append([p.seed for p in per_row])
        with in_flight():
            state["running"].wait()  # paused in place: wait for /continue_generation
            with lock:
                state["abort"].clear()  # /abort_request aborts the requests in the server, not later ones
                state["generating"].set()
                try:
                    # row by row, each with its own sampling_seed: like a deterministic SGLang server, rows with the
                    # same prompt and seed give the same sample (the batch does not make them differ)
                    generations = [_one(row, p) for row, p in zip(rows, per_row, strict=True)]
                finally:
                    state["generating"].clear()
        outputs = []
        for i, g in enumerate(generations):
            reason: dict[str, Any] = {"type": g.finish_reason}
            if g.finish_reason == "stop":
                reason["matched"] = g.token_ids[-1]
            elif g.finish_reason == "length":
                reason["length"] = len(g.token_ids)
            else:
                reason["message"] = "Abort before prefill" if not g.token_ids else "Abort in waiting queue"
            outputs.append(
                {
                    "text": "",
                    "output_ids": g.token_ids,
                    "meta_info": {
                        "id": f"fake-{state['generates']}-{i}",
                        "finish_reason": reason,
                        "prompt_tokens": len(rows[i]),
                        "completion_tokens": len(g.token_ids),
                        "cached_tokens": 0,
                        "weight_version": state["weight_version"],
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(g.logprobs, g.token_ids, strict=True)],
                    },
                }
            )
        return outputs if batch else outputs[0]

    @app.post("/abort_request")
    def abort_request(body: dict[str, Any]) -> Any:
        if body.get("abort_all"):
            state["abort"].set()
        return {}

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(body: dict[str, Any]) -> Any:
        path = body.get("model_path", "")
        if not os.path.isdir(path):
            return JSONResponse(
                {"success": False, "message": f"Failed to get weights iterator: {path} not found"}, status_code=400
            )
        if body.get("abort_all_requests"):
            state["abort"].set()
        with lock:
            engine.update_weights(engine.version + 1, path=path)
        if body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.get("/health_generate")
    @app.get("/health")
    def health_generate() -> Any:
        # SGLang answers both routes with one handler that generates a token (200 at once while a request runs)
        if never_healthy or state["released"]:
            return JSONResponse({}, status_code=503)
        if not state["generating"].is_set():
            with lock:
                engine.generate([[1]], 1, SamplingParams(max_new_tokens=1))
            state["health_generations"] += 1
        return {}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> Any:
        # SGLang does not flush while requests run or wait, and says so with a 400
        busy = state["in_flight"] > 0
        if not busy:
            state["flushes"] += 1
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
            "the operation will not be performed.)\n",
            status_code=400 if busy else 200,
        )

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        body = await request.json() if await request.body() else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return JSONResponse({"error": f"Invalid mode: {mode!r}"}, status_code=400)
        if mode == "abort":
            state["abort"].set()
        state["running"].clear()
        state["paused"] = True
        return {"message": "Generation paused successfully.", "status": 200}

    @app.post("/continue_generation")
    def continue_generation() -> Any:
        state["running"].set()
        state["paused"] = False
        return {"message": "Generation continued successfully.", "status": 200}

    @app.post("/release_memory_occupation")
    def release_memory_occupation() -> Any:
        state["released"] = True
        return {}

    @app.post("/resume_memory_occupation")
    def resume_memory_occupation() -> Any:
        state["released"] = False
        return {}

    @app.get("/get_model_info")
    def get_model_info() -> Any:
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True}

    @app.get("/get_weight_version")
    def get_weight_version() -> Any:
        return {"weight_version": state["weight_version"]}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--startup-delay", type=float, default=0.0)
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--spawn-child", action="store_true", help="start a sleeping grandchild (orphan test)")
    args = parser.parse_args(argv)
    import subprocess

    import uvicorn

    if args.spawn_child:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"fake sglang server: loading {args.model_path}", flush=True)
    time.sleep(args.startup_delay)
    app = create_sglang_app(
        args.model_path,
        crash_after=args.crash_after,
        never_healthy=args.never_healthy,
        eos_token_id=args.eos_token_id,
        api_key=args.api_key,
    )
    print(f"fake sglang server: serving on {args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
