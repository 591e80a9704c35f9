"""The base models' tokenizers, loaded once per folder and shared by everything on the API host
that tokenizes (dataset previews and statistics, the planner's token counts)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from server.services import models
from server.services.failures import NotFound

CACHED = 8  # tokenizers kept loaded (the oldest loaded goes first)
_tokenizers: dict[str, Any] = {}
_lock = threading.Lock()  # the first import of transformers is not safe from two threads


def load(folder: Path) -> Any:
    """The tokenizer of a model folder, loaded once and kept (the last ``CACHED`` folders)."""
    key = str(folder)
    with _lock:
        if key not in _tokenizers:
            from engine.model import load_tokenizer

            while len(_tokenizers) >= CACHED:
                _tokenizers.pop(next(iter(_tokenizers)))
            _tokenizers[key] = load_tokenizer(folder)
        return _tokenizers[key]


def of_model(name: str, *, models_dir: Path, hf_cache: Path | None) -> Any:
    """The tokenizer of the base model ``name``.

    Raises:
        NotFound: no such base model (naming ``model``).
    """
    folder = models.usable_folder(name, models_dir, hf_cache)
    if folder is None:
        raise NotFound(f"no base model {name!r} (see GET /api/models)", param="model")
    return load(folder)
