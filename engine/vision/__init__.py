"""Vision-language models: the supported families and the refused ones (``families``), their
processors (``processing``), images to tensors (``pixels``), a micro-batch's images
(``batch``), what trains in them (``tuning``) and the pipeline's input layer that runs the
vision tower (``layer``). The names below are this package's public face, each loaded on first
use (the family table needs no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.vision.families import (
        NO_VLM_GGUF,
        REFUSED_VLMS,
        SUPPORTED_VLMS,
        VISION_FAMILIES,
        VisionSpec,
        is_vision_config,
        vision_refusal,
        vision_spec,
    )
    from engine.vision.pixels import MAX_IMAGE_BYTES, MAX_PIXELS, open_image, row_pixels
    from engine.vision.processing import PROCESSOR_FILES, build_processor, load_processor, save_processor

# name -> the module that defines it (imported on first use)
_HOMES = {
    "MAX_IMAGE_BYTES": "engine.vision.pixels",
    "MAX_PIXELS": "engine.vision.pixels",
    "NO_VLM_GGUF": "engine.vision.families",
    "PROCESSOR_FILES": "engine.vision.processing",
    "REFUSED_VLMS": "engine.vision.families",
    "SUPPORTED_VLMS": "engine.vision.families",
    "VISION_FAMILIES": "engine.vision.families",
    "VisionSpec": "engine.vision.families",
    "build_processor": "engine.vision.processing",
    "is_vision_config": "engine.vision.families",
    "load_processor": "engine.vision.processing",
    "open_image": "engine.vision.pixels",
    "row_pixels": "engine.vision.pixels",
    "save_processor": "engine.vision.processing",
    "vision_refusal": "engine.vision.families",
    "vision_spec": "engine.vision.families",
}
__all__ = [
    "MAX_IMAGE_BYTES",
    "MAX_PIXELS",
    "NO_VLM_GGUF",
    "PROCESSOR_FILES",
    "REFUSED_VLMS",
    "SUPPORTED_VLMS",
    "VISION_FAMILIES",
    "VisionSpec",
    "build_processor",
    "is_vision_config",
    "load_processor",
    "open_image",
    "row_pixels",
    "save_processor",
    "vision_refusal",
    "vision_spec",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
