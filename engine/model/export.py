"""Exports that ``transformers`` and ``peft`` load unchanged.

- LoRA: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) whose
  base model is recorded by name; optionally merged into the base as a full model folder.
- Full fine-tune: a model folder (``config.json`` + ``model.safetensors``).
Both carry the tokenizer and its chat template, and a vision-language model's also its processor
files (``engine.vision.processing.PROCESSOR_FILES``: the image processor's settings, the
processor's options), copied from the base model's folder, so that the folder (or the adapter on
its base) runs on images elsewhere as it does here. The weights are the engine's fp32 masters.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from engine.training.checkpoint_layout import CheckpointKind, kind_of

DEMO_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the demo model's name on the model hub
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # "org/name", as the hub names models
_CACHE_REPO = re.compile(r"models--([\w.-]+)--([\w.-]+)")  # a Hugging Face cache folder


def base_model_name(name: str | None, folder: str | Path) -> str:
    """The name an export records for its base model, so that ``AutoPeftModelForCausalLM`` on
    another machine finds the base: a hub id where one is known, never a path of this server.

    In order: the demo's hub id; ``name`` when it is a hub id; the ``org/name`` of a Hugging Face
    cache folder; the hub id in the folder's ``config.json`` (``_name_or_path``); ``name`` when it
    is not a path; the folder's name.
    """
    from engine.model.loading import DEMO_NAME

    folder = Path(folder)
    if name == "demo" or folder.name == DEMO_NAME:
        return DEMO_HUB_NAME
    if name and _HUB_ID.fullmatch(name):
        return name
    for part in reversed(folder.parts):
        found = _CACHE_REPO.fullmatch(part)
        if found:
            return f"{found[1]}/{found[2]}"
    try:
        recorded = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if isinstance(recorded, str) and _HUB_ID.fullmatch(recorded) and not Path(recorded).exists():
        return recorded
    if name and "/" not in name and "\\" not in name:
        return name
    return folder.name


def _targets_embeddings(model: Any, targets: Any) -> bool:
    """Whether LoRA ``targets`` (peft's ``target_modules``: names, or one pattern) include the
    token embeddings or the output layer, as peft decides it for ``save_embedding_layers="auto"``
    (before it looks anything up)."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES, INCLUDE_LINEAR_LAYERS_SHORTHAND
    from peft.utils.other import match_target_against_key

    if not targets or targets == INCLUDE_LINEAR_LAYERS_SHORTHAND:
        return False
    if isinstance(targets, str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        names = [n for n, _ in base.named_modules() if n.rsplit(".", 1)[-1] in EMBEDDING_LAYER_NAMES]
        return any(match_target_against_key(targets, n) for n in names)
    return any(t in targets for t in EMBEDDING_LAYER_NAMES)


def is_adapter(folder: str | Path) -> bool:
    return kind_of(folder) == CheckpointKind.ADAPTER


def copy_processor_files(source: str | Path | None, folder: str | Path) -> list[str]:
    """Copy a vision-language model's processor files (``PROCESSOR_FILES``) that ``source`` has
    and ``folder`` lacks into ``folder`` (what the folder's own tokenizer wrote stays); the names
    copied. Nothing for a text model's folder (it has none of them) or no ``source``."""
    from engine.vision.processing import PROCESSOR_FILES

    if source is None:
        return []
    source, folder = Path(source), Path(folder)
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copy2(source / name, folder / name)
            copied.append(name)
    return copied


def save_export(
    model: Any,
    weights: dict[str, torch.Tensor],
    tokenizer: Any,
    folder: str | Path,
    *,
    base_name: str,
    base_folder: str | Path | None = None,
) -> None:
    """Write ``weights`` (keyed like ``model.state_dict()``) as an adapter or a model folder,
    with ``tokenizer`` and, for a vision-language model, the processor files of its base model's
    folder ``base_folder`` (:func:`copy_processor_files`).

    ``model`` is only used for its structure and config; its tensors are not modified.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "peft_config"):
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = base_name
        # said, not left to peft's "auto": that looks the base name up on the model hub (and
        # fetches its config.json) at every save to see whether the vocabulary was resized, which
        # the engine never does; the embeddings are saved when an adapter trains them
        embeddings = any(_targets_embeddings(model, cfg.target_modules) for cfg in model.peft_config.values())
        model.save_pretrained(folder, state_dict=weights, save_embedding_layers=embeddings)
    else:
        model.config._name_or_path = base_name
        model.save_pretrained(folder, state_dict=weights)
    tokenizer.save_pretrained(folder)
    copy_processor_files(base_folder, folder)


def load_export(folder: str | Path, *, base: str | Path | None = None) -> Any:
    """Load an export for inference: a model folder (a vision-language model's as its
    ``*ForConditionalGeneration``), or an adapter on its ``base`` folder."""
    from transformers import AutoModelForCausalLM

    if not is_adapter(folder):
        from engine.model.loading import load_model, vision_architecture

        if vision_architecture(folder) is not None:
            model = load_model(folder)
            model.eval()
            return model
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if base is None:
        raise ValueError(f"{folder} is a LoRA adapter: give the base model folder")
    from peft import PeftModel

    from engine.model.loading import load_model

    base_model = load_model(base)  # dense weights, also from a quantized base (GPT-OSS's MXFP4)
    base_model.eval()
    return PeftModel.from_pretrained(base_model, folder)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def model_bytes(folder: str | Path) -> int:
    """About what a model folder's weights take once loaded and saved in fp32 (what a merge
    writes): its weight files, doubled when ``config.json`` says 16-bit."""
    folder = Path(folder)
    size = sum(p.stat().st_size for pattern in WEIGHT_FILES for p in folder.glob(pattern) if p.is_file())
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "") if isinstance(config, dict) else ""
    return size * 2 if dtype in ("float16", "bfloat16") else size


def merge_adapter(adapter: str | Path, base: str | Path, out: str | Path) -> Path:
    """Merge a LoRA adapter into its base model and write a full model folder, with the
    adapter's tokenizer and a vision-language model's processor files (the adapter's, else its
    base's)."""
    from transformers import AutoTokenizer

    model = load_export(adapter, base=base)
    merged = model.merge_and_unload()
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(adapter).save_pretrained(tmp)
    copy_processor_files(adapter, tmp)
    copy_processor_files(base, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
