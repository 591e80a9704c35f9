"""Exports for other runtimes: GGUF files for llama.cpp and Ollama.

- ``formats.py``: the export formats a checkpoint is delivered in (its own files, merged, GGUF with
  its quantizations): the one registry the CLI, the API and the web UI read.
- ``gguf_quants.py``: the GGUF quantizations written, the one list.

- ``gguf_families.py``: per family, the llama.cpp architecture, the tensor layout changes it
  expects and the metadata it reads; what a family cannot express is refused by name.
- ``gguf_vocab.py``: the tokenizer as GGUF metadata (tokens, merges, pre-tokenizer, special
  tokens, chat template).
- ``gguf_pre_tokenizers.py``: llama.cpp's pre-tokenizer table (the check text, each known
  tokenizer's hash and name, the names its loader accepts), with the llama.cpp commit it is from.
- ``gguf_model.py``: a merged model folder -> one GGUF file (f16, bf16, q8_0, q4_k_m); a PEFT
  LoRA adapter -> a LoRA GGUF for use on a base GGUF.
- ``gguf_types.py``: each tensor's GGML type in an export, by llama-quantize's rules (q4_k_m's
  mix of Q4_K and Q6_K, and its fallbacks for rows a block type does not divide).
- ``kquants.py``: the Q4_K, Q6_K, Q5_0 and Q8_0 block formats as llama.cpp writes them, byte for
  byte (``gguf`` reads the K-quants but does not write them).
- ``read_ahead.py``: an iterator produced by a background thread: the export reads the next
  tensor while it encodes this one.
- ``modelfile.py``: Ollama's ``Modelfile`` next to the GGUF.
- ``bundle.py``: a checkpoint's export folder (the GGUF, or the LoRA GGUF, and the ``Modelfile``).

The names below are this package's public face (the registry of export formats, and the system
prompt a dataset file gives a ``Modelfile``), each loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.export.formats import (
        CHECKPOINT,
        FORMATS,
        GGUF,
        MERGED,
        VARIANTS,
        BuildOptions,
        Built,
        ExportFormat,
        FormatInfo,
        format_named,
        formats_help,
        variants_help,
    )
    from engine.export.modelfile import system_prompt_of_file

# name -> the module that defines it (imported on first use)
_HOMES = {
    "CHECKPOINT": "engine.export.formats",
    "FORMATS": "engine.export.formats",
    "GGUF": "engine.export.formats",
    "MERGED": "engine.export.formats",
    "VARIANTS": "engine.export.formats",
    "BuildOptions": "engine.export.formats",
    "Built": "engine.export.formats",
    "ExportFormat": "engine.export.formats",
    "FormatInfo": "engine.export.formats",
    "format_named": "engine.export.formats",
    "formats_help": "engine.export.formats",
    "system_prompt_of_file": "engine.export.modelfile",
    "variants_help": "engine.export.formats",
}
__all__ = [
    "CHECKPOINT",
    "FORMATS",
    "GGUF",
    "MERGED",
    "VARIANTS",
    "BuildOptions",
    "Built",
    "ExportFormat",
    "FormatInfo",
    "format_named",
    "formats_help",
    "system_prompt_of_file",
    "variants_help",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
