"""What a pull fetches: the files training and export need, and a dataset split's files (pure)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from engine.vision import PROCESSOR_FILES

# the small files of a model folder that training and export read (config, tokenizer, templates;
# a vision-language model's processor: its image processor's settings and options)
MODEL_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        *PROCESSOR_FILES,
    }
)
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
DATA_SUFFIXES = (".jsonl", ".parquet", ".csv")
PARQUET_REVISION = "refs/convert/parquet"  # where the Hub keeps its Parquet conversion of a dataset


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size}


def total(files: Iterable[RemoteFile]) -> int:
    return sum(f.size for f in files)


def model_files(listing: Iterable[RemoteFile], *, index: Mapping[str, Any] | None = None) -> list[RemoteFile]:
    """The files of a model repo a pull fetches: the top-level config, tokenizer and templates, and
    one copy of the weights: the safetensors files (those the index names, when it has one), else
    PyTorch ``.bin`` files; never ``.pth``, ``.gguf``, ONNX or anything in a subfolder.

    Args:
        listing: every file of the repo, with its size.
        index: the parsed ``model.safetensors.index.json``, when the repo has one.
    """
    top = [f for f in listing if "/" not in f.path]
    chosen = [f for f in top if f.path in MODEL_FILES]
    tensors = [f for f in top if f.path.endswith(".safetensors")]
    if tensors:
        named = set((index or {}).get("weight_map", {}).values()) if index else set()
        if named:
            tensors = [f for f in tensors if f.path in named]
        chosen += tensors + [f for f in top if f.path == SAFETENSORS_INDEX]
    else:
        chosen += [f for f in top if f.path.endswith(".bin") or f.path == BIN_INDEX]
    return sorted(chosen, key=lambda f: (f.path != "config.json", f.size, f.path))


def has_weights(files: Iterable[RemoteFile]) -> bool:
    return any(f.path.endswith((".safetensors", ".bin")) for f in files)


def _word(name: str) -> re.Pattern[str]:
    return re.compile(rf"(^|[/_.\-]){re.escape(name)}([/_.\-]|$)", re.IGNORECASE)


def split_files(
    listing: Iterable[RemoteFile], *, split: str, config: str | None
) -> tuple[list[RemoteFile], str | None]:
    """A dataset split's own files in a repo, by the Hub's naming conventions: data files (JSONL,
    Parquet, CSV) whose path names the split as a word (``train.jsonl``, ``data/train-00000-of-00002
    .parquet``, ``train/part-0.csv``), under the config's folder when a config is named. Returns the
    files (one kind only, in order) or none and why."""
    data = [f for f in listing if f.path.lower().endswith(DATA_SUFFIXES)]
    if config and config != "default":
        data = [f for f in data if config in PurePosixPath(f.path).parts[:-1] or _word(config).search(f.path)]
    matched = [f for f in data if _word(split).search(f.path)]
    if not matched:
        return [], None
    kinds = {PurePosixPath(f.path).suffix.lower() for f in matched}
    if len(kinds) > 1:
        return [], f"the split's files are of several kinds ({', '.join(sorted(kinds))})"
    return sorted(matched, key=lambda f: f.path), None


def parquet_files(listing: Iterable[RemoteFile], *, split: str, config: str | None) -> list[RemoteFile]:
    """A split's files in the Hub's Parquet conversion: ``<config>/<split>/NNNN.parquet`` (a big split
    converted in part: ``<config>/partial-<split>/``)."""
    name = config or "default"
    folders = {f"{name}/{split}", f"{name}/partial-{split}"}
    found = [
        f for f in listing if f.path.endswith(".parquet") and str(PurePosixPath(f.path).parent) in folders
    ]
    return sorted(found, key=lambda f: f.path)
