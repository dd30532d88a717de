"""Multi-modal samples (``workers/ledger/multimodal.py``): images in OpenAI content parts are stored once in the
blob store, kept in the ledger's rows as ``image_ref`` parts, and sent to the inference service as base64 data URLs."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.workers.ledger.test_services import completion as services_completion
from workers.ledger import (
    AsyncSampler,
    DirectoryBlobStore,
    ImageNotFound,
    InferenceClient,
    InferenceService,
    Ledger,
    MultiModalError,
    SamplingConfig,
    SamplingScheduler,
    Task,
    UnknownContentPart,
    UnsupportedImageType,
    preprocess_mm_messages_for_sample,
    register_new_model,
    store_mm_messages,
)
from workers.ledger.multimodal import image_mime

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(24))  # the magic bytes are all the checks read
JPEG = b"\xff\xd8\xff\xe0" + bytes(12)
GIF = b"GIF89a" + bytes(10)
WEBP = b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(8)


def png_url(data: bytes = PNG) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Describe images."}, {"role": "user", "content": list(parts)}]


def image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def blob_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@register_new_model
class PictureTask(Task):
    inputs: list[dict]
    target: str


SEEN_INPUTS: list[list[dict[str, Any]]] = []  # the task inputs the sampler claimed


class PictureSampler(AsyncSampler):
    async def run(self) -> None:
        assert isinstance(self.task, PictureTask)
        SEEN_INPUTS.append(self.task.inputs)
        completion = await self.create_chat_completions(self.task.inputs, n=4)
        await self.record_completion(self.task.inputs, completion)

    async def evaluate_record(self, record: Any) -> float:
        return 1.0


def completion(n: int) -> dict[str, Any]:
    return services_completion(n, "a cat")


def test_a_grpo_group_stores_its_image_once_records_references_and_sends_base64(tmp_path):
    picture = tmp_path / "cat.png"
    picture.write_bytes(PNG)
    bodies: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=completion(bodies[-1]["n"]))

    cfg = SamplingConfig(output_dir=str(tmp_path / "run"))
    ledger = Ledger(cfg.ledger_url)
    ledger.register_service(InferenceService(name="engine-0", url="http://engine/v1", model=cfg.model))
    client = InferenceClient(ledger, cfg, transport=httpx.MockTransport(answer))
    blobs = DirectoryBlobStore(tmp_path / "blobs")
    task = PictureTask(inputs=user({"type": "text", "text": "What is it?"}, image(str(picture))), target="cat")
    scheduler = SamplingScheduler(cfg, PictureSampler, [task], ledger=ledger, inference=client, blobs=blobs)
    assert scheduler.write_epoch(0)

    async def one() -> None:
        async with PictureSampler(cfg, ledger=ledger, inference=client, blobs=blobs) as sampler:
            await sampler.run()
        await client.aclose()

    asyncio.run(one())

    (key,) = [str(p.relative_to(tmp_path / "blobs")) for p in blob_files(tmp_path / "blobs")]  # one blob, not 1+4
    ref = {"type": "image_ref", "blob": key, "mime": "image/png"}
    assert key.endswith(".png")
    assert SEEN_INPUTS[-1][1]["content"][1] == ref  # the task row keeps the reference
    sent = bodies[0]["messages"][1]["content"]
    assert sent == [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": png_url()}}]
    records = ledger.records()
    assert len(records) == 4
    for record in records:  # the records keep the reference, not the pixels
        assert record.messages[1]["content"][1] == ref
        assert record.messages[-1] == {"role": "assistant", "content": "a cat"}


class BytesSampler(AsyncSampler):
    """Builds its messages with the image's bytes in them (not from the task row)."""

    async def run(self) -> None:
        messages = user({"type": "text", "text": "What is it?"}, image(PNG))
        await self.record_completion(messages, await self.create_chat_completions(messages, n=4))

    async def evaluate_record(self, record: Any) -> float:
        return 0.0


def test_the_samples_of_a_group_built_from_bytes_share_one_blob(tmp_path):
    cfg = SamplingConfig(output_dir=str(tmp_path / "run"))
    ledger = Ledger(cfg.ledger_url)
    ledger.register_service(InferenceService(name="engine-0", url="http://engine/v1", model=cfg.model))
    answer = httpx.MockTransport(lambda r: httpx.Response(200, json=completion(json.loads(r.content)["n"])))
    client = InferenceClient(ledger, cfg, transport=answer)
    blobs = DirectoryBlobStore(tmp_path / "blobs")
    text_task = PictureTask(inputs=[{"role": "user", "content": "-"}], target="cat")
    assert SamplingScheduler(cfg, BytesSampler, [text_task], ledger=ledger, inference=client, blobs=blobs).write_epoch(
        0
    )
    assert blob_files(tmp_path / "blobs") == []  # a text task stores nothing

    async def one() -> None:
        async with BytesSampler(cfg, ledger=ledger, inference=client, blobs=blobs) as sampler:
            await sampler.run()
        await client.aclose()

    asyncio.run(one())

    (blob,) = blob_files(tmp_path / "blobs")  # 4 samples, one blob
    assert blob.read_bytes() == PNG
    refs = [record.messages[1]["content"][1] for record in ledger.records()]
    assert refs == [{"type": "image_ref", "blob": str(blob.relative_to(tmp_path / "blobs")), "mime": "image/png"}] * 4


def test_references_round_trip_to_the_same_bytes_and_are_json(tmp_path):
    blobs = DirectoryBlobStore(tmp_path)
    messages = user(
        {"type": "text", "text": "Compare."},
        {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
        image(JPEG),
    )

    stored = store_mm_messages(messages, blobs)

    assert json.loads(json.dumps(stored)) == stored
    assert [p["type"] for p in stored[1]["content"]] == ["text", "image_ref", "image_ref"]
    assert stored[1]["content"][1]["detail"] == "low" and stored[1]["content"][2]["mime"] == "image/jpeg"
    assert messages[1]["content"][1]["image_url"]["url"] == PNG  # the caller's messages are not changed
    assert store_mm_messages(stored, blobs) == stored  # references stay references
    sent = preprocess_mm_messages_for_sample(stored, blobs)
    assert sent[0] == messages[0] and sent[1]["content"][0] == {"type": "text", "text": "Compare."}
    assert sent[1]["content"][1] == {"type": "image_url", "image_url": {"url": png_url(), "detail": "low"}}
    data = base64.b64decode(sent[1]["content"][2]["image_url"]["url"].removeprefix("data:image/jpeg;base64,"))
    assert data == JPEG
    assert len(blob_files(tmp_path)) == 2


@pytest.mark.parametrize("source", ["path", "file_url", "bytes", "bytearray", "data_url"])
def test_paths_bytes_and_data_urls_become_base64_data_urls(tmp_path, source):
    picture = tmp_path / "x.png"
    picture.write_bytes(PNG)
    url = {
        "path": str(picture),
        "file_url": f"file://{picture}",
        "bytes": PNG,
        "bytearray": bytearray(PNG),
        "data_url": png_url(),
    }[source]

    sent = preprocess_mm_messages_for_sample(user(image(url)), DirectoryBlobStore(tmp_path / "blobs"))

    assert sent[1]["content"] == [{"type": "image_url", "image_url": {"url": png_url()}}]


@pytest.mark.parametrize(
    ("data", "mime"), [(PNG, "image/png"), (JPEG, "image/jpeg"), (GIF, "image/gif"), (WEBP, "image/webp")]
)
def test_the_image_type_is_read_from_the_magic_bytes(tmp_path, data, mime):
    assert image_mime(data) == mime
    sent = preprocess_mm_messages_for_sample(user(image(data)), DirectoryBlobStore(tmp_path))
    assert sent[1]["content"][0]["image_url"]["url"] == f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_text_only_messages_are_passed_as_they_are(tmp_path):
    messages = [{"role": "user", "content": "Say pear."}]
    assert preprocess_mm_messages_for_sample(messages, DirectoryBlobStore(tmp_path)) == messages
    assert store_mm_messages(messages, DirectoryBlobStore(tmp_path)) == messages
    assert blob_files(tmp_path) == []


class _PictureServer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = self.path == "/cat.png"
        self.send_response(200 if found else 404)
        self.end_headers()
        self.wfile.write(PNG if found else b"no")

    def log_message(self, *args: Any) -> None:
        pass


def test_an_http_url_passes_through_unless_fetching_is_allowed(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PictureServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    blobs = DirectoryBlobStore(tmp_path)
    try:
        messages = user(image(f"{base}/cat.png"))
        assert preprocess_mm_messages_for_sample(messages, blobs) == messages
        assert store_mm_messages(messages, blobs) == messages and blob_files(tmp_path) == []

        fetched = preprocess_mm_messages_for_sample(messages, blobs, fetch_http=True)
        assert fetched[1]["content"] == [{"type": "image_url", "image_url": {"url": png_url()}}]
        assert store_mm_messages(messages, blobs, fetch_http=True)[1]["content"][0]["type"] == "image_ref"
        with pytest.raises(ImageNotFound, match=r"messages\[1\]\.content\[0\]: fetching .*/gone\.png failed: .*404"):
            preprocess_mm_messages_for_sample(user(image(f"{base}/gone.png")), blobs, fetch_http=True)
    finally:
        server.shutdown()
        server.server_close()


def test_bad_content_gets_typed_errors_naming_what_was_expected(tmp_path):
    blobs = DirectoryBlobStore(tmp_path)
    with pytest.raises(
        UnknownContentPart,
        match=r"messages\[1\]\.content\[1\]: expected a content part of type 'text', 'image_url', 'image_ref', "
        r"got type 'input_audio'",
    ):
        preprocess_mm_messages_for_sample(user({"type": "text", "text": "hi"}, {"type": "input_audio"}), blobs)
    with pytest.raises(UnknownContentPart, match=r"content\[0\]: expected a content part .*, got a str"):
        store_mm_messages(user("just text"), blobs)  # type: ignore[arg-type]
    with pytest.raises(
        ImageNotFound, match=r"content\[0\]: expected a readable image file, got the path '.*nope\.png'"
    ):
        store_mm_messages(user(image(str(tmp_path / "nope.png"))), blobs)
    with pytest.raises(
        UnsupportedImageType,
        match=r"content\[0\] \(6 bytes\): expected a PNG, JPEG, GIF or WebP image \(by its magic bytes\), got 6 "
        r"bytes starting b'BM\\x00\\x00\\x00\\x00'",
    ):
        store_mm_messages(user(image(b"BM\x00\x00\x00\x00")), blobs)
    with pytest.raises(UnsupportedImageType, match=r"expected an image_url\.url of a data: URL, .*, got 'ftp://h/x"):
        preprocess_mm_messages_for_sample(user(image("ftp://h/x.png")), blobs)
    with pytest.raises(UnsupportedImageType, match=r"expected a base64 data URL 'data:<mime>;base64,<data>'"):
        preprocess_mm_messages_for_sample(user(image("data:image/png,raw")), blobs)
    with pytest.raises(ImageNotFound, match=r"image_ref blob 'ab/missing\.png' is not in the blob store"):
        preprocess_mm_messages_for_sample(user({"type": "image_ref", "blob": "ab/missing.png"}), blobs)
    assert issubclass(ImageNotFound, FileNotFoundError) and issubclass(UnsupportedImageType, MultiModalError)
    assert blob_files(tmp_path) == []
