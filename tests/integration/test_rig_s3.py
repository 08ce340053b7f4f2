"""The rig's S3 server (versitygw) through the minio client kiln uses."""

from __future__ import annotations

import hashlib
import io
import os
import uuid

import pytest
from minio.error import S3Error

pytestmark = pytest.mark.rig

MiB = 1024 * 1024


@pytest.fixture
def prefix(rig):
    p = f"test-rig-s3/{uuid.uuid4().hex}/"
    yield p
    client = rig.minio_client()
    for obj in client.list_objects(rig.s3_bucket, prefix=p, recursive=True):
        client.remove_object(rig.s3_bucket, obj.object_name)


def test_env_names_the_rig(rig):
    assert rig.env["KILN_S3_ENDPOINT"] == rig.s3_endpoint
    assert rig.env["KILN_S3_BUCKET"] == rig.s3_bucket
    assert rig.minio_client().bucket_exists(rig.s3_bucket)


def test_round_trip_list_overwrite_delete(rig, prefix):
    client, bucket = rig.minio_client(), rig.s3_bucket
    client.put_object(bucket, prefix + "a/one.txt", io.BytesIO(b"first"), 5)
    client.put_object(bucket, prefix + "a/two.txt", io.BytesIO(b"second"), 6)
    client.put_object(bucket, prefix + "b.txt", io.BytesIO(b"b"), 1)

    assert client.get_object(bucket, prefix + "a/one.txt").read() == b"first"
    top = sorted(o.object_name for o in client.list_objects(bucket, prefix=prefix))
    assert top == [prefix + "a/", prefix + "b.txt"]  # "a/" is a common prefix at this level
    deep = sorted(o.object_name for o in client.list_objects(bucket, prefix=prefix, recursive=True))
    assert deep == [prefix + "a/one.txt", prefix + "a/two.txt", prefix + "b.txt"]

    client.put_object(bucket, prefix + "a/one.txt", io.BytesIO(b"overwritten"), 11)
    assert client.get_object(bucket, prefix + "a/one.txt").read() == b"overwritten"
    assert client.stat_object(bucket, prefix + "a/one.txt").size == 11

    client.remove_object(bucket, prefix + "a/one.txt")
    with pytest.raises(S3Error) as err:
        client.stat_object(bucket, prefix + "a/one.txt")
    assert err.value.code in ("NoSuchKey", "NotFound")
    deep = sorted(o.object_name for o in client.list_objects(bucket, prefix=prefix, recursive=True))
    assert deep == [prefix + "a/two.txt", prefix + "b.txt"]


def test_multipart_upload_of_64_mib(rig, prefix, tmp_path):
    client, bucket = rig.minio_client(), rig.s3_bucket
    data = os.urandom(65 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    # 16 MiB parts: the client splits the 65 MiB file into a 5-part multipart upload.
    result = client.fput_object(bucket, prefix + "big.bin", str(src), part_size=16 * MiB)
    # A multipart ETag is "<md5 of part md5s>-<number of parts>", unlike a single PUT's plain md5.
    assert result.etag.endswith("-5"), result.etag
    assert client.stat_object(bucket, prefix + "big.bin").size == len(data)
    got = client.get_object(bucket, prefix + "big.bin").read()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    # A ranged read lands in the middle of the third part.
    part = client.get_object(bucket, prefix + "big.bin", offset=40 * MiB, length=1024).read()
    assert part == data[40 * MiB: 40 * MiB + 1024]


def test_wrong_secret_key_is_refused(rig):
    bad = rig.minio_client(secret_key="not-" + rig.s3_secret_key)
    with pytest.raises(S3Error) as err:
        bad.list_objects(rig.s3_bucket).__next__()
    assert err.value.code == "SignatureDoesNotMatch"
    unknown = rig.minio_client(access_key="nobody", secret_key="nothing")
    name = f"refused-{uuid.uuid4().hex}.txt"
    with pytest.raises(S3Error) as err:
        unknown.put_object(rig.s3_bucket, name, io.BytesIO(b"x"), 1)
    # AWS says InvalidAccessKeyId (403); versitygw v1.8 says XAdminUserNotFound (404).
    assert err.value.code in ("InvalidAccessKeyId", "XAdminUserNotFound")
    with pytest.raises(S3Error):
        rig.minio_client().stat_object(rig.s3_bucket, name)  # and nothing was written
