"""The blob store: a directory by default, an S3-compatible bucket through the minio SDK, tested against a real
S3-compatible HTTP server (moto's) on 127.0.0.1."""

from __future__ import annotations

import pytest

from tests.conftest import requirement
from tests.integration.workers.ledger.pg import free_port
from workers.ledger import MalformedConnectionString
from workers.ledger.blobs import DirectoryBlobStore, S3BlobStore, open_blob_store


@pytest.fixture(scope="module")
def s3_url():
    server_module = pytest.importorskip("moto.server", reason=requirement("moto[server]", "pip install -e .[test]"))
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://testing:testing-secret@127.0.0.1:{port}/ledger-blobs"
    server.stop()


def test_directory_store_round_trips_and_is_content_addressed(tmp_path):
    store = open_blob_store(None, tmp_path / "blobs")
    assert isinstance(store, DirectoryBlobStore)
    key = store.put(b"\x89PNG...", suffix=".png")
    assert store.put(b"\x89PNG...", suffix=".png") == key and key.endswith(".png")
    assert store.get(key) == b"\x89PNG..."
    with pytest.raises(KeyError, match="no blob 'ab/missing'"):
        store.get("ab/missing")
    with pytest.raises(KeyError, match="no blob"):
        store.get("../../etc/passwd")


def test_s3_store_against_a_real_s3_compatible_server(s3_url):
    store = open_blob_store(s3_url, "/unused")
    assert isinstance(store, S3BlobStore) and store.bucket == "ledger-blobs"
    data = bytes(range(256)) * 1000
    key = store.put(data, suffix=".bin")
    assert store.get(key) == data
    again = open_blob_store(s3_url, "/unused")  # the bucket exists now: opened, not created
    assert again.get(key) == data
    with pytest.raises(KeyError, match="no blob 'nope' in bucket ledger-blobs"):
        store.get("nope")


@pytest.mark.parametrize("value", ["s3://bucket", "http://127.0.0.1:9000/bucket", "http://k:secret@host/B_ad"])
def test_malformed_oss_connection_strings_hide_the_secret(value):
    with pytest.raises(MalformedConnectionString, match=r"oss_connection_string: expected None, a directory") as err:
        open_blob_store(value, "/unused")
    assert "secret" not in str(err.value)
