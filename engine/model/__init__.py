"""The models RoundPipe trains: loading a folder (``loading``; a vision-language model's
processor too: ``load_processor_for``, ``vision_architecture``), the registry of model families
(``families``: what each architecture is, how its blocks are laid out, ``model_kind`` of a
``config.json``), the engine's layers around a Hugging Face model (``adapter``), 4-bit bases
(``quant``, ``prequantized``), the loss, and a checkpoint's export (``export``: a LoRA adapter
or a full folder; ``merge_adapter`` folds an adapter into its base).

The names below are this package's public face, each loaded on first use: importing
``engine.model`` loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model.export import base_model_name, merge_adapter, model_bytes
    from engine.model.families import FAMILIES, ModelKind, model_kind
    from engine.model.loading import (
        DEMO_NAME,
        demo_config,
        demo_source,
        dense_load_kwargs,
        load_model,
        load_processor_for,
        load_tokenizer,
        prepare_demo_model,
        resolve_model_path,
        vision_architecture,
    )

# name -> the module that defines it (imported on first use)
_HOMES = {
    "DEMO_NAME": "engine.model.loading",
    "FAMILIES": "engine.model.families",
    "ModelKind": "engine.model.families",
    "base_model_name": "engine.model.export",
    "demo_config": "engine.model.loading",
    "demo_source": "engine.model.loading",
    "dense_load_kwargs": "engine.model.loading",
    "load_model": "engine.model.loading",
    "load_processor_for": "engine.model.loading",
    "load_tokenizer": "engine.model.loading",
    "merge_adapter": "engine.model.export",
    "model_bytes": "engine.model.export",
    "model_kind": "engine.model.families",
    "prepare_demo_model": "engine.model.loading",
    "resolve_model_path": "engine.model.loading",
    "vision_architecture": "engine.model.loading",
}
__all__ = [
    "DEMO_NAME",
    "FAMILIES",
    "ModelKind",
    "base_model_name",
    "demo_config",
    "demo_source",
    "dense_load_kwargs",
    "load_model",
    "load_processor_for",
    "load_tokenizer",
    "merge_adapter",
    "model_bytes",
    "model_kind",
    "prepare_demo_model",
    "resolve_model_path",
    "vision_architecture",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
