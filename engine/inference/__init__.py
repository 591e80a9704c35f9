"""Running a trained model: chat with a KV cache and sampling (``chat``: ``Sampling``,
``prompt_ids``, ``stop_ids``), continuous batching of many requests over one base and its
adapters (``batching``: a ``Batcher`` of ``Model`` entries, fed ``Ask`` requests, answering
``Token`` and ``End``), conversations with images as a VLM's prompt (``images``: ``chat_prompt``
gives a ``Prompt``: token ids and the image tensors of its first forward), and a checkpoint's
evaluation on a dataset (``evaluate_checkpoint``).

The names below are this package's public face, each loaded on first use: importing
``engine.inference`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.inference.batching import Ask, Batcher, Closed, End, Model, Token
    from engine.inference.chat import Sampling, check_messages, prompt_ids, stop_ids
    from engine.inference.evaluate import evaluate_checkpoint
    from engine.inference.generate import load_processor
    from engine.inference.images import Prompt, architecture_of, chat_prompt

# name -> the module that defines it (imported on first use)
_HOMES = {
    "Ask": "engine.inference.batching",
    "Batcher": "engine.inference.batching",
    "Closed": "engine.inference.batching",
    "End": "engine.inference.batching",
    "Model": "engine.inference.batching",
    "Prompt": "engine.inference.images",
    "Sampling": "engine.inference.chat",
    "Token": "engine.inference.batching",
    "architecture_of": "engine.inference.images",
    "chat_prompt": "engine.inference.images",
    "check_messages": "engine.inference.chat",
    "evaluate_checkpoint": "engine.inference.evaluate",
    "load_processor": "engine.inference.generate",
    "prompt_ids": "engine.inference.chat",
    "stop_ids": "engine.inference.chat",
}
__all__ = [
    "Ask",
    "Batcher",
    "Closed",
    "End",
    "Model",
    "Prompt",
    "Sampling",
    "Token",
    "architecture_of",
    "chat_prompt",
    "check_messages",
    "evaluate_checkpoint",
    "load_processor",
    "prompt_ids",
    "stop_ids",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
