"""Colours: a vision-language toy task. Each prompt is a picture of one solid colour and the question "What colour is
this?"; the answer is the colour's name. The policy is a tiny random LLaVA (``workers.models.build_tiny_vlm``), so a
run trains a vision-language model end to end on CPU with nothing downloaded.

The pictures are PNGs written in process (``workers.vision.solid_png``), one per colour, stored in a blob store the
task fills when it is built; a prompt row carries its picture's blob key (``image_refs``,
``rl_contracts.images.IMAGE_REFS``), never the pixels. Every process that builds the task (the driver, the engines,
the trainer ranks) writes the same bytes and so gets the same content-addressed keys: the rollout engine and the
trainer resolve a row's keys through the same :meth:`ColorsTask.image_source`, to the same pixels.

With ``two_pictures`` (a fraction of the prompts, 0 by default), a prompt shows two pictures and asks "Which colours
are these?"; its answer is both names, "red and blue": a batch then mixes rows with one and two images, which the
trainer takes in one batch (``rl_contracts.images.image_counts``).

The reward is read from the answer's characters: the fraction of the colour's name the response starts with
(case and leading spaces ignored), 1.0 for the whole name; a random policy earns a little of it now and then (the
first letter), which GRPO can build on.

>>> task = ColorsTask()
>>> [prompt] = task.prompts("train", 1, seed=0)
>>> prompt["answer"] in COLOURS, len(prompt["image_refs"])
(True, 1)
>>> task.reward(" Gre", answer="green"), task.reward("green!", answer="green"), task.reward("red", answer="green")
(0.6, 1.0, 0.0)
"""

from __future__ import annotations

import random
from typing import Any

from rl_contracts.images import IMAGE_REFS
from rl_contracts.task import Task
from workers.ledger.blobs import MemoryBlobStore
from workers.models import build_tiny_vlm
from workers.vision import BlobImageSource, solid_png

#: the task's colours and their RGB; the names start with distinct letters
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 160, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 230, 0),
    "purple": (128, 0, 160),
    "orange": (255, 140, 0),
}
QUESTION = "What colour is this?"
QUESTION_TWO = "Which colours are these?"


def colour_reward(response_text: str, answer: str) -> float:
    """The fraction of ``answer`` that ``response_text`` starts with (case and leading whitespace ignored)."""
    text, matched = response_text.lstrip().lower(), 0
    for got, expected in zip(text, answer, strict=False):
        if got != expected:
            break
        matched += 1
    return matched / len(answer)


class ColorsTask(Task):
    """Name the colour of a picture; see the module docstring.

    Args:
        image_size: the side of each PNG, in pixels (the image processor resizes it to the vision tower's input).
        hidden_size, num_layers: the tiny LLaVA's text model (``build_tiny_vlm``).
        model_seed: the initial weights' seed.
        two_pictures: the fraction of prompts (drawn per prompt from the seed) with two pictures and the question
            "Which colours are these?" (answer: "red and blue"); 0: every prompt shows one picture.
    """

    reward_fields = ("answer",)

    def __init__(
        self,
        image_size: int = 16,
        hidden_size: int = 64,
        num_layers: int = 2,
        model_seed: int = 0,
        two_pictures: float = 0.0,
    ):
        if not 0.0 <= two_pictures <= 1.0:
            raise ValueError(f"two_pictures is a fraction of the prompts, in [0, 1]; got {two_pictures}")
        self.two_pictures = two_pictures
        self.model_kwargs = {"hidden_size": hidden_size, "num_layers": num_layers, "seed": model_seed}
        vlm = build_tiny_vlm(**self.model_kwargs)
        self._tokenizer, self.chat, self.image_processor = vlm.tokenizer, vlm.chat, vlm.image_processor
        self.blobs = MemoryBlobStore()
        self.image_keys = {
            name: self.blobs.put(solid_png(image_size, image_size, rgb), ".png") for name, rgb in COLOURS.items()
        }
        self._source = BlobImageSource(self.blobs, self.image_processor)
        # every prompt renders alike around its picture: the ids are the same for every colour
        picture = solid_png(image_size, image_size, (0, 0, 0))
        part = {"type": "image_url", "image_url": {"url": picture}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
        self.prompt_ids, _ = self.chat.prompt(messages)
        messages = [{"role": "user", "content": [part, part, {"type": "text", "text": QUESTION_TWO}]}]
        self.two_prompt_ids, _ = self.chat.prompt(messages)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def prompts(self, split: str, num: int, seed: int) -> list[dict[str, Any]]:
        """``num`` prompts with colours drawn from ``seed`` (the eval split from another stream): ``prompt_ids``,
        ``answer`` (the colour's name) and ``image_refs`` (its picture's blob key); with ``two_pictures``, some
        prompts with two pictures (two distinct colours, the answer "first and second") and their two keys."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{split}-{seed}")
        out = []
        for _ in range(num):
            if self.two_pictures and rng.random() < self.two_pictures:
                names = rng.sample(list(COLOURS), 2)
                ids, answer = self.two_prompt_ids, " and ".join(names)
            else:  # the one-picture draws of a task without two_pictures are as they always were
                names = [rng.choice(list(COLOURS))]
                ids, answer = self.prompt_ids, names[0]
            out.append({"prompt_ids": list(ids), "answer": answer, IMAGE_REFS: [self.image_keys[n] for n in names]})
        return out

    def reward(self, response_text: str, **fields: str) -> float:
        return colour_reward(response_text, fields["answer"])

    def build_policy(self) -> Any:
        return build_tiny_vlm(**self.model_kwargs).model

    def image_source(self) -> BlobImageSource:
        """The blob store of the task's pictures, read with the tiny LLaVA's image processor."""
        return self._source
