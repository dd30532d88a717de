"""Weight publish through the shared-memory WeightChannel (``weight_sync: shm``) for a SmolLM2-135M-shaped model.

    python benchmarks/weight_publish.py [--reps 5] [--dtype bfloat16|float32|both] [--delta-steps 3]
    python benchmarks/run.py --only weight_publish

The model has SmolLM2-135M's architecture (LlamaConfig: hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate
1536, vocab 49152, tied embeddings; 134.5M parameters) with random weights: nothing is downloaded. Measured, medians
over ``--reps`` after a warm-up, against baselines of the same run:

- publish: ``WeightChannel.write`` of the state dict (steady state: the channel reuses its oldest file) vs a plain
  copy of the same bytes into a preallocated buffer (``memcpy``) and vs a ``clone`` of every tensor;
- load: an ``HFEngine`` in another (spawned) process copies the newest write into its model
  (``update_weights_in_place`` + ``WeightChannel.read_into``), vs the same memcpy in that process;
- end-to-end: from the trainer's ``write`` call to the engine process having the weights in its parameters (the
  engine waits in ``WeightChannel.wait``, as ``EngineActor.pull_weights`` does), goal 0.1 s;
- serialised, the channel's earlier format: ``torch.save`` of the state dict into /dev/shm, ``torch.load`` + the
  engine's ``update_weights`` (publish, load, end-to-end);
- delta: the fraction of 1 MiB chunks changed per AdamW step (lr 1e-6) on the demo's tiny model and on this one, and
  the delta write / one-behind read times.

Prints one JSON line per figure and a summary table; ``goal / now`` where there is a goal.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GOAL_S = 0.1


def smollm2_config(dtype: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        torch_dtype=dtype,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def smollm2_model(dtype: str, seed: int = 0):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(smollm2_config(dtype)).to(getattr(torch, dtype))
    model.eval()
    return model


def loadavg() -> float:
    return os.getloadavg()[0]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _engine_process(conn, dtype: str, channel_path: str, old_path: str) -> None:
    """The engine side: an HFEngine over a model of the same shape, loading on command."""
    import torch

    torch.set_num_threads(1)
    from rl_contracts.weight_channel import WeightChannel
    from workers.engines.hf import HFEngine

    engine = HFEngine(smollm2_model(dtype, seed=1), dtype=getattr(torch, dtype), pad_token_id=2, eos_token_id=2)
    channel = WeightChannel(channel_path)
    have = -1
    state = engine.model.state_dict()
    flat = torch.empty(sum(t.numel() * t.element_size() for t in state.values()), dtype=torch.uint8)
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            return
        t0 = time.monotonic()
        if cmd == "load":  # arg: min version; have: our write (a delta reader one behind copies the changed chunks)
            stats: dict[str, Any] = {}

            def fill(targets, arg=arg, stats=stats, have=have):
                s = channel.read_into(targets, have, arg, timeout=60.0)
                stats.update(serial=s.serial, chunks=s.chunks, chunks_copied=s.chunks_copied, bytes=s.bytes_copied)
                return s.version

            engine.update_weights_in_place(fill)
            have = stats["serial"]
            conn.send((t0, time.monotonic(), stats))
        elif cmd == "forget":  # a reader further behind
            have = -1
            conn.send((t0, t0, {}))
        elif cmd == "old":  # the earlier format: torch.load of a torch.save'd state dict, then update_weights
            while not os.path.exists(old_path + f".{arg}"):
                time.sleep(1e-4)
            loaded = torch.load(old_path + f".{arg}", weights_only=True)
            engine.update_weights(max(arg, engine.version), state_dict=loaded)
            del loaded
            conn.send((t0, time.monotonic(), {}))
        elif cmd == "memcpy":
            t0 = time.monotonic()
            offset = 0
            for t in state.values():
                n = t.numel() * t.element_size()
                flat[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
                offset += n
            conn.send((t0, time.monotonic(), {}))
        elif cmd == "check":  # the engine's weights equal the published ones
            w = channel.load()[2]
            ok = all(torch.equal(w[n], state[n]) for n in w)
            conn.send((t0, time.monotonic(), {"equal": ok}))


class Engine:
    def __init__(self, dtype: str, channel_path: str, old_path: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_process, args=(child, dtype, channel_path, old_path), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"

    def call(self, cmd: str, arg: Any = None) -> tuple[float, float, dict]:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def start(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def result(self) -> tuple[float, float, dict]:
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("stop", None))
        self.proc.join(30)


def bench_model(dtype: str, reps: int, out: list[dict]) -> None:
    import torch

    from rl_contracts.weight_channel import WeightChannel

    model = smollm2_model(dtype, seed=0)
    state = model.state_dict()
    params = sum(p.numel() for p in model.parameters())
    unique = {t.data_ptr(): t for t in state.values()}
    nbytes = sum(t.numel() * t.element_size() for t in unique.values())
    label = f"smollm2-135m-shape {dtype}"
    row(out, label, "model", parameters=params, bytes=nbytes, tensors=len(state), load=loadavg())
    channel = WeightChannel.create()
    old_dir = Path(tempfile.mkdtemp(prefix="tq-bench-old-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    old_path = str(old_dir / "weights.pt")
    flat = torch.empty(nbytes, dtype=torch.uint8)
    version = [0]

    def memcpy() -> None:
        offset = 0
        for t in unique.values():
            n = t.numel() * t.element_size()
            flat[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n

    def clone() -> None:
        {n: t.clone() for n, t in state.items()}

    def publish() -> None:
        version[0] += 1
        channel.write(version[0], state)

    def old_publish() -> None:
        version[0] += 1
        tmp = old_path + ".tmp"
        torch.save({n: t.detach().contiguous() for n, t in state.items()}, tmp)
        os.replace(tmp, old_path + f".{version[0]}")
        for stale in old_dir.glob("weights.pt.*"):
            if stale.name != f"weights.pt.{version[0]}":
                stale.unlink(missing_ok=True)

    engine = Engine(dtype, str(channel.path), old_path)
    try:
        memcpy_name = "trainer: memcpy"
        for name, fn, base in (("memcpy", memcpy, None), ("clone", clone, None), ("publish", publish, memcpy_name),
                               ("publish serialised (torch.save, before)", old_publish, memcpy_name)):  # fmt: skip
            warm = []
            for _ in range(2):  # the channel's first two writes allocate its two files: the steady state reuses them
                t0 = time.perf_counter()
                fn()
                warm.append(round(time.perf_counter() - t0, 4))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row(out, label, f"trainer: {name}", times, base=base, first_two_s=warm)
        # engine-side load of the newest write, whole (a reader more than one write behind)
        publish()
        times, mem = [], []
        for _ in range(reps + 1):
            engine.call("forget")
            t0, t1, _ = engine.call("load", version[0])
            times.append(t1 - t0)
            a, b, _ = engine.call("memcpy")
            mem.append(b - a)
        row(out, label, "engine: memcpy", mem[1:])
        row(out, label, "engine: load (read_into the HFEngine's model)", times[1:], base="engine: memcpy")
        assert engine.call("check")[2]["equal"], "the engine's weights differ from the published ones"
        # end to end: the engine waits for the next version; the trainer writes it
        e2e = []
        for _ in range(reps + 1):
            engine.call("forget")
            engine.start("load", version[0] + 1)
            time.sleep(0.2)
            t0 = time.monotonic()
            publish()
            _, t1, _ = engine.result()
            e2e.append(t1 - t0)
        # the baseline: the same bytes copied once on each side (trainer memcpy + engine memcpy)
        both = median(mem[1:]) + next(x["median_s"] for x in out if x["model"] == label and x["what"] == memcpy_name)
        row(out, label, "memcpy + memcpy (both sides)", [both])
        row(
            out,
            label,
            "end-to-end: publish -> engine has the weights",
            e2e[1:],
            base="memcpy + memcpy (both sides)",
            goal=GOAL_S,
        )
        old = []
        for _ in range(reps + 1):
            engine.start("old", version[0] + 1)
            time.sleep(0.2)
            t0 = time.monotonic()
            old_publish()
            _, t1, _ = engine.result()
            old.append(t1 - t0)
        row(
            out,
            label,
            "end-to-end serialised (torch.save/load, before)",
            old[1:],
            base="memcpy + memcpy (both sides)",
            goal=GOAL_S,
        )
    finally:
        engine.stop()
        channel.close()
        for stale in old_dir.iterdir():
            stale.unlink()
        old_dir.rmdir()


def delta_steps(name: str, model, steps: int, reps_read: bool, out: list[dict], dtype: str) -> None:
    """Changed fraction per AdamW step (lr 1e-6) with a delta channel; a one-behind reader's copy."""
    import torch

    from rl_contracts.weight_channel import WeightChannel

    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    channel = WeightChannel.create(delta=True)
    reader = {n: torch.empty_like(t) for n, t in model.state_dict().items()}
    try:
        channel.write(0, model.state_dict())
        have = channel.read_into(reader).serial
        vocab = model.config.vocab_size
        for step in range(1, steps + 1):
            model.train()
            before = {n: t.clone() for n, t in model.named_parameters()}
            ids = torch.randint(3, vocab, (2, 32))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                moved = sum(int((p != before[n]).sum()) for n, p in model.named_parameters())
                w = channel.write(step, model.state_dict())
            del before
            t0 = time.perf_counter()
            r = channel.read_into(reader, have)
            read_s = time.perf_counter() - t0
            have = r.serial
            equal = all(torch.equal(reader[n], t) for n, t in model.state_dict().items())
            row(out, f"{name} {dtype}", "delta step", step=step, changed_fraction=round(w.changed_fraction, 4),
                changed_elements_fraction=round(moved / sum(p.numel() for p in model.parameters()), 4),
                changed_chunks=w.changed_chunks, chunks=w.chunks, write_s=round(w.seconds, 4),
                bytes_written=w.bytes_written, read_one_behind_s=round(read_s, 4), chunks_copied=r.chunks_copied,
                reader_equal=equal, load=loadavg())  # fmt: skip
    finally:
        channel.close()


def row(out: list[dict], model: str, what: str, times: list[float] | None = None, base: str | None = None,
        goal: float | None = None, **extra: Any) -> dict:  # fmt: skip
    r: dict[str, Any] = {"model": model, "what": what}
    if times is not None:
        r["median_s"] = round(median(times), 4)
        r["times_ms"] = [round(1000 * t, 1) for t in times]
        r["reps"] = len(times)
        r["load"] = round(loadavg(), 2)
        if base is not None:
            ref = next(x for x in reversed(out) if x["model"] == model and x["what"] == base)
            r["baseline"] = base
            r["baseline_s"] = ref["median_s"]
            r["ratio_to_baseline"] = round(r["median_s"] / ref["median_s"], 2)
        if goal is not None:
            r["goal_s"] = goal
            r["goal_over_now"] = round(goal / r["median_s"], 2)
    r.update(extra)
    print(json.dumps(r), flush=True)
    if times is not None:
        r["times_s"] = times
    out.append(r)
    return r


def run(reps: int = 5, dtypes: tuple[str, ...] = ("bfloat16", "float32"), delta: int = 3) -> list[dict]:
    import torch

    out: list[dict] = []
    for dtype in dtypes:
        bench_model(dtype, reps, out)
    if delta:
        from workers.tasks.addition import AdditionTask, build_model

        for dtype in dtypes:
            tiny = build_model(AdditionTask().tokenizer.vocab_size, seed=0).to(getattr(torch, dtype))
            delta_steps("demo", tiny, delta, False, out, dtype)
            delta_steps("smollm2-135m-shape", smollm2_model(dtype), delta, False, out, dtype)
    return out


def bench_weight_publish(quick: bool, results, reps: int) -> None:
    """benchmarks/run.py's hook: the figures as Results."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Result

    out = run(reps=reps, dtypes=("bfloat16",) if quick else ("bfloat16", "float32"), delta=2 if quick else 3)
    for r in out:
        if "median_s" not in r:
            continue
        extra = {k: v for k, v in r.items() if k in ("load", "ratio_to_baseline", "goal_over_now")}
        goal = r.get("goal_s")
        results.add(
            Result(
                f"weight_publish: {r['model']}: {r['what']}",
                "weight_publish",
                "ms",
                [1000 * t for t in r["times_s"]],
                baseline=r.get("baseline"),
                baseline_value=1000 * r["baseline_s"] if "baseline_s" in r else None,
                target=f"<= {1000 * goal:.0f} ms" if goal else None,
                met=(r["median_s"] <= goal) if goal else None,
                extra=extra,
            )
        )
    for r in out:
        if r["what"] == "delta step":
            results.add(Result(f"weight_publish: {r['model']}: changed fraction, step {r['step']}", "weight_publish",
                               "%", [100 * r["changed_fraction"]], extra={"write_s": r["write_s"]}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "both"], default="both")
    parser.add_argument("--delta-steps", type=int, default=3, help="AdamW steps of the delta measurement (0: none)")
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args()
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    dtypes = ("bfloat16", "float32") if args.dtype == "both" else (args.dtype,)
    print(json.dumps({"start": time.strftime("%H:%M:%S"), "load": loadavg(), "cpus": os.cpu_count()}), flush=True)
    out = run(args.reps, dtypes, args.delta_steps)
    print(json.dumps({"end": time.strftime("%H:%M:%S"), "load": loadavg()}), flush=True)
    for r in out:
        if "median_s" in r:
            goal = f"  goal {r['goal_s']} s / now = {r['goal_over_now']}" if "goal_s" in r else ""
            base = f"  ({r['ratio_to_baseline']}x {r['baseline']})" if "baseline" in r else ""
            print(f"{r['model']:28s} {r['what']:55s} {1000 * r['median_s']:9.1f} ms{base}{goal}")


if __name__ == "__main__":
    main()
