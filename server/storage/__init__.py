"""The storage seam (see ``server.storage.base``): ``open_storage(settings)`` picks the backend
from ``ROUNDHOUSE_STORAGE_URL`` (unset: the home folder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.storage.base import Storage, StorageUnavailable, check_key, join
from server.storage.local import LocalStorage

if TYPE_CHECKING:
    from server.settings import Settings

__all__ = [
    "LocalStorage",
    "S3Storage",
    "Storage",
    "StorageUnavailable",
    "check_key",
    "join",
    "open_storage",
]


def open_storage(settings: Settings) -> Storage:
    """The settings' store: ``LocalStorage(home)`` when ``storage_url`` is unset or empty (or a
    ``file://`` URL of the home folder), an ``S3Storage`` for ``s3://bucket/prefix``.

    Raises:
        ValueError: any other URL (naming the setting).
    """
    url = settings.storage_url or ""
    if not url or url.startswith("file://"):
        if url and url.removeprefix("file://").rstrip("/") != str(settings.home.resolve()):
            raise ValueError(f"ROUNDHOUSE_STORAGE_URL={url!r}: a file:// store is the home folder only")
        return LocalStorage(settings.home)
    if url.startswith("s3://"):
        from server.storage.s3 import S3Storage

        return S3Storage.from_settings(settings)
    raise ValueError(
        f"ROUNDHOUSE_STORAGE_URL={url!r}: expected s3://bucket/prefix (or unset: the home folder)"
    )


def __getattr__(name: str) -> object:  # S3Storage without importing boto3 for a local store
    if name == "S3Storage":
        from server.storage.s3 import S3Storage

        return S3Storage
    raise AttributeError(name)
