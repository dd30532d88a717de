"""Images in the queue's rows: references, not pixels, until the trainer builds its batch.

A row of a vision-language task carries ``image_refs`` (:data:`IMAGE_REFS`), a non-tensor field: the list of its
images' blob-store keys (``workers.ledger.multimodal``'s ``image_ref`` parts; the store is content-addressed), in
the order of the row's image placeholders. The n samples of a GRPO group carry their prompt's keys n times: a few
dozen bytes a row, never the pixels. Only the trainer turns them into ``pixel_values`` (:func:`rows_pixel_values`),
through an :class:`ImageSource` its task gives it (``Task.image_source()``; ``workers.vision.BlobImageSource`` reads
the blob store), decoding each distinct image of the batch once.

Rows of one batch may hold different numbers of images (a text prompt none, a comparison two): the batch's pixels
are padded to its most images per row, ``[B, K_max, 3, H, W]``, and :func:`image_counts` says how many of each row's
``K_max`` are real (``trainers.fsdp.IMAGE_COUNTS``); the model's pass takes exactly those, row by row.

>>> class Grey:
...     def pixel_values(self, keys):
...         return torch.stack([torch.full((3, 2, 2), float(len(k))) for k in keys])
>>> pixels = rows_pixel_values([["a"], ["a"], ["bb"]], Grey())
>>> tuple(pixels.shape), pixels[:, 0, 0, 0, 0].tolist()
((3, 1, 3, 2, 2), [1.0, 1.0, 2.0])
>>> mixed = [["a", "bb"], [], ["a"]]
>>> tuple(rows_pixel_values(mixed, Grey()).shape), image_counts(mixed).tolist()
((3, 2, 3, 2, 2), [2, 0, 1])
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
    """Malformed images of a batch: a row's references are not a list of strings, or the per-row image counts do
    not fit the pixels (``[B]`` counts between 0 and ``K`` for ``[B, K, 3, H, W]`` pixels). Rows with different
    numbers of images are not malformed: see :func:`image_counts`."""


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


def image_counts(refs: Sequence[Sequence[str]]) -> Tensor:
    """``[B]`` int64: how many images each row holds, i.e. how many of its ``K_max`` slots of
    :func:`rows_pixel_values` are real images (the rest is zero padding)."""
    return torch.tensor([len(row) for row in refs], dtype=torch.int64)


def rows_pixel_values(refs: Sequence[Sequence[str]], source: ImageSource | None) -> Tensor | None:
    """``[B, K_max, 3, H, W]`` pixels of the rows' images, ``K_max`` the most images a row holds: row ``b``'s images
    in its first ``len(refs[b])`` slots, zeros after them (:func:`image_counts` tells them apart). Each distinct key
    is resolved once (a GRPO group's n rows share their prompt's images); None when no row has an image (a text
    batch).

    Raises:
        ImagesUnavailable: rows with images and no ``source``.
    """
    most = max((len(row) for row in refs), default=0)
    if most == 0:
        return None
    if source is None:
        raise ImagesUnavailable(
            f"the rows carry {IMAGE_REFS} (up to {most} image(s) per row) but the trainer has no image source: its "
            "task's image_source() returned None (a text task); a vision task returns one"
        )
    distinct = list(dict.fromkeys(key for row in refs for key in row))
    pixels = source.pixel_values(distinct)
    if pixels.dim() != 4 or pixels.shape[0] != len(distinct):
        raise ValueError(
            f"the image source returned shape {tuple(pixels.shape)} for {len(distinct)} keys, expected "
            f"[{len(distinct)}, 3, H, W]"
        )
    out = pixels.new_zeros((len(refs), most, *pixels.shape[1:]))
    position = {key: i for i, key in enumerate(distinct)}
    for b, row in enumerate(refs):
        if row:
            out[b, : len(row)] = pixels[torch.tensor([position[key] for key in row], dtype=torch.int64)]
    return out


def rows_images(pixel_values: Tensor, counts: Tensor | None) -> Tensor:
    """The ``[N, 3, H, W]`` images a LLaVA-style model's forward takes (the batch's images, row by row, in placeholder
    order) from ``[B, K, 3, H, W]`` pixels and their rows' ``[B]`` image counts (None: every row's ``K`` slots are
    images; ``[B, 3, H, W]`` pixels are one image per row).

    Raises:
        UnevenImages: counts that are not ``[B]`` integers between 0 and ``K``.
    """
    if pixel_values.dim() == 4 or counts is None:
        return pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values
    rows, most = pixel_values.shape[:2]
    valid = counts.shape == (rows,) and not counts.is_floating_point()
    if not valid or (rows and not 0 <= int(counts.min()) <= int(counts.max()) <= most):
        raise UnevenImages(
            f"image_counts must be [{rows}] integers between 0 and {most} for pixel_values of shape "
            f"{tuple(pixel_values.shape)}, got {counts.tolist()} (shape {tuple(counts.shape)}, {counts.dtype})"
        )
    keep = torch.arange(most, device=pixel_values.device) < counts.to(pixel_values.device)[:, None]
    return pixel_values[keep]
