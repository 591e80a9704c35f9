"""The base models a job can start from: the demo, the models folder, the local HF cache."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from engine.model.loading import DEMO_NAME, demo_source


@dataclass
class BaseModelInfo:
    name: str
    source: str  # "demo" | "models" | "hf-cache"
    path: Path | None
    architecture: str | None
    parameters: int | None
    size_bytes: int
    ready: bool


def _safetensors_parameters(folder: Path) -> int | None:
    """Parameter count from the safetensors headers (no tensor is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total


def _describe(name: str, source: str, folder: Path) -> BaseModelInfo:
    config = json.loads((folder / "config.json").read_text())
    archs = config.get("architectures") or [None]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return BaseModelInfo(name, source, folder, archs[0], _safetensors_parameters(folder), size, True)


def discover(models_dir: Path, hf_cache: Path | None) -> list[BaseModelInfo]:
    """Every usable base model, the demo first."""
    found: list[BaseModelInfo] = []
    demo_folder = models_dir / DEMO_NAME
    if (demo_folder / "config.json").is_file():
        info = _describe("demo", "demo", demo_folder)
        found.append(info)
    else:
        try:
            gguf = next(demo_source().glob("*.gguf"))
            found.append(
                BaseModelInfo(
                    "demo", "demo", None, "LlamaForCausalLM", 134_515_008, gguf.stat().st_size, False
                )
            )
        except (ValueError, StopIteration):
            pass
    if models_dir.is_dir():
        for child in sorted(models_dir.iterdir()):
            if child.name != DEMO_NAME and (child / "config.json").is_file():
                found.append(_describe(child.name, "models", child))
    if hf_cache is not None and hf_cache.is_dir():
        for repo in sorted(hf_cache.glob("models--*")):
            snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
            if snapshots and (snapshots[-1] / "config.json").is_file():
                name = repo.name.removeprefix("models--").replace("--", "/")
                found.append(_describe(name, "hf-cache", snapshots[-1]))
    return found


_found: dict[tuple[str, str, str], tuple[float, BaseModelInfo | None]] = {}
FIND_TTL_S = 10.0


def find(name: str, models_dir: Path, hf_cache: Path | None) -> BaseModelInfo | None:
    """One base model by name; a lookup is remembered for a few seconds (creating jobs in a burst
    should not rescan every model folder each time)."""
    key = (name, str(models_dir), str(hf_cache))
    hit = _found.get(key)
    if hit is not None and time.monotonic() - hit[0] < FIND_TTL_S:
        return hit[1]
    found = next((m for m in discover(models_dir, hf_cache) if m.name == name), None)
    _found[key] = (time.monotonic(), found)
    return found


def usable_folder(name: str, models_dir: Path, hf_cache: Path | None) -> Path | None:
    """The folder of a base model that is ready to load (the demo once prepared), or None."""
    found = find(name, models_dir, hf_cache)
    return found.path if found is not None and found.ready else None
