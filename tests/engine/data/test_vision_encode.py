"""Rows with images encoded by each VLM family's processor: the image placeholders expanded by the
processor, the loss on the assistant turns alone, the batch's image tensors, the preview's
thumbnails."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.batches import Batcher, collate, pack
from engine.data.encode import load_encoded, validate
from engine.data.formats import get_format
from engine.data.read import check_rows
from engine.data.sequences import Encoded, image_placeholder
from engine.vision.pixels import open_image, row_pixels
from tests.engine.tiny_vision import ARCHITECTURES, VLM_FAMILIES, png, tiny_processor, tiny_vlm

WIDE = png(32, 12, seed=1)  # two sizes: the dynamic-resolution families give them different token counts
TALL = png(8, 30, seed=2)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "what is this? "}, part(data_url(WIDE))]},
    {"role": "assistant", "content": "a wide one"},
    {"role": "user", "content": [part(data_url(TALL)), {"type": "text", "text": "and this?"}]},
    {"role": "assistant", "content": "a tall one"},
]
TWO_TURNS = {"messages": MESSAGES}
TEXT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write(path: Path, *rows: dict[str, Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def expanded(
    processor: Any, messages: list[dict[str, Any]], images: list[bytes], *, generation: bool = False
) -> list[int]:
    """The processor's token ids of a conversation prefix rendered with its images."""
    placeholder = image_placeholder(processor)
    text_messages = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(p["text"] if p["type"] == "text" else placeholder for p in m["content"]),
        }
        for m in messages
    ]
    text = processor.tokenizer.apply_chat_template(
        text_messages, tokenize=False, add_generation_prompt=generation
    )
    pictures = [[open_image(b) for b in images]] if images else None
    out = processor(text=[text], images=pictures, add_special_tokens=False)
    return [int(t) for t in out["input_ids"][0]]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_labels_cover_exactly_the_assistant_turns(tmp_path: Path, family: str) -> None:
    processor = tiny_processor(family)
    [row, text_row] = load_encoded(write(tmp_path / "t.jsonl", TWO_TURNS, TEXT_ROW), processor)
    messages = MESSAGES
    # the oracle: each assistant turn lies between the processor's ids of the conversation before
    # it (with the generation prompt) and up to its end, each prefix with the images it holds
    full = expanded(processor, messages, [WIDE, TALL])
    assert row.input_ids == full and row.images == (WIDE, TALL)
    bounds = [
        (
            len(expanded(processor, messages[:1], [WIDE], generation=True)),
            len(expanded(processor, messages[:2], [WIDE])),
        ),
        (
            len(expanded(processor, messages[:3], [WIDE, TALL], generation=True)),
            len(expanded(processor, messages[:4], [WIDE, TALL])),
        ),
    ]
    want = [t if any(a <= i < b for a, b in bounds) else -100 for i, t in enumerate(full)]
    assert row.labels == want
    trained = [processor.tokenizer.decode(full[a:b]) for a, b in bounds]
    assert trained == ["a wide one<|im_end|>\n", "a tall one<|im_end|>\n"]
    # the image tokens are as many as the model's tower makes of these images
    image_id = processor.tokenizer.convert_tokens_to_ids(
        "<image_soft_token>" if family == "gemma3_vl" else processor.image_token
    )
    counts = _image_token_counts(row.input_ids, image_id)
    pixels = row_pixels(processor, ARCHITECTURES[family])(row.images)
    if family in ("qwen2_5_vl", "qwen3_vl"):
        assert counts == [int(g.prod()) // 4 for g in pixels["image_grid_thw"]] and counts[0] != counts[1]
    elif family == "idefics3":
        assert sum(counts) == pixels["pixel_values"].shape[0] * 4  # 4 tokens a tile
    else:
        assert counts == [4, 4]
    assert text_row.images == () and text_row.trained_tokens > 0


def _image_token_counts(ids: list[int], image_id: int) -> list[int]:
    """The lengths of the runs of ``image_id``."""
    runs: list[int] = []
    for prev, tok in zip([None, *ids], ids, strict=False):
        if tok == image_id:
            if prev == image_id:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_encoded_rows_feed_the_model(tmp_path: Path, family: str) -> None:
    """The batch of an image row and a text row runs through the tiny model of the family: its
    image tokens match the tower's features."""
    processor = tiny_processor(family)
    rows = load_encoded(write(tmp_path / "t.jsonl", TWO_TURNS, TEXT_ROW), processor)
    pixels = row_pixels(processor, ARCHITECTURES[family])
    batch = collate(rows, int(processor.tokenizer.pad_token_id), pixels=pixels)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape == (2, len(rows[0].input_ids))
    assert batch["images"][1] is None and set(batch["images"][0]) == set(pixels(rows[0].images))
    model = tiny_vlm(family)
    inputs: dict[str, Any] = dict(batch["images"][0])
    if family == "idefics3":
        inputs = {k: v.unsqueeze(0) for k, v in inputs.items()}
    if family == "gemma3_vl":
        inputs["token_type_ids"] = (batch["input_ids"][:1] == processor.tokenizer.image_token_id).long()
    if family == "qwen3_vl":  # its forward needs the image positions for its 3-D rotary positions
        inputs["mm_token_type_ids"] = (batch["input_ids"][:1] == processor.image_token_id).int()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"][:1], labels=batch["labels"][:1], **inputs)
    assert torch.isfinite(out.loss)


def test_collate_needs_pixels_for_image_rows_and_batcher_passes_them(tmp_path: Path) -> None:
    processor = tiny_processor("qwen2_5_vl")
    rows = load_encoded(write(tmp_path / "t.jsonl", TWO_TURNS, TEXT_ROW, TWO_TURNS), processor)
    with pytest.raises(ValueError, match="line 1: a row with images, and no image processor to batch them"):
        collate(rows, 0)
    assert "images" not in collate([rows[1]], 0)
    seen: list[tuple[bytes, ...]] = []

    def pixels(images: Any) -> dict[str, torch.Tensor]:
        seen.append(tuple(images))
        return {"pixel_values": torch.zeros(len(images), 1)}

    batcher = Batcher(rows, batch_size=3, seed=0, pad_id=0, pixels=pixels)
    batch = batcher.next()
    assert [None if e is None else tuple(e["pixel_values"].shape) for e in batch["images"]].count((2, 1)) == 2
    assert seen == [(WIDE, TALL), (WIDE, TALL)]


def test_packing_keeps_each_rows_images_in_order(tmp_path: Path) -> None:
    processor = tiny_processor("gemma3_vl")
    rows = load_encoded(write(tmp_path / "t.jsonl", TWO_TURNS, TEXT_ROW), processor)
    [packed] = pack([rows[0], rows[1], rows[0]], 1000)
    assert packed.images == (WIDE, TALL, WIDE, TALL)
    assert packed.input_ids == rows[0].input_ids + rows[1].input_ids + rows[0].input_ids


def test_max_length_may_not_cut_an_image(tmp_path: Path) -> None:
    processor = tiny_processor("idefics3")
    path = write(tmp_path / "t.jsonl", TWO_TURNS)
    report = validate(path, tokenizer=processor, max_length=40)
    assert len(report.errors) == 1 and str(report.errors[0]).startswith(
        "line 1: the images' tokens end at token "
    )
    assert "past max_length=40: raise data.max_length or give smaller images" in str(report.errors[0])
    [row] = load_encoded(path, processor, max_length=len(load_encoded(path, processor)[0].input_ids) - 3)
    assert row.truncated and row.images == (WIDE, TALL)


def test_the_preview_shows_each_rows_images_as_thumbnails(tmp_path: Path) -> None:
    from PIL import Image

    processor = tiny_processor("qwen2_5_vl")
    big = png(300, 150, seed=3)
    row = {
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "noise"}],
        "images": [data_url(big)],
    }
    found = check_rows(write(tmp_path / "t.jsonl", row, TEXT_ROW), limit=5)
    views = [get_format("sharegpt").preview(ex, processor, 256) for ex in found.examples]
    [thumb] = views[0]["images"]
    assert thumb.startswith("data:image/jpeg;base64,")
    picture = Image.open(io.BytesIO(base64.b64decode(thumb.partition(",")[2])))
    assert picture.size == (96, 48)
    assert "images" not in views[1]
    trained = "".join(t["text"] for t in views[0]["tokens"] if t["trained"])
    assert trained == "noise<|im_end|>\n"
    assert any(t["text"] == "<|image_pad|>" and not t["trained"] for t in views[0]["tokens"])


def test_image_rows_with_a_text_model_fail_and_text_rows_encode_with_a_processor(tmp_path: Path) -> None:
    processor = tiny_processor("gemma3_vl")
    [row] = load_encoded(write(tmp_path / "t.jsonl", TEXT_ROW), processor)
    plain = load_encoded(str(tmp_path / "t.jsonl"), processor.tokenizer)[0]
    assert isinstance(row, Encoded) and row.input_ids == plain.input_ids and row.labels == plain.labels


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_text_holding_the_models_image_token_is_refused(tmp_path: Path, family: str) -> None:
    processor = tiny_processor(family)
    token = processor.image_token
    literal = {
        "messages": [{"role": "user", "content": f"what is {token}?"}, {"role": "assistant", "content": "x"}]
    }
    beside = {
        "messages": [
            {"role": "user", "content": [part(data_url(WIDE)), {"type": "text", "text": f"and {token}"}]},
            {"role": "assistant", "content": "x"},
        ]
    }
    report = validate(write(tmp_path / "t.jsonl", literal, beside), tokenizer=processor)
    message = f"the text holds {token!r}, the model's image placeholder"
    assert [e.line for e in report.errors] == [1, 2] and all(message in e.message for e in report.errors)
    # a text model reads the token as text; the image of line 2 is what it refuses
    assert [e.line for e in validate(str(tmp_path / "t.jsonl"), tokenizer=processor.tokenizer).errors] == [2]
