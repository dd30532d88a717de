"""A blob store for large objects that records reference (images, files, long observations): the ledger keeps
their keys, never their bytes. A directory by default; an S3-compatible bucket (MinIO, S3, ...) through the
``minio`` SDK when ``oss_connection_string`` is ``http(s)://ACCESS_KEY:SECRET_KEY@HOST:PORT/BUCKET``.

>>> store = open_blob_store(None, "/tmp/doctest-blobs")
>>> key = store.put(b"image bytes", suffix=".png")
>>> store.get(key)
b'image bytes'
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote

from workers.ledger.errors import MalformedConnectionString
from workers.ledger.schema import redact


class BlobStore(Protocol):
    def put(self, data: bytes, suffix: str = "") -> str:
        """Store ``data``; its key (content-addressed: the same bytes get the same key)."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key`` (``KeyError`` if none)."""
        ...


def blob_key(data: bytes, suffix: str) -> str:
    digest = hashlib.sha256(data).hexdigest()
    return f"{digest[:2]}/{digest}{suffix}"


class DirectoryBlobStore:
    """Blobs as files under ``root`` (written to a temporary name, then renamed: a reader never sees half a file)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes, suffix: str = "") -> str:
        key = blob_key(data, suffix)
        path = self.root / key
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return key

    def get(self, key: str) -> bytes:
        path = self.root / key
        if ".." in Path(key).parts or not path.is_file():
            raise KeyError(f"no blob {key!r} in {self.root}")
        return path.read_bytes()


class MemoryBlobStore:
    """Blobs in a dict, keyed as the other stores key them (for tests and a single process).

    >>> store = MemoryBlobStore()
    >>> store.get(store.put(b"x", ".bin"))
    b'x'
    """

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}

    def put(self, data: bytes, suffix: str = "") -> str:
        key = blob_key(data, suffix)
        self._blobs.setdefault(key, bytes(data))
        return key

    def get(self, key: str) -> bytes:
        try:
            return self._blobs[key]
        except KeyError:
            raise KeyError(f"no blob {key!r} in memory") from None


class S3BlobStore:
    """Blobs as objects of one bucket of an S3-compatible server (created if missing)."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, bucket: str, secure: bool):
        from minio import Minio

        self.bucket = bucket
        self.client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure)
        if not self.client.bucket_exists(bucket):
            self.client.make_bucket(bucket)

    def put(self, data: bytes, suffix: str = "") -> str:
        key = blob_key(data, suffix)
        self.client.put_object(self.bucket, key, io.BytesIO(data), length=len(data))
        return key

    def get(self, key: str) -> bytes:
        from minio.error import S3Error

        try:
            response = self.client.get_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                raise KeyError(f"no blob {key!r} in bucket {self.bucket}") from None
            raise
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()


_S3 = re.compile(
    r"^(?P<scheme>https?)://(?P<key>[^:@/]+):(?P<secret>[^@/]+)@(?P<host>[^/]+)/(?P<bucket>[a-z0-9.\-]{3,63})/?$"
)
EXPECTED = "None, a directory path, or 'http(s)://ACCESS_KEY:SECRET_KEY@HOST:PORT/BUCKET'"


def open_blob_store(oss_connection_string: str | None, default_dir: str | os.PathLike) -> BlobStore:
    """The blob store ``oss_connection_string`` names (``None``: a directory ``default_dir``)."""
    if oss_connection_string is None:
        return DirectoryBlobStore(default_dir)
    if "://" not in oss_connection_string:
        return DirectoryBlobStore(oss_connection_string)
    match = _S3.match(oss_connection_string)
    if match is None:
        shown = redact(oss_connection_string)
        raise MalformedConnectionString(f"oss_connection_string: expected {EXPECTED}, got {shown!r}")
    return S3BlobStore(
        match["host"], unquote(match["key"]), unquote(match["secret"]), match["bucket"], match["scheme"] == "https"
    )
