"""A micro-batch's images: its rows' image tensors joined for the tower, and what the language
blocks' context needs of them.

A batch's ``images`` holds one entry per row: None for a text row, else the tensors of that
row's images (``engine.vision.pixels.row_pixels``), each joined over the row's images along its
first dimension. A micro-batch joins its rows' tensors the same way, in row order, so the
tower's features come out in the order of the image tokens (row by row, left to right); image
tensors of different heights and widths (Idefics3's tiles) are padded to the largest with zeros,
their pixel mask marking what is real.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.model.block_context import BidirectionalImages

RowImages = dict[str, torch.Tensor]


def check_images(images: Sequence[RowImages | None], rows: int) -> None:
    """Raise ``ValueError`` unless ``images`` has one entry per row, each None or tensors."""
    if len(images) != rows:
        raise ValueError(
            f"images has {len(images)} entries for {rows} rows (give one per row, None for text)"
        )
    keys: set[str] | None = None
    for i, row in enumerate(images):
        if row is None:
            continue
        if not isinstance(row, dict) or not all(isinstance(v, torch.Tensor) for v in row.values()):
            raise ValueError(f"images[{i}]: expected a dict of tensors or None, got {type(row).__name__}")
        if keys is None:
            keys = set(row)
        elif set(row) != keys:
            raise ValueError(f"images[{i}] has tensors {sorted(row)}, other rows {sorted(keys)}")


def join_images(rows: Sequence[RowImages | None]) -> RowImages | None:
    """The tensors of several rows' images, joined in row order (None: no row has images)."""
    present = [r for r in rows if r]
    if not present:
        return None
    joined: RowImages = {}
    for key in present[0]:
        parts = [r[key] for r in present]
        if parts[0].dim() >= 3 and len({p.shape[1:] for p in parts}) > 1:
            parts = _pad_spatial(parts)
        joined[key] = torch.cat(parts)
    return joined


def _pad_spatial(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pad the last two dimensions of each tensor to the largest with zeros."""
    height = max(p.shape[-2] for p in parts)
    width = max(p.shape[-1] for p in parts)
    return [torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in parts]


def context_inputs(
    adapted: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, images: RowImages | None
) -> dict[str, torch.Tensor]:
    """What the language blocks' context of one micro-batch needs of its images, built on the host:
    Qwen2.5-VL's 3-D rotary positions (``position_ids [3, b, s]``, the model's own
    ``get_rope_index``), Gemma 3's ``token_type_ids`` (1 on image tokens). Empty for a text model."""
    spec = adapted.vision
    if spec is None:
        return {}
    is_image = input_ids == adapted.image_token_id
    if spec.positions == "mrope":
        grid = None if images is None else images.get("image_grid_thw")
        merge = int(adapted.hf_config.vision_config.spatial_merge_size)
        features = 0 if grid is None else int((grid.prod(-1) // merge**2).sum())
        if features != int(is_image.sum()):
            raise ValueError(
                f"the images give {features} image features for {int(is_image.sum())} image tokens "
                "(the data's image placeholders and its images disagree)"
            )
        positions, _ = adapted.rope_index(
            input_ids,
            mm_token_type_ids=is_image.int(),
            image_grid_thw=grid,
            attention_mask=attention_mask,
        )
        return {"position_ids": positions}
    if isinstance(spec.text.context, BidirectionalImages):
        return {"token_type_ids": is_image.long()}
    return {}
