"""A ``rollout.generate_fn`` for tests that need a rollout caught in flight: the built-in single-turn rollout, except
that a request holding one of the prompts listed in the JSON file ``gate`` waits for as long as that file exists."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from workers.agents.rollout_fns import single_turn_generate


async def gated_generate(prompts: list[dict[str, Any]], engine: Any, *, gate: str, **kwargs: Any) -> list[Any]:
    while os.path.exists(gate):
        try:
            with open(gate) as f:
                blocked = {tuple(ids) for ids in json.load(f)["prompt_ids"]}
        except FileNotFoundError:
            break
        if not any(tuple(p["prompt_ids"]) in blocked for p in prompts):
            break
        await asyncio.sleep(0.2)
    return await single_turn_generate(prompts, engine, **kwargs)
