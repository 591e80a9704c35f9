"""The input layer of a vision-language model: token embeddings with each image's features in
place of its placeholder tokens.

``VisionInputLayer`` holds the token embeddings, the vision tower and the projector as one
pipeline layer (layer 0). Its forward runs the tower over the micro-batch's images, the projector
over the tower's outputs, and scatters the result into the embeddings at the image tokens, in
order (row by row, left to right), as the families' own forwards do. A micro-batch without images
is embedded as text. The family's ``features`` picks how the tower is called:

- ``qwen2_5_vl``: ``pixel_values [patches, C*T*P*P]`` and ``image_grid_thw [images, 3]``; the
  tower's patch merger (inside it) is the projector, its ``pooler_output`` the features.
- ``qwen3_vl``: as Qwen2.5-VL; its tower also gives the deepstack features of some intermediate
  layers, handed on beside the hidden states (``[b, s, d * (1 + deepstack)]``: the hidden states,
  then each deepstack feature scattered at the image tokens, zero elsewhere) to the first
  language blocks, each wrapped in a ``DeepstackBlock`` that adds its own after the block and
  passes the rest on. Adding zero where there is no image leaves those hidden states as they are,
  so this equals the model's own adding at the image positions alone.
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
        features, deepstack = self.image_features(hidden.dtype, **images)
        if features.shape[0] != wanted:
            raise ValueError(
                f"the images give {features.shape[0]} image features for {wanted} image tokens "
                "(the data's image placeholders and its images disagree)"
            )
        where = is_image.unsqueeze(-1)
        hidden = hidden.masked_scatter(where, features.to(hidden.dtype))
        if not deepstack:
            return hidden
        extra = [torch.zeros_like(hidden).masked_scatter(where, f.to(hidden.dtype)) for f in deepstack]
        return torch.cat([hidden, *extra], dim=-1)

    def image_features(
        self, dtype: torch.dtype, **images: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One feature vector per image token (``[image tokens, d]``), and the deepstack features
        (Qwen3-VL; else none)."""
        pixels = images["pixel_values"].to(dtype)
        if self.features in ("qwen2_5_vl", "qwen3_vl"):
            out = self.tower(pixels, grid_thw=images["image_grid_thw"])
            return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
        if self.features == "gemma3":
            assert self.projector is not None
            projected = self.projector(self.tower(pixel_values=pixels).last_hidden_state)
            return projected.reshape(-1, projected.shape[-1]), []
        if self.features == "idefics3":
            assert self.projector is not None
            mask = images["pixel_attention_mask"].bool()
            p = self.patch_size
            patches = mask.unfold(1, p, p).unfold(2, p, p)
            patch_mask = patches.sum(dim=(-1, -2)) > 0
            last = self.tower(pixel_values=pixels, patch_attention_mask=patch_mask).last_hidden_state
            out = self.projector(last)
            return out.reshape(-1, out.shape[-1]), []
        raise ValueError(f"unknown image features {self.features!r}")


class DeepstackBlock(nn.Module):
    """A language block that adds its deepstack feature after it runs (Qwen3-VL).

    Its input is ``[b, s, d * (1 + n)]``: the hidden states, then ``n`` deepstack features of
    width ``d``, the first of them this block's. It returns the block's output plus that feature,
    followed by the ``n - 1`` others for the next blocks. An input of width ``d`` (a micro-batch
    without images) is the block's alone.
    """

    def __init__(self, block: nn.Module, width: int) -> None:
        super().__init__()
        self.block = block
        self.width = width

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        d = self.width
        out = self.block(x[..., :d] if x.shape[-1] > d else x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if x.shape[-1] == d:
            return out  # type: ignore[no-any-return]
        out = out + x[..., d : 2 * d]
        rest = x[..., 2 * d :]
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def vision_layer_parts(model: Any, spec: VisionSpec) -> tuple[nn.Module, nn.Module | None]:
    """The tower and the projector of ``model`` (None: the projector is inside the tower)."""
    from operator import attrgetter

    tower = attrgetter(spec.tower)(model)
    projector = attrgetter(spec.projector)(model)
    inside = any(m is projector for m in tower.modules())
    return tower, None if inside else projector
