"""A vision-language model's processor: its tokenizer, its image processor and how its chat
text's image placeholders become image tokens.

The families' own ``*Processor`` classes do the work (placeholder expansion, the image
processor's resizing and patching). They are built here rather than by ``AutoProcessor``,
which also loads a video processor (Qwen2.5-VL's needs torchvision, which the engine does not
install): the image processors are taken with their PIL backend and a processor is built with
no video processor. ``save_processor`` writes what ``load_processor`` reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# what a family's processor keeps besides its tokenizer and image processor (processor_config.json)
_OPTIONS = {
    "Qwen2_5_VLForConditionalGeneration": (),
    "Qwen3VLForConditionalGeneration": (),
    "Gemma3ForConditionalGeneration": ("image_seq_length",),
    "Idefics3ForConditionalGeneration": ("image_seq_len",),
    "SmolVLMForConditionalGeneration": ("image_seq_len",),
}
PROCESSOR_CONFIG = "processor_config.json"
# the files a processor adds to a model folder besides the tokenizer's: the image processor's
# settings, the processor's options and the chat template the processor renders
PROCESSOR_FILES = ("preprocessor_config.json", PROCESSOR_CONFIG, "chat_template.jinja", "chat_template.json")


def build_processor(architecture: str, image_processor: Any, tokenizer: Any, **options: Any) -> Any:
    """The processor of ``architecture`` around ``image_processor`` and ``tokenizer``.

    Raises:
        KeyError: an architecture the engine has no processor for.
    """
    if architecture in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"):
        from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor

        # its __init__ insists on a video processor; images are all the engine feeds it
        kind = Qwen2_5_VLProcessor if architecture.startswith("Qwen2_5") else Qwen3VLProcessor
        processor: Any = object.__new__(kind)
        processor.image_processor, processor.tokenizer = image_processor, tokenizer
        processor.video_processor = None
        processor.chat_template = getattr(tokenizer, "chat_template", None)
        processor.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        processor.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
        processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
        for edge in ("start", "end"):  # Qwen3-VL's processor reads these too
            token = getattr(tokenizer, f"vision_{edge}_token", None) or f"<|vision_{edge}|>"
            setattr(processor, f"vision_{edge}_token", token)
            setattr(processor, f"vision_{edge}_token_id", tokenizer.convert_tokens_to_ids(token))
        return processor
    if architecture == "Gemma3ForConditionalGeneration":
        from transformers import Gemma3Processor

        for name, token in (
            ("boi", "<start_of_image>"),
            ("eoi", "<end_of_image>"),
            ("image", "<image_soft_token>"),
        ):
            if getattr(tokenizer, f"{name}_token", None) is None:
                setattr(tokenizer, f"{name}_token", token)
                setattr(tokenizer, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
        return Gemma3Processor(image_processor, tokenizer, **options)
    if architecture in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        from transformers import Idefics3Processor

        return Idefics3Processor(image_processor, tokenizer, **options)
    raise KeyError(architecture)


def save_processor(processor: Any, architecture: str, folder: str | Path) -> None:
    """Write ``processor`` into a model folder: its tokenizer, its image processor
    (``preprocessor_config.json``) and its options (``processor_config.json``)."""
    folder = Path(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    options = {k: getattr(processor, k) for k in _OPTIONS.get(architecture, ())}
    (folder / PROCESSOR_CONFIG).write_text(json.dumps(options, indent=2) + "\n")


def load_processor(folder: str | Path, architecture: str) -> Any:
    """The processor of a model folder of ``architecture``."""
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    images = AutoImageProcessor.from_pretrained(folder, backend="pil")
    stored: dict[str, Any] = {}
    path = folder / PROCESSOR_CONFIG
    if path.is_file():
        stored = json.loads(path.read_text())
    options = {k: stored[k] for k in _OPTIONS.get(architecture, ()) if k in stored}
    return build_processor(architecture, images, tokenizer, **options)
