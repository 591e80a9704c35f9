"""``S3Storage``: an S3-compatible object store (AWS S3, MinIO, ...) through boto3.

``s3://bucket/prefix``: the object of key ``k`` is ``prefix/k`` in ``bucket``. Large files go up
in parts (boto3's managed transfer); downloads are written to a temporary file and renamed.

Every operation is tried again while the store does not answer (refused or dropped connections,
timeouts, 5xx answers), with exponential backoff for ``retry_s`` seconds in all, and then raises
``StorageUnavailable``; a missing object or a refusal (403, a bad bucket) is raised at once.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar
from urllib.parse import quote, urlsplit

from server.storage.base import Storage, StorageUnavailable, check_key, join, retrying

if TYPE_CHECKING:
    from server.settings import Settings

T = TypeVar("T")
PART = 16 << 20  # bytes of one part of a multipart upload
# how long one operation waits for a store that does not answer: a download answers 503 after it,
# a worker's checkpoint push tries again for longer (``server.worker.files.PUSH_RETRY_S``)
RETRY_S = 10.0
# the S3 error codes of a store that is failing for now (as any 5xx answer is)
BUSY_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "503", "500"})


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is the store not answering for now: a connection refused, dropped or timed
    out, a body cut short, a 5xx answer (also wrapped by boto3's transfers), not a missing object
    or a refusal."""
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, IncompleteReadError

    if isinstance(exc, S3UploadFailedError | RetriesExceededError):
        inner = getattr(exc, "last_exception", None) or exc.__cause__ or exc.__context__
        return inner is not None and transient(inner)
    if isinstance(exc, ConnectionError | HTTPClientError | IncompleteReadError):
        return True
    if isinstance(exc, ClientError):
        response: Any = exc.response or {}
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return status >= 500 or str(response.get("Error", {}).get("Code", "")) in BUSY_CODES
    return False


class _Counting:
    """A read-only stream that counts the bytes read through it."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.count = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket[/prefix]``.

    Raises:
        ValueError: naming the setting and the value.
    """
    parts = urlsplit(url)
    prefix = parts.path.strip("/")
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"ROUNDHOUSE_STORAGE_URL={url!r}: expected s3://bucket/prefix")
    if prefix:
        check_key(prefix)
    return parts.netloc, prefix


class S3Storage(Storage):
    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        public_endpoint_url: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        region: str | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        # credentials not given here come from boto3's own chain (AWS_ACCESS_KEY_ID, ~/.aws, a role)
        session = boto3.session.Session(
            aws_access_key_id=access_key_id or None,
            aws_secret_access_key=secret_access_key or None,
            region_name=region or None,
        )
        config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"mode": "standard"},
            connect_timeout=5,  # a host that drops packets fails the try soon; ``retry_s`` goes on
        )
        self.retry_s = retry_s
        self.client: Any = session.client("s3", endpoint_url=endpoint_url or None, config=config)
        self.signer: Any = (
            session.client("s3", endpoint_url=public_endpoint_url, config=config)
            if public_endpoint_url
            else self.client
        )
        self.transfer = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART)

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Storage:
        return cls(
            settings.storage_url or "",
            endpoint_url=settings.s3_endpoint_url,
            public_endpoint_url=settings.s3_public_endpoint_url,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key,
            region=settings.s3_region,
        )

    def _name(self, key: str, *, prefix: bool = False) -> str:
        check_key(key, prefix=prefix)
        return join(self.prefix, key)

    def _folder(self, prefix: str) -> str:
        """The object-name prefix of a folder (with its trailing ``/``; the bucket's prefix for "")."""
        name = self._name(prefix, prefix=True)
        return f"{name}/" if name else ""

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _missing(self, error: Exception) -> bool:
        code = str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def without_retries(self) -> S3Storage:
        once = copy.copy(self)  # the same clients
        once.retry_s = 0.0
        return once

    def _retry(self, what: str, call: Callable[[], T], *, budget_s: float | None = None) -> T:
        """``call()`` tried again while the store does not answer (``retrying``, ``retry_s``)."""
        budget = self.retry_s if budget_s is None else budget_s
        return retrying(call, what=f"{self.url}: {what}", budget_s=budget, transient=transient)

    def _not_found(self, key: str, call: Callable[[], T]) -> T:
        """``call()``, with a missing object raised as ``FileNotFoundError``."""
        from botocore.exceptions import ClientError

        try:
            return call()
        except ClientError as exc:
            if self._missing(exc):
                raise FileNotFoundError(f"no object {key!r}") from exc
            raise

    def put_file(self, key: str, path: Path) -> None:
        def put() -> None:
            self.client.upload_file(str(path), self.bucket, self._name(key), Config=self.transfer)

        self._retry(f"putting {key!r}", put)

    def put_stream(self, key: str, stream: BinaryIO) -> int:
        start = stream.tell() if stream.seekable() else None

        def put() -> int:
            if start is not None:
                stream.seek(start)
            counted = _Counting(stream)
            self.client.upload_fileobj(counted, self.bucket, self._name(key), Config=self.transfer)
            return counted.count

        # a stream that cannot be read again is tried once
        return self._retry(f"putting {key!r}", put, budget_s=None if start is not None else 0.0)

    def get_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:

                def get() -> None:
                    out.seek(0)
                    out.truncate()
                    self.client.download_fileobj(self.bucket, self._name(key), out, Config=self.transfer)

                self._retry(f"getting {key!r}", lambda: self._not_found(key, get))
            os.chmod(name, 0o644)
            os.replace(name, path)
        finally:
            Path(name).unlink(missing_ok=True)

    def iter_bytes(self, key: str, *, chunk: int = 1 << 20) -> Iterator[bytes]:
        yield from self.stream(key, chunk=chunk)[1]

    def stream(self, key: str, *, chunk: int = 1 << 20) -> tuple[int, Iterator[bytes]]:
        def get() -> Any:
            return self.client.get_object(Bucket=self.bucket, Key=self._name(key))

        response = self._retry(f"getting {key!r}", lambda: self._not_found(key, get))
        return int(response["ContentLength"]), self._chunks(key, response["Body"], chunk)

    def _chunks(self, key: str, body: Any, chunk: int) -> Iterator[bytes]:
        """The body's chunks; botocore checks that they add up to its Content-Length, and a store
        that breaks off is raised as ``StorageUnavailable`` (never a short, clean end)."""
        try:
            yield from body.iter_chunks(chunk)
        except Exception as exc:
            if transient(exc):
                raise StorageUnavailable(f"{self.url}: reading {key!r} broke off: {exc}") from exc
            raise
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        def find() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._name(key))
                return True
            except ClientError as exc:
                if not self._missing(exc):
                    raise
            found = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._folder(key), MaxKeys=1)
            return bool(found.get("KeyCount", 0))

        return self._retry(f"looking up {key!r}", find)

    def list(self, prefix: str) -> list[tuple[str, int]]:
        def pages() -> list[tuple[str, int]]:
            found = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._folder(prefix)
            )
            return [(self._key(o["Key"]), int(o["Size"])) for page in found for o in page.get("Contents", [])]

        return sorted(self._retry(f"listing {prefix!r}", pages))

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._retry(f"deleting {key!r}", lambda: self.client.delete_object(Bucket=self.bucket, Key=name))

    def delete_prefix(self, prefix: str) -> None:
        names = [self._name(key) for key, _ in self.list(check_key(prefix))]
        for start in range(0, len(names), 1000):  # the most one request deletes
            batch = {"Objects": [{"Key": n} for n in names[start : start + 1000]], "Quiet": True}

            def delete(batch: dict[str, Any] = batch) -> None:
                self.client.delete_objects(Bucket=self.bucket, Delete=batch)

            self._retry(f"deleting under {prefix!r}", delete)

    def presigned_url(self, key: str, *, expires_s: int = 3600, filename: str | None = None) -> str | None:
        params = {"Bucket": self.bucket, "Key": self._name(key)}
        if filename is not None:
            params["ResponseContentDisposition"] = f"attachment; filename*=UTF-8''{quote(filename)}"
        url: str = self.signer.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s)
        return url

    def local_path(self, key: str) -> Path | None:
        check_key(key)
        return None
