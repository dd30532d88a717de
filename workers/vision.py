"""Images for vision-language models (VLMs) in the in-process engine: decoding, a minimal image processor, and the
image placeholder tokens of a LLaVA-style prompt.

A LLaVA-style model (``transformers.LlavaForConditionalGeneration``) takes ``input_ids`` in which every image stands
as ``tokens_per_image`` copies of its image token (``config.image_token_index``), and ``pixel_values`` ``[N, 3, S, S]``
for the N images of the batch in the order their placeholders appear (row by row); its vision tower's features are
scattered into those positions. :class:`VisionChatFormat` renders OpenAI-style messages with ``image_url`` parts to
such ids plus the images in order; :class:`ImageProcessor` turns images into ``pixel_values`` (resize to the vision
tower's ``image_size``, scale to [0, 1], normalise with CLIP's mean and std; no download, no torchvision).

An image is PNG/JPEG/GIF/WebP bytes, a base64 ``data:`` URL, a ``PIL.Image.Image`` or a ``[3, H, W]`` float tensor in
[0, 1]. Stored ``image_ref`` parts (the sampling ledger's) become ``data:`` URLs with
``workers.ledger.multimodal.preprocess_mm_messages_for_sample`` first.

>>> from workers.models import build_tiny_vlm
>>> vlm = build_tiny_vlm()
>>> ids, images = vlm.chat.prompt([{"role": "user", "content": [
...     {"type": "image_url", "image_url": {"url": solid_png(8, 8, (255, 0, 0))}}, {"type": "text", "text": "hi"}]}])
>>> ids.count(vlm.image_token_id) == vlm.tokens_per_image, len(images), tuple(vlm.image_processor(images).shape)
(True, 1, (1, 3, 16, 16))
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from workers.engines.errors import ImagesNotSupported, ImageTokenMismatch
from workers.ledger.blobs import BlobStore
from workers.ledger.errors import ImageNotFound, UnknownContentPart, UnsupportedImageType
from workers.ledger.multimodal import IMAGE_REF, image_mime

#: CLIP's normalisation (LLaVA's image processors use it)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

ImageInput = Any  # bytes | str (data: URL) | PIL.Image.Image | Tensor [3, H, W] in [0, 1]


def image_tensor(image: ImageInput, where: str = "image") -> Tensor:
    """``image`` as a ``[3, H, W]`` float32 RGB tensor in [0, 1].

    Raises:
        UnsupportedImageType: for bytes that are no PNG/JPEG/GIF/WebP or do not decode, a string that is no base64
            ``data:`` URL, a tensor not shaped ``[3, H, W]``, or another type.
    """
    if isinstance(image, Tensor):
        if image.dim() != 3 or image.shape[0] != 3:
            raise UnsupportedImageType(f"{where}: expected a [3, H, W] image tensor, got shape {tuple(image.shape)}")
        return image.float()
    if isinstance(image, str):
        image = _data_url_bytes(image, where)
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        image_mime(data, where)  # typed error for bytes of no known image type
        from PIL import Image

        try:  # a known header over broken or hostile bytes: truncated, undecodable, a decompression bomb
            image = Image.open(io.BytesIO(data))
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise UnsupportedImageType(
                f"{where}: expected a decodable image, got {len(data)} bytes that do not decode: {exc}"
            ) from exc
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise UnsupportedImageType(
            f"{where}: expected image bytes, a base64 data: URL, a PIL image or a [3, H, W] tensor, got "
            f"{type(image).__name__}"
        )
    rgb = image.convert("RGB")
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).reshape(rgb.height, rgb.width, 3)
    return pixels.permute(2, 0, 1).float() / 255.0


def _data_url_bytes(url: str, where: str) -> bytes:
    header, comma, body = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise UnsupportedImageType(
            f"{where}: expected a base64 data URL 'data:<mime>;base64,<data>' (stored image_ref parts and paths go "
            f"through preprocess_mm_messages_for_sample first), got {shown!r}"
        )
    try:
        return base64.b64decode(body, validate=True)
    except binascii.Error as exc:
        raise UnsupportedImageType(f"{where}: the data URL's base64 does not decode ({exc})") from None


@dataclass(frozen=True)
class ImageProcessor:
    """Images to ``pixel_values``: each resized (bilinear, antialiased) to ``image_size`` x ``image_size``, scaled to
    [0, 1] and normalised per channel, ``(x - mean) / std``.

    >>> ImageProcessor(4)([torch.ones(3, 8, 8)]).shape
    torch.Size([1, 3, 4, 4])
    """

    image_size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> ImageProcessor:
        """The processor for a VLM's vision tower (its ``config.vision_config.image_size``).

        Raises:
            ImagesNotSupported: if the model has no vision config.
        """
        vision = getattr(getattr(model, "config", None), "vision_config", None)
        if vision is None or not isinstance(getattr(vision, "image_size", None), int):
            raise ImagesNotSupported(
                f"{type(model).__name__} has no vision tower (no config.vision_config.image_size): it takes text only"
            )
        return cls(vision.image_size)

    def __call__(self, images: Sequence[ImageInput]) -> Tensor:
        """``[len(images), 3, image_size, image_size]`` float32."""
        out = torch.empty(len(images), 3, self.image_size, self.image_size)
        mean = torch.tensor(self.mean).view(3, 1, 1)
        std = torch.tensor(self.std).view(3, 1, 1)
        for i, image in enumerate(images):
            pixels = image_tensor(image, f"images[{i}]")
            if pixels.shape[1:] != (self.image_size, self.image_size):
                pixels = torch.nn.functional.interpolate(
                    pixels[None], size=(self.image_size, self.image_size), mode="bilinear", antialias=True
                )[0]
            out[i] = (pixels - mean) / std
        return out


@dataclass(frozen=True)
class BlobImageSource:
    """The trainer's :class:`rl_contracts.images.ImageSource` over a blob store: the images of the rows'
    ``image_refs`` (blob keys, as ``store_mm_messages`` wrote them) read from ``blobs`` and turned into pixels by
    ``processor``. A vision task's ``image_source()`` returns one.

    >>> from workers.ledger.blobs import MemoryBlobStore
    >>> blobs = MemoryBlobStore()
    >>> key = blobs.put(solid_png(8, 8, (255, 0, 0)), ".png")
    >>> tuple(BlobImageSource(blobs, ImageProcessor(4)).pixel_values([key, key]).shape)
    (2, 3, 4, 4)
    """

    blobs: BlobStore
    processor: ImageProcessor

    def pixel_values(self, keys: Sequence[str]) -> Tensor:
        """``[len(keys), 3, S, S]``; ``ImageNotFound`` for a key the blob store does not hold."""
        images = []
        for i, key in enumerate(keys):
            try:
                images.append(self.blobs.get(key))
            except KeyError as exc:
                raise ImageNotFound(f"image_refs key {key!r} (image {i}) is not in the blob store ({exc})") from None
        return self.processor(images)


def image_token_id(model: torch.nn.Module) -> int | None:
    """A VLM's image placeholder token id (``config.image_token_index`` or ``image_token_id``); None for a text-only
    model (one without a ``vision_config``)."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    for name in ("image_token_index", "image_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def tokens_per_image(model: torch.nn.Module) -> int:
    """How many placeholder tokens one image takes in a LLaVA-style prompt: the vision tower's patch count
    ``(image_size // patch_size) ** 2``, plus one for the CLS token with ``vision_feature_select_strategy="full"``;
    ``config.image_seq_length`` when the vision config has no patch size.

    Raises:
        ImagesNotSupported: for a model without a vision config.
    """
    config: Any = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise ImagesNotSupported(f"{type(model).__name__} has no vision config: it takes text only")
    patch, size = getattr(vision, "patch_size", None), getattr(vision, "image_size", None)
    if isinstance(patch, int) and isinstance(size, int):
        full = getattr(config, "vision_feature_select_strategy", "default") == "full"
        return (size // patch) ** 2 + int(full)
    return int(config.image_seq_length)


class _Chat(Protocol):
    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class VisionChatFormat:
    """Chat messages with OpenAI content parts to a VLM's prompt: token ids in which each image is
    ``tokens_per_image`` copies of ``image_token_id``, and the images in the order of their placeholders.

    Each list content becomes text: its parts joined with newlines, an ``image_url`` part as ``image_token`` (the
    image token's text, e.g. ``"<image>"``, which the tokenizer must encode as the single id ``image_token_id``);
    ``chat`` (a ``ChatFormat``: the chat template) renders the messages, and each image token of the result is
    expanded to ``tokens_per_image`` copies, as LLaVA's processor does. ``decode`` is ``chat``'s.

    Args:
        chat: renders string-content messages to prompt ids (``HFChatFormat`` over the VLM's tokenizer).
        image_token: the text that stands for one image in the rendered messages.
        image_token_id: its token id (the model's ``config.image_token_index``).
        tokens_per_image: see :func:`tokens_per_image`.
    """

    def __init__(self, chat: _Chat, image_token: str, image_token_id: int, tokens_per_image: int):
        self.chat, self.image_token = chat, image_token
        self.image_token_id, self.tokens_per_image = image_token_id, tokens_per_image

    def prompt(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[ImageInput]]:
        """The prompt ids (image placeholders expanded) and the images, in order.

        Raises:
            UnknownContentPart: for a part that is neither ``text`` nor ``image_url`` (an ``image_ref`` names its fix).
            ImageTokenMismatch: if the rendered prompt does not hold one image token per image.
        """
        text_messages, images = self.text_messages(messages)
        ids = self.chat.prompt_ids(text_messages)
        found = ids.count(self.image_token_id)
        if found != len(images):
            raise ImageTokenMismatch(
                f"the rendered prompt holds {found} image tokens (id {self.image_token_id}, text "
                f"{self.image_token!r}), expected one per image: {len(images)}; does the tokenizer encode "
                f"{self.image_token!r} as that single id?"
            )
        out: list[int] = []
        for token in ids:
            out.extend([token] * self.tokens_per_image if token == self.image_token_id else [token])
        return out, images

    def text_messages(self, messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageInput]]:
        """The messages with string content (an image part as ``image_token``) and the images, in order."""
        out, images = [], []
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, list):
                out.append(dict(message))
                continue
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    pieces.append(part["text"])
                elif kind == "image_url":
                    spec = part["image_url"]
                    images.append(spec["url"] if isinstance(spec, dict) else spec)
                    pieces.append(self.image_token)
                else:
                    fix = " (turn stored parts into data URLs with preprocess_mm_messages_for_sample)"
                    raise UnknownContentPart(
                        f"messages[{i}].content[{j}]: expected a 'text' or 'image_url' part, got type {kind!r}"
                        + (fix if kind == IMAGE_REF else "")
                    )
            out.append({**message, "content": "\n".join(pieces)})
        return out, images

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The prompt ids of text-only ``messages`` (``ChatFormat``'s call); see :meth:`prompt` for images.

        Raises:
            ImagesNotSupported: if the messages hold images (they would be lost).
        """
        ids, images = self.prompt(messages)
        if images:
            raise ImagesNotSupported(
                f"prompt_ids returns token ids only and would drop the {len(images)} images of these messages; "
                "expected text-only messages: use prompt(messages) for the ids and the images"
            )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.chat.decode(ids)


def solid_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A ``width`` x ``height`` PNG of one colour, written without PIL (for tests and examples)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(rgb) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )
