"""Image references in the queue's rows and the pixels the trainer resolves them to (``rl_contracts.images``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tensordict import NonTensorStack

from rl_contracts.images import (
    ImagesUnavailable,
    UnevenImages,
    image_counts,
    image_refs_of,
    rows_images,
    rows_pixel_values,
)


class Shades:
    """Each key's image a constant shade (its length), recording the keys of every call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def pixel_values(self, keys: Sequence[str]) -> torch.Tensor:
        self.calls.append(list(keys))
        return torch.stack([torch.full((3, 2, 2), float(len(key))) for key in keys])


def test_each_distinct_image_is_resolved_once_and_every_row_gets_its_own_in_order():
    source = Shades()
    # two groups of three rows, two images per row; the groups share an image
    refs = [["a", "bbb"]] * 3 + [["cc", "a"]] * 3
    pixels = rows_pixel_values(refs, source)
    assert source.calls == [["a", "bbb", "cc"]]
    assert pixels is not None and pixels.shape == (6, 2, 3, 2, 2)
    assert pixels[:, :, 0, 0, 0].tolist() == [[1.0, 3.0]] * 3 + [[2.0, 1.0]] * 3


def test_rows_without_images_need_no_source():
    assert rows_pixel_values([[], []], None) is None
    assert rows_pixel_values([], None) is None


def test_images_without_a_source_or_malformed_references_are_typed_errors():
    with pytest.raises(ImagesUnavailable, match=r"the rows carry image_refs \(up to 2 image\(s\) per row\) but the"):
        rows_pixel_values([["a"], [], ["a", "b"]], None)
    with pytest.raises(UnevenImages, match=r"image_refs\[1\]: expected a list of blob keys \(str\), got 'a'"):
        image_refs_of([["a"], "a"])


def test_rows_with_different_numbers_of_images_are_padded_and_counted_and_give_back_exactly_their_images():
    """Before, rows holding 1, 0 and 2 images were refused (UnevenImages); now each row's images fill its first
    slots, zeros the rest, and ``rows_images`` hands the model exactly the real ones, row by row."""
    refs = [["a"], [], ["bb", "a"], ["ccc"]]
    pixels = rows_pixel_values(refs, Shades())
    assert pixels is not None and pixels.shape == (4, 2, 3, 2, 2)
    assert pixels[:, :, 0, 0, 0].tolist() == [[1.0, 0.0], [0.0, 0.0], [2.0, 1.0], [3.0, 0.0]]
    counts = image_counts(refs)
    assert counts.tolist() == [1, 0, 2, 1] and counts.dtype == torch.int64
    assert rows_images(pixels, counts)[:, 0, 0, 0].tolist() == [1.0, 2.0, 1.0, 3.0]
    assert rows_images(pixels[1:2], counts[1:2]).shape == (0, 3, 2, 2)  # a text row's micro-batch: no images
    assert rows_images(pixels, None).shape == (8, 3, 2, 2)  # no counts: every slot is an image
    with pytest.raises(
        UnevenImages, match=r"image_counts must be \[4\] integers between 0 and 2 .* got \[1, 0, -1, 1\]"
    ):
        rows_images(pixels, torch.tensor([1, 0, -1, 1]))
    with pytest.raises(UnevenImages, match=r"image_counts must be \[4\] integers .* torch.float32\)"):
        rows_images(pixels, counts.float())


def test_a_source_of_the_wrong_shape_is_refused():
    class Flat:
        def pixel_values(self, keys: Sequence[str]) -> torch.Tensor:
            return torch.zeros(len(keys), 12)

    with pytest.raises(ValueError, match=r"returned shape \(1, 12\) for 1 keys, expected \[1, 3, H, W\]"):
        rows_pixel_values([["a"]], Flat())


def test_the_queue_column_reads_back_as_lists_of_keys():
    assert image_refs_of(NonTensorStack(["k1"], ["k1"], [])) == [["k1"], ["k1"], []]
    assert image_refs_of([["k1", "k2"]]) == [["k1", "k2"]]
