"""A chat request's ``image_url`` parts, read into the bytes the worker's inference service takes.

A ``data:image/<type>;base64,...`` URL is decoded here; an ``http(s)://`` URL is fetched here, once,
only where the operator allows fetching images (``ROUNDHOUSE_ALLOW_IMAGE_URLS``, the setting that
lets dataset uploads fetch theirs), else refused. Each refusal is a 400 naming the part
(``messages.<i>.content.<j>.image_url.url``). The worker decodes the image itself and refuses one
it cannot read, or any image for a text-only model, naming the part the same way.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from server.api.openai.completion_shapes import ImagePart, TextPart
from server.errors import ApiError
from server.services.dataset_images import FETCH_TIMEOUT_S, max_image_bytes


class Message(Protocol):
    """A chat message as the playground's and the chat completions' requests both give it."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str | Sequence[TextPart | ImagePart]: ...


URLS_OFF = (
    "http(s) image URLs are not fetched on this server (its operator has not set "
    "ROUNDHOUSE_ALLOW_IMAGE_URLS): give the image as a data:image/<type>;base64,... URL"
)


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", param=param)


def data_url_bytes(url: str, param: str) -> bytes:
    """The image of a base64 data URL.

    Raises:
        ApiError: (400, naming ``param``) not an image data URL, bad base64, too large, empty.
    """
    limit = max_image_bytes()
    head, sep, body = url.partition(",")
    if not sep or not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
        raise _refuse(param, f"{head[:60]!r}: a data URL must read data:image/<type>;base64,<data>")
    if len(body) > (limit * 4) // 3 + 4:
        raise _refuse(param, f"the image is larger than the limit of {limit} bytes")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(param, "the data URL's base64 is invalid") from None
    if not data:
        raise _refuse(param, "the image is empty (0 bytes)")
    return data


async def fetch_image(client: httpx.AsyncClient, url: str, param: str) -> bytes:
    """The bytes at an http(s) URL (at most the engine's ``MAX_IMAGE_BYTES``).

    Raises:
        ApiError: (400, naming ``param``) it could not be fetched, or is too large.
    """
    limit = max_image_bytes()
    try:
        async with client.stream("GET", url, follow_redirects=True, timeout=FETCH_TIMEOUT_S) as response:
            if response.status_code != 200:
                raise _refuse(param, f"{url[:120]!r}: the server answered HTTP {response.status_code}")
            data = b""
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise _refuse(param, f"{url[:120]!r}: larger than the limit of {limit} bytes")
    except httpx.HTTPError as exc:
        raise _refuse(param, f"{url[:120]!r}: could not be fetched ({exc.__class__.__name__})") from None
    if not data:
        raise _refuse(param, f"{url[:120]!r}: the image is empty (0 bytes)")
    return data


async def image_bytes(part: ImagePart, param: str, *, allow_urls: bool) -> bytes:
    """The image an ``image_url`` part gives (see the module's docstring)."""
    url = part.image_url.url.strip()
    scheme = url[:8].lower()
    if scheme.startswith("data:"):
        return data_url_bytes(url, param)
    if scheme.startswith(("http://", "https://")):
        if not allow_urls:
            raise _refuse(param, URLS_OFF)
        async with httpx.AsyncClient() as client:
            return await fetch_image(client, url, param)
    raise _refuse(param, f"{url[:60]!r}: an image is a data:image/... URL (or an allowed http(s) URL)")


async def payload_messages(messages: Sequence[Message], *, allow_urls: bool) -> list[dict[str, Any]]:
    """The conversation as the worker's ``/generate`` takes it: ``developer`` as ``system``; text
    content as text; parts as ``{"type": "text", "text"}`` and ``{"type": "image", "data": <base64>}``
    at the same indices (so the worker's errors name the request's part).

    Raises:
        ApiError: an image part that cannot be read (400, naming it).
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if isinstance(m.content, str):
            out.append({"role": role, "content": m.content})
            continue
        if not any(isinstance(p, ImagePart) for p in m.content):
            out.append(
                {"role": role, "content": "".join(p.text for p in m.content if isinstance(p, TextPart))}
            )
            continue
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(m.content):
            if isinstance(p, ImagePart):
                data = await image_bytes(p, f"messages.{i}.content.{j}.image_url.url", allow_urls=allow_urls)
                parts.append({"type": "image", "data": base64.b64encode(data).decode()})
            else:
                parts.append({"type": "text", "text": p.text})
        out.append({"role": role, "content": parts})
    return out
