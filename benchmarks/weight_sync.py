"""Weight-sync time per engine kind: median seconds for one ``update_weights`` (from memory and from a Hugging Face
directory) of the demo's policy and, with ``--smollm2 DIR``, SmolLM2-135M.

    python benchmarks/weight_sync.py [--repeat 5] [--smollm2 DIR] [--vllm] [--vllm-server]

Kinds: ``hf`` (in-process), ``sglang-api`` (SGLangEngine over HTTP against the loopback SGLang-schema server of
tests/engine_fakes.py, HF underneath: the HTTP + safetensors round trip, not SGLang's own loader), ``vllm``
(in-process vllm.LLM, needs the vLLM venv) and ``vllm-server`` (VLLMServerEngine behind an EngineServer). vLLM's CPU
attention has no kernel for head size 16, so the vLLM rows of the demo model use 2 heads of 32 (same parameters).
Prints one JSON line per (model, kind, source).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def demo_model(num_heads: int, seed: int):
    from workers.tasks.addition import AdditionTask, build_model

    task = AdditionTask()
    return build_model(task.tokenizer.vocab_size, num_heads=num_heads, seed=seed)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_engine(name, model_name, engine, state, directory, repeat, out):
    version = [engine.version]

    def from_memory():
        version[0] += 1
        engine.update_weights(version[0], state_dict=state)

    def from_dir():
        version[0] += 1
        engine.update_weights(version[0], path=directory)

    for source, fn in (("memory", from_memory), ("directory", from_dir)):
        fn()  # warm-up
        row = {"model": model_name, "engine": name, "source": source, "median_s": round(timed(fn, repeat), 4)}
        print(json.dumps(row), flush=True)
        out.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smollm2", default=None, help="a prepared SmolLM2 directory (recipe/smollm2/prepare.py)")
    parser.add_argument("--vllm", action="store_true", help="also the in-process vLLM engine (vLLM venv)")
    parser.add_argument("--vllm-server", action="store_true", help="also vLLM's OpenAI server (vLLM venv)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM

    from workers.agents.task_server import serve_in_background
    from workers.engines.hf import HFEngine
    from workers.engines.sglang import SGLangEngine

    out: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="tq-bench-sync-"))
    models = [("demo", 4), ("demo-2heads", 2)]
    if args.smollm2:
        models.append(("smollm2-135m", 0))
    for model_name, heads in models:
        if heads:
            base, new = demo_model(heads, 0), demo_model(heads, 1)
        else:
            base = AutoModelForCausalLM.from_pretrained(args.smollm2)
            new = AutoModelForCausalLM.from_pretrained(args.smollm2)
        base_dir, new_dir = work / f"{model_name}-base", work / f"{model_name}-new"
        base.save_pretrained(base_dir)
        new.save_pretrained(new_dir)
        state = new.state_dict()
        n_params = sum(p.numel() for p in new.parameters())
        print(json.dumps({"model": model_name, "parameters": n_params}), flush=True)
        eos = base.config.eos_token_id if base.config.eos_token_id is not None else 0
        eos = eos[0] if isinstance(eos, list) else eos
        if not args.skip_hf and heads != 2:
            bench_engine("hf", model_name, HFEngine(base, pad_token_id=0, eos_token_id=eos), state, str(new_dir),
                         args.repeat, out)  # fmt: skip
            from tests.engine_fakes import create_sglang_app

            with serve_in_background(create_sglang_app(str(base_dir), eos_token_id=eos)) as url:
                engine = SGLangEngine(url, model_path=str(base_dir))
                bench_engine("sglang-api", model_name, engine, state, str(new_dir), args.repeat, out)
        if args.vllm and heads != 4:
            from workers.engines.vllm_engine import VLLMEngine

            engine = VLLMEngine(model_path=str(base_dir), eos_token_id=eos)
            bench_engine("vllm", model_name, engine, state, str(new_dir), args.repeat, out)
            engine.close()
        if args.vllm_server and heads != 4:
            from workers.engines.server import EngineServer
            from workers.engines.vllm_server import VLLMServerEngine, vllm_server_command, vllm_server_env

            _add_tokenizer(base_dir, base.config.vocab_size)
            server = EngineServer(
                lambda host, port, d=str(base_dir): vllm_server_command(d, port, host),
                env={**vllm_server_env(), "PYTHONPATH": str(ROOT)},
                startup_timeout=1200,
                health_interval=0,
                engine_factory=lambda url, d=str(base_dir): VLLMServerEngine(url, model_path=d),
            )
            with server:
                bench_engine("vllm-server", model_name, server.engine, state, str(new_dir), args.repeat, out)
    print(json.dumps({"summary": out}))


def _add_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer for a model directory without one (vLLM's OpenAI server needs a tokenizer)."""
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        return
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0").save_pretrained(directory)


if __name__ == "__main__":
    main()
