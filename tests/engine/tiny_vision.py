"""Tiny vision-language models of every supported VLM family, their processors, test images and
batches, and the plain single-device training loop's inputs for them.

Each tiny model is a real ``*ForConditionalGeneration`` of its family: a 2-block vision tower, the
family's projector and a 2-block language model of width 32, over the tiny byte-level tokenizer
of ``tests.engine.tiny`` with the family's image tokens added. Their processors are the
families' own (``engine.vision.processing.build_processor``), with the image sizes cut so that
an image is a handful of tokens; images of different sizes give different token counts where
the family resizes dynamically (Qwen2.5-VL, Idefics3's tiling).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from tests.engine.tiny import tiny_tokenizer

# the families the tests build, by short name
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3_vl", "idefics3")
ENGINE_VLM_FAMILIES = VLM_FAMILIES

_SPECIAL = {
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "qwen3_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma3_vl": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)],
}
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


# each family's placeholder of one image in its chat text
PLACEHOLDERS = {
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3_vl": "<start_of_image>",
    "idefics3": "<image>",
}
# ChatML whose message content may be a list of parts: text, and images rendered as the family's
# placeholder (as the released models' templates do)
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}PLACEHOLDER{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vision_tokenizer(family: str) -> Any:
    """The tiny tokenizer with the family's image tokens added and a chat template that renders
    image parts as the family's placeholder."""
    tok = tiny_tokenizer()
    tok.chat_template = _CHAT_TEMPLATE.replace("PLACEHOLDER", PLACEHOLDERS[family])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *_SPECIAL[family]]})
    if family == "gemma3_vl":
        # Gemma 3's processor reads these names off its tokenizer
        tok.boi_token, tok.eoi_token, tok.image_token = (
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        )
        tok.boi_token_id = tok.convert_tokens_to_ids("<start_of_image>")
        tok.eoi_token_id = tok.convert_tokens_to_ids("<end_of_image>")
        tok.image_token_id = tok.convert_tokens_to_ids("<image_soft_token>")
    return tok


def _config(family: str, tok: Any, blocks: int) -> Any:
    import transformers

    ids = tok.convert_tokens_to_ids
    vocab = len(tok)
    text = dict(
        TEXT,
        vocab_size=vocab,
        num_hidden_layers=blocks,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
        return transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(
                depth=2,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                patch_size=4,
                temporal_patch_size=2,
                spatial_merge_size=2,
                out_hidden_size=32,
                window_size=16,
                fullatt_block_indexes=[1],
            ),
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
            tie_word_embeddings=False,
        )
    if family == "qwen3_vl":
        text["head_dim"] = 8
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        return transformers.Qwen3VLConfig(
            text_config=text,
            vision_config=dict(
                depth=3,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                patch_size=4,
                temporal_patch_size=2,
                spatial_merge_size=2,
                out_hidden_size=32,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1],
            ),
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
            tie_word_embeddings=False,
        )
    if family == "gemma3_vl":
        text.update(head_dim=8, query_pre_attn_scalar=8, sliding_window=8, sliding_window_pattern=2)
        return transformers.Gemma3Config(
            text_config=text,
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,
            boi_token_index=ids("<start_of_image>"),
            eoi_token_index=ids("<end_of_image>"),
            image_token_index=ids("<image_soft_token>"),
        )
    if family == "idefics3":
        return transformers.Idefics3Config(
            text_config=dict(text, model_type="llama"),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=16,
                patch_size=4,
            ),
            scale_factor=2,
            image_token_id=ids("<image>"),
            tie_word_embeddings=False,
        )
    raise KeyError(family)


def tiny_vlm(family: str, *, blocks: int = 2, seed: int = 0) -> Any:
    """A tiny ``*ForConditionalGeneration`` of ``family`` in train mode."""
    import transformers

    tok = vision_tokenizer(family)
    config = _config(family, tok, blocks)
    cls = {
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "gemma3_vl": transformers.Gemma3ForConditionalGeneration,
        "idefics3": transformers.Idefics3ForConditionalGeneration,
    }[family]
    torch.manual_seed(seed)
    model = cls(config)
    model.train()
    return model


def tiny_processor(family: str) -> Any:
    """The family's processor for the tiny model: tiny image sizes, the tiny tokenizer."""
    from engine.vision.processing import build_processor

    tok = vision_tokenizer(family)
    if family in ("qwen2_5_vl", "qwen3_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        images: Any = Qwen2VLImageProcessorPil(
            patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
        )
        return build_processor(ARCHITECTURES[family], images, tok)
    if family == "gemma3_vl":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        images = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        return build_processor("Gemma3ForConditionalGeneration", images, tok, image_seq_length=4)
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        images = Idefics3ImageProcessorPil(
            size={"longest_edge": 32}, max_image_size={"longest_edge": 16}, do_image_splitting=True
        )
        return build_processor("Idefics3ForConditionalGeneration", images, tok, image_seq_len=4)
    raise KeyError(family)


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A random RGB picture as PNG bytes."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def tiny_vlm_folder(path: str | Path, family: str = "qwen2_5_vl") -> Path:
    """Save a tiny VLM with its processor as a Hugging Face folder; returns the path."""
    from engine.vision.processing import save_processor

    model = tiny_vlm(family)
    model.save_pretrained(path)
    save_processor(tiny_processor(family), type(model).__name__, path)
    return Path(path)


ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "gemma3_vl": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}


def vision_rows(family: str) -> list[tuple[str, list[bytes]]]:
    """Four rows: two images of different sizes, one image, a text row, one more image.

    Cut into 3 micro-batches (2, 1, 1 rows) the third micro-batch is the text row alone."""
    ph = PLACEHOLDERS[family]
    return [
        (f"look {ph} at this {ph} two", [png(24, 16, 0), png(40, 30, 1)]),
        (f"one {ph} x", [png(16, 16, 2)]),
        ("no image here at all, only text", []),
        (f"y {ph} z", [png(32, 20, 3)]),
    ]


def vision_batches(
    family: str, processor: Any, rows: list[tuple[str, list[bytes]]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same batch twice: as the family's processor gives it to the model's own forward (the
    plain loop's keyword arguments, ``labels`` included) and as the engine takes it (``images``:
    one entry per row, ``engine.vision.pixels.row_pixels``). Labels: every real token but the
    first two of each row."""
    from PIL import Image

    from engine.vision.pixels import row_pixels

    rows = vision_rows(family) if rows is None else rows
    texts = [t for t, _ in rows]
    pictures = [[Image.open(io.BytesIO(b)).convert("RGB") for b in images] for _, images in rows]
    if family in ("qwen2_5_vl", "qwen3_vl"):
        flat = [p for row in pictures for p in row]
        out = processor(text=texts, images=flat or None, return_tensors="pt", padding=True)
    else:
        out = processor(
            text=texts, images=pictures if any(pictures) else None, return_tensors="pt", padding=True
        )
    labels = out["input_ids"].clone()
    labels[out["attention_mask"] == 0] = -100
    labels[:, :2] = -100
    plain = dict(out, labels=labels)
    pixels = row_pixels(processor, ARCHITECTURES[family])
    engine = {
        "input_ids": out["input_ids"],
        "labels": labels,
        "attention_mask": out["attention_mask"],
        "images": [pixels(images) if images else None for _, images in rows],
    }
    return plain, engine
