"""Multi-modal samples: images in OpenAI's content-part form, stored once in the blob store, kept in the ledger's rows
as references, and sent to the inference service as base64 ``data:`` URLs.

A message's ``content`` is a string or a list of parts:

    {"type": "text", "text": "What is in the picture?"}
    {"type": "image_url", "image_url": {"url": URL}}    URL: "data:image/png;base64,...", "https://...",
                                                        "file:///x.png", a local path "x.png", or the bytes
    {"type": "image_ref", "blob": KEY, "mime": "image/png"}   the stored form: KEY is the blob store's key

``store_mm_messages`` turns every image it can read (a data URL, a path, bytes; an http(s) URL only with
``fetch_http=True``) into an ``image_ref`` (the blob store is content-addressed: the same image is stored once, however
many tasks, records or samples of a GRPO group refer to it); ``preprocess_mm_messages_for_sample`` (AgentRL's name)
turns every image into a ``data:`` URL for the request. An http(s) URL is passed through as it is unless the caller
allows fetching it (``fetch_http=True``, with httpx). Image bytes must be PNG, JPEG, GIF or WebP (checked by their
magic bytes).

>>> from workers.ledger.blobs import DirectoryBlobStore
>>> blobs = DirectoryBlobStore("/tmp/doctest-mm-blobs")
>>> png = b"\\x89PNG\\r\\n\\x1a\\n" + bytes(8)
>>> stored = store_mm_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}], blobs)
>>> stored[0]["content"][0]["type"], stored[0]["content"][0]["mime"]
('image_ref', 'image/png')
>>> preprocess_mm_messages_for_sample(stored, blobs)[0]["content"][0]["image_url"]["url"]
'data:image/png;base64,iVBORw0KGgoAAAAAAAAAAA=='
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.ledger.blobs import BlobStore
from workers.ledger.errors import ImageNotFound, UnknownContentPart, UnsupportedImageType

IMAGE_REF = "image_ref"
PART_TYPES = ("text", "image_url", IMAGE_REF)
IMAGE_TYPES = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp"}
SOURCES = "a data: URL, an http(s):// URL, a file:// URL, a local path, or bytes"


def image_mime(data: bytes, source: str = "image") -> str:
    """The MIME type of ``data`` by its magic bytes; ``UnsupportedImageType`` unless PNG, JPEG, GIF or WebP."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    raise UnsupportedImageType(
        f"{source}: expected a PNG, JPEG, GIF or WebP image (by its magic bytes), got {len(data)} bytes starting "
        f"{data[:12]!r}"
    )


def data_url(data: bytes, source: str = "image") -> str:
    """``data`` as a base64 ``data:`` URL (its type checked by its magic bytes)."""
    return f"data:{image_mime(data, source)};base64,{base64.b64encode(data).decode('ascii')}"


def is_multimodal(messages: list[dict[str, Any]]) -> bool:
    """Whether any message's content is a list of parts (a text-only conversation needs no conversion)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def store_mm_messages(
    messages: list[dict[str, Any]], blobs: BlobStore, *, fetch_http: bool = False, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """``messages`` with every readable image stored in ``blobs`` and replaced by an ``image_ref`` part (a new list;
    string contents, text parts and references are kept as they are; an http(s) URL too unless ``fetch_http``)."""

    def to_ref(data: bytes, source: str, part: dict[str, Any]) -> dict[str, Any]:
        mime = image_mime(data, source)
        ref = {"type": IMAGE_REF, "blob": blobs.put(data, suffix=IMAGE_TYPES[mime]), "mime": mime}
        return ref | ({"detail": part["detail"]} if "detail" in part else {})

    return _convert(messages, blobs, fetch_http, timeout_s, to_ref, keep_refs=True)


def preprocess_mm_messages_for_sample(
    messages: list[dict[str, Any]], blobs: BlobStore, *, fetch_http: bool = False, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """``messages`` as the inference service takes them: every image (an ``image_ref``, a path, bytes, a data URL;
    an http(s) URL only with ``fetch_http``, else passed through) as an ``image_url`` part with a base64 ``data:``
    URL (a new list; string contents and text parts are kept as they are)."""

    def to_url(data: bytes, source: str, part: dict[str, Any]) -> dict[str, Any]:
        image_url = {"url": data_url(data, source)} | ({"detail": part["detail"]} if "detail" in part else {})
        return {"type": "image_url", "image_url": image_url}

    return _convert(messages, blobs, fetch_http, timeout_s, to_url, keep_refs=False)


def image_refs(messages: list[dict[str, Any]]) -> list[str]:
    """The blob keys of the ``image_ref`` parts of ``messages`` (stored by :func:`store_mm_messages`), in the order
    the parts appear: a row's ``image_refs`` field (``rl_contracts.images.IMAGE_REFS``), what the trainer turns into
    pixels. The n samples of a GRPO group carry their prompt's keys, not n copies of its pixels."""
    return [
        part["blob"]
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == IMAGE_REF
    ]


def store_mm_payload(value: Any, blobs: BlobStore, *, fetch_http: bool = False) -> Any:
    """``value`` (a task's field: any JSON-like structure) with the images of every message in it (a dict with
    ``role`` and a list ``content``) stored as ``image_ref`` parts; ``value`` itself when it holds none."""
    if isinstance(value, list):
        if is_multimodal(value) and all(isinstance(m, dict) and "role" in m for m in value):
            return store_mm_messages(value, blobs, fetch_http=fetch_http)
        items = [store_mm_payload(v, blobs, fetch_http=fetch_http) for v in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if isinstance(value, dict):
        if "role" in value and isinstance(value.get("content"), list):
            return store_mm_messages([value], blobs, fetch_http=fetch_http)[0]
        fields = {k: store_mm_payload(v, blobs, fetch_http=fetch_http) for k, v in value.items()}
        return fields if any(fields[k] is not value[k] for k in value) else value
    return value


Convert = Callable[[bytes, str, dict[str, Any]], dict[str, Any]]


def _convert(
    messages: list[dict[str, Any]],
    blobs: BlobStore,
    fetch_http: bool,
    timeout_s: float,
    convert: Convert,
    keep_refs: bool,
) -> list[dict[str, Any]]:
    if not is_multimodal(messages):
        return list(messages)
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise UnknownContentPart(f"{where}: a text part needs a string 'text', got {_shown(part)}")
                parts.append(part)
            elif kind == IMAGE_REF:
                key = part.get("blob")
                if not isinstance(key, str):
                    raise UnknownContentPart(
                        f"{where}: an image_ref part needs a string 'blob' key, got {_shown(part)}"
                    )
                if keep_refs:
                    parts.append(part)
                    continue
                try:
                    data = blobs.get(key)
                except KeyError as exc:
                    raise ImageNotFound(f"{where}: image_ref blob {key!r} is not in the blob store ({exc})") from None
                parts.append(convert(data, f"{where} (blob {key})", part))
            elif kind == "image_url":
                image_url = part.get("image_url")
                spec = image_url if isinstance(image_url, dict) else {"url": image_url}
                url = spec.get("url")
                read = _read(url, where, fetch_http, timeout_s)
                parts.append(part if read is None else convert(read, f"{where} ({_shown(url)})", spec))
            else:
                got = f"type {kind!r}" if isinstance(part, dict) else f"a {type(part).__name__}"
                raise UnknownContentPart(
                    f"{where}: expected a content part of type {', '.join(map(repr, PART_TYPES))}, got {got}"
                )
        out.append({**message, "content": parts})
    return out


def _read(url: Any, where: str, fetch_http: bool, timeout_s: float) -> bytes | None:
    """The image bytes ``url`` names; None for an http(s) URL not to be fetched (it is passed through)."""
    if isinstance(url, bytes | bytearray | memoryview):
        return bytes(url)
    if not isinstance(url, str) or not url:
        raise UnsupportedImageType(f"{where}: expected an image_url.url of {SOURCES}, got {_shown(url)}")
    if url.startswith("data:"):
        header, comma, body = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise UnsupportedImageType(
                f"{where}: expected a base64 data URL 'data:<mime>;base64,<data>', got {_shown(url)}"
            )
        try:
            return base64.b64decode(body, validate=True)
        except binascii.Error as exc:
            raise UnsupportedImageType(f"{where}: the data URL's base64 does not decode ({exc})") from None
    if url.startswith(("http://", "https://")):
        if not fetch_http:
            return None
        import httpx

        try:
            response = httpx.get(url, timeout=timeout_s, follow_redirects=True)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ImageNotFound(f"{where}: fetching {url} failed: {type(exc).__name__}: {exc}") from None
        return response.content
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    elif "://" in url:
        raise UnsupportedImageType(f"{where}: expected an image_url.url of {SOURCES}, got {_shown(url)}")
    path = Path(url).expanduser()
    if not path.is_file():
        raise ImageNotFound(f"{where}: expected a readable image file, got the path {url!r}, which is no file")
    return path.read_bytes()


def _shown(url: Any) -> str:
    if isinstance(url, bytes | bytearray | memoryview):
        return f"{len(url)} bytes"
    text = repr(url)
    return text if len(text) <= 80 else text[:77] + "..."
