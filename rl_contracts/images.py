"""Images in the queue's rows: references, not pixels, until the trainer builds its batch.

A row of a vision-language task carries ``image_refs`` (:data:`IMAGE_REFS`), a non-tensor field: the list of its
images' blob-store keys (``workers.ledger.multimodal``'s ``image_ref`` parts; the store is content-addressed), in
the order of the row's image placeholders. The n samples of a GRPO group carry their prompt's keys n times: a few
dozen bytes a row, never the pixels. Only the trainer turns them into ``pixel_values`` (:func:`rows_pixel_values`),
through an :class:`ImageSource` its task gives it (``Task.image_source()``; ``workers.vision.BlobImageSource`` reads
the blob store), decoding each distinct image of the batch once.

>>> class Grey:
...     def pixel_values(self, keys):
...         return torch.stack([torch.full((3, 2, 2), float(len(k))) for k in keys])
>>> pixels = rows_pixel_values([["a"], ["a"], ["bb"]], Grey())
>>> tuple(pixels.shape), pixels[:, 0, 0, 0, 0].tolist()
((3, 1, 3, 2, 2), [1.0, 1.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

#: the queue field of a row's image references: a list of blob keys (str) per row, in placeholder order
IMAGE_REFS = "image_refs"


class ImagesUnavailable(ValueError):
    """Rows carry image references, but the trainer has no :class:`ImageSource` to resolve them with (its task's
    ``image_source()`` is None: a text task)."""


class UnevenImages(ValueError):
    """The rows of one training batch hold different numbers of images (the model's pass takes ``[B, K, 3, H, W]``:
    the same ``K`` in every row), or a row's references are not a list of strings."""


class ImageSource(Protocol):
    """Resolves image references to the model's pixels."""

    def pixel_values(self, keys: Sequence[str]) -> Tensor:
        """``[len(keys), 3, H, W]`` float32: the images ``keys`` name, preprocessed for the model."""
        ...


def image_refs_of(value: Any) -> list[list[str]]:
    """A queue column of image references (a ``NonTensorStack`` as the queue returns it, or a list of rows) as
    lists of keys.

    Raises:
        UnevenImages: for a row that is not a list of strings.
    """
    rows = value.tolist() if hasattr(value, "tolist") else list(value)
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not all(isinstance(key, str) for key in row):
            raise UnevenImages(f"{IMAGE_REFS}[{i}]: expected a list of blob keys (str), got {row!r}")
    return rows


def rows_pixel_values(refs: Sequence[Sequence[str]], source: ImageSource | None) -> Tensor | None:
    """``[B, K, 3, H, W]`` pixels of the rows' images, each distinct key resolved once (a GRPO group's n rows share
    their prompt's images); None when no row has an image (a text batch).

    Raises:
        ImagesUnavailable: rows with images and no ``source``.
        UnevenImages: rows with different numbers of images.
    """
    counts = sorted({len(row) for row in refs})
    if not refs or counts == [0]:
        return None
    if len(counts) > 1:
        per_row = [len(row) for row in refs]
        raise UnevenImages(
            f"every row of a training batch must hold the same number of images, got {per_row} images per row"
        )
    if source is None:
        raise ImagesUnavailable(
            f"the rows carry {IMAGE_REFS} ({counts[0]} image(s) per row) but the trainer has no image source: its "
            "task's image_source() returned None (a text task); a vision task returns one"
        )
    distinct = list(dict.fromkeys(key for row in refs for key in row))
    pixels = source.pixel_values(distinct)
    if pixels.dim() != 4 or pixels.shape[0] != len(distinct):
        raise ValueError(
            f"the image source returned shape {tuple(pixels.shape)} for {len(distinct)} keys, expected "
            f"[{len(distinct)}, 3, H, W]"
        )
    position = {key: i for i, key in enumerate(distinct)}
    index = torch.tensor([[position[key] for key in row] for row in refs], dtype=torch.int64)
    return pixels[index]
