"""Image bytes to what a vision tower takes: ``open_image`` checks and decodes one image,
``row_pixels`` turns one row's images into its tensors with the family's image processor."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch

# an image larger than this (width x height) is refused before it is decoded
MAX_PIXELS = 40_000_000
# image bytes larger than this are refused
MAX_IMAGE_BYTES = 32 * 1024 * 1024


def open_image(data: bytes, *, max_pixels: int = MAX_PIXELS) -> Any:
    """Decode image bytes (PNG, JPEG, WebP, GIF's first frame, ...) as an RGB ``PIL.Image``.

    Raises:
        ValueError: no bytes, more than ``MAX_IMAGE_BYTES``, not an image PIL reads, or larger
            than ``max_pixels`` (read from the header, before the pixels are decoded).
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ValueError("the image is empty (0 bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is {len(data)} bytes, more than the {MAX_IMAGE_BYTES} allowed")
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"not a readable image ({exc.__class__.__name__})") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height} pixels, more than the {max_pixels} allowed")
    if width < 1 or height < 1:
        raise ValueError(f"the image is {width}x{height} pixels")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image could not be decoded ({exc})") from exc
    return image.convert("RGB")


def row_pixels(processor: Any, architecture: str) -> Callable[[Sequence[bytes]], dict[str, torch.Tensor]]:
    """The function that makes one row's image tensors (``engine.vision.batch``'s row entries)
    from its images' bytes, with ``processor``'s image processor as the processor itself would
    call it for that row."""
    images = processor.image_processor

    def pixels(row: Sequence[bytes]) -> dict[str, torch.Tensor]:
        decoded = [open_image(b) for b in row]
        if architecture in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
            out = images(images=decoded, return_tensors="pt")
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        out = images(images=[decoded], return_tensors="pt")
        if architecture == "Gemma3ForConditionalGeneration":
            return {"pixel_values": out["pixel_values"]}
        # Idefics3 / SmolVLM: [1, tiles, C, H, W] and its pixel mask, one row
        values = out["pixel_values"][0]
        mask = out.get("pixel_attention_mask")
        mask = torch.ones(values.shape[0], *values.shape[-2:], dtype=torch.long) if mask is None else mask[0]
        return {"pixel_values": values, "pixel_attention_mask": mask.long()}

    return pixels
