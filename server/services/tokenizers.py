"""The base models' tokenizers (and a vision-language model's processor), loaded once per folder and
shared by everything on the API host that tokenizes (dataset previews and statistics, the
planner's token counts)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import ConfigError
from server.services import models
from server.services.failures import Invalid, NotFound

CACHED = 8  # tokenizers and processors kept loaded (the oldest loaded goes first)
_loaded: dict[tuple[str, str], Any] = {}  # by (folder, "tokenizer" | "processor")
_lock = threading.Lock()  # the first import of transformers is not safe from two threads


def _cached(folder: Path, kind: str, make: Callable[[Path], Any]) -> Any:
    key = (str(folder), kind)
    with _lock:
        if key not in _loaded:
            while len(_loaded) >= CACHED:
                _loaded.pop(next(iter(_loaded)))
            _loaded[key] = make(folder)
        return _loaded[key]


def load(folder: Path) -> Any:
    """The tokenizer of a model folder (a VLM's text tokenizer), loaded once and kept."""
    from engine.model import load_tokenizer

    return _cached(folder, "tokenizer", load_tokenizer)


def load_processor(folder: Path) -> Any:
    """The processor of a vision-language model's folder (``engine.model.load_processor_for``:
    its tokenizer and image processor), loaded once and kept; None for a text model.

    Raises:
        ConfigError: (``model.path``) a vision-language model the engine does not train.
    """
    from engine.model import load_processor_for, vision_architecture

    if vision_architecture(folder) is None:  # a text model: nothing loaded, nothing kept
        return None
    return _cached(folder, "processor", load_processor_for)


def of_model(name: str, *, models_dir: Path, hf_cache: Path | None) -> Any:
    """What renders rows for the base model ``name``: a vision-language model's processor (rows
    with images render their image tokens), else its tokenizer.

    Raises:
        NotFound: no such base model (naming ``model``).
        Invalid: a vision-language model the engine does not train (naming ``model`` and why).
    """
    folder = models.usable_folder(name, models_dir, hf_cache)
    if folder is None:
        raise NotFound(f"no base model {name!r} (see GET /api/models)", param="model")
    try:
        processor = load_processor(folder)
    except ConfigError as exc:
        raise Invalid("unsupported_model", f"model {name!r}: {exc}", param="model") from exc
    return processor if processor is not None else load(folder)
