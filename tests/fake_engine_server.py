"""A tiny stand-in engine server for the EngineServer lifecycle tests: standard library only, so it starts in a
fraction of a second (no torch). Like a real server, on SIGTERM it stops its own child processes, then exits.

    python tests/fake_engine_server.py --port P [--never-healthy] [--spawn-child] [--fail-bind] [--api-key KEY]
                                       [--key-from-env] [--vocab-size V] [--chat-delay S] [--generate-tokens]
                                       [--generate-delay S] [ENGINE FLAGS ...]

Routes: GET /health and /health_generate (200, or 503 with --never-healthy), POST /release_memory_occupation, POST
/resume_memory_occupation (health answers 503 while released), SGLang's POST /update_weights_from_disk (``{"model_path",
"weight_version"}``: recorded, ``{"success": true}``), GET /get_model_info (``--model-path``), GET /get_weight_version
and POST /generate (one empty output per row of ``input_ids``), SGLang's POST /v1/chat/completions
(``sglang_chat_reply``; to a request with vLLM's ``return_token_ids`` it answers as vLLM does too: ``prompt_token_ids``
on the reply, ``token_ids`` on each choice), and GET /argv: ``{"argv": [...], "loads": [[model_path, weight_version],
...], "generated": [weight_version, ...], "chats": [weight_version, ...]}`` (the command line it was started with, flags
it does not know included, as an engine's sizing flags; the weight loads it answered; the weight version of each
generation and of each chat completion it answered, a generation while released marked " released"; ``events``:
release, resume, ``load VERSION`` and ``generate VERSION`` in the order they happened; ``in_flight_at_release``: the
generations being answered at each release; ``in_flight``: those being answered now). ``--generate-tokens``: each
/generate output is the tokens 5 and 2 with their log-probs (else empty); ``--generate-delay S``: each /generate takes
S seconds. ``--vocab-size V``: the prompt's token ids are its characters' code points modulo V (a tiny model's
vocabulary); ``--chat-delay S``: each chat completion takes S seconds (so concurrent samplers' requests overlap).
With ``--api-key`` (or ``--key-from-env``: ``TQ_API_KEY``), the POST routes answer 401 without ``Authorization:
Bearer KEY``, as SGLang's ``--api-key``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--key-from-env", action="store_true")
    parser.add_argument("--model-path", default=None)  # answered by GET /get_model_info (kept for GET /argv too)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--chat-delay", type=float, default=0.0)
    parser.add_argument("--generate-tokens", action="store_true")
    parser.add_argument("--generate-delay", type=float, default=0.0)
    args, _ = parser.parse_known_args()  # an engine's own flags (--tp-size 2 ...) are kept for GET /argv
    key = os.environ.get("TQ_API_KEY") if args.key_from_env else args.api_key
    state: dict[str, object] = {"released": False, "weight_version": "default"}
    loads: list[list[str]] = []
    generated: list[str] = []
    chats: list[str] = []
    events: list[str] = []  # release, resume, generate VERSION (when it finished), in order
    in_flight_at_release: list[int] = []
    in_flight = [0]  # /generate requests being answered
    lock = threading.Lock()
    children: list[subprocess.Popen[bytes]] = []
    if args.spawn_child:
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                ok = not args.never_healthy and not state["released"]
                self._reply(200 if ok else 503, {})
            elif self.path == "/argv":
                self._reply(200, {"argv": sys.argv[1:], "loads": loads, "generated": generated, "chats": chats,
                                  "events": events, "in_flight_at_release": in_flight_at_release,
                                  "in_flight": in_flight[0]})  # fmt: skip
            elif self.path == "/get_model_info":
                self._reply(200, {"model_path": args.model_path})
            elif self.path == "/get_weight_version":
                self._reply(200, {"weight_version": state["weight_version"]})
            else:
                self._reply(404, {"error": self.path})

        def do_POST(self) -> None:
            if key is not None and self.headers.get("Authorization") != f"Bearer {key}":
                self._reply(401, {"error": "Unauthorized"})
            elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                with lock:
                    state["released"] = self.path.startswith("/release")
                    events.append("release" if state["released"] else "resume")
                    if state["released"]:
                        in_flight_at_release.append(in_flight[0])
                self._reply(200, {})
            elif self.path == "/generate":  # SGLang's schema; the weight version it generated with
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                with lock:
                    in_flight[0] += 1
                time.sleep(args.generate_delay)
                with lock:
                    in_flight[0] -= 1
                    version = str(state["weight_version"]) + (" released" if state["released"] else "")
                    generated.append(version)
                    events.append(f"generate {version}")
                meta = {"output_token_logprobs": [], "finish_reason": {"type": "length"}}
                if args.generate_tokens:  # the tokens 5 and 2 (log-probs -0.25 and -1.5), as sglang_chat_reply
                    meta = {"output_token_logprobs": [[-0.25, 5, None], [-1.5, 2, None]],
                            "finish_reason": {"type": "stop"}}  # fmt: skip
                output = {"output_ids": [5, 2] if args.generate_tokens else [], "meta_info": meta}
                self._reply(200, [output] * len(body["input_ids"]))
            elif self.path == "/v1/chat/completions":  # SGLang's OpenAI-compatible chat (its reply's fields)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                time.sleep(args.chat_delay)
                chats.append(str(state["weight_version"]))
                self._reply(200, sglang_chat_reply(body, str(state["weight_version"]), args.vocab_size))
            elif self.path == "/update_weights_from_disk":
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                loads.append([body["model_path"], body["weight_version"]])
                events.append(f"load {body['weight_version']}")
                state["weight_version"] = body["weight_version"]
                self._reply(200, {"success": True, "message": "loaded", "num_paused_requests": 0})
            else:
                self._reply(404, {"error": self.path})

        def log_message(self, *a: object) -> None:
            pass

    print(f"fake engine server: starting on {args.host}:{args.port}", flush=True)
    if key is not None:
        print(f"fake engine server: api_key={key!r}", flush=True)  # as SGLang prints its server_args
    server = ThreadingHTTPServer((args.host, args.port), Handler)  # raises "Address already in use" when taken

    def stop(signum: int, frame: object) -> None:
        for child in children:
            child.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("fake engine server: ready", flush=True)
    server.serve_forever()


def sglang_chat_reply(body: dict, weight_version: str, vocab_size: int | None = None) -> dict:
    """SGLang's non-streamed chat completion to ``body``: ``n`` choices of the tokens 5 and 2 (log-probs -0.25 and
    -1.5); with ``return_prompt_token_ids`` each choice has ``prompt_token_ids`` (here the messages' characters' code
    points), with ``return_meta_info`` its ``meta_info`` (``output_token_logprobs`` as ``[logprob, token id, text]``
    when ``logprobs``, and the ``weight_version``); ``logprobs.content`` names tokens, not ids. Without the flags
    SGLang answers without the ids, as here. With vLLM's ``return_token_ids`` the reply has vLLM's ``prompt_token_ids``
    and each choice its ``token_ids``; ``vocab_size``: the code points modulo it."""
    prompt = [ord(c) for message in body.get("messages", []) for c in str(message.get("content", ""))]
    if vocab_size:
        prompt = [token % vocab_size for token in prompt]
    tokens = [(-0.25, 5, "t5"), (-1.5, 2, "t2")]
    choices = []
    for i in range(int(body.get("n") or 1)):
        choice: dict = {
            "index": i,
            "message": {"role": "assistant", "content": "t5t2", "reasoning_content": None, "tool_calls": None},
            "logprobs": None,
            "finish_reason": "stop",
            "matched_stop": 2,
        }
        if body.get("logprobs"):
            content = [
                {"token": t, "bytes": list(t.encode()), "logprob": lp, "top_logprobs": []} for lp, _, t in tokens
            ]
            choice["logprobs"] = {"content": content}
        if body.get("return_token_ids"):  # vLLM's
            choice["token_ids"] = [token_id for _, token_id, _ in tokens]
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = prompt
        if body.get("return_meta_info"):
            meta: dict = {"id": f"req-{i}", "prompt_tokens": len(prompt), "completion_tokens": 2,
                          "weight_version": weight_version, "finish_reason": {"type": "stop"}}  # fmt: skip
            if body.get("logprobs"):
                meta["output_token_logprobs"] = [list(token) for token in tokens]
            choice["meta_info"] = meta
        choices.append(choice)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": 2 * len(choices), "prompt_tokens_details": None}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    reply = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model"),
             "choices": choices, "usage": usage}  # fmt: skip
    if body.get("return_token_ids"):  # vLLM's
        reply["prompt_token_ids"] = prompt
    return reply


if __name__ == "__main__":
    main()
