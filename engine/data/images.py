"""The images of a dataset's rows: where a row gives one (``ImageRef``), how a reference is checked
as the row is read, and how it is read into bytes (``ImageReader``).

A row names an image by a reference or holds its bytes:

- ``data:image/png;base64,...``: the image inline;
- a file name relative to the dataset's folder (``images/cat.png``); in an archive, relative to
  its data file's folder, else to the archive's root (absolute names and ``..`` are refused);
- ``sha256:<64 hex digits>``: a file of the content-addressed image store (``data.image_store``),
  ``<store>/<hex[:2]>/<hex>``;
- bytes (a Parquet column of binary, or of ``{"bytes", "path"}`` structs as Hugging Face datasets
  write them).

``http(s)://`` URLs are refused: the engine reads no network (the service fetches such images at
upload, when its operator allows it, and stores them as ``sha256:`` references).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

# marks an image's place in a row's normalised text; each row's marks and images pair up in order
IMAGE_MARK = "\ufffc"  # U+FFFC OBJECT REPLACEMENT CHARACTER
SHA256 = re.compile(r"sha256:([0-9a-f]{64})")
DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?(;[^,]*)?,", re.ASCII)
THUMBNAIL = 96  # pixels of a preview thumbnail's longer side
HTTP_REFUSED = (
    "http(s) image URLs are not fetched in training: upload the images with the data (a zip or tar "
    "holding the JSONL and the image files), or give them as data: URLs"
)


@dataclass(frozen=True)
class ImageRef:
    """One image of a row, in its placeholder order.

    Attributes:
        field: where the row gives it, as errors name it (``messages[0].content[1].image_url.url``,
            ``images[2]``).
        source: its reference (a data URL, a relative file name, ``sha256:<hex>``) or its bytes.
        data: its bytes, once read (``ImageReader``); None before.
    """

    field: str
    source: str | bytes
    data: bytes | None = None


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "…"


def image_ref(value: Any, field: str) -> ImageRef:
    """A row's image value checked: a reference string, bytes, or a ``{"bytes", "path"}`` struct.

    Raises:
        ValueError: naming ``field``: an empty or mistyped value, an http(s) URL, a malformed
            data URL or ``sha256:`` reference, an absolute file name or one with ``..``.
    """
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes"):
            return image_ref(value["bytes"], field)
        return image_ref(value.get("path"), f"{field}.path")
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise ValueError(f"{field}: the image is empty (0 bytes)")
        return ImageRef(field, bytes(value))
    if not isinstance(value, str):
        raise ValueError(
            f"{field}: an image is a data URL, a file name or sha256:<hex>, got {type(value).__name__}"
        )
    text = value.strip()
    if not text:
        raise ValueError(f"{field}: the image reference is empty")
    lower = text[:8].lower()
    if lower.startswith(("http://", "https://")):
        raise ValueError(f"{field}: {_short(text)!r}: {HTTP_REFUSED}")
    if lower.startswith("data:"):
        if not DATA_URL.match(text) or ";base64," not in text[:200]:
            raise ValueError(f"{field}: a data URL must read data:image/<type>;base64,<data>")
        return ImageRef(field, text)
    if lower.startswith("sha256:"):
        if not SHA256.fullmatch(text):
            raise ValueError(f"{field}: {_short(text)!r} is not sha256: and 64 lower-case hex digits")
        return ImageRef(field, text)
    if "://" in text:
        raise ValueError(f"{field}: {_short(text)!r}: only data: URLs and relative file names are read")
    path = PurePosixPath(text.replace("\\", "/"))
    if path.is_absolute() or re.match(r"[A-Za-z]:", text) or ".." in path.parts:
        raise ValueError(
            f"{field}: {_short(text)!r}: give a file name relative to the dataset's folder (no absolute "
            "path, no '..')"
        )
    return ImageRef(field, str(path))


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data URL.

    Raises:
        ValueError: not base64.
    """
    _, _, payload = url.partition(",")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data URL's base64 is invalid ({exc})") from None


class ImageReader:
    """Reads a row's images into bytes: relative file names from ``folder`` (the data file's),
    else from ``root`` (its archive's; by default ``folder``), never outside ``root``; ``sha256:``
    references from the image ``store``.

    With ``cache``, a repeated reference is read once (the rows that name it share the bytes).
    """

    def __init__(
        self,
        folder: str | Path | None,
        store: str | Path | None = None,
        *,
        root: str | Path | None = None,
        cache: bool = True,
    ) -> None:
        self.folder = None if folder is None else Path(folder).resolve()
        self.root = self.folder if root is None else Path(root).resolve()
        self.store = None if store is None else Path(store)
        self.cache = cache
        self._read: dict[str, bytes] = {}

    def read(self, ref: ImageRef) -> ImageRef:
        """``ref`` with its bytes.

        Raises:
            ValueError: naming the field: a missing file or store entry, no store configured, a
                file name leaving the dataset's folder, invalid base64.
        """
        if isinstance(ref.source, bytes):
            return ImageRef(ref.field, ref.source, ref.source)
        found = self._read.get(ref.source)
        if found is None:
            try:
                found = self._bytes(ref.source)
            except ValueError as exc:
                raise ValueError(f"{ref.field}: {exc}") from None
            if self.cache:
                self._read[ref.source] = found
        return ImageRef(ref.field, ref.source, found)

    def _bytes(self, source: str) -> bytes:
        if source[:5].lower() == "data:":
            return decode_data_url(source)
        digest = SHA256.fullmatch(source)
        if digest is not None:
            if self.store is None:
                raise ValueError(f"{source}: no image store is configured (data.image_store)")
            hexa = digest.group(1)
            path = self.store / hexa[:2] / hexa
            if not path.is_file():
                raise ValueError(f"{source}: not in the image store")
            return path.read_bytes()
        if self.folder is None or self.root is None:
            raise ValueError(f"image file {source!r}: the dataset has no folder to read it from")
        for base in dict.fromkeys((self.folder, self.root)):
            path = (base / source).resolve()
            if not path.is_relative_to(self.root):
                raise ValueError(f"image file {source!r} lies outside the dataset's folder")
            if path.is_file():
                return path.read_bytes()
        raise ValueError(f"image file {source!r} not found beside the dataset")


def check_image(ref: ImageRef) -> None:
    """Decode a read image (``engine.vision.pixels.open_image``): readable, and within the size
    limits.

    Raises:
        ValueError: naming the field: unreadable, too large, not yet read.
    """
    from engine.vision.pixels import open_image  # PIL on first use: text datasets never load it

    if ref.data is None:
        raise ValueError(f"{ref.field}: the image was not read")
    try:
        open_image(ref.data)
    except ValueError as exc:
        raise ValueError(f"{ref.field}: {exc}") from None


def thumbnail(data: bytes, size: int = THUMBNAIL) -> str:
    """A small JPEG of an image as a data URL (a preview's thumbnail), its longer side ``size``.

    Raises:
        ValueError: an unreadable image.
    """
    from engine.vision.pixels import open_image

    image = open_image(data)
    image.thumbnail((size, size))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")
