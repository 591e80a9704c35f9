"""The input layer of a vision-language model: token embeddings with each image's features in
place of its placeholder tokens.

``VisionInputLayer`` holds the token embeddings, the vision tower and the projector as one
pipeline layer (layer 0). Its forward runs the tower over the micro-batch's images, the projector
over the tower's outputs, and scatters the result into the embeddings at the image tokens, in
order (row by row, left to right), as the families' own forwards do. A micro-batch without images
is embedded as text. The family's ``features`` picks how the tower is called:

- ``qwen2_5_vl``: ``pixel_values [patches, C*T*P*P]`` and ``image_grid_thw [images, 3]``; the
  tower's patch merger (inside it) is the projector, its ``pooler_output`` the features.
- ``gemma3``: ``pixel_values [images, C, H, W]``; the tower's last hidden state through the
  multi-modal projector.
- ``idefics3``: ``pixel_values [tiles, C, H, W]`` and ``pixel_attention_mask [tiles, H, W]``; the
  tower with its patch mask, then the connector (pixel shuffle and projection).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.vision.families import VisionSpec


class VisionInputLayer(nn.Module):
    """``input_ids [b, s]`` and the micro-batch's image tensors -> ``hidden [b, s, d]``.

    Args:
        embed_tokens: the language model's token embeddings (Gemma 3's scale them inside).
        tower: the vision tower (Qwen2.5-VL's holds its projector).
        projector: the projector, or None where the tower holds it.
        spec: the family's ``VisionSpec``.
        image_token_id: the placeholder token each image feature replaces.
        patch_size: the tower's patch size (Idefics3's patch mask).
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        tower: nn.Module,
        projector: nn.Module | None,
        *,
        spec: VisionSpec,
        image_token_id: int,
        patch_size: int,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.tower = tower
        self.projector = projector
        self.features = spec.features
        self.image_token_id = image_token_id
        self.patch_size = patch_size

    def forward(self, input_ids: torch.Tensor, **images: torch.Tensor) -> torch.Tensor:
        is_image = input_ids == self.image_token_id
        weight: torch.Tensor = self.embed_tokens.weight  # type: ignore[assignment]
        vocab = int(weight.shape[0])
        # Gemma 3's image token lies beyond its vocabulary: embed padding there, replaced below
        ids = input_ids.masked_fill(is_image, 0) if self.image_token_id >= vocab else input_ids
        hidden: torch.Tensor = self.embed_tokens(ids)
        wanted = int(is_image.sum())
        if not images:
            if wanted:
                raise ValueError(f"{wanted} image tokens in a micro-batch without images")
            return hidden
        features = self.image_features(hidden.dtype, **images)
        if features.shape[0] != wanted:
            raise ValueError(
                f"the images give {features.shape[0]} image features for {wanted} image tokens "
                "(the data's image placeholders and its images disagree)"
            )
        return hidden.masked_scatter(is_image.unsqueeze(-1), features.to(hidden.dtype))

    def image_features(self, dtype: torch.dtype, **images: torch.Tensor) -> torch.Tensor:
        """One feature vector per image token: ``[image tokens, d]``."""
        pixels = images["pixel_values"].to(dtype)
        if self.features == "qwen2_5_vl":
            out = self.tower(pixels, grid_thw=images["image_grid_thw"])
            return out.pooler_output  # type: ignore[no-any-return]
        if self.features == "gemma3":
            assert self.projector is not None
            projected = self.projector(self.tower(pixel_values=pixels).last_hidden_state)
            return projected.reshape(-1, projected.shape[-1])  # type: ignore[no-any-return]
        if self.features == "idefics3":
            assert self.projector is not None
            mask = images["pixel_attention_mask"].bool()
            p = self.patch_size
            patches = mask.unfold(1, p, p).unfold(2, p, p)
            patch_mask = patches.sum(dim=(-1, -2)) > 0
            last = self.tower(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state
            out = self.projector(last)
            return out.reshape(-1, out.shape[-1])  # type: ignore[no-any-return]
        raise ValueError(f"unknown image features {self.features!r}")


def vision_layer_parts(model: Any, spec: VisionSpec) -> tuple[nn.Module, nn.Module | None]:
    """The tower and the projector of ``model`` (None: the projector is inside the tower)."""
    from operator import attrgetter

    tower = attrgetter(spec.tower)(model)
    projector = attrgetter(spec.projector)(model)
    inside = any(m is projector for m in tower.modules())
    return tower, None if inside else projector
