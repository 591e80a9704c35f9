"""A checkpoint (or any model folder) as a folder for llama.cpp and Ollama:

model-<quant>.gguf     the model (a LoRA checkpoint merged into its base first)
adapter-f32.gguf       LoRA checkpoints: the adapter alone, for ``llama-cli --lora`` on a base GGUF
Modelfile              for ``ollama create NAME -f Modelfile``
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from engine.export.gguf_families import family_for
from engine.export.gguf_model import check_quant, export_adapter_gguf, export_gguf
from engine.export.modelfile import modelfile, system_prompt_of_file
from engine.training.checkpoint_layout import read_trainer_state

MODELFILE = "Modelfile"
ADAPTER_FILE = "adapter-f32.gguf"


def model_file_name(quant: str) -> str:
    return f"model-{quant}.gguf"


def recorded_system_prompt(checkpoint: Path) -> str | None:
    """The system prompt shared by the training data the checkpoint's run recorded, if any."""
    state = read_trainer_state(checkpoint) or {}
    try:
        config = state.get("config") or {}
        train = (config.get("data") or {}).get("train")
    except AttributeError:
        return None
    return system_prompt_of_file(train) if isinstance(train, str) else None


def check_exportable(folder: Path) -> None:
    """Refuse a model folder whose family (or config) the GGUF export cannot write, from its
    ``config.json`` alone: nothing is loaded, merged or written first.

    Raises:
        ValueError: naming the family and why (``gguf_families.family_for``).
    """
    from transformers import AutoConfig

    family_for(AutoConfig.from_pretrained(folder))


def export_gguf_folder(
    source: str | Path,
    out: str | Path,
    *,
    quant: str = "f16",
    base: str | Path | None = None,
    system: str | None = None,
    name: str | None = None,
    comment: str | None = None,
) -> dict[str, Any]:
    """Write ``out/`` (see the module docstring) from a model folder or a checkpoint folder.

    Args:
        source: a full model folder, or a LoRA adapter folder (a checkpoint) with ``base``.
        out: the folder to fill (created; files in it are replaced).
        quant: f16, bf16, q8_0 or q4_k_m.
        base: the base model folder of a LoRA adapter.
        system: the Modelfile's system prompt (default: the one the recorded training data
            shares, if any).
        name: ``general.name`` in the GGUF.
        comment: comment lines at the top of the Modelfile.

    Returns:
        The export's facts (``arch``, ``quant``, ``context_length``, ``files``).

    Raises:
        ValueError: a bad quant, a LoRA adapter without its base, a family or config that
            llama.cpp cannot run (a vision-language model among them), refused before anything
            is merged or written.
    """
    from engine.model.export import is_adapter, merge_adapter

    check_quant(quant)
    source = Path(source)
    adapter_base = None
    if is_adapter(source):
        if base is None:
            raise ValueError(f"{source} is a LoRA adapter: give its base model folder")
        adapter_base = Path(base)
    check_exportable(adapter_base or source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if system is None:
        system = recorded_system_prompt(source)
    files = []
    if adapter_base is not None:
        with tempfile.TemporaryDirectory(prefix="gguf-merge-", dir=out) as work:
            merged = merge_adapter(source, adapter_base, Path(work) / "merged")
            info = export_gguf(merged, out / model_file_name(quant), quant=quant, name=name or source.name)
        export_adapter_gguf(source, adapter_base, out / ADAPTER_FILE)
        files.append(ADAPTER_FILE)
    else:
        info = export_gguf(source, out / model_file_name(quant), quant=quant, name=name or source.name)
    files.insert(0, model_file_name(quant))
    capped = info["context_length"] if info["context_length"] < 4096 else None
    text = modelfile(
        model_file_name(quant),
        chat_template=info.get("chat_template"),
        eos=info.get("eos"),
        system=system,
        context_length=capped,
        comment=comment,
    )
    (out / MODELFILE).write_text(text)
    files.append(MODELFILE)
    return {"arch": info["arch"], "quant": quant, "context_length": info["context_length"], "files": files}
